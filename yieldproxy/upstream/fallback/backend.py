"""The fallback's embedding client: one embedding server in one API shape (Ollama's or OpenAI's)."""

from __future__ import annotations

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure

from ..attempt import Upstream
from ..control import backend_errors
from ..translation import BackendError, EmbedRequest, Embeddings, backend_request, parse_response
from ..verdict import Reason

#: The header lines of an embedding call.
_EMBED_HEADERS = ((b"Content-Type", b"application/json"), (b"Accept", b"application/json"))


class EmbedBackend:
    """An embedding server in one API shape, reached through an :class:`Upstream`'s client.

    The primary is reached through the proxy's own upstream (its pool, not the
    parking lot); the fallback through an Upstream of its own.
    """

    def __init__(
        self,
        clock: IReactorTime,
        upstream: Upstream,
        api: str,
        timeout: float,
        openai_prefix: str = "",
    ):
        self._clock = clock
        self._upstream = upstream
        self.api = api
        self._timeout = timeout
        #: The primary is addressed at its root, so its OpenAI routes need ``/v1``;
        #: the fallback's OpenAI URL is a base URL that already ends in it.
        self._openai_prefix = openai_prefix
        self.url = upstream.url

    def describe(self) -> str:
        return f"{self.url} ({self.api})"

    async def embed(self, request: EmbedRequest, model: str) -> Embeddings:
        """The vectors for ``request`` under the backend's name ``model``; :class:`BackendError` if none."""
        path, body = backend_request(request, self.api, model)
        if self.api == "openai":
            path = self._openai_prefix + path
        upstream = self._upstream
        d = upstream.client.request(
            b"POST", upstream.target(path.encode("ascii")), _EMBED_HEADERS, body, replayable=False
        )

        def timed_out(result, seconds):
            return Failure(BackendError(Reason.TIMEOUT, f"{self.url}: no answer within {seconds:g}s"))

        d.addTimeout(self._timeout, self._clock, onTimeoutCancel=timed_out)
        with backend_errors(self.url):
            response = await d
        return parse_response(request, self.api, response.code, response.body)

    def close(self) -> Deferred:
        return self._upstream.close()
