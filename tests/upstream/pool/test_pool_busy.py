"""Busy is not failure: a pool member's "busy" answer sends the request to another member (issue 16, section 5).

A member whose server says it is full (Ollama's 503 ``server busy``, TEI's
429 ``Overloaded``) is up: the request goes to another eligible member that
has not answered it busy, not counted against ``upstream.max_attempts``, and
no outage is probed or held for it.  With no other member left, a 429 is the
caller's to hear (with its own words) and a 503 is judged as any 503.
"""

from __future__ import annotations

from helpers import config_with
from inmemory import Rig, answered
from rawhttp import counter_total
from yieldproxy.tools.sim import expected_embedding, expected_reply, messages_prompt

CHAT = "llama3.2"
#: Member a serves one request at a time and queues none: one call of its own fills it.
FULL = {"parallel": 1, "max_queue": 0, "latency": 3.0}
#: The same for embeddings, slow only for a long batch (twin verification's few texts stay quick).
ONE_SLOT = {"parallel": 1, "max_queue": 0, "per_item_latency": 0.1}
#: A batch that takes ONE_SLOT's slot for about 3 s.
LONG_BATCH = {"inputs": [f"long {i}" for i in range(30)]}


def pool_rig(members, config, watchers: bool = False) -> Rig:
    """The proxy pooling ``members`` in memory, started, its model lists read and its twins verified."""
    rig = Rig(config, members=members, watchers=watchers, latency=0.01)
    rig.start()
    rig.settle()
    return rig


def fill(rig: Rig, name: str, path: str, body: dict):
    """A call straight to member ``name``'s sim (not through the proxy) that takes its one slot."""
    pending = rig.direct(name, "POST", path, body)
    assert rig.sims[name].serving == 1 and not answered(pending)
    return pending


def end(rig: Rig, occupied) -> None:
    """The calls that filled the members are answered once their time is up; stopped, nothing is left scheduled."""
    rig.until(lambda: all(answered(d) for d in occupied), 10)
    assert all(rig.result(d).code == 200 for d in occupied)
    rig.stop()
    assert rig.clock.getDelayedCalls() == []


def test_an_ollama_members_busy_503_goes_to_another_member_uncounted_and_holds_nothing():
    members = [{"name": "a", "sim": FULL}, {"name": "b"}]
    rig = pool_rig(members, config_with(upstream={"max_attempts": 1}), watchers=True)
    occupied = fill(rig, "a", "/api/chat", {"model": CHAT, "messages": [{"role": "user", "content": "x"}], "stream": False})
    messages = [{"role": "user", "content": "who serves"}]
    pending = rig.post("/api/chat", {"model": CHAT, "messages": messages, "stream": False})
    rig.until(lambda: answered(pending), 1)
    answer = rig.result(pending)
    body = answer.json()
    assert answer.code == 200, body
    assert body["message"]["content"] == "".join(expected_reply(messages_prompt(messages), CHAT))
    # a said busy once (Ollama's own words), b served it; with max_attempts = 1 it was not counted.
    assert rig.sims["a"].outcomes["busy"] == 1
    assert rig.sample("yieldproxy_upstream_attempts_total", upstream="a", outcome="busy") == 1
    assert rig.sample("yieldproxy_upstream_attempts_total", upstream="b", outcome="ok") == 1
    # Busy is not an outage: nothing probed, nothing held, nothing counted as a failure.
    assert counter_total(rig, "yieldproxy_outage_probes", probe="model") == 0
    assert not rig.proxy.state.yielded_for("a")
    assert counter_total(rig, "yieldproxy_upstream_failures") == 0
    end(rig, [occupied])


def test_a_busy_429_goes_to_another_member_and_is_relayed_only_when_every_member_said_busy():
    model = "BAAI/bge-small-en-v1.5"
    tei = {"api": "tei", "models": (model,)}
    members = [
        {"name": "a", "api": "tei", "sim": {**tei, **ONE_SLOT}},
        {"name": "b", "api": "tei", "sim": {**tei, **ONE_SLOT}},
    ]
    # b is a's verified twin (same model, same vectors), so either may serve the model's embeddings.
    rig = pool_rig(members, config_with(verification={"models": (model,)}))
    assert rig.proxy.twins.settled
    occupied = [fill(rig, "a", "/embed", LONG_BATCH)]
    request = {"model": model, "input": ["t"]}
    pending = rig.post("/v1/embeddings", request)
    rig.until(lambda: answered(pending), 1)
    answer = rig.result(pending)
    assert answer.code == 200
    assert answer.json()["data"][0]["embedding"] == expected_embedding("t", model)
    assert rig.sims["a"].outcomes["busy"] == 1
    # Both full: each said busy once, and the caller hears TEI's own 429 (before: at once, from a).
    occupied.append(fill(rig, "b", "/embed", LONG_BATCH))
    answer = rig.call("POST", rig.proxy_url + "/v1/embeddings", json=request)
    assert answer.code == 429
    assert answer.json()["type"] == "Overloaded"
    assert rig.sims["a"].outcomes["busy"] == 2 and rig.sims["b"].outcomes["busy"] == 1
    end(rig, occupied)


def test_a_busy_answer_is_not_retried_on_the_same_member_for_a_standby_that_may_not_take_it():
    """a (``always``) is full and answers busy; b is a standby (``use = "when_others_yielded"``), which
    may take nothing while a is available (busy is not unavailable).  So no other member may take the
    request now: a's 503 is judged as any 503 (here counted: max_attempts = 1, no outage watcher: given
    up, 502), once.
    (Before: b counted as a member that may take it, so the request went back to the lot, a took it
    again, said busy again, and so on, uncounted, one upstream call per turn until a had room.)"""
    members = [{"name": "a", "sim": FULL}, {"name": "b", "use": "when_others_yielded"}]
    config = config_with(upstream={"max_attempts": 1, "retry_backoff_seconds": 0.05, "retry_backoff_max_seconds": 0.1})
    rig = pool_rig(members, config)
    occupied = fill(rig, "a", "/api/chat", {"model": CHAT, "messages": [{"role": "user", "content": "x"}], "stream": False})
    pending = rig.post("/api/chat", {"model": CHAT, "messages": [{"role": "user", "content": "hi"}], "stream": False})
    rig.until(lambda: answered(pending), 2)
    answer = rig.result(pending)
    body = answer.json()
    # Given up after its one counted attempt, in the proxy's words quoting Ollama's.
    assert answer.code == 502, body
    assert "server busy" in body["error"]
    assert rig.sims["a"].outcomes["busy"] == 1
    assert rig.sims["b"].requests_total["/api/chat"] == 0
    end(rig, [occupied])
