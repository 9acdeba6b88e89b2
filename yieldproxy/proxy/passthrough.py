"""Routes that never park: one attempt on one member, failures reported as they are.

In a pool the request goes to one member (:meth:`Scheduler.passthrough_member`);
the model lists (``GET /api/tags``, ``/v1/models``) are the union of every
member's that serves the route.
"""

from __future__ import annotations

from typing import Any

import attrs
from twisted.internet.defer import CancelledError
from twisted.internet.interfaces import IReactorTime

from ..config import Config
from ..schedule.scheduler import Scheduler
from ..upstream.attempt import Attempt, ClientBuffers, ClientTooSlow, RelayBroken, RetryableFailure
from ..upstream.pool.lists import UNION_PATHS, union_list
from ..upstream.pool.member import Member
from ..upstream.served import MANAGEMENT_PATHS
from ..upstream.verdict import gateway_status
from .calls import body_for, managed
from .facts import RequestFacts
from .outcome import Outcomes
from .target import Target


@attrs.define(eq=False)
class Passthrough:
    """Serves a passthrough request to its end, its outcome said on its facts and written once."""

    _clock: IReactorTime
    _config: Config
    _scheduler: Scheduler
    _outcomes: Outcomes
    #: Answers waiting in memory for slow clients (proxy.slow_client_buffer_*).
    _buffers: ClientBuffers

    async def run(self, request: Any, facts: RequestFacts, target: Target, body: bytes, api: str, model: str | None):
        """The request's life: its outcome is written once, here, however it ends."""
        facts.attempts = 1
        try:
            method = request.method.decode("latin-1")
            if method == "GET" and target.path in UNION_PATHS:
                members = self._scheduler.members_serving(method, target.path)
                if len(members) > 1:
                    return await self._union(request, facts, target, api, members)
            return await self._one(request, facts, method, target, body, api, model)
        except CancelledError:
            facts.gone()
            raise
        finally:
            self._outcomes.close(request, facts)

    async def _one(
        self, request: Any, facts: RequestFacts, method: str, target: Target, body: bytes, api: str, model: str | None
    ):
        """One attempt on the member that takes the route."""
        member = self._scheduler.passthrough_member(method, target.path, model)
        facts.served_by = member.log_name
        sent = body_for(member, model, body)
        upstream = self._config.upstream
        attempt = Attempt(
            self._clock, member.upstream, request, sent, upstream.attempt_timeout_seconds, retry_statuses=False,
            buffers=self._buffers, target=target.raw, stall_timeout=upstream.stall_timeout_seconds,
        )
        try:
            status = await attempt.run()
        except RetryableFailure as failure:
            # Reported for outage detection; nobody waits on the verdict.
            member.health.report(failure.reason)
            return self._outcomes.refuse(
                request, facts, api, gateway_status(failure.reason), "upstream_error", failure.detail, attempts=1
            )
        except RelayBroken as broken:
            return await self._outcomes.broken(request, facts, api, broken, 1)
        except ClientTooSlow as slow:
            return await self._outcomes.drop_slow_client(request, facts, slow, 1)
        member.health.report(None)
        if 200 <= status < 300 and target.path in MANAGEMENT_PATHS:
            managed(member, target.path, sent)
        if not attempt.client_has_all():
            await attempt.client_drained()
        facts.say(status, "ok", 1)
        return None

    async def _union(self, request: Any, facts: RequestFacts, target: Target, api: str, members: list[Member]):
        """``GET /api/tags`` or ``/v1/models`` of a pool: every member's list, each model once."""
        answer = await union_list(members, target.path, timeout=self._config.upstream.health_timeout_seconds)
        if answer is None:
            return self._outcomes.refuse(
                request, facts, api, 502, "upstream_error",
                f"no upstream of the pool answered {target.path}", attempts=len(members),
            )
        request.setResponseCode(200)
        request.responseHeaders.setRawHeaders(b"content-type", [b"application/json; charset=utf-8"])
        request.responseHeaders.setRawHeaders(b"content-length", [b"%d" % len(answer)])
        facts.say(200, "ok", len(members))
        return answer
