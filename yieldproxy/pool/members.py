"""The pool's members as they run: each ``[[upstreams]]`` table with every default resolved.

A config without ``[[upstreams]]`` is a pool of one, named ``default``, made
of ``proxy.upstream`` and the global sections, so every legacy config keeps
its meaning.  Keys a ``[[upstreams]]`` table leaves out take the global
sections' values (``[replay]``, ``[upstream]``, ``[handover]``); the global
``[watchers]`` hold every member (their holds name no member).
"""

from __future__ import annotations

import attrs

from ..config import Config
from ..names import CLASS_NAMES
from ..servers import server
from ..state import DEFAULT_MEMBER

#: Each api's health route, when a member does not name one: a route that runs no model.


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
    unload_on_yield: bool = False
    preload_models: tuple[str, ...] = ()

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
        return (legacy_member(config),)
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
                # The global handover is for the members that speak Ollama's API.
                unload_on_yield=(handover.unload_on_yield and ollama) if m.unload_on_yield is None else m.unload_on_yield,
                preload_models=(handover.preload_models if ollama else ())
                if m.preload_models is None else m.preload_models,
            )
        )
    return tuple(specs)


def legacy_member(config: Config) -> MemberSpec:
    """``proxy.upstream`` as the one member of a pool, with the global settings as they always were."""
    return MemberSpec(
        name=DEFAULT_MEMBER,
        url=config.proxy.upstream,
        api=config.fallback.primary_api if config.fallback.enabled else "ollama",
        replay_concurrency=config.replay.concurrency,
        detect_outages=config.upstream.detect_outages,
        health_path=config.upstream.health_path,
        unload_on_yield=config.handover.unload_on_yield,
        preload_models=config.handover.preload_models,
    )
