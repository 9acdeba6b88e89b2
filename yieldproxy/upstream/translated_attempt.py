"""An embedding attempt on a pool member that speaks another dialect: translated there and back.

An Ollama client's ``/api/embed`` may go to a member that has no such route
when the pool made it eligible (schedule/routing.py); what is sent and what
comes back: docs/pool.md ("A CPU copy for embeddings").  It stands in for
:class:`~yieldproxy.upstream.attempt.Attempt` in the proxy's attempt loop and
fails the same ways (:func:`~yieldproxy.upstream.attempt.raise_judged`), so
retries, outcomes, metrics and timeouts are the proxy's as ever.  Nothing
reaches the client before the member's whole answer is in and read (embedding
answers are small and never streamed), so the attempt timeout covers the whole
answer, and a failure is always retryable.
"""

from __future__ import annotations

from typing import Sequence

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure

from ..edge.h1client import H1Error, Response
from ..errors import error_body
from ..servers import Server
from .attempt import RetryableFailure, Upstream, UpstreamAnswer, describe_failure, failure_reason, raise_judged
from .translation import BackendError, EmbedRequest, backend_request, client_response, error_message, parse_response
from .verdict import Reason, status_reason

#: The header lines of the translated request (the caller's belong to the caller's server).
HEADERS = ((b"Content-Type", b"application/json"), (b"Accept", b"application/json"))
#: The most of a member's answer read: vectors for a large batch are a few MB.
MAX_ANSWER_BYTES = 64 * 1024 * 1024
_JSON = b"application/json; charset=utf-8"


class TranslatedAttempt:
    """One try of an embedding request on a member of another dialect (see the module docstring).

    The same surface as :class:`~yieldproxy.upstream.attempt.Attempt` for the proxy:
    ``run()`` fires with the status written to the client once the answer is
    complete; the client then has it all (it was written in one piece).
    """

    def __init__(
        self,
        clock: IReactorTime,
        upstream: Upstream,
        server: Server,
        request,
        wanted: EmbedRequest,
        own_model: str,
        error_shape: str,
        timeout: float,
        extra_headers: Sequence[tuple[bytes, bytes]] = (),
        *,
        member: str,
        relay_errors: bool = True,
        prefixed=None,
    ):
        self._clock = clock
        self._upstream = upstream
        self._server = server
        self._request = request
        self._wanted = wanted
        self._own_model = own_model
        #: The caller's error shape (``entry.api``).
        self._error_shape = error_shape
        self._timeout = timeout
        self._extra_headers = extra_headers
        self._member = member
        #: False: no error answer of the member is ever relayed (the ``[fallback]`` member's rule): each is a
        #: retryable failure, so the request goes back to its place in the lot.
        self._relay_errors = relay_errors
        #: The member (:class:`~yieldproxy.upstream.pool.member.Member`) when its server may be mounted under an API
        #: prefix: a 404 while its prefix is not known is asked once more under the other one.
        self._prefixed = prefixed
        #: The prefix asked after a 404 (None: the first call, or none asked).
        self._other_prefix: str | None = None
        self._parts: list[bytes] = []
        self._size = 0
        self._began = 0.0
        #: The member's name once it answered the caller (the request log names it: observe/requestlog.py).
        self.translated_by: str | None = None

    def run(self) -> Deferred:
        shape = self._server.embed_shape
        path, body = backend_request(self._wanted, shape, self._own_model)
        if shape != "ollama":  # an OpenAI base URL's path: the member's own route says where it is mounted
            path = self._server.embed_path
        self._body = body
        self._path = path
        self._began = self._clock.seconds()
        return self._send(path, self._timeout)

    def _send(self, path: str, timeout: float) -> Deferred:
        upstream = self._upstream
        self._size = 0
        d = upstream.client.request(
            b"POST", upstream.target(path.encode("ascii")), HEADERS, self._body, self, replayable=False,
        )
        # Nothing reaches the client before the whole answer is in: the timeout covers all of it.
        d.addTimeout(timeout, self._clock, onTimeoutCancel=self._timed_out)
        return d.addCallbacks(self._answered, self._failed)

    def _under_another_prefix(self) -> Deferred | None:
        """After a 404 on the first call: the same request once under the API prefix its member's server
        may be mounted under instead, while that prefix is not known (:meth:`Member.prefixes_after_404`,
        as twin verification asks), within what is left of the attempt timeout; None if there is none."""
        if self._prefixed is None or self._other_prefix is not None:
            return None
        others = self._prefixed.prefixes_after_404(self._path)
        if not others:
            return None
        self._other_prefix = others[0]
        path = self._prefixed.server.with_prefix(self._other_prefix).embed_path
        left = max(0.0, self._timeout - (self._clock.seconds() - self._began))
        return self._send(path, left)

    def _timed_out(self, result, seconds: float) -> Failure:
        return Failure(RetryableFailure(Reason.TIMEOUT, f"no answer from the upstream within {seconds:g}s"))

    def client_has_all(self) -> bool:
        return True

    def client_drained(self) -> Deferred:
        return succeed(None)

    # -- the member's answer (h1client's ResponseHandler) ----------------------------------

    def response_started(self, response: Response) -> None:
        pass

    def body_received(self, data: bytes) -> None:
        self._size += len(data)
        if self._size > MAX_ANSWER_BYTES:
            # Raised into the client, which aborts the connection.
            raise RetryableFailure(
                Reason.BAD_ANSWER, f"upstream {self._upstream.url}: answer longer than {MAX_ANSWER_BYTES} bytes"
            )
        self._parts.append(data)

    def _answered(self, response: Response) -> int:
        body = b"".join(self._parts)
        self._parts = []
        code = response.code
        url = self._upstream.url
        if code == 404:
            again = self._under_another_prefix()
            if again is not None:
                return again  # type: ignore[return-value]  # fires with the status written, as this does
        elif self._other_prefix is not None:
            self._prefixed.found_prefix(self._other_prefix)
        if 200 <= code < 300:
            try:
                result = parse_response(self._wanted, self._server.embed_shape, code, body)
            except BackendError as e:
                raise RetryableFailure(Reason.BAD_ANSWER, f"upstream {url}: {e.detail}") from None
            vectors = client_response(self._wanted, result, self._clock.seconds() - self._began)
            return self._write(200, b"OK", vectors)
        message = error_message(body)
        # The member's words in the caller's shape (an Ollama client cannot read OpenAI's error object);
        # its judge reads them as the member wrote them.
        answer = UpstreamAnswer(
            code, response.phrase, [(b"Content-Type", _JSON)], error_body(self._error_shape, code, message, "upstream_error")
        )
        if not self._relay_errors:
            raise RetryableFailure(status_reason(code), f"upstream {url} answered {code}: {message[:200]}", answer)
        raise_judged(code, self._server.judge(code, body), f"upstream {url} answered {code}: {message[:200]}", answer)
        return self._write(code, response.phrase, answer.body)

    def _write(self, code: int, phrase: bytes, body: bytes) -> int:
        request = self._request
        request.setResponseCode(code, phrase)
        headers = request.responseHeaders
        headers.setRawHeaders(b"content-type", [_JSON])
        headers.setRawHeaders(b"content-length", [b"%d" % len(body)])
        for name, value in self._extra_headers:
            headers.setRawHeaders(name, [value])
        request.write(body)
        self.translated_by = self._member
        return code

    def _failed(self, failure):
        self._parts = []
        error = failure.value
        if isinstance(error, H1Error):
            raise RetryableFailure(failure_reason(error), describe_failure(error, self._upstream.url))
        # The client left (CancelledError), no answer in time or too long (RetryableFailure), or a bug: as it is.
        return failure
