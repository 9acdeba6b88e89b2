"""Classes and policies: route rules, drain priority without starvation, honest budgets."""

from __future__ import annotations

import pytest

from helpers import config_with, make_core
from inmemory import Rig, answered
from test_parking import finish, park, released
from yieldproxy.config import RouteRule
from yieldproxy.lot.classify import BadBody, Classifier, is_unload, runs_no_model
from yieldproxy.servers.gojson import read_request
from yieldproxy.tools.sim import expected_embedding

# -- classification -----------------------------------------------------------------


def test_default_routes():
    c = Classifier.from_rules(())
    assert c.classify("POST", "/api/embed") == "batch"
    assert c.classify("POST", "/v1/embeddings") == "batch"
    assert c.classify("POST", "/api/chat") == "interactive"
    assert c.classify("POST", "/v1/completions") == "interactive"
    assert c.classify("GET", "/api/tags") == "passthrough"
    assert c.classify("POST", "/api/pull") == "passthrough"


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages", "/v1/audio/transcriptions"])
def test_every_model_route_of_ollama_has_a_parkable_default_class(path):
    assert Classifier.from_rules(()).classify("POST", path) == "interactive"


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/"), ("HEAD", "/"), ("GET", "/api/version"), ("HEAD", "/api/version"), ("GET", "/api/status"),
        ("GET", "/api/tags"), ("HEAD", "/api/tags"), ("GET", "/api/ps"), ("POST", "/api/show"),
        ("GET", "/v1/models"), ("GET", "/v1/models/llama3.2:latest"), ("HEAD", "/api/blobs/sha256:ab12"),
        ("POST", "/api/blobs/sha256:ab12"), ("POST", "/api/copy"), ("DELETE", "/api/delete"), ("POST", "/api/push"),
        ("POST", "/api/me"), ("POST", "/api/signout"), ("DELETE", "/api/user/keys/abc"),
        ("OPTIONS", "/api/embed"), ("OPTIONS", "/v1/chat/completions"),
    ],
)
def test_passthrough_is_an_allow_list_of_routes_that_run_no_model(method, path):
    assert runs_no_model(method, path)
    assert Classifier.from_rules(()).classify(method, path) == "passthrough"


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/api/embed/x"), ("POST", "/api/tags"), ("GET", "/api/show"), ("HEAD", "/api/ps"),
        ("GET", "/v1/models/library/llama3"), ("POST", "/api/blobs/a/b"), ("GET", "/API/TAGS"),
        ("POST", "/api/experimental/web_search"), ("POST", "/some/new/route"), ("GET", "/favicon.ico"),
    ],
)
def test_an_unknown_route_gets_the_unknown_route_class(method, path):
    assert not runs_no_model(method, path)
    assert Classifier.from_rules(()).classify(method, path) == "interactive"
    assert Classifier.from_rules((), unknown_class="batch").classify(method, path) == "batch"
    assert Classifier.from_rules((), unknown_class="passthrough").classify(method, path) == "passthrough"
    # A rule still comes first.
    rule = RouteRule(cls="long", path=path)
    assert Classifier.from_rules((rule,), unknown_class="passthrough").classify(method, path) == "long"


def test_first_matching_rule_wins_with_method_prefix_and_model():
    c = Classifier.from_rules(
        (
            RouteRule(cls="long", path="/api/generate", models=("qwen*-32b",)),
            RouteRule(cls="batch", prefix="/api/gen", methods=("POST",)),
            RouteRule(cls="passthrough", path="/api/embed", models=("tiny",)),
        )
    )
    assert c.needs_model("POST", "/api/generate")
    assert not c.needs_model("POST", "/api/chat")
    assert c.classify("POST", "/api/generate", "qwen2.5-32b") == "long"
    assert c.classify("POST", "/api/generate", "llama3.2") == "batch"
    assert c.classify("GET", "/api/generate", "llama3.2") == "interactive"  # the default rule
    assert c.classify("POST", "/api/embed", "tiny") == "passthrough"
    assert c.classify("POST", "/api/embed", None) == "batch"


def _unload(path: str, body: bytes, method: str = "POST") -> bool:
    return is_unload(method, path, read_request(body))


def test_unload_requests_are_recognised():
    assert _unload("/api/generate", b'{"model": "m", "keep_alive": 0}')
    assert _unload("/api/generate", b'{"model": "m", "keep_alive": "0s", "prompt": ""}')
    assert _unload("/api/chat", b'{"model": "m", "keep_alive": 0, "messages": []}')
    assert _unload("/api/chat", b'{"model": "m", "keep_alive": "0m"}')
    assert not _unload("/api/generate", b'{"model": "m", "keep_alive": 0, "prompt": "hi"}')
    assert not _unload("/api/generate", b'{"model": "m"}')
    assert not _unload("/api/generate", b'{"model": "m", "keep_alive": 0}', method="PUT")
    assert not _unload("/api/tags", b'{"keep_alive": 0}')


def test_embed_with_keep_alive_0_loads_the_model_so_it_is_no_unload():
    """EmbedHandler schedules the runner before anything else (routes.go:854)."""
    assert not _unload("/api/embed", b'{"model": "m", "keep_alive": 0}')
    assert not _unload("/api/embed", b'{"model": "m", "keep_alive": "0", "input": []}')
    assert not _unload("/api/embeddings", b'{"model": "m", "keep_alive": 0}')


@pytest.mark.parametrize(
    "body",
    [
        b'{"keep_alive": 0, "Prompt": "hi", "model": "m"}',  # case-folded key
        b'{"keep_alive": 0, "PROMPT": "hi", "model": "m"}',
        b'{"keep_alive": 0, "prompt": "", "prompt": "hi", "model": "m"}',  # the last duplicate wins
        b'{"keep_al\\u0131ve": 0, "model": "m"}',  # dotless i does not fold to i: keep_alive unset, a load
        b'{"keep_alive": 0, "keep_alive": null, "model": "m"}',  # null unsets the pointer
        b'{"keep_alive": 0, "keep_alive": "5m", "model": "m"}',
        b'{"keep_alive": 0, "prompt": 5, "model": "m"}',  # a type error: Ollama refuses it
    ],
)
def test_disguised_generations_are_no_unload(body):
    assert not _unload("/api/generate", body)


@pytest.mark.parametrize(
    "body",
    [
        b'{"KEEP_ALIVE": 0, "model": "m"}',
        b'{"\\u212aeep_alive": 0, "model": "m"}',  # Kelvin sign folds to k
        b'{"prompt": "hi", "keep_alive": 0, "Prompt": ""}',  # the last duplicate wins
        b'{"prompt": null, "keep_alive": 1e-10, "model": "m"}',  # null leaves a string alone; 0.1 ns is 0
    ],
)
def test_unloads_in_go_spelling_are_unloads(body):
    assert _unload("/api/generate", body)


def test_disguised_chats_are_no_unload():
    assert not _unload("/api/chat", b'{"keep_alive": 0, "Messages": [{"role": "user", "content": "hi"}]}')
    assert not _unload("/api/chat", b'{"keep_alive": 0, "messages": {}}')
    assert _unload("/api/chat", b'{"keep_alive": 0, "messages": [{"role": "user"}], "MESSAGES": []}')


def test_bad_bodies_are_named():
    with pytest.raises(BadBody, match="not valid JSON"):
        read_request(b"{model")
    with pytest.raises(BadBody, match="JSON object"):
        read_request(b'["m"]')


# -- drain order ---------------------------------------------------------------------


def test_interactive_first_but_batch_never_starves():
    core = make_core(concurrency=1)
    core.state.hold("api")
    batch = [park(core, cls="batch") for _ in range(8)]
    interactive = [park(core, cls="interactive") for _ in range(8)]
    core.state.release("api")
    order = []
    everyone = batch + interactive
    for _ in range(16):
        core.run(0.001)
        now_released = [o for o in released(everyone) if o not in order]
        assert len(now_released) == 1
        order.append(now_released[0])
        finish(core, now_released[0])
    classes = "".join(o["entry"].cls[0].upper() for o in order)
    # Batch holds a quarter of the releases while interactive work waits (min_share 0.25).
    assert classes == "IIIBIIIBIIBBBBBB"
    for cls in ("batch", "interactive"):
        seqs = [o["entry"].seq for o in order if o["entry"].cls == cls]
        assert seqs == sorted(seqs)


def test_equal_priorities_drain_in_arrival_order():
    config = config_with(classes={c: {"priority": 0, "min_share": 0.0} for c in ("interactive", "batch", "long")})
    core = make_core(config, concurrency=100)
    core.state.hold("api")
    outcomes = [park(core, cls=cls) for cls in ["batch", "long", "interactive", "batch", "long"]]
    core.state.release("api")
    core.run(0.01)
    seqs = [o["entry"].seq for o in sorted(released(outcomes), key=lambda o: o["released_at"])]
    assert seqs == sorted(seqs)


def test_class_ceiling_keeps_room_for_interactive():
    config = config_with(parking={"max_parked": 10}, classes={"batch": {"max_parked": 6}})
    core = make_core(config)
    core.state.hold("api")
    assert all("deferred" in park(core, cls="batch") for _ in range(6))
    assert park(core, cls="batch")["refused"].reason == "queue_full"
    assert "deferred" in park(core, cls="interactive")


# -- policies and budgets ---------------------------------------------------------------


def test_long_jobs_wait_minutes_while_interactive_is_told_at_once():
    core = make_core()
    core.state.hold("broker", "game", expected_seconds=120)
    chat = park(core, cls="interactive")
    job = park(core, cls="long")
    assert chat["refused"].reason == "over_budget" and chat["refused"].retry_after == 120
    assert "held at most 15s" in chat["refused"].message
    assert "deferred" in job
    core.run(119)
    assert "failure" not in job
    core.state.release("broker")
    core.run(0.01)
    assert "released_at" in job


def test_retry_after_is_the_queue_ahead_times_service_time_while_draining():
    config = config_with(parking={"max_parked": 4})
    core = make_core(config, concurrency=2)
    core.scheduler.service_seconds = 3.0
    core.state.hold("api")
    for _ in range(4):
        park(core)
    core.state.release("api")
    core.run(0.001)
    # Two released; two still parked; two more fill the lot; the next is refused.
    park(core)
    park(core)
    refusal = park(core)["refused"]
    assert refusal.reason == "queue_full"
    assert refusal.retry_after == 6  # 4 ahead * 3 s / 2 slots


def test_retry_after_follows_the_latest_declared_end():
    core = make_core(config_with(parking={"max_parked": 1}))
    core.state.hold("a", expected_seconds=30)
    core.state.hold("b", expected_seconds=90, for_seconds=20)
    park(core)
    assert park(core)["refused"].retry_after == 90
    core.state.release("b")
    assert park(core)["refused"].retry_after == 30


# -- over real sockets, with the real client ------------------------------------------------


def test_mixed_traffic_through_a_declared_yield():
    """Chat is told at once when to come back; embeddings and a long job wait and are answered."""
    rig = Rig(config_with(classes={"interactive": {"hold_seconds": 2}}), latency=0.01)
    rig.proxy.state.hold("broker", "game", expected_seconds=4)
    embedding = rig.post("/api/embed", {"model": "all-minilm", "input": ["x", "y"]})
    job = rig.post(
        "/api/generate", {"model": "llama3.2", "prompt": "summarise the archive", "stream": False},
        headers={"X-Yield-Class": "long"},
    )
    assert len(rig.proxy.lot) == 2
    rig.run(1)
    # Refused without the clock moving: told at once, not after its 2 s hold bound.
    chat = rig.result(rig.post("/api/chat", {"model": "llama3.2", "messages": [{"role": "user", "content": "hi"}]}))
    assert chat.code == 503 and "expected back in" in chat.json()["error"]
    chat_headers = rig.result(rig.post("/v1/chat/completions", {"model": "llama3.2", "messages": []}))
    assert chat_headers.code == 503 and chat_headers.json()["error"]["code"] == "over_budget"
    assert chat_headers.header("retry-after") == ["3"]  # the declared end, 3 s from now
    assert rig.proxy.lot.count_by_class() == {"batch": 1, "long": 1}
    rig.run(3)
    assert not answered(embedding) and not answered(job)
    rig.proxy.state.release("broker")
    rig.run(1)
    assert rig.result(embedding).json()["embeddings"] == [expected_embedding("x"), expected_embedding("y")]
    assert rig.result(job).json()["response"]
    assert rig.sample("yieldproxy_rejected_total", **{"class": "interactive", "reason": "over_budget"}) == 2
    assert rig.sample("yieldproxy_replay_total", **{"class": "long", "outcome": "ok"}) == 1


def test_model_loads_wait_and_unloads_pass_during_a_yield():
    rig = Rig()
    rig.proxy.state.hold("api")
    unload = rig.result(rig.post("/api/generate", {"model": "llama3.2", "keep_alive": 0}))
    assert unload.code == 200
    assert len(rig.proxy.lot) == 0
    pull = rig.post("/api/pull", {"model": "x"})
    assert rig.proxy.lot.count_by_class().get("long") == 1
    rig.run(60)
    assert not answered(pull)
    rig.proxy.state.release("api")
    rig.turn()
    # Forwarded after the resume (the simulated Ollama has no /api/pull: its own 404).
    pulled = rig.result(pull)
    assert pulled.header("x-yield-parked-seconds") == ["60.000"]
    assert pulled.code == 404 and rig.sim.requests_total["/api/pull"] == 1


def test_rule_by_model_and_malformed_json_gets_400(tmp_path):
    from yieldproxy.config import load

    path = tmp_path / "y.toml"
    path.write_text('[[routes]]\npath = "/api/embed"\nmodels = ["bulk-*"]\nclass = "long"\n')
    rig = Rig(load(path))
    rig.proxy.state.hold("api")
    bulk = rig.post("/api/embed", {"model": "bulk-embed", "input": "a"})
    assert rig.proxy.lot.count_by_class() == {"long": 1}
    bad = rig.result(rig.post("/api/embed", data=b"{nope"))
    # Ollama's own 400, in Go's words, at once (servers/ollama.py refuse), before any rule reads it.
    assert bad.code == 400 and bad.json() == {"error": "invalid character 'n' looking for beginning of object key string"}
    rig.proxy.state.release("api")
    rig.turn()
    assert rig.result(bulk).code == 200
