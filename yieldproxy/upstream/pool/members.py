"""The pool's members as they run: each ``[[upstreams]]`` table with every default resolved.

Without ``[[upstreams]]`` the pool is ``proxy.upstream`` alone, named ``default``
(:func:`default_member`); an enabled ``[fallback]`` adds a standby member named
``fallback`` (:func:`fallback_member`).  How a table's missing keys are filled
in: docs/configuration.md and docs/pool.md.

What the pool's make-up decides (whether lines name members, what a
member's own holds hold) is decided here, once, from the members
(:func:`pool_shape`): the parts that act on it read :class:`PoolShape`
rather than count members.
"""

from __future__ import annotations

from typing import Sequence
from urllib.parse import urlsplit, urlunsplit

import attrs

from ...config import Config
from ...lot.state import ALL, DEFAULT_MEMBER
from ...names import CLASS_NAMES
from ...servers import Server, server

#: The member an enabled ``[fallback]`` becomes.
FALLBACK_MEMBER = "fallback"


@attrs.frozen
class MemberSpec:
    """One member: what it is, where it is, what it serves, and how its yields are watched."""

    name: str
    url: str
    api: str
    #: Model-name patterns it serves; empty: what its model list says (:mod:`.models`).
    models: tuple[str, ...] = ()
    #: A request's model name -> this member's name for it.
    model_map: dict[str, str] = attrs.Factory(dict)
    #: Its cap while the lot drains into it.
    replay_concurrency: int = 4
    use: str = "always"
    classes: tuple[str, ...] = CLASS_NAMES
    state_file: str = ""
    command: str = ""
    detect_outages: bool = True
    health_path: str = "/api/version"
    #: The model its outage probes ask for, and on which route ("": see upstream.probe_model, probe_path).
    probe_model: str = ""
    probe_path: str = ""
    unload_on_yield: bool = False
    preload_models: tuple[str, ...] = ()
    #: Its starts per second while the lot drains into it (None: ``replay.rate``).
    rate: float | None = None
    #: Its own bound on an attempt (0: the class's or ``upstream.attempt_timeout_seconds``).
    attempt_timeout_seconds: float = 0.0
    #: The ``[fallback]`` member (:func:`fallback_member`): it serves embeddings only translated,
    #: its url is an API base URL, its errors are never shown (a request it fails goes back to its
    #: place and is not given to it again), and its answers say so (:func:`answer_headers`).
    fallback: bool = False

    @property
    def standby(self) -> bool:
        """Used only while no ``always`` member that may serve a request is available."""
        return self.use == "when_others_yielded"

    @property
    def hands_over(self) -> bool:
        """True when a yield of this member unloads or preloads models on it."""
        return self.unload_on_yield or bool(self.preload_models)


def member_specs(config: Config) -> tuple[MemberSpec, ...]:
    """The members of ``config``'s pool, in config order."""
    if not config.upstreams:
        return (default_member(config), *fallback_member(config))
    handover = config.handover
    specs = []
    for m in config.upstreams:
        ollama = m.api == "ollama"
        specs.append(
            MemberSpec(
                name=m.name,
                url=m.url,
                api=m.api,
                models=m.models,
                model_map=dict(m.model_map),
                replay_concurrency=m.replay_concurrency or config.replay.concurrency,
                use=m.use,
                classes=m.classes,
                state_file=m.state_file,
                command=m.command,
                detect_outages=config.upstream.detect_outages if m.detect_outages is None else m.detect_outages,
                health_path=m.health_path or server(m.api).health_path,
                probe_model=config.upstream.probe_model if m.probe_model is None else m.probe_model,
                probe_path=config.upstream.probe_path if m.probe_path is None else m.probe_path,
                # The global handover is for the members that speak Ollama's API.
                unload_on_yield=(handover.unload_on_yield and ollama) if m.unload_on_yield is None else m.unload_on_yield,
                preload_models=(handover.preload_models if ollama else ())
                if m.preload_models is None else m.preload_models,
            )
        )
    return tuple(specs)


def default_member(config: Config) -> MemberSpec:
    """``proxy.upstream`` as the member ``default``, with the global sections' settings."""
    return MemberSpec(
        name=DEFAULT_MEMBER,
        url=config.proxy.upstream,
        api=config.fallback.primary_api if config.fallback.enabled else "ollama",
        # Beside a fallback it is asked for every model (it reads no model list).
        models=("*",) if config.fallback.enabled else (),
        replay_concurrency=config.replay.concurrency,
        detect_outages=config.upstream.detect_outages,
        health_path=config.upstream.health_path,
        probe_model=config.upstream.probe_model,
        probe_path=config.upstream.probe_path,
        unload_on_yield=config.handover.unload_on_yield,
        preload_models=config.handover.preload_models,
    )


@attrs.frozen
class PoolShape:
    """What the number of members decides, decided once from them (:func:`pool_shape`)."""

    #: More than one member (the ``[fallback]`` one counts): each member's yields get their own log
    #: line, the request log names the member that served, a request that expired is told what kept
    #: each member from it, and no drainer's end of drain is the proxy's "now available".  False:
    #: the proxy-wide lines (the GPU, the upstream) are the only ones.
    names_members: bool
    #: One upstream beside at most the ``[fallback]`` member: the holds its own watchers take (and
    #: its stuck-loading hold) hold all (:data:`~yieldproxy.lot.state.ALL`), it has no model list to
    #: read and no twins to verify, and its VRAM handover is the proxy's ``handover``.
    one_upstream: bool

    def hold_scope(self, name: str) -> str:
        """The scope of the holds member ``name``'s own watchers take: its name, or every member's."""
        return ALL if self.one_upstream else name

    def log_name(self, name: str) -> str | None:
        """How the request log names member ``name`` on the requests it served (None: it names none)."""
        return name if self.names_members else None


def pool_shape(specs: Sequence[MemberSpec]) -> PoolShape:
    """The :class:`PoolShape` of a pool of ``specs`` (:func:`member_specs`)."""
    return PoolShape(
        names_members=len(specs) > 1,
        one_upstream=sum(not spec.fallback for spec in specs) == 1,
    )


def fallback_member(config: Config) -> tuple[MemberSpec, ...]:
    """An enabled ``[fallback]`` as a standby member (none when disabled).

    It serves the classes whose policy is ``fallback`` (of ``fallback.classes``),
    the models ``fallback.models`` maps (each under its mapped name), at most
    ``fallback.concurrency`` at once, each attempt bounded by
    ``fallback.timeout_seconds``.  Its verification is the fallback's own
    (:class:`~yieldproxy.upstream.fallback.Fallback`: the pool's twin check for it).
    """
    fc = config.fallback
    if not fc.enabled:
        return ()
    return (
        MemberSpec(
            name=FALLBACK_MEMBER,
            url=fc.url,
            api=fc.api,
            models=tuple(fc.models),
            model_map=dict(fc.models),
            replay_concurrency=fc.concurrency,
            use="when_others_yielded",
            classes=tuple(c for c in fc.classes if c in config.classes and config.classes[c].policy == "fallback"),
            detect_outages=False,
            health_path=member_server(fc.api, base_url=True).health_path,
            rate=0.0,
            attempt_timeout_seconds=fc.timeout_seconds,
            fallback=True,
        ),
    )


def member_server(api: str, base_url: bool = False) -> Server:
    """What the pool knows of a member's server; with ``base_url``, an OpenAI API base URL
    (``fallback.url`` ends in ``/v1``: its routes are relative to it)."""
    described = server(api)
    if base_url and api == "openai":
        return attrs.evolve(described, embed_path="/embeddings", models_path="/models", health_path="/models")
    return described


def answer_headers(spec: MemberSpec, own_model: str) -> tuple[tuple[bytes, bytes], ...]:
    """The headers of an answer that say who gave it: the ``[fallback]`` member's (docs/fallback.md)."""
    if not spec.fallback:
        return ()
    return ((b"x-yield-served-by", b"fallback"), (b"x-yield-fallback-model", own_model.encode("utf-8")))


def served_outcome(spec: MemberSpec) -> str:
    """The replay outcome (and log outcome) of a request this member answered: ``fallback`` or ``ok``."""
    return "fallback" if spec.fallback else "ok"


def url_warnings(config: Config) -> list[str]:
    """A warning for each upstream URL that ends in an API path, naming it and what was probably meant.

    The proxy adds each request's own path (``/api/embed``, ``/v1/embeddings``)
    to the upstream URL, so a URL that already ends in ``/api`` or in an
    OpenAI-style ``/v1`` base (an OpenAI client's ``base_url``) sends every
    request to ``/api/api/embed`` or ``/v1/v1/embeddings``: each gets a 404,
    and nothing fails at start.  A path before the API part (a server mounted
    under a prefix) is kept in the suggestion.
    """
    if config.upstreams:
        urls = [(f"upstreams[{i}].url", m.url, m.api) for i, m in enumerate(config.upstreams)]
    else:
        urls = [("proxy.upstream", config.proxy.upstream, default_member(config).api)]
    warnings = []
    for key, url, api in urls:
        parts = urlsplit(url)
        segments = parts.path.split("/")
        found = next((i for i, segment in enumerate(segments) if segment.lower() in ("api", "v1")), None)
        if found is None:
            continue
        meant = urlunsplit((parts.scheme, parts.netloc, "/".join(segments[:found]), "", ""))
        tail = "/" + "/".join(s for s in segments[found:] if s)
        if segments[found].lower() == "api":
            what = f"Ollama's API path {tail}: requests would go to {tail}/api/... and get 404"
        elif api == "ollama":
            what = (
                f"an OpenAI-style base ({tail}), but its api is \"ollama\": Ollama serves /api/ and /v1/ at its "
                f"root, so requests would go to {tail}/api/... and {tail}/v1/... and get 404"
            )
        else:
            what = (
                f"an OpenAI-style base ({tail}, an OpenAI client's base_url): the proxy adds each request's own "
                f"path, so requests would go to {tail}/v1/... and get 404"
            )
        warnings.append(
            f"{key} = {url!r} ends in {what}; the upstream URL is the server's root, "
            f"probably {meant!r}"
        )
    return warnings
