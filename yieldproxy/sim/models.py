"""Models in (simulated) memory: keep-alive, loads, what /api/tags and /api/ps list."""

from __future__ import annotations

import datetime
import hashlib
import math
import re
from typing import TYPE_CHECKING, Any

import attrs
from twisted.internet.interfaces import IDelayedCall

if TYPE_CHECKING:
    from .jobs import _Job

_FOREVER = math.inf


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_UNIT_SECONDS = {
    "ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6,
    "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0,
}


def parse_keep_alive(value: Any, default: float) -> float:
    """
    Ollama's ``keep_alive``: seconds, or a Go duration such as ``"5m"``.

    Returns seconds; ``0`` means unload after answering, and a negative value
    means keep the model loaded forever (returned as ``math.inf``).

    :raises ValueError: with Go's wording, for a value Ollama would refuse.
    """
    if value is None:
        return default
    if isinstance(value, bool):
        raise ValueError(f"invalid keep_alive {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            sign = -1.0 if text.startswith("-") else 1.0
            body = text.lstrip("+-")
            parts = _DURATION_PART.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise ValueError(f'time: invalid duration "{value}"') from None
            seconds = sign * sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
    else:
        raise ValueError(f"invalid keep_alive {value!r}")
    return _FOREVER if seconds < 0 else seconds


def _iso(t: float) -> str:
    """RFC 3339 the way Ollama writes its timestamps."""
    if math.isinf(t):
        return "2318-01-01T00:00:00Z"
    return (
        datetime.datetime.fromtimestamp(t, datetime.timezone.utc)
        .isoformat()
        .replace("+00:00", "Z")
    )


def _ns(seconds: float) -> int:
    """Ollama reports durations in integer nanoseconds."""
    return max(0, int(round(seconds * 1e9)))


def _model_details(name: str) -> tuple[dict[str, Any], int]:
    """Plausible ``details`` and size, so clients that parse them are happy."""
    lowered = name.lower()
    if any(k in lowered for k in ("minilm", "embed", "bge", "e5")):
        family, params, size = "bert", "23M", 45_960_996
    else:
        family, params, size = "llama", "3.2B", 2_019_393_189
    details = {
        "parent_model": "",
        "format": "gguf",
        "family": family,
        "families": [family],
        "parameter_size": params,
        "quantization_level": "F16" if family == "bert" else "Q4_K_M",
    }
    return details, size


def _digest(name: str) -> str:
    """A stable stand-in for a model's blob digest."""
    return hashlib.sha256(name.encode("utf-8")).hexdigest()


@attrs.define(eq=False)
class _LoadedModel:
    """A model in (simulated) VRAM; expires lazily, no timer needed."""

    name: str
    loaded_at: float
    expires_at: float
    busy: int = 0


@attrs.define(eq=False)
class _Loading:
    """A model load in progress, shared by every request that needs it."""

    started: float
    delayed: IDelayedCall | None = None
    waiters: list[_Job] = attrs.Factory(list)
