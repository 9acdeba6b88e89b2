"""``python -m yieldproxy.sim``."""

from .command import main

main()
