"""``python -m yieldproxy.tools.sim``."""

from .command import main

main()
