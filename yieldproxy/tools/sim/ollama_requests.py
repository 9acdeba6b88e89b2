"""
Reading Ollama's requests as Ollama does: its routes and the OpenAI-compatible ones it serves.

A proxy in front of Ollama must pass the caller's mistakes through with
Ollama's own answer, so the sim checks each body with Ollama's rules and
words: a missing ``model``, an unparsable ``keep_alive`` (Go's duration
wording), a wrong ``input`` type, a ``template`` Go cannot parse.
"""

from __future__ import annotations

import json
import re
from typing import Any

from twisted.web.server import Request

from .api import BadRequest, Sim
from .content import canonical_model, count_tokens, messages_prompt
from .jobs import Job
from .models import parse_keep_alive

#: The routes whose inputs are texts to embed.
EMBED_OPS = ("embed", "embeddings", "v1_embeddings")


def read_json(request: Request) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 in Ollama's words."""
    raw = request.content.read() if request.content is not None else b""
    if not raw.strip():
        raise BadRequest("missing request body")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"invalid character in request body: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("json: cannot unmarshal into a request object")
    return body


def parse(sim: Sim, job: Job, body: dict[str, Any]) -> None:
    """Validate a model request the way Ollama does; fill in its job."""
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise BadRequest("model is required")
    try:
        job.keep_alive = parse_keep_alive(body.get("keep_alive"), sim.default_keep_alive)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    job.model = model
    job.key = canonical_model(model)
    options = body.get("options")
    if isinstance(options, dict) and isinstance(options.get("num_ctx"), int):
        job.num_ctx = options["num_ctx"]
    op = job.route.op
    if op in EMBED_OPS:
        _parse_embed(sim, job, body)
    elif op == "generate":
        prompt = body.get("prompt", "")
        if not isinstance(prompt, str):
            raise BadRequest("prompt must be a string")
        job.prompt = prompt
        job.load_only = prompt == ""
        job.stream = body.get("stream", True) is not False
        template = body.get("template")
        if isinstance(template, str) and template and not job.load_only:
            job.template_error = template_error(template)
    elif op == "chat":
        messages = body.get("messages") or []
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise BadRequest("messages must be a list of objects")
        job.prompt = messages_prompt(messages)
        job.load_only = not messages
        job.stream = body.get("stream", True) is not False
    elif op == "v1_chat":
        parse_v1_chat(job, body)
    elif op == "v1_completions":
        parse_v1_completion(job, body)


def parse_v1_chat(job: Job, body: dict[str, Any]) -> None:
    """``/v1/chat/completions``: the messages, and whether to stream."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("messages is required and must be a list of objects")
    job.prompt = messages_prompt(messages)
    _parse_v1_stream(job, body)


def parse_v1_completion(job: Job, body: dict[str, Any]) -> None:
    """``/v1/completions``: the prompt (one string), and whether to stream."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BadRequest("prompt must be a string")
    job.prompt = prompt
    _parse_v1_stream(job, body)


def _parse_v1_stream(job: Job, body: dict[str, Any]) -> None:
    """OpenAI streams only when asked (``stream: true``)."""
    job.stream = body.get("stream") is True
    options = body.get("stream_options")
    job.include_usage = isinstance(options, dict) and options.get("include_usage") is True


def _parse_embed(sim: Sim, job: Job, body: dict[str, Any]) -> None:
    """Inputs of the three embed routes, with their own rules."""
    op = job.route.op
    if op == "embeddings":
        prompt = body.get("prompt", "")
        if not isinstance(prompt, str):
            raise BadRequest("prompt must be a string")
        job.texts = [prompt] if prompt else []
        job.load_only = not prompt
        return
    raw = body.get("input")
    if op == "embed" and raw is None:
        raw = []
    if isinstance(raw, str):
        texts = [raw]
    elif isinstance(raw, list) and all(isinstance(t, str) for t in raw):
        texts = list(raw)
    else:
        raise BadRequest("invalid input type")
    if op == "v1_embeddings":
        if not texts:
            raise BadRequest("invalid input")
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise BadRequest(f"invalid encoding format: {fmt!r}")
        job.encoding_format = fmt
    job.texts = texts
    job.load_only = not texts
    dimensions = body.get("dimensions")
    if dimensions is not None:
        if not isinstance(dimensions, int) or isinstance(dimensions, bool):
            raise BadRequest("dimensions must be an integer")
        if 0 < dimensions < sim.dim:
            job.dimensions = dimensions
    if body.get("truncate") is False:
        for text in texts:
            if count_tokens(text) > sim.context_length:
                raise BadRequest("the input length exceeds the context length")


#: Names a Go template may call: text/template's builtins and keywords, and
#: the functions Ollama adds (``template/template.go``, ``funcs``).
_TEMPLATE_NAMES = frozenset(
    "if else end range with define template block break continue nil true false "
    "and or not len index slice eq ne lt le gt ge print printf println html js urlquery call "
    "json currentDate yesterdayDate toTypeScriptType".split()
)
_TEMPLATE_ACTION = re.compile(r"\{\{-?\s*(.*?)\s*-?\}\}", re.S)
_TEMPLATE_WORD = re.compile(r"(?:^|[|(\s])([A-Za-z_][A-Za-z0-9_]*)")
_TEMPLATE_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|`[^`]*`')


def template_error(text: str) -> str | None:
    """Go's parse error for a ``template`` Ollama could not parse, in Go's words; None if it parses.

    Only the two mistakes a caller makes most (an unknown function, an
    unclosed action) are recognised; the message quotes the caller's
    template, as Ollama's 500 does (``server/routes.go``: ``template.Parse``).
    """
    for number, line in enumerate(text.split("\n"), start=1):
        if line.count("{{") > line.count("}}"):
            return f"template: :{number}: unclosed action"
        for action in _TEMPLATE_ACTION.findall(line):
            for word in _TEMPLATE_WORD.findall(_TEMPLATE_STRING.sub('""', action)):
                if word not in _TEMPLATE_NAMES:
                    return f'template: :{number}: function "{word}" not defined'
    return None
