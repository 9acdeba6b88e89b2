"""``twistd ARGS`` in a process whose wall clock steps when told (tests/test_clock_real.py).

    python tests/clockstep_twistd.py -n --pidfile= yieldproxy ...

``time.time`` is replaced before Twisted is imported (the reactor's own clock,
``twisted.python.runtime.seconds``, is bound to it then), so everything in
this process that reads the wall clock sees the step, as after an NTP step or
a resumed VM; the machine's clock is never touched.  Each line on stdin, a
number of seconds, steps it by that much more; once applied, ``clock stepped
by TOTAL s`` is printed on stderr.
"""

from __future__ import annotations

import sys
import threading
import time

_real = time.time
_offset = [0.0]


def _stepped() -> float:
    return _real() + _offset[0]


time.time = _stepped


def _listen() -> None:
    for line in sys.stdin:
        _offset[0] += float(line)
        print(f"clock stepped by {_offset[0]:+g} s", file=sys.stderr, flush=True)


def main() -> None:
    threading.Thread(target=_listen, daemon=True).start()
    from twisted.scripts.twistd import run

    sys.argv = ["twistd", *sys.argv[1:]]
    run()


if __name__ == "__main__":
    main()
