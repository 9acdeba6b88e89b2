"""Memory of the proxy holding 10,000 parked 1 KB embedding requests.

The proxy (its own process) is yielded through the admin API
(``POST /yield``); then 10,000 client connections each send one
``POST /api/embed`` with a ~1 KB body.  When ``GET /status`` says
``parked_total`` is 10,000, VmRSS of the proxy process (/proc/PID/status) is
read and compared with its RSS idle (after a warm-up).  Then ``POST /resume``
releases the lot, and every one of the 10,000 must be answered 200.

RLIMIT_NOFILE is raised here and in the proxy child.  The client is one
thread with non-blocking sockets and epoll, so 10,000 connections cost it
little.

Targets: <= 100 MB RSS with 10,000 parked; <= 10 KB per parked request.

    .venv/bin/python bench/parked_memory.py [--count 10000] [--body 1024]
"""

from __future__ import annotations

import argparse
import errno
import selectors
import socket
import sys
import time

from _common import (
    Children,
    Conn,
    admin_call,
    embed_body,
    header,
    rss_bytes,
    start_proxy,
    start_sim,
    verdict,
    wait_parked,
)
from _proxy_runner import raise_nofile

TARGET_RSS_MB = 100
#: Bytes per parked request with a 1 KB body (issue 11; HAProxy holding 8,000
#: such requests on this kind of machine costs about 8.7 KB each).
TARGET_PER_REQUEST_KB = 10
MB = 1024 * 1024


def open_parked(port: int, count: int, raw: bytes, timeout: float, batch: int = 200) -> tuple[selectors.BaseSelector, dict]:
    """Open ``count`` connections and send one request on each; returns (selector, sockets).

    Connections are opened ``batch`` at a time and each batch's requests are
    sent before the next batch starts.  A listen backlog smaller than a batch
    (a ``tcp:`` endpoint's default is 50) drops SYNs, which the kernel resends
    after 1 s, 3 s, ...: that shows as a long opening time.
    """
    sel = selectors.DefaultSelector()
    socks: dict[int, dict] = {}
    deadline = time.monotonic() + timeout
    opened = 0
    while opened < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {opened} of {count} connections opened in {timeout}s")
        pending = {}
        for _ in range(min(batch, count - opened)):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            rc = s.connect_ex(("127.0.0.1", port))
            if rc not in (0, errno.EINPROGRESS):
                s.close()
                raise OSError(rc, f"connect: {errno.errorcode.get(rc, rc)}")
            pending[s.fileno()] = s
            sel.register(s, selectors.EVENT_WRITE)
            opened += 1
        while pending:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(pending)} connections still connecting after {timeout}s")
            for key, _ in sel.select(timeout=1.0):
                s = pending.pop(key.fd)
                err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    raise OSError(err, f"connect: {errno.errorcode.get(err, err)}")
                s.sendall(raw)  # ~1 KB: fits in an empty socket buffer at once
                sel.modify(s, selectors.EVENT_READ)
                socks[key.fd] = {"sock": s, "buf": bytearray()}
    return sel, socks


def _whole(buf: bytes) -> bool:
    """Whether ``buf`` holds a whole answer (by its ``Content-Length``, or a chunked body's last chunk)."""
    head, sep, body = buf.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return body.endswith(b"0\r\n\r\n")


def read_all(sel: selectors.BaseSelector, socks: dict, timeout: float, keep_alive: bool = False) -> dict[int, int]:
    """Read every answer (to EOF, or with ``keep_alive`` to its end, the connection left open); counts by status."""
    statuses: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while socks:
        if time.monotonic() > deadline:
            statuses[0] = statuses.get(0, 0) + len(socks)  # 0: no answer in time
            break
        for key, _ in sel.select(timeout=1.0):
            entry = socks[key.fd]
            try:
                data = entry["sock"].recv(65536)
            except ConnectionError:
                data = b""
            if data:
                entry["buf"] += data
                if not (keep_alive and _whole(bytes(entry["buf"]))):
                    continue
            sel.unregister(entry["sock"])
            entry["sock"].close()
            del socks[key.fd]
            line = bytes(entry["buf"][:32])
            try:
                code = int(line.split(b" ", 2)[1])
            except (IndexError, ValueError):
                code = -1  # closed without an answer
            statuses[code] = statuses.get(code, 0) + 1
    for entry in socks.values():
        entry["sock"].close()
    sel.close()
    return statuses


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=10_000, help="requests to park")
    p.add_argument("--body", type=int, default=1024, help="request body size in bytes")
    p.add_argument("--keep-alive", action="store_true",
                   help="clients that keep their connection open (no Connection: close), as most HTTP clients do")
    p.add_argument("--backlog", type=int, default=0,
                   help="the proxy's listen backlog (0: as configured by default; a tcp: endpoint gets 50)")
    args = p.parse_args(argv)

    nofile = raise_nofile(args.count + 2000)
    if nofile < args.count + 100:
        print(f"RLIMIT_NOFILE is {nofile}: too low for {args.count} connections", file=sys.stderr)
        return 1
    body = embed_body(args.body)
    raw = (
        b"POST /api/embed HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    if args.keep_alive:
        raw = raw.replace(b"Connection: close\r\n", b"")

    with Children() as children:
        _, sim_port = start_sim(children)
        proxy, proxy_port, admin_port = start_proxy(
            children, sim_port, "--nofile", str(args.count + 2000), "--max-parked", str(max(10_000, args.count)),
            *(["--backlog", str(args.backlog)] if args.backlog else []),
        )
        # Warm up: the first requests import and build what later ones reuse.
        conn = Conn(proxy_port)
        for _ in range(50):
            status, _, _ = conn.request(raw.replace(b"Connection: close\r\n", b""))
            assert status == 200, status
        conn.close()
        time.sleep(0.5)
        rss_idle = rss_bytes(proxy.pid)

        admin_call(admin_port, "POST", "/yield", {"reason": "bench parked_memory", "source": "bench"})
        t0 = time.monotonic()
        sel, socks = open_parked(proxy_port, args.count, raw, timeout=100.0)
        opened = time.monotonic() - t0
        status = wait_parked(admin_port, args.count, timeout=60.0)
        parked_in = time.monotonic() - t0
        time.sleep(0.5)
        rss_full = rss_bytes(proxy.pid)

        t1 = time.monotonic()
        admin_call(admin_port, "POST", "/resume", {"source": "bench"})
        statuses = read_all(sel, socks, timeout=90.0, keep_alive=args.keep_alive)
        drained = time.monotonic() - t1
        time.sleep(0.5)
        rss_after = rss_bytes(proxy.pid)
        final = admin_call(admin_port, "GET", "/status")

    per_request = (rss_full - rss_idle) / args.count
    answered_ok = statuses.get(200, 0)
    clients = "keep-alive" if args.keep_alive else "Connection: close"
    header(f"yieldproxy parked memory: {args.count} parked POST /api/embed of {len(body)} bytes ({clients} clients)")
    print(f"  RSS idle (after warm-up)         {rss_idle / MB:8.1f} MB")
    print(f"  RSS with {args.count} parked        {rss_full / MB:8.1f} MB   "
          f"(parked_total {status['parked_total']}, parked_bytes {status['parked_bytes'] / MB:.1f} MB)")
    print(f"  RSS after all were answered      {rss_after / MB:8.1f} MB")
    print(f"  per parked request               {per_request / 1024:8.1f} KB   "
          f"({per_request / len(body):.1f}x the body)")
    print(f"  proxy code: {proxy.src}")
    print(f"  connections opened in {opened:.1f}s, all parked in {parked_in:.1f}s (listening on {proxy.endpoint}); "
          f"released and answered in {drained:.1f}s ({args.count / drained:.0f}/s)")
    print(f"  answers: {', '.join(f'{k}: {v}' for k, v in sorted(statuses.items()))}; "
          f"lot after: parked_total {final['parked_total']}, inflight {final['inflight']}, state {final['state']}")
    print()
    print("targets")
    print(f"  [{verdict(rss_full <= TARGET_RSS_MB * MB)}] RSS with {args.count} parked: {rss_full / MB:.1f} MB "
          f"(target <= {TARGET_RSS_MB} MB)")
    print(f"  [{verdict(per_request <= TARGET_PER_REQUEST_KB * 1024)}] per parked request: {per_request / 1024:.1f} KB "
          f"(target <= {TARGET_PER_REQUEST_KB} KB; HAProxy: about 8.7 KB)")
    print(f"  [{verdict(answered_ok == args.count)}] answered 200 after resume: {answered_ok} of {args.count}")
    return 0 if answered_ok == args.count else 1


if __name__ == "__main__":
    sys.exit(main())
