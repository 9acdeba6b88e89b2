"""A request body with another name for its model: for a member whose ``model_map`` names it differently.

The member gets the body with its own name as the one top-level ``model``
key: every key Ollama's Go decoder reads as the model (case-insensitively,
the last of several winning) is replaced by it, in lower case, which every
server reads; everything else is kept.  A body that is not a JSON object is
sent as it came: the member answers it in its own words.
"""

from __future__ import annotations

import json


def renamed_body(body: bytes, model: str) -> bytes:
    """``body`` with its model named ``model``."""
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return body
    if not isinstance(document, dict):
        return body
    for key in [key for key in document if key.lower() == "model"]:
        del document[key]
    document["model"] = model
    return json.dumps(document, separators=(",", ":")).encode("ascii")  # escapes: a lone surrogate stays as sent
