"""Ollama: its routes, its failures, its health, its model list, its probes, what it refuses at once.

Pure data and functions, read from Ollama's source and checked against a
running Ollama (tests/test_sim_vs_ollama_real.py): which routes run no model
(:data:`ROUTES`), when an error is the GPU's (:func:`is_gpu_failure`: a prefix
of Ollama's own, llama.cpp's ``Compute error.``, or an out-of-memory
substring in a 500; evidence only, the outage probe decides), the busy 503,
the health and probe calls, and :func:`refuse` (its CORS check, router and
body decode).  The specification, with every source line: docs/servers.md,
*Ollama, as the proxy reads it*.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Iterable

import attrs

from . import goscan
from .base import (
    BUSY,
    CALLER,
    GPU,
    OK,
    PASSTHROUGH,
    PROBE_TEXT,
    UPSTREAM,
    Asked,
    MinimalCall,
    ModelCall,
    Refusal,
    Route,
    Server,
    json_object,
    listed_names,
    openai_call,
    routes,
)
from .cors import Origins
from .gojson import FirstValue, GoStruct, decode_error

# -- routes ----------------------------------------------------------------------

ROUTES = (
    *routes("ollama", "batch", "POST /api/embed", "POST /api/embeddings"),
    *routes("openai", "batch", "POST /v1/embeddings"),
    *routes("ollama", "interactive", "POST /api/chat", "POST /api/generate"),
    *routes(
        "openai", "interactive",
        "POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses", "POST /v1/audio/transcriptions",
    ),
    *routes("anthropic", "interactive", "POST /v1/messages"),
    *routes(
        "ollama", PASSTHROUGH,
        "GET HEAD /", "GET HEAD /api/version", "GET /api/status", "GET HEAD /api/tags", "GET /api/ps",
        "POST /api/show", "HEAD POST /api/blobs/<digest>", "POST /api/copy", "DELETE /api/delete", "POST /api/push",
        "POST /api/me", "POST /api/signout", "DELETE /api/user/keys/<key>", "POST /api/pull", "POST /api/create",
    ),
    *routes("openai", PASSTHROUGH, "GET /v1/models", "GET /v1/models/<name>"),
)

#: Routes that make Ollama fetch or build a model: passthrough while the GPU is
#: there, held (as ``long``) during a yield.
MODEL_LOADING_PATHS = frozenset({"/api/pull", "/api/create"})
#: Routes where ``keep_alive: 0`` with nothing to compute unloads without loading.
UNLOAD_PATHS = frozenset({"/api/generate", "/api/chat"})


def is_unload(method: str, path: str, request: Any) -> bool:
    """True for a request Ollama answers by unloading a model, without loading one.

    ``request`` is a :class:`yieldproxy.servers.gojson.GoRequest`.  Ollama's
    server/routes.go at fb30760996871fa9460115c753afd2c60d4ab0f7:
    ``GenerateHandler`` expires the runner when ``req.Prompt == "" &&
    req.KeepAlive != nil && req.KeepAlive.Duration == 0`` (line 404) and
    nothing before that line schedules one (the body is bound, the model
    looked up on disk; cloud models are proxied elsewhere); ``ChatHandler``
    likewise when ``len(req.Messages) == 0`` and keep_alive is 0 (line
    2505).  ``EmbedHandler`` and ``EmbeddingsHandler`` call
    ``scheduleRunner`` before anything else (lines 854, 1072): with
    ``keep_alive: 0`` and no input they *load* the model, so they are never
    an unload.  ``keep_alive`` is an ``api.Duration`` (api/types.go,
    ``Duration.UnmarshalJSON``), read by :func:`yieldproxy.servers.gojson.go_duration`.
    A request with any field Go could not decode is not an unload (Ollama
    refuses it; parking it is the safe side).
    """
    if method != "POST" or path not in UNLOAD_PATHS or request.type_errors:
        return False
    if request.values.get("keep_alive") != 0:
        return False
    if path == "/api/generate":
        return bool(request.values.get("prompt", "") == "")
    return bool(request.values.get("messages", 0) == 0)


def error_shape(path: str) -> str:
    """``openai`` on the /v1/ routes, else ``ollama``: the shape of the proxy's own error bodies."""
    return "openai" if path.startswith("/v1/") else "ollama"


def api_family(path: bytes) -> str:
    """:func:`error_shape` of a raw path (bytes), as the listener has it before routing."""
    return "openai" if path.startswith(b"/v1/") else "ollama"


# -- what Ollama refuses at once ----------------------------------------------------

#: ``envconfig.AllowedOrigins()``'s defaults, after ``OLLAMA_ORIGINS``'s entries
#: (envconfig/config.go:57-80 at v0.11.4, 86-109 at HEAD): ``http``/``https``
#: on localhost, 127.0.0.1 and 0.0.0.0 with any port or none, and the desktop
#: and editor schemes.
DEFAULT_ORIGINS: tuple[str, ...] = (
    *(
        f"{scheme}://{host}{port}"
        for host in ("localhost", "127.0.0.1", "0.0.0.0")
        for port in ("", ":*")
        for scheme in ("http", "https")
    ),
    "app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*",
)


def allowed_origins(configured: Iterable[str] = ()) -> Origins:
    """The origins Ollama's CORS check lets in: ``configured`` (mirroring ``OLLAMA_ORIGINS``) and its defaults.

    The list is ``AllowOrigins`` of gin-contrib/cors, set in ``GenerateRoutes``
    (server/routes.go:1219-1251 at v0.11.4, 1842-1873 at HEAD) with
    ``AllowWildcard`` and ``AllowBrowserExtensions``; ValueError for an entry
    that makes ``cors.New`` panic (:meth:`Origins.from_entries`).
    """
    return Origins.from_entries((*configured, *DEFAULT_ORIGINS))


#: Routes some releases since v0.11.4 serve and others do not (``server/routes.go`` at every
#: tag from v0.11.4 to HEAD): a request to one of these paths is left to the Ollama that runs.
#: ``/api/experimental/`` paths are left to it too (they may change without notice).
SOME_RELEASES_ROUTES = routes(
    "ollama", "",
    "GET /api/status", "POST /api/me", "POST /api/signout", "DELETE /api/user/keys/<key>",
    "POST /v1/responses", "POST /v1/messages", "POST /v1/audio/transcriptions",
    "POST /v1/images/generations", "POST /v1/images/edits",
)
#: gin's method trees in the order ``GenerateRoutes`` first registers each method
#: (``HEAD /`` first): the order of a 405's ``Allow`` (gin.go:649-666, v1.10.0).
_TREE_ORDER = ("HEAD", "GET", "POST", "DELETE")


def _matches(route: Route, path: str) -> bool:
    return route.path == path if route.pattern is None else route.pattern.fullmatch(path) is not None


def _methods(path: str) -> set[str] | None:
    """The methods every release since v0.11.4 serves ``path`` with, or None when releases differ on it."""
    if path.startswith("/api/experimental/") or any(_matches(r, path) for r in SOME_RELEASES_ROUTES):
        return None
    found: set[str] = set()
    for route in ROUTES:
        if _matches(route, path):
            found |= route.methods
    return found


@functools.lru_cache(maxsize=4096)
def _route_refusal(method: str, path: str) -> Refusal | None:
    """gin's answer to a route it has no handler for: ``404 page not found``, or ``405 method not
    allowed`` with ``Allow`` when another method has the path (``HandleMethodNotAllowed``,
    server/routes.go:1247 at v0.11.4, 1870 at HEAD; gin.go:649-670 and ``serveError`` 675-690,
    v1.10.0: ``text/plain``, no newline).  ``OPTIONS`` and ``HEAD`` are left alone: a preflight or
    Ollama's Host check may answer 204 first, and a HEAD answer has no body to compare.
    Remembered for the routes seen last (clients ask the same few again and again)."""
    if method in ("OPTIONS", "HEAD"):
        return None
    methods = _methods(path)
    if methods is None or method in methods:
        return None
    if methods:
        allow = ", ".join(m for m in _TREE_ORDER if m in methods)
        return Refusal(405, b"405 method not allowed", b"text/plain", ((b"allow", allow.encode("ascii")),),
                       reason="unknown_route")
    return Refusal(404, b"404 page not found", b"text/plain", reason="unknown_route")


def _fields(*table: str, only_some: tuple[str, ...] = ()) -> dict[str, tuple[str, bool]]:
    """A field table written ``"kind name name..."``; ``only_some`` names fields only HEAD has."""
    out: dict[str, tuple[str, bool]] = {}
    for line in table:
        kind, *names = line.split()
        for name in names:
            out[name] = (kind, name not in only_some)
    return out


_HEAD_ONLY = ("truncate", "shift", "_debug_render_only", "logprobs", "top_logprobs", "dimensions")
#: The request structs of the model routes, every field (api/types.go: v0.11.4 lines 45-93,
#: 96-123, 352-367, 380-393; HEAD lines 62-130, 133-180, 599-618, 631-644).  Fields only
#: HEAD has are judged only on values both versions take (v0.11.4 ignores their keys).
#: ``messages``, ``images``, ``tools``, ``think`` have decoders of their own (``Message``,
#: ``ImageData``, ``ThinkValue``...): never judged.
REQUEST_STRUCTS: dict[str, GoStruct] = {
    "/api/generate": GoStruct("api.GenerateRequest", _fields(
        "string model prompt suffix system template", "ints context", "bool stream raw", "raw format",
        "duration keep_alive", "opaque images think", "map options",
        "bool truncate shift _debug_render_only logprobs", "int top_logprobs", only_some=_HEAD_ONLY,
    )),
    "/api/chat": GoStruct("api.ChatRequest", _fields(
        "string model", "messages messages", "bool stream", "raw format", "duration keep_alive",
        "opaque tools think", "map options",
        "bool truncate shift _debug_render_only logprobs", "int top_logprobs", only_some=_HEAD_ONLY,
    )),
    "/api/embed": GoStruct("api.EmbedRequest", _fields(
        "string model", "any input", "duration keep_alive", "bool truncate", "int dimensions", "map options",
        only_some=("dimensions",),
    )),
    "/api/embeddings": GoStruct("api.EmbeddingRequest", _fields(
        "string model prompt", "duration keep_alive", "map options",
    )),
}
#: Each of those handlers' answer to an empty body (``io.EOF``): server/routes.go at v0.11.4
#: lines 141-143, 453-458, 591-593, 1511-1513; HEAD 248-250, 798-802, 1044-1046, 2444-2446.
MISSING_BODY = "missing request body"


def _body_refusal(path: str, body: bytes, shared: FirstValue | None) -> Refusal | None:
    """The 400 a model route's handler gives a body Go's decoder refuses, before it looks at the model.

    ``c.ShouldBindJSON(&req)`` (gin's ``json.NewDecoder(body).Decode``) is each
    handler's first step; any error is ``c.AbortWithStatusJSON(400,
    gin.H{"error": err.Error()})`` (lines above): Go's own words
    (:func:`~.gojson.decode_error`), in gin's JSON (``json.Marshal``: ``<``,
    ``>`` and ``&`` escaped, no newline).  Only the native routes: the
    ``/v1/`` ones decode in a middleware that HEAD puts behind a cloud check.
    """
    struct = REQUEST_STRUCTS.get(path)
    if struct is None:
        return None
    message = decode_error(body, struct, shared)
    if message is None:
        return None
    if message == goscan.EOF:
        message = MISSING_BODY
    return Refusal(400, go_json({"error": message}), b"application/json; charset=utf-8")


def go_quote(text: str) -> str:
    """``text`` as Go's ``%q`` writes it, for the texts where JSON's escapes and Go's agree."""
    return json.dumps(text, ensure_ascii=False)


def go_json(value: Any) -> bytes:
    """``value`` as Go's ``json.Marshal`` writes it (HTML characters and U+2028/9 escaped, no spaces)."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    for char, escape in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(char, escape)
    return text.encode("utf-8", "surrogatepass")


def refuse(asked: Asked, origins: Origins) -> Refusal | None:
    """What Ollama answers at once, before any handler runs a model, or None.

    In the order of gin's handler chain (server/routes.go:1246-1251 at
    v0.11.4, 1869-1874 at HEAD): the CORS check first (403, empty body:
    :class:`~.cors.Origins`), on every route, known or not; then the router
    (404 or 405: :func:`_route_refusal`); then the handler's decode of the
    body (400: :func:`_body_refusal`).  Past the CORS check, an allowed
    cross-origin request's answer carries ``Vary: Origin`` and
    ``Access-Control-Allow-Origin`` (gin-contrib/cors ``handleNormal``, config.go:93-98; ``*``
    alone when every origin is allowed, utils.go ``generateNormalHeaders``).
    """
    refusal = None if asked.declared else _route_refusal(asked.method, asked.path)
    if origins.refuses(asked.origin, asked.hosts):
        # gin sets a 405's Allow before the chain runs (gin.go:663), so the 403 carries it too.
        allow = refusal.headers if refusal is not None and refusal.status == 405 else ()
        return Refusal(403, headers=allow, reason="origin")
    if refusal is None and asked.method == "POST":
        refusal = _body_refusal(asked.path, asked.body, asked.shared)
    if refusal is None or not asked.origin:
        return refusal
    if any(asked.origin in (f"http://{h}", f"https://{h}") for h in asked.hosts):
        return refusal
    if origins.every:
        cors: tuple[tuple[bytes, bytes], ...] = ((b"access-control-allow-origin", b"*"),)
    else:
        cors = ((b"vary", b"Origin"), (b"access-control-allow-origin", asked.origin.encode("utf-8", "surrogateescape")))
    return attrs.evolve(refusal, headers=(*cors, *refusal.headers))


# -- failures ----------------------------------------------------------------------

#: Prefixes of Ollama's own runner and memory failures (see the module docstring for the commits).
GPU_FAILURE_PREFIXES: tuple[str, ...] = (
    # The runner process died or is gone.
    "llama runner process has terminated",  # v0.12.0 llm/server.go:1261
    "llama runner process no longer running",  # v0.12.0 llm/server.go:1173, 1277
    "llama-server process has terminated",  # HEAD llm/llama_server.go:1306-1325
    "llama-server process no longer running",  # HEAD llm/llama_server.go:1198, 1341
    "model runner has unexpectedly stopped",  # HEAD llm/llama_server.go:1642-1644, 1936-1938; v0.12.0 llm/server.go:1460
    "an error was encountered while running the model",  # HEAD llm/llama_server.go:1766, 2075; v0.12.0 llm/server.go:1537
    "do embedding request:",  # the runner's port is gone: HEAD llm/llama_server.go:2371; v0.12.0 llm/server.go:1588
    "unexpected server status:",  # the runner is not ready: HEAD llm/llama_server.go:1550, 1907, 2348; v0.12.0 llm/server.go:1438, 1572
    "llama-server error:",  # the runner's health check failed: HEAD llm/llama_server.go:1250
    # The runner could not start or load the model.
    "timed out waiting for llama runner to start",  # v0.12.0 llm/server.go:1259, 1270
    "timed out waiting for llama-server to start",  # HEAD llm/llama_server.go:1302, 1336
    "error starting runner:",  # v0.12.0 llm/server.go:407
    "error starting llama-server:",  # HEAD llm/llama_server.go:969
    "llama-server startup failed",  # HEAD llm/llama_server.go:1059, 1096, 1101
    # Not enough (GPU) memory to load.
    "llama-server reported out-of-memory during startup",  # HEAD llm/llama_server.go:1372, 1375
    "unable to load full model on GPU",  # ErrLoadRequiredFull: HEAD llm/server.go:20; v0.12.0 llm/server.go:497
    "model requires more system memory",  # v0.12.0 llm/server.go:540, 957
    "failed to allocate memory for model",  # v0.12.0 llm/server.go:591
    "memory layout cannot be allocated",  # v0.12.0 llm/server.go:801, 811
    "failed to commit memory for model",  # v0.12.0 llm/server.go:834
)

#: llama.cpp's own words when ``llama_decode`` fails on the device (``update_slots``, server.cpp), which
#: HEAD's llama-server runner relays with their status: ``normalizeEmbeddingError`` keeps any message
#: that is not about the input's length (HEAD llm/llama_server.go:2380-2382, 2435-2447).
COMPUTE_ERROR = "Compute error."

#: Ollama's ``outOfMemorySubstrings`` (HEAD llm/status.go:85-96): a message containing one, in any case
#: (``IsOutOfMemoryMessage``, llm/status.go:116-124), is a runtime OOM to Ollama, which then expires its
#: loaded runners (server/sched.go:1632-1636).
OUT_OF_MEMORY_SUBSTRINGS: tuple[str, ...] = (
    "out of memory",
    "out of device memory",
    "cudamalloc failed",
    "hipmalloc failed",
    "failed to allocate",
    "allocation failed",
    "not enough memory",
    "insufficient memory",
    "vk_error_out_of_device_memory",
    "erroroutofmemory",
)

#: Statuses such an error comes with (500; 400 from HEAD's /api/embed, see above).
GPU_FAILURE_STATUSES = frozenset({400, 500})

#: ``ErrMaxQueue`` (server/sched.go): the whole message of Ollama's 503 for a full queue.
BUSY_MESSAGE = "server busy, please try again.  maximum pending requests exceeded"


def error_message(body: bytes) -> str | None:
    """The message of an Ollama error body, from its JSON structure only, or None.

    ``{"error": "msg"}`` (Ollama) or ``{"error": {"message": "msg", ...}}``
    (its OpenAI-compatible routes); anything else (not JSON, other keys, a
    message that is not a string) has no message.
    """
    document = json_object(body)
    if document is None:
        return None
    error = document.get("error")
    if isinstance(error, dict):
        error = error.get("message")
    return error if isinstance(error, str) else None


def is_gpu_failure(status: int, body: bytes) -> bool:
    """True when Ollama says its runner or GPU memory failed, in its own words (see the module docstring):
    a prefix at the very start of its message, llama.cpp's whole ``Compute error.``, or one of
    Ollama's out-of-memory substrings."""
    if status not in GPU_FAILURE_STATUSES:
        return False
    message = error_message(body)
    if message is None:
        return False
    if message.startswith(GPU_FAILURE_PREFIXES) or message == COMPUTE_ERROR:
        return True
    if status < 500:
        # A 400 is the caller's unless a prefix says otherwise: a substring may be its input, quoted.
        return False
    lowered = message.lower()
    return any(needle in lowered for needle in OUT_OF_MEMORY_SUBSTRINGS)


def judge(status: int, body: bytes) -> str:
    """What an Ollama answer means: ``gpu`` for its runner and memory failures, ``busy``
    for its full queue, ``caller`` for any other 4xx, ``upstream`` for any other 5xx."""
    if status < 400:
        return OK
    if is_gpu_failure(status, body):
        return GPU
    if status == 503 and error_message(body) == BUSY_MESSAGE:
        return BUSY
    return CALLER if status < 500 else UPSTREAM


# -- model list --------------------------------------------------------------------


def parse_models(body: bytes) -> tuple[str, ...]:
    """The names in ``/api/tags``'s answer ``{"models": [{"name": ...}, ...]}`` (``api.ListResponse``)."""
    return listed_names(body, "models", "name", "an Ollama")


# -- probes ------------------------------------------------------------------------


def minimal_call(kind: ModelCall) -> MinimalCall | None:
    """``(method, path, JSON body)`` of the smallest call of ``kind``'s kind, or None for other routes.

    Embeddings embed one short text.  Ollama's ``/api/generate`` and
    ``/api/chat`` load the model with an empty prompt / no messages and
    answer at once (``server/routes.go``: "load the model"), which is the
    step a GPU failure breaks; the OpenAI-compatible routes have no such
    form, so they generate one token.  A request whose own input broke its
    call (a huge context, a bad option) is not reproduced by such a probe,
    which is how the proxy tells "the GPU is down" from "this request is wrong".
    """
    model = kind.model
    path = kind.path
    if path == "/api/embed":
        return "POST", path, {"model": model, "input": PROBE_TEXT}
    if path == "/api/embeddings":
        return "POST", path, {"model": model, "prompt": PROBE_TEXT}
    if path == "/api/generate":
        return "POST", path, {"model": model, "prompt": "", "stream": False}
    if path == "/api/chat":
        return "POST", path, {"model": model, "messages": [], "stream": False}
    return openai_call(kind)


SERVER = Server(
    api="ollama",
    routes=ROUTES,
    judge=judge,
    health_path="/api/version",
    models_path="/api/tags",
    parse_models=parse_models,
    minimal_call=minimal_call,
    embed_shape="ollama",
    embed_path="/api/embed",
    error_shape=error_shape,
    model_loading_paths=MODEL_LOADING_PATHS,
    is_unload=is_unload,
    refuse=refuse,
)
