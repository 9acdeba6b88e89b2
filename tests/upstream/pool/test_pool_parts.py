"""Small parts of the pool: a member's model catalogue, the renamed body, the joined model lists."""

from __future__ import annotations

import json

from twisted.internet.defer import Deferred, fail, succeed

from yieldproxy.upstream.control import Answer
from yieldproxy.upstream.pool.lists import union_list
from yieldproxy.upstream.pool.models import ModelCatalogue
from yieldproxy.upstream.pool.rename import renamed_body


def test_patterns_and_mapped_names_decide_without_a_list():
    catalogue = ModelCatalogue(("llama3.1:*", "all-minilm"), {"bge": "BAAI/bge-small-en-v1.5"})
    assert catalogue.serves("llama3.1:70b") and catalogue.serves("all-minilm:latest")
    assert catalogue.serves("bge:latest") and catalogue.own_name("bge") == "BAAI/bge-small-en-v1.5"
    assert catalogue.serves("mistral") is False and catalogue.own_name("all-minilm") is None


def test_a_discovered_list_is_unknown_until_it_comes_and_tells_its_listeners():
    catalogue = ModelCatalogue()
    changes = []
    catalogue.when_changed(lambda: changes.append(catalogue.version))
    assert catalogue.serves("all-minilm") is None
    catalogue.update(("all-minilm:latest",))
    catalogue.update(("all-minilm:latest",))  # the same list: nothing changed
    assert catalogue.serves("all-minilm") is True and catalogue.serves("bge-m3") is False
    assert changes == [1] and catalogue.names() == ["all-minilm:latest"]


def test_renamed_body_names_the_members_model_and_keeps_the_rest():
    body = b'{"MODEL": "all-minilm", "input": ["a", "b"], "options": {"model": "inner"}}'
    assert json.loads(renamed_body(body, "minilm-l6")) == {
        "model": "minilm-l6", "input": ["a", "b"], "options": {"model": "inner"}
    }
    # Not a JSON object: sent as it came, the member answers it in its own words.
    assert renamed_body(b"[1, 2]", "m") == b"[1, 2]" and renamed_body(b"{oops", "m") == b"{oops"


class Member:
    """A member whose control client answers every call with ``answer`` (an exception: fails with it)."""

    def __init__(self, answer):
        self.control = self
        self._answer = answer

    def request(self, method, path, body=None, timeout=10.0):
        return fail(self._answer) if isinstance(self._answer, Exception) else succeed(self._answer)


def joined(members, path):
    results = []
    d = Deferred.fromCoroutine(union_list(members, path, 1.0))
    d.addBoth(results.append)
    return results[0]


def test_model_lists_are_joined_in_config_order_each_model_once_without_the_silent_ones():
    first = Answer(200, json.dumps({"models": [{"name": "a:latest"}, {"name": "b:latest"}]}).encode())
    second = Answer(200, json.dumps({"models": [{"name": "b:latest", "size": 2}, {"name": "c:latest"}]}).encode())
    down = Member(ConnectionRefusedError())
    answer = joined([Member(first), down, Member(second), Member(Answer(500, b"oops"))], "/api/tags")
    assert json.loads(answer) == {"models": [{"name": "a:latest"}, {"name": "b:latest"}, {"name": "c:latest"}]}
    listed = Answer(200, json.dumps({"object": "list", "data": [{"id": "x"}]}).encode())
    assert json.loads(joined([Member(listed), Member(listed)], "/v1/models")) == {
        "object": "list", "data": [{"id": "x"}]
    }
    assert joined([down, Member(Answer(404, b""))], "/api/tags") is None
