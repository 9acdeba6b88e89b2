"""Twin verification on a Clock (upstream/pool/twins.py): a member serves a model's embeddings only while verified.

Two members serve ``all-minilm``; ``a`` is its reference (first in config
order), ``b`` a twin.  Each member's control client is a fake that answers
the verification's embed calls with the sim's deterministic vectors
(another model's vectors for a twin whose weights differ) and records every
call, so a test sees exactly which member was asked to run a model, when.
"""

from __future__ import annotations

import json

import attrs
import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from helpers import Core, advance_through, clock_cooperator, config_with, pool_config
from yieldproxy.lot.parking import Entry, Refused
from yieldproxy.observe.metrics import Metrics
from yieldproxy.service import build_heart
from yieldproxy.tools.sim import expected_embedding
from yieldproxy.upstream.control import Answer, ControlTimeout
from yieldproxy.upstream.pool.twins import POSTPONED_RECHECK_SECONDS, TwinVerifier

MODEL = "all-minilm"
INTERVAL = 600.0
MAX_AGE = 1800.0


@attrs.define(eq=False)
class FakeControl:
    """A member's control client: answers ``POST /api/embed`` with vectors of ``weights``; records the calls."""

    clock: Clock
    name: str
    #: The model whose vectors it answers with (another name: different weights).
    weights: str | None = None
    #: True: never answers (the call's own timeout ends it, as UpstreamControl's addTimeout does).
    hang: bool = False
    calls: list = attrs.Factory(list)

    def request(self, method, path, body=None, timeout=10.0, max_body=0):
        self.calls.append((method, path, body, self.clock.seconds()))
        d: Deferred = Deferred()
        if self.hang:
            return d.addTimeout(
                timeout, self.clock, onTimeoutCancel=lambda r, s: Failure(ControlTimeout(f"no answer in {s:g}s"))
            )
        model = self.weights or body["model"]
        vectors = [expected_embedding(text, model) for text in body["input"]]
        d.callback(Answer(200, json.dumps({"model": body["model"], "embeddings": vectors}).encode()))
        return d

    def embeds(self) -> int:
        return sum(1 for call in self.calls if call[1] == "/api/embed")


@attrs.define(eq=False)
class Rig:
    core: Core
    verifier: TwinVerifier
    controls: dict

    @property
    def scheduler(self):
        return self.core.scheduler

    def run(self, seconds: float = 0.0) -> None:
        advance_through(self.core.clock, seconds)

    def entry(self, path="/api/embed", cls="batch", model=MODEL) -> Entry:
        return Entry(cls=cls, routing=self.scheduler.routing("POST", path, cls, model))

    def may_serve(self, name: str, entry: Entry) -> bool:
        return self.scheduler.twin_ok(self.scheduler.member(name), entry)

    def stop(self) -> None:
        self.verifier.stopService()
        self.scheduler.stop()
        self.run()
        assert self.core.clock.getDelayedCalls() == []


def rig(
    b_weights: str | None = None, b_hangs: bool = False, models=(MODEL,), start=True, classes=None,
    serves=(MODEL, "llama3.2"),
) -> Rig:
    config = pool_config(
        {"name": "a", "models": serves},
        {"name": "b", "models": serves},
        config=config_with(
            verification={
                "models": models, "verify_interval_seconds": INTERVAL, "max_verification_age_seconds": MAX_AGE,
                "timeout_seconds": 5.0, "probe_texts": ("hello", "two words", "東京"),
            },
            upstream={"detect_outages": False},
            **({"classes": classes} if classes else {}),
        ),
    )
    clock = Clock()
    controls = {
        "a": FakeControl(clock, "a"),
        "b": FakeControl(clock, "b", weights=b_weights, hang=b_hangs),
    }
    metrics = Metrics()
    heart = build_heart(
        clock, config, metrics, clock_cooperator(clock), clients=lambda spec: (None, controls[spec.name]), twins=True,
    )
    core = Core(clock, metrics, heart.state, heart.lot, heart.scheduler.drainer(None), heart.scheduler)
    verifier = heart.twins
    if start:
        verifier.startService()
    return Rig(core, verifier, controls)


def test_a_verified_twin_serves_embeddings_and_takes_them_while_the_reference_is_yielded():
    r = rig()
    r.run()
    # One call each: the reference's vectors, then the twin's, the probe texts in one request.
    assert r.controls["a"].embeds() == 1 and r.controls["b"].embeds() == 1
    assert r.controls["b"].calls[0][2] == {"model": MODEL, "input": ["hello", "two words", "東京"], "truncate": True}
    assert r.may_serve("b", r.entry())
    assert r.verifier.status("b")[MODEL]["state"] == "verified"
    assert r.verifier.status("a")[MODEL]["state"] == "reference"
    assert r.core.sample("yieldproxy_twin_verified", upstream="b", model=MODEL) == 1
    assert r.core.sample("yieldproxy_twin_verifications_total", upstream="b", result="ok") == 1
    # The reference yields: an embedding goes to the twin at once.
    r.core.state.hold("api", "game", scope="a")
    entry = r.entry()
    d = r.core.scheduler.admit(entry)
    r.run()
    assert entry.released_to == "b" and d.called
    r.stop()


def test_a_twin_with_other_vectors_never_serves_embeddings_but_still_serves_chat():
    r = rig(b_weights="nomic-embed-text")
    r.run()
    status = r.verifier.status("b")[MODEL]
    assert status["state"] == "mismatch" and "3 of 3 probe texts differ" in status["reason"]
    assert not r.may_serve("b", r.entry())
    assert r.core.sample("yieldproxy_twin_verified", upstream="b", model=MODEL) == 0
    assert r.core.sample("yieldproxy_twin_verifications_total", upstream="b", result="mismatch") == 1
    r.core.state.hold("api", "game", scope="a")
    embedding = r.entry()
    parked = r.core.scheduler.admit(embedding)
    chat = r.entry(path="/api/chat", cls="interactive", model=MODEL)
    served = r.core.scheduler.admit(chat)
    r.run(30)
    # The embedding waits for its reference; the chat for the same model is served by the twin.
    assert not parked.called and embedding.released_to is None
    assert served.called and chat.released_to == "b"
    r.core.scheduler.finished(failed=False, seconds=0.01, member="b")
    # The reference comes back: the embedding goes to it.
    r.core.state.release("api", "a")
    r.run()
    assert parked.called and embedding.released_to == "a"
    r.core.scheduler.finished(failed=False, seconds=0.01, member="a")
    r.stop()


def test_a_stale_verification_stops_the_twin_until_it_is_verified_again():
    r = rig()
    r.run()
    assert r.may_serve("b", r.entry())
    # The reference yields for longer than the verification may age: no re-verification can run.
    r.core.state.hold("api", "long game", scope="a")
    r.run(MAX_AGE - 1)
    assert r.may_serve("b", r.entry())
    assert r.controls["a"].embeds() == 1 and r.controls["b"].embeds() == 1
    r.run(2)
    assert not r.may_serve("b", r.entry())
    assert r.verifier.status("b")[MODEL]["state"] == "stale"
    assert r.core.sample("yieldproxy_twin_verified", upstream="b", model=MODEL) == 0
    # Back: verified again within a few seconds, and it serves again.
    r.core.state.release("api", "a")
    r.run(POSTPONED_RECHECK_SECONDS)
    assert r.controls["a"].embeds() == 2 and r.controls["b"].embeds() == 2
    assert r.may_serve("b", r.entry())
    r.stop()


def test_no_verification_call_reaches_a_yielded_reference_or_twin():
    for yielded in ("a", "b"):
        r = rig(start=False)
        r.core.state.hold("api", "game", scope=yielded)
        r.verifier.startService()
        r.run(3 * INTERVAL)
        assert r.controls["a"].calls == [] and r.controls["b"].calls == []
        assert not r.may_serve("b", r.entry())
        assert r.verifier.status("b")[MODEL]["state"] == "unverified"
        r.core.state.release("api", yielded)
        r.run(POSTPONED_RECHECK_SECONDS)
        assert r.controls["a"].embeds() == 1 and r.controls["b"].embeds() == 1
        assert r.may_serve("b", r.entry())
        r.stop()


def test_a_twin_that_does_not_answer_in_time_is_unverified_and_tried_again_sooner():
    r = rig(b_hangs=True)
    r.run(4.9)
    assert r.verifier.status("b")[MODEL]["state"] == "unverified"
    r.run(0.2)
    status = r.verifier.status("b")[MODEL]
    assert status["state"] == "error" and "no answer in 5s" in status["reason"]
    assert not r.may_serve("b", r.entry())
    assert r.core.sample("yieldproxy_twin_verifications_total", upstream="b", result="error") == 1
    # An error is retried within a minute, not a whole interval later.
    r.run(60)
    assert r.controls["b"].embeds() == 2
    r.stop()


def test_a_model_first_seen_in_an_embedding_request_is_verified_then_served_by_its_twin():
    r = rig(models=())
    r.run()
    assert r.controls["a"].calls == []
    # Its first request may go to the reference only; it starts the twins' verification.
    assert not r.may_serve("b", r.entry())
    assert r.may_serve("a", r.entry())
    r.run()
    assert r.controls["a"].embeds() == 1 and r.controls["b"].embeds() == 1
    assert r.may_serve("b", r.entry())
    r.stop()


def test_chat_and_generation_are_never_restricted():
    r = rig(b_weights="other", start=False)
    assert r.may_serve("b", r.entry(path="/api/chat", cls="interactive", model="llama3.2"))
    assert r.may_serve("b", r.entry(path="/api/generate", cls="interactive", model=MODEL))
    assert not r.may_serve("b", r.entry())
    assert r.may_serve("a", r.entry())
    r.stop()



def test_an_embedding_only_the_yielded_reference_may_serve_waits_for_the_yield_under_its_class_policy():
    """The unverified twin is no way out: the hold bound's early refusal and the reject policy apply."""
    r = rig(b_weights="nomic-embed-text")
    r.run()
    r.core.state.hold("api", "long game", expected_seconds=3600, scope="a")
    with pytest.raises(Refused) as refused:
        r.core.scheduler.admit(r.entry())
    assert refused.value.reason == "over_budget"
    # A chat for the same model is served by the twin at once.
    chat = r.entry(path="/api/chat", cls="interactive")
    assert r.core.scheduler.admit(chat).called and chat.released_to == "b"
    r.core.scheduler.finished(failed=False, seconds=0.01, member="b")
    r.stop()

    r = rig(b_weights="nomic-embed-text", classes={"batch": {"policy": "reject"}})
    r.run()
    r.core.state.hold("api", "game", scope="a")
    with pytest.raises(Refused) as refused:
        r.core.scheduler.admit(r.entry())
    assert refused.value.reason == "policy"
    r.stop()


def test_an_expiry_in_a_pool_says_what_kept_each_upstream_from_taking_it():
    """Issue 10's honest expiry, per upstream: the pool as a whole was far from yielded."""
    r = rig(b_weights="nomic-embed-text", classes={"batch": {"hold_seconds": 30}})
    r.run()
    r.core.state.hold("api", "game", scope="a")
    entry = r.entry()
    d = r.core.scheduler.admit(entry)
    r.run(31)
    failure = d.result
    d.addErrback(lambda f: None)
    refusal = r.core.scheduler.explain(failure.value, entry)
    assert refusal.reason == "expired"
    assert refusal.message.endswith(
        "no upstream that may serve it was free: a yielded (held by api); "
        f"b not a verified twin for {MODEL}'s embeddings"
    ), refusal.message
    r.stop()


def test_an_unverified_twin_counts_no_waiting_embedding():
    """yieldproxy_upstream_waiting_requests (YieldproxyLotStalled reads it): an embedding waiting for its
    yielded reference is not work the available, unverified twin could take."""
    r = rig(b_weights="nomic-embed-text")
    r.run()
    r.core.state.hold("api", "game", scope="a")
    entry = r.entry()
    d = r.core.scheduler.admit(entry)
    r.run()
    assert not d.called
    rows = {row[0]: row[4] for row in r.scheduler.metric_rows()}
    assert rows == {"a": 1, "b": 0}
    assert {row["name"]: row["waiting"] for row in r.scheduler.status()} == {"a": 1, "b": 0}
    r.core.state.release("api", "a")
    r.run()
    assert d.called and entry.released_to == "a"
    r.core.scheduler.finished(failed=False, seconds=0.01, member="a")
    r.stop()


def test_an_embedding_waiting_for_its_reference_does_not_hold_back_the_twins_chat():
    """No overtaking is judged on what a member may take: chat for an idle twin is not parked and paced
    behind an embedding only the yielded reference may serve."""
    r = rig(b_weights="nomic-embed-text")
    r.run()
    r.core.state.hold("api", "game", scope="a")
    embedding = r.entry()
    r.core.scheduler.admit(embedding)
    r.run()
    assert embedding.released_to is None and len(r.core.lot) == 1
    chats = [r.entry(path="/api/chat", cls="interactive") for _ in range(3)]
    answered = [r.core.scheduler.admit(chat).called for chat in chats]
    assert answered == [True, True, True] and all(chat.released_to == "b" for chat in chats)
    for _ in chats:
        r.core.scheduler.finished(failed=False, seconds=0.01, member="b")
    r.core.state.release("api", "a")
    r.run()
    assert embedding.released_to == "a"
    r.core.scheduler.finished(failed=False, seconds=0.01, member="a")
    r.stop()


def test_model_names_from_requests_cannot_crowd_out_a_real_model():
    """With patterns like "*", requests may name any number of models: the oldest named are forgotten
    to make room (never a configured one), so a real model named later is still verified."""
    from yieldproxy.upstream.pool.twins import MAX_MODELS

    r = rig(serves=("*",))
    r.run()
    r.core.state.hold("api", "game", scope="a")  # nothing is verified meanwhile: only the table is watched
    for i in range(MAX_MODELS + 50):
        r.may_serve("b", r.entry(model=f"junk-{i}"))
    assert r.may_serve("b", r.entry(model="nomic-embed-text")) is False
    tracked = set(r.verifier._models)
    assert len(tracked) == MAX_MODELS
    assert {"nomic-embed-text:latest", f"{MODEL}:latest"} <= tracked and "junk-0:latest" not in tracked
    r.core.state.release("api", "a")
    r.run(10)
    assert r.may_serve("b", r.entry(model="nomic-embed-text"))
    r.stop()


#: One model to Ollama (its ParseName: case-insensitive, default host, namespace and tag).
SPELLINGS = ("all-minilm", "ALL-MINILM", "all-minilm:Latest", "registry.ollama.ai/library/all-minilm:latest",
             "Library/All-MiniLM", "https://registry.ollama.ai/library/all-minilm")


def test_every_spelling_of_the_model_ollama_accepts_is_served_by_the_verified_twin_during_the_references_yield():
    r = rig()
    r.run()
    r.core.state.hold("api", "game", scope="a")
    for spelling in SPELLINGS:
        entry = r.entry(model=spelling)
        assert entry.eligible == ("a", "b"), spelling
        assert r.may_serve("b", entry), spelling
        d = r.core.scheduler.admit(entry)
        r.run()
        assert d.called and entry.released_to == "b", spelling
        r.core.scheduler.finished(failed=False, seconds=0.01, member="b")
    # Another model is not this one: it waits for the reference.
    other = r.entry(model="all-minilm:v2")
    assert not r.core.scheduler.admit(other).called
    r.core.state.release("api", "a")
    r.run()
    assert other.released_to == "a"
    r.core.scheduler.finished(failed=False, seconds=0.01, member="a")
    r.stop()
