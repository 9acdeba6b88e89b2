"""The ``[fallback]``'s verification is a contract run by the one verifier of "same vectors" (upstream/pool/twins.py).

The fallback keeps its promises (verified before use, again every interval,
never used unverified or stale, never a probe to a yielded primary) with no
timer or verification of its own: every moment of generated sequences of
yields, resumes, clock steps, on-demand verifications and changed weights is
checked against those promises through the pool's own twin check.
"""

from __future__ import annotations

from types import SimpleNamespace

import attrs
from hypothesis import given, settings, strategies as st
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock

from helpers import clock_cooperator, config_with
from yieldproxy.config import FallbackConfig
from yieldproxy.edge.h1client import BadResponse, ConnectFailed, H1Error
from yieldproxy.lot.parking import Entry
from yieldproxy.observe.metrics import Metrics
from yieldproxy.service import build_heart
from yieldproxy.tools.sim import expected_embedding
from yieldproxy.upstream.control import ControlTimeout
from yieldproxy.upstream.fallback import NotNow
from yieldproxy.upstream.pool.members import FALLBACK_MEMBER
from yieldproxy.upstream.pool.twins import TwinVerifier
from yieldproxy.upstream.translation import BackendError, Embeddings

MODEL = "all-minilm"
INTERVAL, MAX_AGE = 600.0, 1800.0


@attrs.define(eq=False)
class Side:
    """One side of the verification: the sim's vectors (of other weights when ``weights`` is set), or a refusal."""

    clock: Clock
    api: str = "openai"
    url: str = "http://side"
    weights: str | None = None
    fail: bool = False
    #: When each probe came, and whether the GPU was yielded then.
    calls: list = attrs.Factory(list)
    yielded: object = None

    def embed(self, request, model):
        self.calls.append((self.clock.seconds(), bool(self.yielded and self.yielded())))
        if self.fail:
            raise BackendError("refused", "connection refused")
        name = self.weights or model
        return succeed(Embeddings(tuple(tuple(expected_embedding(t, name)) for t in request.inputs), 3))


def make(clock: Clock):
    fc = attrs.evolve(
        FallbackConfig(), enabled=True, url="http://127.0.0.1:7997/v1", api="openai", models={MODEL: MODEL},
        verify_interval_seconds=INTERVAL, max_verification_age_seconds=MAX_AGE, probe_texts=("one", "two"),
    )
    config = attrs.evolve(config_with(classes={"batch": {"policy": "fallback"}}), fallback=fc)
    primary, backend = Side(clock, "ollama"), Side(clock)
    heart = build_heart(
        clock, config, Metrics(), clock_cooperator(clock), lambda spec: (None, None), (primary, backend),
    )
    primary.yielded = backend.yielded = lambda: heart.state.yielded
    return heart, primary, backend


def test_the_fallback_is_a_contract_of_the_one_verifier():
    clock = Clock()
    heart, primary, backend = make(clock)
    verifier = heart.verifier
    assert isinstance(verifier, TwinVerifier) and verifier.contract is not None
    assert verifier.contract.twin == FALLBACK_MEMBER and verifier.contract.reference == "default"
    # The pool's twin check is the verifier's; one upstream beside the fallback finds no twins of its own.
    assert heart.scheduler.twin_ok == verifier.twin_ok and heart.twins is None
    heart.fallback.startService()
    assert verifier.running
    clock.advance(0)
    assert len(primary.calls) == len(backend.calls) == 1
    assert heart.fallback.verifications is verifier.contract.verifications
    # The only timer is the verifier's next pass.
    assert [call.getTime() for call in clock.getDelayedCalls()] == [INTERVAL]
    heart.fallback.stopService()
    assert not verifier.running and clock.getDelayedCalls() == []


step = st.one_of(
    st.tuples(st.just("advance"), st.sampled_from([0.0, 1.0, 5.0, 59.0, 60.0, 300.0, 600.0, 1200.0, 1801.0])),
    st.tuples(st.just("yield"), st.none()),
    st.tuples(st.just("resume"), st.none()),
    st.tuples(st.just("verify"), st.none()),
    st.tuples(st.just("weights"), st.sampled_from([None, "nomic-embed-text"])),
    st.tuples(st.just("fail"), st.booleans()),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(step, max_size=25))
def test_never_used_unverified_at_any_moment(steps):
    clock = Clock()
    heart, primary, backend = make(clock)
    fallback, scheduler = heart.fallback, heart.scheduler
    member = scheduler.member(FALLBACK_MEMBER)
    fallback.startService()
    for action, arg in steps:
        if action == "advance":
            clock.advance(arg)
        elif action == "yield":
            heart.state.hold("api", "test")
        elif action == "resume":
            heart.state.release("api")
        elif action == "verify":
            try:
                fallback.verify()
            except NotNow:
                assert heart.state.yielded
        elif action == "weights":
            backend.weights = arg
        else:
            primary.fail = arg
        # Every moment: the pool lets the fallback serve the model exactly while its last verification
        # passed and is recent enough; /status and the metrics say the same.
        v = fallback.verifications.get(MODEL)
        fresh = v is not None and v.ok and clock.seconds() - v.at <= MAX_AGE
        entry = Entry(cls="batch", routing=scheduler.routing("POST", "/api/embed", "batch", MODEL))
        assert scheduler.twin_ok(member, entry) is fresh
        assert (fallback.why_not(MODEL) is None) is fresh
        assert fallback.status()["models"][MODEL]["usable"] is fresh
    # No probe ever reached the primary while it was yielded.
    assert not any(yielded for _, yielded in primary.calls)
    # While it runs and is not yielded, a verification is never overdue by more than a pass.
    if not heart.state.yielded:
        clock.advance(0)
        v = fallback.verifications.get(MODEL)
        assert v is not None and clock.seconds() - v.at <= INTERVAL
    fallback.stopService()
    assert clock.getDelayedCalls() == []


_URL = "http://127.0.0.1:7997"
_FAILURES = st.one_of(
    st.builds(ConnectFailed, st.text(max_size=20), st.sampled_from(["refused", "connect", "timeout", "tls"])),
    st.builds(BadResponse, st.text(max_size=20)),
    st.builds(H1Error, st.text(max_size=20)),
    st.builds(ControlTimeout, st.text(max_size=20)),
    st.builds(ValueError, st.text(max_size=20)),
    st.builds(OSError, st.text(max_size=20)),
)


@attrs.define
class _FailingUpstream:
    """An Upstream (for EmbedBackend) and a member's control client (for the twins) whose call fails with ``error``."""

    error: Exception
    url: str = _URL

    @property
    def client(self):
        return self

    def target(self, path):
        return path

    def request(self, *args, **kwargs):
        return fail(self.error)


def _raised(coroutine) -> tuple[str, str, str]:
    failure = []
    Deferred.fromCoroutine(coroutine).addErrback(failure.append)
    [raised] = failure
    return type(raised.value).__name__, raised.value.reason, raised.value.detail


@given(_FAILURES)
def test_the_fallbacks_client_and_the_twins_calls_turn_a_failure_into_the_same_backend_error(error):
    """One reading of a failed embedding call: the fallback's client and the twin verifier's call say the same
    (reason and detail) for every failure, as the one verifier's two sides should."""
    from yieldproxy.config import VerificationConfig
    from yieldproxy.servers import server
    from yieldproxy.upstream.fallback import EmbedBackend
    from yieldproxy.upstream.translation import EmbedRequest

    probe = EmbedRequest("embed", MODEL, ("one",))
    backend = EmbedBackend(Clock(), _FailingUpstream(error), "ollama", timeout=5.0)
    by_backend = _raised(backend.embed(probe, MODEL))
    member = SimpleNamespace(spec=SimpleNamespace(url=_URL), server=server("ollama"), control=_FailingUpstream(error))
    verifier = TwinVerifier(Clock(), (), VerificationConfig(), find_twins=False)
    by_twins = _raised(verifier._call(member, probe, "ollama", {"model": MODEL, "input": ["one"]}))
    assert by_backend == by_twins
    assert by_backend[0] == "BackendError"
