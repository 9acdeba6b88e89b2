"""Model names as Ollama reads them (names.canonical_model against ollama/ollama types/model/name.go)."""

import pytest

from yieldproxy.names import canonical_model


@pytest.mark.parametrize(
    "name, key",
    [
        ("all-minilm", "all-minilm:latest"),
        ("ALL-MINILM", "all-minilm:latest"),
        ("all-minilm:Latest", "all-minilm:latest"),
        ("registry.ollama.ai/library/all-minilm:latest", "all-minilm:latest"),
        ("Registry.Ollama.AI/Library/All-MiniLM", "all-minilm:latest"),
        ("https://registry.ollama.ai/library/all-minilm", "all-minilm:latest"),
        ("library/all-minilm:v2", "all-minilm:v2"),
        ("  all-minilm  ", "all-minilm:latest"),
        # A namespace or host of one's own is part of the name.
        ("me/all-minilm", "me/all-minilm:latest"),
        ("hf.co/User/Model:Q4_K_M", "hf.co/user/model:q4_k_m"),
        # A ':' before the last '/' is a port, not a tag (ParseNameBare).
        ("registry:5000/library/m", "registry:5000/library/m:latest"),
        ("a:b:c", "a:b:c"),
        ("x/y/z/w", "x/y/z/w:latest"),
    ],
)
def test_a_model_name_is_keyed_as_ollama_parses_and_compares_it(name, key):
    assert canonical_model(name) == key


def test_names_ollama_tells_apart_stay_apart():
    assert canonical_model("all-minilm:v2") != canonical_model("all-minilm")
    assert canonical_model("me/all-minilm") != canonical_model("all-minilm")
    assert canonical_model("other.host/library/all-minilm") != canonical_model("all-minilm")


def test_a_name_ollama_reads_as_invalid_keys_apart_from_the_valid_one():
    """ParseNameBare's cutPromised: a ':' promises a tag, so ``all-minilm:`` has a missing tag (Ollama
    refuses the name), not the default one; it must not be the twin of ``all-minilm:latest``.  The
    scheme is cut at the first ``://`` (strings.Cut), as Ollama does."""
    assert canonical_model("all-minilm:") != canonical_model("all-minilm")
    assert canonical_model("me/all-minilm:") != canonical_model("me/all-minilm")
    assert canonical_model(":latest") != canonical_model("latest")
    assert canonical_model("a://b://c/ns/m") == "b://c/ns/m:latest"
