"""Yield-state watchers: the ways the proxy learns that the GPU is taken.

Each watcher is a named holder of the yield state (the GPU is yielded while
any source holds it) and a :class:`~twisted.application.service.Service`
that :class:`~yieldproxy.service.YieldProxyService` starts and stops:

* :mod:`.state_file` (source ``file``): a file exists;
* :mod:`.signals` (source ``signal``): SIGUSR1 / SIGUSR2;
* :mod:`.command` (source ``command``): a probe command exits 0;
* :mod:`.outage` (source ``outage``): the upstream, once reachable, fails.

:func:`build_watchers` makes the enabled ones (and the VRAM handover, which
is no watcher but runs beside them) from the config.
"""

from __future__ import annotations

from twisted.application.service import Service
from twisted.internet.interfaces import IReactorFDSet

from ..control import Answer, UpstreamControl
from ..handover import Handover
from ..servers.ollama import is_gpu_failure, minimal_call
from .command import CommandWatcher
from .outage import OutageWatcher
from .signals import SignalWatcher
from .state_file import StateFileWatcher

__all__ = ["build_watchers", "CommandWatcher", "OutageWatcher", "SignalWatcher", "StateFileWatcher"]


def build_watchers(reactor, proxy) -> list[Service]:
    """The enabled watchers and the handover of ``proxy`` (a :class:`~yieldproxy.service.Proxy`), not started.

    Also adds their state to ``/status`` (``watchers`` and ``handover``).
    """
    config = proxy.config
    state, metrics = proxy.state, proxy.metrics
    control = UpstreamControl(reactor, config.proxy.upstream)
    watchers: list[Service] = []
    w = config.watchers
    if w.state_file:
        # inotify needs a reactor that watches file descriptors; a Clock only polls.
        real = reactor if IReactorFDSet.providedBy(reactor) else None
        watchers.append(
            StateFileWatcher(reactor, state, metrics, w.state_file, w.state_file_poll_seconds, inotify_reactor=real)
        )
    if w.signals:
        watchers.append(SignalWatcher(reactor, state, metrics))
    if w.command:
        watchers.append(
            CommandWatcher(
                reactor, state, metrics, w.command,
                interval=w.command_interval_seconds, timeout=w.command_timeout_seconds,
            )
        )
    up = config.upstream
    if up.detect_outages:
        watchers.append(_outage_watcher(reactor, proxy, control))
    services = list(watchers)
    extras = proxy.admin_app.status_extras
    extras["watchers"] = lambda: {s.name.split(":", 1)[1]: s.status() for s in watchers}
    h = config.handover
    if h.unload_on_yield or h.preload_models:
        handover = Handover(reactor, state, proxy.replayer, control, metrics, h)
        services.append(handover)
        extras["handover"] = handover.status
    return services


def _outage_watcher(reactor, proxy, control: UpstreamControl) -> OutageWatcher:
    """The outage watcher, probing through ``control``: the health path, or a minimal model call."""
    config = proxy.config
    up = config.upstream
    gate = proxy.gate

    def health_answered(answer: Answer) -> bool:
        if answer.code == 200:
            # The gate's own "never reached" rule (fail at once) must agree with ours.
            gate.upstream_answered = True
        return answer.code == 200

    def model_answered(answer: Answer) -> bool:
        """Down only when it fails the way an outage does; any other answer means the GPU serves."""
        gate.upstream_answered = True
        return not (answer.code == 503 or is_gpu_failure(answer.code, answer.body))

    def check(call):
        minimal = minimal_call(call) if call is not None else None
        if minimal is None:
            return control.request("GET", up.health_path, timeout=up.health_timeout_seconds).addCallback(
                health_answered
            )
        method, path, body = minimal
        return control.request(method, path, body, timeout=up.model_probe_timeout_seconds).addCallback(
            model_answered
        )

    def set_judge(judge) -> None:
        gate.outage_judge = judge

    return OutageWatcher(
        reactor, proxy.state, gate.upstream_listeners, check, proxy.metrics, set_judge,
        interval=up.health_interval_seconds, max_interval=up.health_max_interval_seconds,
        upstream=config.proxy.upstream,
    )
