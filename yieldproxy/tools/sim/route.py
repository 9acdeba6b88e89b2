"""What a simulated server's path is (kept apart from :mod:`.api` so that :mod:`.jobs` needs no dialect)."""

from __future__ import annotations

import attrs


@attrs.frozen
class Route:
    """What a path is: its methods, its kind (:data:`.api.KINDS`), its error shape, its operation."""

    methods: tuple[str, ...]
    kind: str
    style: str
    op: str
