"""``yieldproxy check-fallback``: verify the configured fallback once and print the table."""

from __future__ import annotations

from typing import Mapping

from twisted.internet.defer import Deferred

from ...config import VerificationConfig
from ..attempt import Upstream
from ..pool.twins import TwinVerifier
from ..vectors import Verification, _short, _width
from .backend import EmbedBackend
from .contract import fallback_contract


def format_table(verifications: Mapping[str, Verification], min_cosine: float) -> str:
    """The verification table, one block per model, for people."""
    lines = []
    for model, v in verifications.items():
        verdict = "OK" if v.ok else "FAILED"
        worst = "n/a" if v.worst_cosine is None else f"{v.worst_cosine:.6f}"
        lines.append(f"{model} -> {v.fallback_model}: {verdict} (worst cosine {worst}, needs >= {min_cosine:g})")
        if v.reason:
            lines.append(f"  {v.reason}")
        if v.rows:
            lines.append(f"  {'#':>2}  {'text':<42} {'dim primary':>11} {'dim fallback':>12} {'cosine':>9}")
            for i, r in enumerate(v.rows, 1):
                c = "-" if r.cosine is None else f"{r.cosine:.6f}"
                mark = "" if r.ok else "  <- differs"
                text = _short(r.text)
                text += " " * (42 - _width(text))
                lines.append(f"  {i:>2}  {text} {r.primary_dimension:>11} {r.fallback_dimension:>12} {c:>9}{mark}")
        lines.append("")
    return "\n".join(lines)


async def check(reactor, config) -> tuple[bool, str]:
    """Verify ``config``'s fallback once (enabled or not), and the table to print."""
    fc = config.fallback
    upstream = Upstream(reactor, config.proxy.upstream, 4)
    primary = EmbedBackend(reactor, upstream, fc.primary_api, fc.timeout_seconds, openai_prefix="/v1")
    backend = EmbedBackend(reactor, Upstream(reactor, fc.url, 4), fc.api, fc.timeout_seconds)
    # The one verifier, with no pool: only the fallback's contract to run.
    contract = fallback_contract(fc, "primary", primary, backend, lambda: True)
    verifier = TwinVerifier(reactor, (), VerificationConfig(), contract=contract, find_twins=False)
    try:
        results = await verifier.verify_contract()
    finally:
        await upstream.close()
        await backend.close()
    header = (
        f"primary  {primary.describe()}\nfallback {backend.describe()}\n"
        f"{len(fc.probe_texts)} probe texts, min cosine {fc.min_cosine:g}\n"
    )
    ok = bool(results) and all(v.ok for v in results.values())
    return ok, header + "\n" + format_table(results, fc.min_cosine)


def check_command(config_path: str | None) -> int:
    """``yieldproxy check-fallback``: 0 when every mapped model passes, 1 when any fails, 2 on a bad config."""
    import sys

    from twisted.internet import task

    from ...config import ConfigError, load

    try:
        config = load(config_path)
    except ConfigError as e:
        print(f"yieldproxy: {e}", file=sys.stderr)
        return 2
    fc = config.fallback
    missing = [key for key, value in (("fallback.url", fc.url), ("fallback.models", fc.models)) if not value]
    if missing:
        where = config_path or "the defaults (no --config)"
        print(f"yieldproxy: {' and '.join(missing)} not set in {where}; nothing to check", file=sys.stderr)
        return 2
    outcome: list[int] = []

    async def run(reactor):
        ok, table = await check(reactor, config)
        print(table, end="")
        print("fallback verified: it may be used" if ok else "fallback NOT verified: requests would park instead")
        outcome.append(0 if ok else 1)

    try:
        task.react(lambda reactor: Deferred.fromCoroutine(run(reactor)))
    except SystemExit:  # react always ends with one; an error was printed already
        pass
    return outcome[0] if outcome else 1
