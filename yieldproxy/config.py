"""The configuration: attrs values with defaults, loaded from one TOML file.

Every key has a default and is checked at start; a bad value is reported with
the file and the dotted key (``yieldproxy.toml: replay.rate: ...``), and the
process does not start.  docs/configuration.md specifies every key (what it
does, its default, its bounds), section by section as the classes here are;
``etc/yieldproxy.toml`` sets each to its default, commented.
"""

from __future__ import annotations

import collections.abc
import difflib
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Mapping, Sequence
from urllib.parse import urlsplit

import attrs

from .names import CLASS_NAMES, ROUTE_CLASSES, check_source
from .servers.cors import Origins

POLICIES = ("park", "reject", "fallback")
TRUST_MODES = ("loopback", "always", "never")


class ConfigError(Exception):
    """A configuration problem, worded for the person who wrote the file."""


def _at_least(minimum: float):
    def check(instance, attribute, value):
        if value < minimum:
            raise ValueError(f"must be >= {minimum}, got {value!r}")

    return check


def _one_of(choices: tuple[str, ...]):
    def check(instance, attribute, value):
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}; got {value!r}")

    return check


def _status(instance, attribute, value):
    if value not in (429, 503):
        raise ValueError(f"must be 503 or 429, got {value!r}")


def _http_url(instance, attribute, value):
    if not (value.startswith("http://") or value.startswith("https://")):
        raise ValueError(f"must be an http:// or https:// URL, got {value!r}")
    try:
        parts = urlsplit(value)
        parts.port
    except ValueError as e:
        raise ValueError(f"not a usable URL ({e}): {value!r}") from None
    if not parts.hostname:
        raise ValueError(f"needs a host name, got {value!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"must not have a query or fragment, got {value!r}")


#: An ``allowed_hosts`` entry: a name, an IP address (no port), ``*.suffix``, or ``*``.
_HOST_PATTERN = re.compile(r"\*|(\*\.)?[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\.?|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*")


def _host_patterns(instance, attribute, value):
    for entry in value:
        if not _HOST_PATTERN.fullmatch(entry):
            raise ValueError(
                "must be host names or IP addresses without a port, '*.example.lan' patterns, "
                f"or '*' (any host), got {entry!r}"
            )


def _origins(instance, attribute, value):
    Origins.from_entries(value)  # ValueError naming the entry Ollama's CORS check would refuse to start with


def _source_names(instance, attribute, value):
    for name in value:
        try:
            check_source(name)
        except ValueError as e:
            raise ValueError(f"{name!r}: {e}") from None


@attrs.frozen
class ProxyConfig:
    listen: str = "tcp:11435:interface=127.0.0.1"
    upstream: str = attrs.field(default="http://127.0.0.1:11434", validator=_http_url)
    max_body_bytes: int = attrs.field(default=32 * 1024 * 1024, validator=_at_least(1))
    trust_class_header: str = attrs.field(default="loopback", validator=_one_of(TRUST_MODES))
    unknown_route_class: str = attrs.field(default="interactive", validator=_one_of(ROUTE_CLASSES))
    idle_timeout_seconds: float = attrs.field(default=300.0, validator=_at_least(1))
    keepalive_timeout_seconds: float = attrs.field(default=30.0, validator=_at_least(1))
    request_read_timeout_seconds: float = attrs.field(default=30.0, validator=_at_least(1))
    shutdown_timeout_seconds: float = attrs.field(default=30.0, validator=_at_least(0))
    slow_client_buffer_bytes: int = attrs.field(default=64 * 1024 * 1024, validator=_at_least(1))
    slow_client_buffer_total_bytes: int = attrs.field(default=256 * 1024 * 1024, validator=_at_least(1))
    max_connections: int = attrs.field(default=0, validator=_at_least(0))
    max_receiving_bytes: int = attrs.field(default=256 * 1024 * 1024, validator=_at_least(1))
    allowed_hosts: tuple[str, ...] = attrs.field(default=(), validator=_host_patterns)
    allowed_origins: tuple[str, ...] = attrs.field(default=(), validator=_origins)


#: Connections kept beyond ``parking.max_parked`` by default: requests in flight,
#: passthrough calls, idle keep-alive connections.
CONNECTION_HEADROOM = 1024


def proxy_max_connections(config: "Config") -> int:
    """The proxy listener's connection cap: ``proxy.max_connections``, or what parking needs."""
    return config.proxy.max_connections or config.parking.max_parked + CONNECTION_HEADROOM


@attrs.frozen
class AdminConfig:
    listen: str = "tcp:11436:interface=127.0.0.1"
    token_file: str = ""
    read_token_file: str = ""
    max_connections: int = attrs.field(default=64, validator=_at_least(1))
    max_connections_per_peer: int = attrs.field(default=16, validator=_at_least(1))
    allowed_hosts: tuple[str, ...] = attrs.field(default=(), validator=_host_patterns)
    max_holds: int = attrs.field(default=32, validator=_at_least(1))
    known_sources: tuple[str, ...] = attrs.field(default=(), validator=_source_names)


@attrs.frozen
class ParkingConfig:
    max_parked: int = attrs.field(default=10_000, validator=_at_least(1))
    max_parked_bytes: int = attrs.field(default=256 * 1024 * 1024, validator=_at_least(1))
    reject_status: int = attrs.field(default=503, validator=_status)


@attrs.frozen
class ReplayConfig:
    concurrency: int = attrs.field(default=4, validator=_at_least(1))
    rate: float = attrs.field(default=0.0, validator=_at_least(0))


def _model_name(instance, attribute, value):
    """A model name without surrounding spaces, or "" / None (none named)."""
    if value and value != value.strip():
        raise ValueError(f"must be a model name without surrounding spaces, got {value!r}")


def _url_path(instance, attribute, value):
    if not value.startswith("/"):
        raise ValueError(f"must be a path starting with '/', got {value!r}")


@attrs.frozen
class UpstreamConfig:
    attempt_timeout_seconds: float = attrs.field(default=120.0, validator=_at_least(0.001))
    stall_timeout_seconds: float = attrs.field(default=60.0, validator=_at_least(0.001))
    max_attempts: int = attrs.field(default=5, validator=_at_least(1))
    retry_backoff_seconds: float = attrs.field(default=0.5, validator=_at_least(0))
    retry_backoff_max_seconds: float = attrs.field(default=10.0, validator=_at_least(0))
    max_connections: int = attrs.field(default=64, validator=_at_least(1))
    detect_outages: bool = True
    health_path: str = attrs.field(default="/api/version", validator=_url_path)
    health_interval_seconds: float = attrs.field(default=0.5, validator=_at_least(0.01))
    health_max_interval_seconds: float = attrs.field(default=10.0, validator=_at_least(0.01))
    health_timeout_seconds: float = attrs.field(default=2.0, validator=_at_least(0.01))
    model_probe_timeout_seconds: float = attrs.field(default=60.0, validator=_at_least(0.01))
    not_ready_max_seconds: float = attrs.field(default=300.0, validator=_at_least(0.01))
    models_refresh_seconds: float = attrs.field(default=60.0, validator=_at_least(1))
    probe_model: str = attrs.field(default="", validator=_model_name)
    probe_path: str = attrs.field(default="", validator=lambda i, a, v: _optional_url_path(i, a, v))


@attrs.frozen
class WatchersConfig:
    """Watchers that take holds by themselves (docs/watchers.md); each is off until set."""

    state_file: str = ""
    state_file_poll_seconds: float = attrs.field(default=1.0, validator=_at_least(0.01))
    signals: bool = False
    command: str = ""
    command_interval_seconds: float = attrs.field(default=5.0, validator=_at_least(0.1))
    command_timeout_seconds: float = attrs.field(default=10.0, validator=_at_least(0.01))


def _absolute_path(instance, attribute, value):
    if value and not Path(value).expanduser().is_absolute():
        raise ValueError(f"must be an absolute path (or start with '~/'), got {value!r}")


@attrs.frozen
class StateConfig:
    """What the proxy keeps across restarts: its holds (docs/operating.md, "Restart, reload, upgrade")."""

    holds_file: str = attrs.field(default="", validator=_absolute_path)
    restart_hold_seconds: float = attrs.field(default=600.0, validator=[_at_least(1), attrs.validators.le(7 * 24 * 3600.0)])


def _model_names(instance, attribute, value):
    for name in value:
        if not name.strip() or name != name.strip():
            raise ValueError(f"must be model names without surrounding spaces, got {name!r}")


@attrs.frozen
class HandoverConfig:
    """Giving the GPU's memory away during a yield and loading models back after it."""

    unload_on_yield: bool = False
    unload_wait_seconds: float = attrs.field(default=30.0, validator=_at_least(0))
    unload_timeout_seconds: float = attrs.field(default=15.0, validator=_at_least(0.01))
    preload_models: tuple[str, ...] = attrs.field(default=(), validator=_model_names)
    preload_timeout_seconds: float = attrs.field(default=120.0, validator=_at_least(0.01))


def _share(instance, attribute, value):
    if not 0 <= value <= 1:
        raise ValueError(f"must be between 0 and 1, got {value!r}")


@attrs.frozen
class ClassConfig:
    policy: str = attrs.field(default="park", validator=_one_of(POLICIES))
    hold_seconds: float = attrs.field(default=600.0, validator=_at_least(0))
    max_parked: int = attrs.field(default=0, validator=_at_least(0))
    priority: int = 0
    min_share: float = attrs.field(default=0.0, validator=_share)
    attempt_timeout_seconds: float = attrs.field(default=0.0, validator=_at_least(0))


def _default_classes() -> dict[str, ClassConfig]:
    return {
        "interactive": ClassConfig(hold_seconds=15.0, priority=2),
        "batch": ClassConfig(hold_seconds=600.0, priority=1, min_share=0.25),
        # Long jobs may think for many minutes before their first byte.
        "long": ClassConfig(hold_seconds=3600.0, priority=0, min_share=0.1, attempt_timeout_seconds=1800.0),
    }


def _path(instance, attribute, value):
    if value and not value.startswith("/"):
        raise ValueError(f"must start with '/', got {value!r}")


@attrs.frozen
class RouteRule:
    """One classification rule; the first rule that matches a request decides its class."""

    cls: str = attrs.field(validator=_one_of(ROUTE_CLASSES))
    path: str = attrs.field(default="", validator=_path)
    prefix: str = attrs.field(default="", validator=_path)
    methods: tuple[str, ...] = ()
    models: tuple[str, ...] = ()


API_SHAPES = ("ollama", "openai")

#: Two probe texts longer than the usual truncation limits, within llama-server's default batch
#: (docs/fallback.md, "What verification checks": why, and what was measured with them).
LONG_PROBE_TEXTS = (
    "A batch ingest of a large document collection can run for hours, and most of that time goes into "
    "embedding: every chunk of every document is sent to the embedding server, one request after another, "
    "and the vectors that come back are written into a vector store next to the text they describe. When "
    "the same machine is also used for other work, such as a game, a render or a training run that needs "
    "the whole graphics card for a while, the embedding server has to step aside. Without anything in "
    "between, the ingest sees connection errors and timeouts, gives up on a few hundred chunks and leaves "
    "holes in the store that nobody notices until a search fails to find what it should. A proxy in front "
    "of the server can instead hold each request while the card is away, keep the connection open, and "
    "send the requests on in their original order once the server is back, at a pace the server can take. "
    "The caller sees a slow answer rather than an error, and the store ends up complete. The same proxy "
    "can also send some of the work to a copy of the model that runs on the processor, but only when that "
    "copy is known to give the same vectors, because a vector from another model sits in the store "
    "without any error and quietly ruins every search that touches it. That is why the copy is compared "
    "with the original on a fixed set of texts before it is ever used, and again every few minutes while "
    "the original is there to compare with.",
    "Checking that two servers give the same vectors sounds simple, yet the details matter. The same "
    "weights can be served by programs that read their input differently: one cuts every text after a "
    "fixed number of word pieces, another reads as far as its context allows, a third adds a prefix or "
    "forgets to normalise. On short texts all of them agree to many decimal places, so a check that only "
    "ever embeds a greeting, a sentence or two and a line of code will call them twins. The difference "
    "shows only on long texts, and long texts are exactly what a document ingest sends: chunks of several "
    "hundred tokens, cut to fill the model's window. A text longer than one server's limit but shorter "
    "than the other's is embedded in full on one side and in part on the other, and the two vectors point "
    "in visibly different directions. So the texts used for the check must include some that are longer "
    "than the usual limits, while staying short enough that every honest server still accepts them in one "
    "batch, or the reference itself would refuse the check. Measured on the small sentence model used in "
    "the tests, a text of a little more than three hundred word pieces already separates a server that "
    "truncates at two hundred and fifty six from one that reads up to five hundred and twelve, and a text "
    "of about four hundred and fifty separates them further, while neither text is refused. When the "
    "check fails on these texts alone, the likely cause is truncation at a different length, and the "
    "reason given says so, so that the operator can either align the servers or limit the probe texts to "
    "what both read in full, knowing that long inputs would then be embedded differently by the two. "
    "Either way the choice is made in the open: the status page shows the worst cosine found, the texts "
    "that differ and when the check last ran, and until a copy passes again it receives none of the "
    "embeddings, which wait for the original instead. Chat and generation are never held back by this "
    "check, since a reply that differs a little does no lasting harm, whereas a stored vector from the "
    "wrong function stays wrong for as long as the store is kept, and nothing downstream can tell.",
)

#: What verification embeds on both sides (docs/fallback.md, "What verification checks").
DEFAULT_PROBE_TEXTS = (
    "hello",
    "The quick brown fox jumps over the lazy dog.",
    "Parking requests while the GPU is away, then replaying them in order when it comes back, "
    "keeps a batch ingest from failing; serving them from a copy of the same model on the CPU "
    "is only safe when that copy really gives the same vectors, which is why it is checked "
    "against the primary on a fixed set of texts before it is ever used, and again every few "
    "minutes while the primary is there to compare with.",
    "Der Bericht wurde gestern veröffentlicht und löste eine lebhafte Debatte aus.",
    "東京は日本の首都であり、世界最大の都市圏の一つです。",
    "def add(a: int, b: int) -> int:\n    return a + b  # TODO: overflow?",
    "Invoice 2024-0173: 3 x 19.99 EUR = 59.97 EUR, due 2024-12-31, ref #88412.",
    "Great job 🎉🚀 see you at the café ☕",
    "SELECT id, name FROM users WHERE created_at > '2024-01-01' ORDER BY id;",
    "  leading and trailing   spaces,\ttabs and\nnew lines  ",
    *LONG_PROBE_TEXTS,
)


def _nonempty_http_url(instance, attribute, value):
    if value:
        _http_url(instance, attribute, value)


def _cosine(instance, attribute, value):
    if not 0 < value <= 1:
        raise ValueError(f"must be above 0 and at most 1, got {value!r}")


def _class_names(instance, attribute, value):
    for name in value:
        if name not in CLASS_NAMES:
            raise ValueError(f"unknown class {name!r} (known classes: {', '.join(CLASS_NAMES)})")


def _probe_texts(instance, attribute, value):
    if not value or not all(text.strip() for text in value):
        raise ValueError("must be a non-empty list of non-blank texts")


def _model_map(instance, attribute, value):
    for primary, fallback in value.items():
        if not isinstance(fallback, str) or not primary.strip() or not fallback.strip():
            raise ValueError(f"must map model names to model names, got {primary!r} = {fallback!r}")


@attrs.frozen
class FallbackConfig:
    """A CPU copy of the primary's embedding models, used only while verified (docs/fallback.md)."""

    enabled: bool = False
    url: str = attrs.field(default="", validator=_nonempty_http_url)
    api: str = attrs.field(default="ollama", validator=_one_of(API_SHAPES))
    primary_api: str = attrs.field(default="ollama", validator=_one_of(API_SHAPES))
    models: Mapping[str, str] = attrs.field(factory=dict, validator=_model_map)
    classes: tuple[str, ...] = attrs.field(default=("batch",), validator=_class_names)
    concurrency: int = attrs.field(default=2, validator=_at_least(1))
    verify_interval_seconds: float = attrs.field(default=600.0, validator=_at_least(1))
    max_verification_age_seconds: float = attrs.field(default=1800.0, validator=_at_least(1))
    min_cosine: float = attrs.field(default=0.99, validator=_cosine)
    probe_texts: tuple[str, ...] = attrs.field(default=DEFAULT_PROBE_TEXTS, validator=_probe_texts)
    timeout_seconds: float = attrs.field(default=30.0, validator=_at_least(0.001))


@attrs.frozen
class VerificationConfig:
    """Twin verification in a pool: which members may serve a model's embeddings (docs/pool.md).

    The keys mean what ``[fallback]``'s do, applied to every member that
    serves a model and is not its reference (the first member serving it).
    """

    models: tuple[str, ...] = attrs.field(default=(), validator=_model_names)
    verify_interval_seconds: float = attrs.field(default=600.0, validator=_at_least(1))
    max_verification_age_seconds: float = attrs.field(default=1800.0, validator=_at_least(1))
    min_cosine: float = attrs.field(default=0.99, validator=_cosine)
    probe_texts: tuple[str, ...] = attrs.field(default=DEFAULT_PROBE_TEXTS, validator=_probe_texts)
    timeout_seconds: float = attrs.field(default=30.0, validator=_at_least(0.001))


#: What ``[[upstreams]] api`` takes: the kind of server a member is (docs/servers.md).
UPSTREAM_APIS = ("ollama", "openai", "tei", "infinity", "llamacpp")
#: ``[[upstreams]] use``: ``always``, or only while no ``always`` member that may serve a request is available.
MEMBER_USES = ("always", "when_others_yielded")
#: A member's name: a metric label, a log word and a JSON string, so a conservative set.
_MEMBER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _member_name(instance, attribute, value):
    if not _MEMBER_NAME.fullmatch(value):
        raise ValueError(
            "must be 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or a digit, "
            f"got {value!r}"
        )


def _model_patterns(instance, attribute, value):
    for pattern in value:
        if not pattern.strip() or pattern != pattern.strip():
            raise ValueError(f"must be model names or shell patterns without surrounding spaces, got {pattern!r}")


def _optional_url_path(instance, attribute, value):
    if value:
        _url_path(instance, attribute, value)


@attrs.frozen
class MemberConfig:
    """One ``[[upstreams]]`` table: an upstream of the pool, with its own yield state (docs/configuration.md).

    Keys it leaves out take the global sections' values: ``[replay]``,
    ``[upstream]``, ``[watchers]`` and ``[handover]`` are the defaults of
    every member (None here means "not set").
    """

    name: str = attrs.field(default="", validator=_member_name)
    url: str = attrs.field(default="", validator=_nonempty_http_url)
    api: str = attrs.field(default="ollama", validator=_one_of(UPSTREAM_APIS))
    models: tuple[str, ...] = attrs.field(default=(), validator=_model_patterns)
    model_map: Mapping[str, str] = attrs.field(factory=dict, validator=_model_map)
    replay_concurrency: int = attrs.field(default=0, validator=_at_least(0))
    use: str = attrs.field(default="always", validator=_one_of(MEMBER_USES))
    classes: tuple[str, ...] = attrs.field(default=CLASS_NAMES, validator=_class_names)
    state_file: str = ""
    command: str = ""
    detect_outages: bool | None = None
    health_path: str = attrs.field(default="", validator=_optional_url_path)
    probe_model: str | None = attrs.field(default=None, validator=_model_name)
    probe_path: str | None = attrs.field(default=None, validator=_optional_url_path)
    unload_on_yield: bool | None = None
    preload_models: tuple[str, ...] | None = attrs.field(default=None, validator=attrs.validators.optional(_model_names))


@attrs.frozen
class Config:
    proxy: ProxyConfig = attrs.Factory(ProxyConfig)
    admin: AdminConfig = attrs.Factory(AdminConfig)
    parking: ParkingConfig = attrs.Factory(ParkingConfig)
    replay: ReplayConfig = attrs.Factory(ReplayConfig)
    upstream: UpstreamConfig = attrs.Factory(UpstreamConfig)
    watchers: WatchersConfig = attrs.Factory(WatchersConfig)
    handover: HandoverConfig = attrs.Factory(HandoverConfig)
    classes: Mapping[str, ClassConfig] = attrs.Factory(_default_classes)
    routes: tuple[RouteRule, ...] = ()
    fallback: FallbackConfig = attrs.Factory(FallbackConfig)
    verification: VerificationConfig = attrs.Factory(VerificationConfig)
    upstreams: tuple[MemberConfig, ...] = ()
    state: StateConfig = attrs.Factory(StateConfig)
    #: The ``section.key`` names the file or the command line set (not compared: the same values are
    #: the same config).  Defaults sized to the machine (lifecycle/limits.py) give way only where the operator
    #: set nothing; a setting given that cannot be met is warned about.
    explicit: frozenset[str] = attrs.field(default=frozenset(), eq=False, repr=False, metadata={"section": False})

    def with_overrides(self, **dotted: Any) -> "Config":
        """A copy with ``section.key`` values replaced (command-line options)."""
        sections: dict[str, dict[str, Any]] = {}
        for dotted_key, value in dotted.items():
            if value is None:
                continue
            section, key = dotted_key.split(".")
            sections.setdefault(section, {})[key] = value
        changes = {name: attrs.evolve(getattr(self, name), **keys) for name, keys in sections.items()}
        given = {f"{name}.{key}" for name, keys in sections.items() for key in keys}
        return attrs.evolve(self, **changes, explicit=self.explicit | given)

    def sized(self, **dotted: Any) -> "Config":
        """A copy with ``section.key`` defaults replaced by values sized to the machine (not made explicit)."""
        return attrs.evolve(self.with_overrides(**dotted), explicit=self.explicit)


_SECTIONS = {
    "proxy": ProxyConfig,
    "admin": AdminConfig,
    "parking": ParkingConfig,
    "replay": ReplayConfig,
    "upstream": UpstreamConfig,
    "watchers": WatchersConfig,
    "handover": HandoverConfig,
    "fallback": FallbackConfig,
    "verification": VerificationConfig,
    "state": StateConfig,
}


def _coerce(where: str, expected: Any, value: Any) -> Any:
    """Check a TOML value against the field's type; ints are fine where floats go."""
    if typing.get_origin(expected) in (typing.Union, types.UnionType):
        # ``X | None``: a key the file leaves out is None; one it sets is an X.
        expected = next(arg for arg in typing.get_args(expected) if arg is not type(None))
    if typing.get_origin(expected) is collections.abc.Mapping:
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise ConfigError(f"{where}: must be a table of strings, got {value!r}")
        return dict(value)
    if typing.get_origin(expected) is tuple:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: must be a list of strings, got {value!r}")
        return tuple(value)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if (expected is int and isinstance(value, bool)) or not isinstance(value, expected):
        raise ConfigError(f"{where}: must be {expected.__name__}, got {type(value).__name__} {value!r}")
    return value


def unknown(where: str, what: str, name: str, known: Sequence[str], plural: str = "") -> ConfigError:
    """The error for a name the config does not know: the nearest known one first, when one is near (a typo),
    then all of them."""
    nearest = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {nearest[0]!r}?" if nearest else ""
    return ConfigError(f"{where}: unknown {what}{hint} (known {plural or what + 's'}: {', '.join(known)})")


def _build(cls: type, table: Any, where: str) -> Any:
    """One attrs section from its TOML table; every error names its own key."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: must be a table, got {type(table).__name__}")
    types = typing.get_type_hints(cls)
    fields = attrs.fields_dict(cls)
    values = {}
    for key, value in table.items():
        if key not in types:
            raise unknown(f"{where}.{key}", "key", key, sorted(types))
        value = _coerce(f"{where}.{key}", types[key], value)
        validator = fields[key].validator
        if validator is not None:
            try:
                validator(None, fields[key], value)
            except ValueError as e:
                raise ConfigError(f"{where}.{key}: {e}") from None
        values[key] = value
    return cls(**values)


def from_dict(data: Mapping[str, Any], source: str = "<config>") -> Config:
    """Build a :class:`Config` from parsed TOML, with errors prefixed by ``source``."""
    sections: dict[str, Any] = {}
    try:
        for name, table in data.items():
            if name == "classes":
                sections["classes"] = _classes(table)
            elif name == "routes":
                sections["routes"] = _routes(table)
            elif name == "upstreams":
                sections["upstreams"] = _upstreams(table)
            elif name in _SECTIONS:
                sections[name] = _build(_SECTIONS[name], table, name)
            else:
                raise unknown(name, "section", name, [*_SECTIONS, "classes", "routes", "upstreams"])
        if "upstreams" in data and isinstance(data.get("proxy"), dict) and "upstream" in data["proxy"]:
            raise ConfigError(
                "proxy.upstream and [[upstreams]] are both set: proxy.upstream is the one-upstream form; "
                "with [[upstreams]], give each upstream its url there and remove proxy.upstream"
            )
        explicit = frozenset(
            f"{name}.{key}" for name, table in data.items() if name in _SECTIONS and isinstance(table, dict)
            for key in table
        )
        config = Config(**sections, explicit=explicit)
        _check_combinations(config)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return config


def _classes(table: Any) -> dict[str, ClassConfig]:
    if not isinstance(table, dict):
        raise ConfigError(f"classes: must be a table, got {type(table).__name__}")
    classes = _default_classes()
    for name, body in table.items():
        if name not in CLASS_NAMES:
            raise unknown(f"classes.{name}", "class", name, CLASS_NAMES, "classes")
        built = _build(ClassConfig, body, f"classes.{name}")
        # Keys the file leaves out keep the class's own default, not the generic one.
        classes[name] = attrs.evolve(classes[name], **{k: getattr(built, k) for k in body})
    return classes


def _routes(tables: Any) -> tuple[RouteRule, ...]:
    """``[[routes]]`` tables, in order; each needs a class and a path or a prefix."""
    if not isinstance(tables, list):
        raise ConfigError("routes: must be an array of tables ([[routes]])")
    rules = []
    for index, table in enumerate(tables):
        where = f"routes[{index}]"
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: must be a table")
        table = dict(table)
        if "class" not in table:
            raise ConfigError(f"{where}.class: missing (one of {', '.join(ROUTE_CLASSES)})")
        table["cls"] = table.pop("class")
        if bool(table.get("path")) == bool(table.get("prefix")):
            raise ConfigError(f"{where}: give exactly one of path or prefix")
        try:
            rule = _build(RouteRule, table, where)
        except ConfigError as e:
            raise ConfigError(str(e).replace(f"{where}.cls", f"{where}.class")) from None
        rules.append(attrs.evolve(rule, methods=tuple(m.upper() for m in rule.methods)))
    return tuple(rules)


def _upstreams(tables: Any) -> tuple[MemberConfig, ...]:
    """``[[upstreams]]`` tables, in order: each needs a name and a url; names are distinct."""
    if not isinstance(tables, list) or not tables:
        raise ConfigError("upstreams: must be an array of tables ([[upstreams]]), at least one")
    members = []
    names: dict[str, int] = {}
    for index, table in enumerate(tables):
        where = f"upstreams[{index}]"
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: must be a table")
        for key in ("name", "url"):
            if key not in table:
                raise ConfigError(f"{where}.{key}: missing (every [[upstreams]] table needs a name and a url)")
        member = _build(MemberConfig, table, where)
        if member.name in names:
            raise ConfigError(f"{where}.name: {member.name!r} is the name of upstreams[{names[member.name]}] too")
        names[member.name] = index
        if member.api != "ollama" and (member.unload_on_yield or member.preload_models):
            key = "unload_on_yield" if member.unload_on_yield else "preload_models"
            raise ConfigError(
                f"{where}.{key}: the VRAM handover unloads and loads models through Ollama's API; "
                f"this upstream's api is {member.api}"
            )
        members.append(member)
    return tuple(members)


def _check_combinations(config: Config) -> None:
    """Rules that span keys: each names the key to change."""
    for name, cls in config.classes.items():
        if cls.policy == "fallback" and not config.fallback.enabled:
            raise ConfigError(
                f"classes.{name}.policy: 'fallback' needs a fallback backend, and fallback.enabled "
                "is false; set up [fallback] (see docs/fallback.md) or use 'park' or 'reject'"
            )
        if cls.policy == "fallback" and name not in config.fallback.classes:
            raise ConfigError(
                f"classes.{name}.policy: 'fallback', but fallback.classes "
                f"({', '.join(config.fallback.classes) or 'empty'}) does not list {name}; add it there"
            )
        if cls.max_parked > config.parking.max_parked:
            raise ConfigError(
                f"classes.{name}.max_parked: {cls.max_parked} is above parking.max_parked "
                f"({config.parking.max_parked}); lower it or raise the global ceiling"
            )
    shares = sum(c.min_share for c in config.classes.values())
    if shares > 1:
        raise ConfigError(f"classes.*.min_share: the shares add up to {shares:g}, more than 1")
    for most, least in (("retry_backoff_max_seconds", "retry_backoff_seconds"), ("health_max_interval_seconds", "health_interval_seconds")):
        if getattr(config.upstream, most) < getattr(config.upstream, least):
            raise ConfigError(f"upstream.{most}: must be >= upstream.{least}")
    _check_probe_models(config)
    _check_fallback(config.fallback)
    if config.verification.max_verification_age_seconds < config.verification.verify_interval_seconds:
        raise ConfigError(
            "verification.max_verification_age_seconds: must be >= verification.verify_interval_seconds "
            f"({config.verification.verify_interval_seconds:g}), or every verification goes stale before the next"
        )
    _check_upstreams(config)


def _check_probe_models(config: Config) -> None:
    """A ``probe_path`` needs a ``probe_model``, and a route the upstream's server has a minimal call for."""
    from .servers import ModelCall, server

    up = config.upstream
    if not config.upstreams:
        api = config.fallback.primary_api if config.fallback.enabled else "ollama"
        targets = [("upstream", up.probe_model, up.probe_path, api)]
    else:
        targets = [
            (f"upstreams[{i}]" if m.probe_path is not None else "upstream",
             up.probe_model if m.probe_model is None else m.probe_model,
             up.probe_path if m.probe_path is None else m.probe_path, m.api)
            for i, m in enumerate(config.upstreams)
        ]
    for where, model, path, api in targets:
        if not path:
            continue
        if not model:
            raise ConfigError(f"{where}.probe_path: needs a probe_model (the model the outage probe asks for)")
        if server(api).minimal_call(ModelCall(path, model)) is None:
            raise ConfigError(
                f"{where}.probe_path: {path!r} is no route an outage probe can call on an upstream of api {api} "
                "(a model route: /api/embed, /api/generate, /api/chat, /v1/embeddings, /v1/chat/completions...)"
            )


def _check_upstreams(config: Config) -> None:
    """A pool needs a member that is always used, and a member for every class."""
    if not config.upstreams:
        return
    if not any(m.use == "always" for m in config.upstreams):
        raise ConfigError(
            "upstreams: every upstream has use = \"when_others_yielded\"; at least one must be \"always\" "
            "(the others are used while it is yielded)"
        )
    for cls in config.classes:
        if not any(cls in m.classes for m in config.upstreams):
            raise ConfigError(
                f"upstreams.*.classes: no upstream serves {cls} requests; add {cls!r} to some upstream's classes"
            )
    if config.fallback.enabled:
        raise ConfigError(
            "fallback.enabled: [fallback] is the one-upstream form of a CPU copy; with [[upstreams]], "
            "add the CPU copy as an upstream with use = \"when_others_yielded\" and turn [fallback] off"
        )


def _check_fallback(fallback: FallbackConfig) -> None:
    """An enabled fallback needs somewhere to go and something to serve."""
    if not fallback.enabled:
        return
    if not fallback.url:
        raise ConfigError("fallback.url: required when fallback.enabled is true")
    if not fallback.models:
        raise ConfigError(
            "fallback.models: required when fallback.enabled is true "
            '(a table mapping primary model names to the fallback\'s, e.g. "all-minilm" = "all-minilm")'
        )
    if fallback.max_verification_age_seconds < fallback.verify_interval_seconds:
        raise ConfigError(
            "fallback.max_verification_age_seconds: must be >= fallback.verify_interval_seconds "
            f"({fallback.verify_interval_seconds:g}), or every verification goes stale before the next"
        )


def load(path: str | Path | None) -> Config:
    """Read a TOML file (or return the defaults when ``path`` is None)."""
    if path is None:
        return Config()
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file: {e.strerror or e}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    return from_dict(data, str(path))


def read_token(config: Config) -> str | None:
    """The admin token from ``admin.token_file`` (stripped), or None when unset."""
    return _read_token_file(config.admin.token_file, "admin.token_file")


def read_read_token(config: Config) -> str | None:
    """The read-only token from ``admin.read_token_file`` (stripped), or None when unset."""
    return _read_token_file(config.admin.read_token_file, "admin.read_token_file")


def read_tokens(config: Config) -> tuple[str | None, str | None]:
    """Both admin tokens, checked together: a read-only token needs an admin token, and differs from it."""
    token = read_token(config)
    read = read_read_token(config)
    if read is not None and token is None:
        raise ConfigError(
            "admin.read_token_file: needs admin.token_file too (without an admin token every "
            "route is open, so a read-only token would protect nothing)"
        )
    if read is not None and read == token:
        raise ConfigError("admin.read_token_file: holds the same token as admin.token_file; use another")
    return token, read


def _read_token_file(path: str, key: str) -> str | None:
    if not path:
        return None
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path}: {e.strerror or e}") from None
    if not token:
        raise ConfigError(f"{key}: {path} is empty")
    return token
