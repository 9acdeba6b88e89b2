"""Run one yieldproxy in its own process, for the benchmarks.

Not a benchmark itself: ``_common.start_proxy`` starts it.  It wires the proxy
with ``service.build`` on the real reactor and listens with the endpoint
strings of the default config (``proxy.listen``, ``admin.listen``: so the same
backlog and options as a real deployment), their port numbers swapped for free
loopback ports.  Then it prints one line::

    ready proxy=PORT admin=PORT pid=PID src=DIR

Then it serves until SIGTERM/SIGINT.  With ``--profile FILE`` it runs under
cProfile and writes the stats to FILE when it stops.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import socket
import sys


def raise_nofile(wanted: int) -> int:
    """Raise RLIMIT_NOFILE towards ``wanted`` (the hard limit too, when allowed)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if wanted > hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, wanted))
            return wanted
        except (ValueError, OSError):
            wanted = hard
    if wanted > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_port(description: str, port: int, backlog: int = 0) -> str:
    """A ``tcp:`` endpoint string with its port replaced (and a backlog, if given)."""
    parts = description.split(":")
    if parts[0] != "tcp":
        parts = ["tcp", "0", "interface=127.0.0.1"]
    rest = [p for p in parts[1:] if not re.match(r"^(port=)?\d+$", p)]
    rest = [p for p in rest if not (backlog and p.startswith("backlog="))]
    if backlog:
        rest.append(f"backlog={backlog}")
    return ":".join(["tcp", str(port), *rest])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--upstream", required=True, help="http://127.0.0.1:PORT")
    p.add_argument("--nofile", type=int, default=0, help="raise RLIMIT_NOFILE to this")
    p.add_argument("--max-parked", type=int, default=0, help="parking.max_parked (0: default)")
    p.add_argument("--replay-concurrency", type=int, default=0, help="replay.concurrency (0: default)")
    p.add_argument("--profile", default="", help="write cProfile stats here on exit")
    p.add_argument("--backlog", type=int, default=0, help="proxy listen backlog (0: the endpoint's own, 50 for tcp:)")
    p.add_argument("--log-level", default="info", help="twisted log level (stderr)")
    p.add_argument("--config", default="", help="a yieldproxy.toml to start from (the other options override it)")
    args = p.parse_args(argv)

    if args.nofile:
        raise_nofile(args.nofile)

    from twisted.internet import epollreactor

    epollreactor.install()
    from twisted.internet import defer, reactor
    from twisted.internet.endpoints import serverFromString
    from twisted.logger import LogLevel, globalLogBeginner

    import yieldproxy
    from yieldproxy.config import Config, load
    from yieldproxy.observe.requestlog import text_file_observer
    from yieldproxy.service import build

    # Log as `twistd -n yieldproxy` would (its text observer at --log-level,
    # requestlog.text_observer, to stderr, which the parent sends to a file),
    # so the cost of the proxy's own log lines is part of what is measured.
    globalLogBeginner.beginLoggingTo(
        [text_file_observer(sys.stderr, LogLevel.levelWithName(args.log_level))],
        redirectStandardIO=False,
    )

    overrides = {"proxy.upstream": args.upstream}
    if args.max_parked:
        overrides["parking.max_parked"] = args.max_parked
    if args.replay_concurrency:
        overrides["replay.concurrency"] = args.replay_concurrency
    config = (load(args.config) if args.config else Config()).with_overrides(**overrides)
    proxy = build(reactor, config)
    proxy_endpoint = with_port(config.proxy.listen, free_port(), args.backlog)
    admin_endpoint = with_port(config.admin.listen, free_port())

    @defer.inlineCallbacks
    def listen():
        proxy_port = yield serverFromString(reactor, proxy_endpoint).listen(proxy.proxy_app.site())
        admin_port = yield serverFromString(reactor, admin_endpoint).listen(proxy.admin_app.site())
        print(
            f"ready proxy={proxy_port.getHost().port} admin={admin_port.getHost().port} pid={os.getpid()} "
            f"src={os.path.dirname(os.path.abspath(yieldproxy.__file__))} endpoint={proxy_endpoint}",
            flush=True,
        )

    def failed(f):
        print(f"listen failed: {f.getErrorMessage()}", file=sys.stderr, flush=True)
        reactor.stop()

    reactor.callWhenRunning(lambda: listen().addErrback(failed))
    reactor.addSystemEventTrigger("before", "shutdown", proxy.upstream.close)

    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
        try:
            reactor.run()
        finally:
            profiler.disable()
            profiler.dump_stats(args.profile)
    else:
        reactor.run()


if __name__ == "__main__":
    main()
