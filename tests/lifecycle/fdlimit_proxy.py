"""A proxy in its own process under a given open-file limit, as twistd starts it (tests/lifecycle/test_limits.py).

    python tests/lifecycle/fdlimit_proxy.py NOFILE UPSTREAM_URL

Sets RLIMIT_NOFILE (soft and hard) to NOFILE, fits the config to it as
``tap.makeService`` does (:func:`yieldproxy.lifecycle.limits.fit_fd_limit`), starts the
service on ephemeral ports and prints ``ready proxy=PORT cap=N``; serves until
stdin closes (the test's end).
"""

from __future__ import annotations

import resource
import sys


def main() -> None:
    nofile, upstream = int(sys.argv[1]), sys.argv[2]
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    from twisted.internet import reactor, stdio
    from twisted.internet.protocol import Protocol

    from helpers import EPHEMERAL, listening_url
    from yieldproxy.config import Config
    from yieldproxy.lifecycle.limits import fit_fd_limit
    from yieldproxy.service import build

    config = Config().with_overrides(
        **{"proxy.upstream": upstream, "upstream.detect_outages": False}, **EPHEMERAL
    )
    config = fit_fd_limit(config)
    proxy = build(reactor, config)
    proxy.service.startService()

    class _UntilStdinCloses(Protocol):
        def connectionLost(self, reason):
            reactor.stop()

    stdio.StandardIO(_UntilStdinCloses())
    port = listening_url(proxy, "proxy").rsplit(":", 1)[1]
    print(f"ready proxy={port} cap={config.proxy.max_connections}", flush=True)
    reactor.run()


if __name__ == "__main__":
    main()
