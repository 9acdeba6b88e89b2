"""``GET /api/tags`` and ``GET /v1/models`` of a pool: the union of its members' lists.

A client lists the models it may ask for; behind a pool that is every model
some member serves.  Each member whose api serves the route is asked (in
parallel, each bounded in time); their lists are joined in config order, a
model listed by several once (the first member's entry).  A member that does
not answer is left out; when none does, there is no list (the caller answers 502).
"""

from __future__ import annotations

import json
from typing import Sequence

from twisted.internet.defer import DeferredList

#: The model-list routes a pool answers itself, with the key of the list in the answer and of a name in an entry.
UNION_PATHS = {
    "/api/tags": ("models", "name"),
    "/v1/models": ("data", "id"),
}


async def union_list(members: Sequence, path: str, timeout: float) -> bytes | None:
    """The joined list as the answer's JSON body, or None when no member answered with a list."""
    key, name_key = UNION_PATHS[path]
    results = await DeferredList(
        [member.control.request("GET", path, timeout=timeout) for member in members], consumeErrors=True
    )
    entries: list = []
    seen: set[str] = set()
    answered = False
    for ok, answer in results:
        if not ok or answer.code != 200:
            continue
        try:
            listed = json.loads(answer.body).get(key)
        except (ValueError, AttributeError, UnicodeDecodeError, RecursionError):
            continue
        if not isinstance(listed, list):
            continue
        answered = True
        for entry in listed:
            name = entry.get(name_key) if isinstance(entry, dict) else None
            if isinstance(name, str) and name not in seen:
                seen.add(name)
                entries.append(entry)
    if not answered:
        return None
    document = {"models": entries} if key == "models" else {"object": "list", "data": entries}
    return json.dumps(document).encode("utf-8")
