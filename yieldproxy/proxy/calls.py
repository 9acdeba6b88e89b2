"""A request's call as a pool member takes it, and what a call tells the member's health."""

from __future__ import annotations

from ..lot.classify import UNLOAD_PATHS, BadBody, is_unload
from ..lot.parking import Entry
from ..servers import ModelCall
from ..servers.gojson import find_model, read_request
from ..upstream.pool.member import Member
from ..upstream.pool.rename import renamed_body
from ..upstream.served import redefined_by
from .admission import UNLOAD_BODY_LIMIT
from .target import Target


def failed_call(target: Target, body: bytes) -> ModelCall | None:
    """What a failed model call was (route and model), so the outage probe can test the same kind.

    The route is the canonical path the request was classified and forwarded
    on; the model is the one Ollama's Go decoder reads (:func:`gojson.find_model`:
    a large body is scanned, not parsed whole).  None when the body names no
    model: the probe is then the health path.
    """
    try:
        model = find_model(body)
    except BadBody:
        return None
    return ModelCall(target.path, model) if model else None


def failed_call_on(target: Target, entry: Entry, body: bytes, member: Member) -> ModelCall | None:
    """What failed (or was served) on ``member``, for its outage probe: a translated attempt ran its own
    embedding route."""
    if entry.routing is not None and member.name in entry.routing.translated and entry.model:
        return ModelCall(member.server.embed_path, member.catalogue.own_name(entry.model) or entry.model)
    if entry.model:
        # Read at admission, as failed_call reads it: not read again on every success.  The member's
        # own name (its model_map), as the request asked it: the probe asks for what failed.
        return ModelCall(target.path, member.catalogue.own_name(entry.model) or entry.model)
    return failed_call(target, body)


def body_for(member: Member, model: str | None, body: bytes) -> bytes:
    """The body as ``member`` takes it: with its own name for the model when its ``model_map`` renames it."""
    if model is None:
        return body
    own = member.catalogue.own_name(model)
    return body if own is None else renamed_body(body, own)


def managed(member: Member, path: str, body: bytes) -> None:
    """A model-management call was answered 2xx: the model it defined anew loses its standing in the record
    of what ``member`` served, the one it deleted leaves it (upstream/served.py)."""
    redefined, deleted = redefined_by(path, body)
    if redefined is not None:
        member.health.record.redefined(redefined)
    if deleted is not None:
        member.health.record.deleted(deleted)


def unloads(method: bytes, path: str, body: bytes) -> bool:
    """Whether a request answered 2xx was an unload (it loaded nothing, so it shows nothing about the GPU)."""
    if path not in UNLOAD_PATHS or len(body) > UNLOAD_BODY_LIMIT:
        return False
    try:
        return is_unload(method.decode("latin-1"), path, read_request(body))
    except BadBody:
        return False
