"""Configuration: defaults, TOML loading, and errors that name the file and the key."""

from __future__ import annotations

import pytest

from yieldproxy.config import Config, ConfigError, from_dict, load, read_token
from yieldproxy.tap import Options, admin_is_local


def test_defaults_match_the_contract():
    config = Config()
    assert config.proxy.upstream == "http://127.0.0.1:11434"
    assert config.proxy.listen == "tcp:11435:interface=127.0.0.1"
    assert config.admin.listen == "tcp:11436:interface=127.0.0.1"
    assert config.replay.concurrency == 4 and config.replay.rate == 0
    holds = {name: c.hold_seconds for name, c in config.classes.items()}
    assert holds == {"interactive": 15, "batch": 600, "long": 3600}
    assert config.parking.reject_status == 503


def test_a_class_table_keeps_that_class_defaults(tmp_path):
    path = tmp_path / "y.toml"
    path.write_text("[classes.interactive]\nmax_parked = 50\n[replay]\nrate = 20\n")
    config = load(path)
    assert config.classes["interactive"].hold_seconds == 15
    assert config.classes["interactive"].max_parked == 50
    assert config.replay.rate == 20.0


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[replay]\nconcurrency = 0\n", "replay.concurrency: must be >= 1"),
        ("[replay]\nspeed = 3\n", "replay.speed: unknown key"),
        ("[proxy]\nupstream = 'ollama:11434'\n", "proxy.upstream: must be an http:// or https:// URL"),
        ("[parking]\nreject_status = 500\n", "parking.reject_status: must be 503 or 429"),
        ("[parking]\nmax_parked = '10'\n", "parking.max_parked: must be int"),
        ("[classes.batch]\npolicy = 'wait'\n", "classes.batch.policy: must be one of"),
        ("[classes.urgent]\npolicy = 'park'\n", "classes.urgent: unknown class"),
        ("[classes.batch]\nmax_parked = 99999\n", "classes.batch.max_parked: 99999 is above parking.max_parked"),
        ("[gpu]\nx = 1\n", "gpu: unknown section"),
        ("[replay\n", "not valid TOML"),
        ("[upstream]\nprobe_model = ' all-minilm'\n", "upstream.probe_model: must be a model name without surrounding spaces"),
        ("[upstream]\nprobe_path = 'api/embed'\n", "upstream.probe_path: must be a path starting with '/'"),
        ("[upstream]\nprobe_path = '/api/embed'\n", "upstream.probe_path: needs a probe_model"),
        ("[upstream]\nprobe_model = 'm'\nprobe_path = '/api/tags'\n",
         "upstream.probe_path: '/api/tags' is no route an outage probe can call on an upstream of api ollama"),
        ("[[upstreams]]\nname = 'tei'\nurl = 'http://h:1'\napi = 'tei'\nprobe_model = 'm'\nprobe_path = '/api/embed'\n",
         "upstreams[0].probe_path: '/api/embed' is no route an outage probe can call on an upstream of api tei"),
    ],
)
def test_errors_name_the_file_and_the_key(tmp_path, text, expected):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load(path)
    message = str(caught.value)
    assert message.startswith(str(path))
    assert expected in message


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load(tmp_path / "nope.toml")


def test_token_file(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    assert read_token(from_dict({"admin": {"token_file": str(token)}})) == "s3cret"
    token.write_text("  \n")
    with pytest.raises(ConfigError, match="is empty"):
        read_token(from_dict({"admin": {"token_file": str(token)}}))


def test_command_line_overrides_the_file(tmp_path):
    path = tmp_path / "y.toml"
    path.write_text("[proxy]\nupstream = 'http://10.0.0.1:1'\nlisten = 'tcp:9999'\n")
    options = Options()
    options.parseOptions(["--config", str(path), "--upstream", "http://127.0.0.1:5555"])
    assert options.config.proxy.upstream == "http://127.0.0.1:5555"
    assert options.config.proxy.listen == "tcp:9999"


def test_bad_config_is_a_usage_error_not_a_traceback(tmp_path):
    from twisted.python.usage import UsageError

    path = tmp_path / "y.toml"
    path.write_text("[replay]\nrate = -1\n")
    with pytest.raises(UsageError, match="replay.rate"):
        Options().parseOptions(["--config", str(path)])


def test_admin_on_a_public_interface_needs_a_token(tmp_path):
    from twisted.python.usage import UsageError

    with pytest.raises(UsageError, match="admin.token_file"):
        Options().parseOptions(["--admin", "tcp:11436"])
    token = tmp_path / "token"
    token.write_text("t")
    path = tmp_path / "y.toml"
    path.write_text(f"[admin]\ntoken_file = '{token}'\nlisten = 'tcp:11436'\n")
    options = Options()
    options.parseOptions(["--config", str(path)])
    assert options.token == "t"


def test_admin_is_local():
    assert admin_is_local("tcp:11436:interface=127.0.0.1")
    assert admin_is_local("tcp6:11436:interface=\\:\\:1")
    assert admin_is_local("unix:/run/yieldproxy/admin.sock")
    assert not admin_is_local("tcp:11436")
    assert not admin_is_local("tcp:11436:interface=0.0.0.0")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--upstream", "ftp://x"], "--upstream: must be an http:// or https:// URL"),
        (["--upstream", "http://"], "--upstream: needs a host name"),
        (["--upstream", "http://host:port"], "--upstream: not a usable URL"),
        (["--listen", "tcp:notaport"], "proxy.listen: not a valid endpoint"),
        (["--admin", "bogus:1"], "admin.listen: not a valid endpoint"),
    ],
)
def test_bad_command_line_values_name_the_option(args, message):
    from twisted.python.usage import UsageError

    with pytest.raises(UsageError, match=message):
        Options().parseOptions(args)


def test_read_only_token_needs_an_admin_token_of_its_own(tmp_path):
    from twisted.python.usage import UsageError

    from yieldproxy.config import read_tokens

    admin, read = tmp_path / "admin.token", tmp_path / "read.token"
    admin.write_text("admin-s3cret\n")
    read.write_text("read-s3cret\n")
    both = from_dict({"admin": {"token_file": str(admin), "read_token_file": str(read)}})
    assert read_tokens(both) == ("admin-s3cret", "read-s3cret")
    with pytest.raises(ConfigError, match="admin.read_token_file: needs admin.token_file"):
        read_tokens(from_dict({"admin": {"read_token_file": str(read)}}))
    read.write_text("admin-s3cret")
    with pytest.raises(ConfigError, match="admin.read_token_file: holds the same token"):
        read_tokens(both)
    with pytest.raises(ConfigError, match="admin.read_token_file: cannot read"):
        read_tokens(from_dict({"admin": {"token_file": str(admin), "read_token_file": str(tmp_path / "no")}}))
    path = tmp_path / "y.toml"
    path.write_text(f"[admin]\nread_token_file = '{read}'\n")
    with pytest.raises(UsageError, match="admin.read_token_file"):
        Options().parseOptions(["--config", str(path)])


@pytest.mark.parametrize(
    "table, fragment",
    [
        ({"proxy": {"allowed_hosts": ["gpu.lan:11435"]}}, "proxy.allowed_hosts: must be host names"),
        ({"admin": {"allowed_hosts": ["http://x"]}}, "admin.allowed_hosts: must be host names"),
        ({"admin": {"known_sources": ["two words"]}}, "admin.known_sources: 'two words': source may hold only"),
        ({"admin": {"max_holds": 0}}, "admin.max_holds: must be >= 1"),
        ({"admin": {"max_connections": 0}}, "admin.max_connections: must be >= 1"),
        ({"proxy": {"max_connections": -1}}, "proxy.max_connections: must be >= 0"),
        ({"proxy": {"keepalive_timeout_seconds": 0}}, "proxy.keepalive_timeout_seconds: must be >= 1"),
    ],
)
def test_edge_keys_are_checked(table, fragment):
    with pytest.raises(ConfigError, match=fragment):
        from_dict(table)


def test_the_config_knows_which_keys_were_set_and_compares_by_values_only():
    config = from_dict({"parking": {"max_parked": 10000}, "proxy": {"listen": "tcp:1"}})
    assert config.explicit == {"parking.max_parked", "proxy.listen"}
    overridden = config.with_overrides(**{"proxy.upstream": "http://127.0.0.1:9"})
    assert overridden.explicit == {"parking.max_parked", "proxy.listen", "proxy.upstream"}
    assert from_dict({"parking": {"max_parked": 10000}}) == Config()  # the same values: the same config
    assert Config().sized(**{"parking.max_parked": 5}).explicit == frozenset()


def test_probe_model_and_path_are_each_upstreams_default_and_its_own_key_wins():
    from yieldproxy.upstream.pool.members import member_specs

    config = from_dict({
        "upstream": {"probe_model": "all-minilm", "probe_path": "/api/embed"},
        "upstreams": [
            {"name": "a", "url": "http://h:1"},
            {"name": "b", "url": "http://h:2", "api": "tei", "probe_model": "bge", "probe_path": "/embed"},
        ],
    })
    assert [(s.name, s.probe_model, s.probe_path) for s in member_specs(config)] == [
        ("a", "all-minilm", "/api/embed"), ("b", "bge", "/embed"),
    ]
    legacy = member_specs(from_dict({"upstream": {"probe_model": "all-minilm"}}))[0]
    assert (legacy.probe_model, legacy.probe_path) == ("all-minilm", "")
