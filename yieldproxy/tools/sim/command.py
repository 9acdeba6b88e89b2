"""The command line: ``python -m yieldproxy.tools.sim`` and ``yieldproxy sim``."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from twisted.internet import defer

from .modes import MODES
from .server import APIS, DEFAULT_MODELS, SimOllama


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0-65535, got {port}")
    return port


class _Names(tuple):
    """The model names of ``--model``, shown as a person types them (``--help``'s default)."""

    def __str__(self) -> str:
        return " ".join(self)


class _AppendModel(argparse.Action):
    """``--model NAME``, repeatable: the names given replace the default list, they do not add to it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        current = getattr(namespace, self.dest)
        names = () if current is self.default else tuple(current)
        setattr(namespace, self.dest, _Names((*names, values)))


def build_parser(prog: str = "python -m yieldproxy.tools.sim") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "A simulated Ollama backend, or TEI, Infinity or llama.cpp's server with --api "
            "(deterministic answers, outage modes).  As Ollama, it serves the models it has "
            "(--model) and answers any other name 404, as a model never pulled."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--port", type=_port, default=11434, help="TCP port, 0 for any free one")
    p.add_argument("--interface", default="127.0.0.1", help="address to listen on")
    p.add_argument("--latency", type=float, default=0.0, help="seconds per model request")
    p.add_argument("--per-item-latency", type=float, default=0.0, help="extra seconds per input text")
    p.add_argument("--parallel", type=int, default=4, help="requests served at once (OLLAMA_NUM_PARALLEL)")
    p.add_argument("--chunk-delay", type=float, default=0.0, help="seconds between streamed chunks")
    p.add_argument("--chunks", type=int, default=5, help="content chunks per reply")
    p.add_argument("--dim", type=int, default=384, help="embedding dimension")
    p.add_argument("--load-seconds", type=float, default=0.0, help="model load time")
    p.add_argument("--mode", choices=MODES, default="ok", help="initial outage mode")
    p.add_argument("--api", choices=tuple(APIS), default="ollama",
                   help="the server to play: its routes, answers and errors")
    p.add_argument("--model", dest="models", action=_AppendModel, metavar="NAME", default=_Names(DEFAULT_MODELS),
                   help="a model it has (repeat for more: they replace the default list); Ollama lists, shows and "
                        "serves these and answers any other name 404; TEI, Infinity and llama.cpp serve the first")
    return p


#: The options that are SimOllama's settings, by the same names.
_SETTINGS = ("latency", "per_item_latency", "parallel", "chunk_delay", "chunks", "dim", "load_seconds", "mode", "api", "models")


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The SimOllama keyword arguments the command line gives."""
    return {name: getattr(args, name) for name in _SETTINGS}


def _run(reactor: Any, args: argparse.Namespace, prog: str) -> defer.Deferred[None]:
    """Listen, say where, and serve until the reactor stops.

    A port that cannot be bound (in use, say) ends it with one line naming
    the option, and exit status 1.
    """
    from ...edge.listen_errors import interface_at_fault, why_cannot_listen

    sim = SimOllama(reactor, **_settings(args))
    forever: defer.Deferred[None] = defer.Deferred()

    def bound(port: int) -> defer.Deferred[None]:
        print(f"listening on {args.interface}:{port}", flush=True)
        reactor.addSystemEventTrigger("before", "shutdown", sim.stop)
        return forever

    def cannot_listen(failure: Any) -> None:
        option = f"--interface {args.interface}" if interface_at_fault(failure.value) else f"--port {args.port}"
        print(
            f"{prog}: {option}: cannot listen on {args.interface}:{args.port}: {why_cannot_listen(failure.value)}",
            file=sys.stderr,
        )
        raise SystemExit(1)

    return sim.listen(args.port, args.interface).addCallbacks(bound, cannot_listen)


def main(argv: Sequence[str] | None = None, prog: str = "python -m yieldproxy.tools.sim") -> None:
    """``python -m yieldproxy.tools.sim`` (``prog`` names it in messages): the only place that uses the global reactor."""
    from twisted.internet import task
    from twisted.logger import (
        FilteringLogObserver,
        LogLevel,
        LogLevelFilterPredicate,
        globalLogBeginner,
        textFileLogObserver,
    )

    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        # Validate the settings before binding anything.
        SimOllama(None, **_settings(args))
    except ValueError as e:
        parser.error(str(e))
    globalLogBeginner.beginLoggingTo(
        [
            FilteringLogObserver(
                textFileLogObserver(sys.stderr),
                [LogLevelFilterPredicate(defaultLogLevel=LogLevel.warn)],
            )
        ],
        redirectStandardIO=False,
    )
    task.react(_run, (args, prog))
