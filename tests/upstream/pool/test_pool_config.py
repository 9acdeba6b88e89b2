"""``[[upstreams]]``: parsed, validated with the file and the key named, resolved against the global sections."""

from __future__ import annotations

import tomllib

import pytest

from helpers import pool_config
from yieldproxy.config import Config, ConfigError, from_dict
from yieldproxy.lot.state import ALL
from yieldproxy.upstream.pool.members import default_member, member_specs, pool_shape, url_warnings


def parse(text: str):
    return from_dict(tomllib.loads(text), "pool.toml")


TWO = """
[[upstreams]]
name = "desktop"
url = "http://192.168.1.20:11434"
state_file = "/run/desktop-gaming"

[[upstreams]]
name = "server"
url = "http://192.168.1.30:11434"
api = "openai"
replay_concurrency = 2
models = ["all-minilm", "bge-*"]
model_map = { "all-minilm" = "sentence-transformers/all-MiniLM-L6-v2" }
use = "when_others_yielded"
classes = ["batch"]
detect_outages = false
"""


def test_two_members_with_every_default_resolved():
    config = parse(TWO + "\n[replay]\nconcurrency = 6\n[handover]\nunload_on_yield = true\n")
    desktop, server = member_specs(config)
    assert (desktop.name, desktop.url, desktop.api, desktop.use) == (
        "desktop", "http://192.168.1.20:11434", "ollama", "always"
    )
    assert desktop.replay_concurrency == 6 and desktop.health_path == "/api/version"
    assert desktop.detect_outages and desktop.state_file == "/run/desktop-gaming"
    # The global handover is the default of the members that speak Ollama's API.
    assert desktop.unload_on_yield and not server.unload_on_yield
    assert server.replay_concurrency == 2 and server.standby and server.classes == ("batch",)
    assert server.health_path == "/v1/models" and not server.detect_outages
    assert server.model_map == {"all-minilm": "sentence-transformers/all-MiniLM-L6-v2"}


def test_no_upstreams_is_a_pool_of_one_named_default_from_proxy_upstream():
    config = parse('[proxy]\nupstream = "http://gpu:11434"\n[upstream]\nhealth_path = "/"\n')
    (only,) = member_specs(config)
    assert only == default_member(config)
    assert (only.name, only.url, only.api, only.health_path) == ("default", "http://gpu:11434", "ollama", "/")


def test_what_the_number_of_members_decides_is_decided_from_them():
    """More than one member (the [fallback] counts) names them; one upstream beside at most the [fallback] holds all."""
    fallback = {"enabled": True, "url": "http://127.0.0.1:7997/v1", "api": "openai", "models": {"m": "m"}}
    shapes = {
        "proxy.upstream": pool_shape(member_specs(from_dict({}))),
        "with [fallback]": pool_shape(member_specs(from_dict({"fallback": fallback}))),
        "one [[upstreams]]": pool_shape(member_specs(pool_config({"name": "a"}))),
        "two [[upstreams]]": pool_shape(member_specs(pool_config({"name": "a"}, {"name": "b"}))),
    }
    assert {k: (s.names_members, s.one_upstream) for k, s in shapes.items()} == {
        "proxy.upstream": (False, True),
        "with [fallback]": (True, True),
        "one [[upstreams]]": (False, True),
        "two [[upstreams]]": (True, False),
    }
    assert [(s.hold_scope("a"), s.log_name("a")) for s in shapes.values()] == [
        (ALL, None), (ALL, "a"), (ALL, None), ("a", "a"),
    ]


def test_proxy_upstream_and_upstreams_together_name_both_keys():
    with pytest.raises(ConfigError, match=r"^pool.toml: proxy.upstream and \[\[upstreams\]\] are both set"):
        parse('[proxy]\nupstream = "http://gpu:11434"\n' + TWO)


@pytest.mark.parametrize(
    "table, error",
    [
        ('url = "http://x:1"', r"upstreams\[0\].name: missing"),
        ('name = "a"', r"upstreams\[0\].url: missing"),
        ('name = "a b"\nurl = "http://x:1"', r"upstreams\[0\].name: must be 1 to 64 letters"),
        ('name = "a"\nurl = "ftp://x"', r"upstreams\[0\].url: must be an http"),
        ('name = "a"\nurl = "http://x:1"\napi = "vllm"', r"upstreams\[0\].api: must be one of ollama, openai, tei"),
        ('name = "a"\nurl = "http://x:1"\nuse = "sometimes"', r"upstreams\[0\].use: must be one of always"),
        ('name = "a"\nurl = "http://x:1"\nclasses = ["bulk"]', r"upstreams\[0\].classes: unknown class 'bulk'"),
        ('name = "a"\nurl = "http://x:1"\nreplay_concurrency = -1', r"upstreams\[0\].replay_concurrency: must be >= 0"),
        ('name = "a"\nurl = "http://x:1"\nmodels = [" m"]', r"upstreams\[0\].models: must be model names"),
        ('name = "a"\nurl = "http://x:1"\nhealth_path = "health"', r"upstreams\[0\].health_path: must be a path"),
        ('name = "a"\nurl = "http://x:1"\ndetect_outages = "yes"', r"upstreams\[0\].detect_outages: must be bool"),
        ('name = "a"\nurl = "http://x:1"\nport = 1', r"upstreams\[0\].port: unknown key"),
        ('name = "a"\nurl = "http://x:1"\napi = "openai"\nunload_on_yield = true',
         r"upstreams\[0\].unload_on_yield: the VRAM handover"),
    ],
)
def test_each_bad_member_key_is_named(table, error):
    with pytest.raises(ConfigError, match=rf"^pool.toml: {error}"):
        parse("[[upstreams]]\n" + table + "\n")


def test_names_are_distinct():
    with pytest.raises(ConfigError, match=r"upstreams\[1\].name: 'a' is the name of upstreams\[0\] too"):
        parse('[[upstreams]]\nname = "a"\nurl = "http://x:1"\n[[upstreams]]\nname = "a"\nurl = "http://y:1"\n')


def test_a_pool_needs_an_always_member_and_a_member_for_every_class():
    with pytest.raises(ConfigError, match=r"upstreams: every upstream has use = \"when_others_yielded\""):
        parse('[[upstreams]]\nname = "a"\nurl = "http://x:1"\nuse = "when_others_yielded"\n')
    with pytest.raises(ConfigError, match=r"upstreams.\*.classes: no upstream serves interactive requests"):
        parse('[[upstreams]]\nname = "a"\nurl = "http://x:1"\nclasses = ["batch", "long"]\n')


def test_the_one_upstream_fallback_is_refused_beside_upstreams():
    text = TWO + '[fallback]\nenabled = true\nurl = "http://cpu:1"\nmodels = { "m" = "m" }\n'
    with pytest.raises(ConfigError, match=r"fallback.enabled: \[fallback\] is the one-upstream form"):
        parse(text)


def test_every_api_the_config_takes_has_a_server_description():
    from yieldproxy.config import UPSTREAM_APIS
    from yieldproxy.servers import APIS

    assert set(UPSTREAM_APIS) == set(APIS)


def test_twistd_upstream_option_is_refused_beside_upstreams(tmp_path):
    from twisted.python.usage import UsageError

    from yieldproxy.tap import Options

    path = tmp_path / "pool.toml"
    path.write_text(TWO)
    with pytest.raises(UsageError, match=r"--upstream: the config file has \[\[upstreams\]\]"):
        Options().parseOptions(["--config", str(path), "--upstream", "http://other:1"])


@pytest.mark.parametrize(
    "url, api, meant",
    [
        ("http://127.0.0.1:11434/api", "ollama", "http://127.0.0.1:11434"),
        ("http://127.0.0.1:11434/api/", "ollama", "http://127.0.0.1:11434"),
        ("http://gpu:11434/api/embed", "ollama", "http://gpu:11434"),
        ("http://gpu:11434/v1", "ollama", "http://gpu:11434"),
        ("http://cpu:7997/v1", "infinity", "http://cpu:7997"),
        ("http://gpu/ollama/api", "ollama", "http://gpu/ollama"),  # a server under a prefix keeps it
    ],
)
def test_an_upstream_url_that_ends_in_an_api_path_is_named_with_what_was_meant(url, api, meant):
    config = pool_config({"name": "gpu", "url": url, "api": api})
    [warning] = url_warnings(config)
    assert warning.startswith(f"upstreams[0].url = {url!r} ends in ") and warning.endswith(f"probably {meant!r}")
    if api == "ollama" and url.rstrip("/").endswith("/v1"):
        assert 'its api is "ollama"' in warning
    single = url_warnings(Config().with_overrides(**{"proxy.upstream": url}))
    assert single[0].startswith(f"proxy.upstream = {url!r} ends in ")


def test_a_root_url_or_a_prefix_that_is_no_api_path_gives_no_warning():
    for url in ("http://127.0.0.1:11434", "http://gpu:11434/", "http://gpu/apiary", "http://gpu/ollama"):
        assert url_warnings(Config().with_overrides(**{"proxy.upstream": url})) == []
