"""One accepted request on its way through its sites: streaming its chunks to the caller, moving
it to another site when its site cannot take it (before it starts) or fails (mid-stream: the
answer continues there from the tokens already produced), keeping the sites' token ledgers,
bounding it by its deadline (and an answer without a client's length limit by its time:
gateway/dispatch/answer_time.py), and recording the outcome."""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from datetime import datetime

from gateway.db.models import RequestStatus, utcnow
from gateway.dispatch.accounting import (
    DispatchLimits,
    LengthFeedback,
    OutcomeRecorder,
    Placement,
)
from gateway.dispatch.answer_time import AnswerClock
from gateway.dispatch.continuation import ResumePoint, Splice, resume_point
from gateway.dispatch.request import AdmissionPart, PreparedCompletion
from gateway.errors import (
    GatewayError,
    Unauthenticated,
    invalid_request,
    request_timed_out,
    service_unavailable,
    upstream_failed,
)
from gateway.metrics import GatewayMetrics
from gateway.sites.interface import (
    GenerateParams,
    SiteBusy,
    SiteCallError,
    SiteChunk,
    SiteFailed,
    SiteRejected,
    SiteTimedOut,
    SiteUnavailable,
)
from gateway.sites.lease import SiteLease
from gateway.sites.registry import SiteState
from gateway.stores.request_log import NewSample, Outcome

log = logging.getLogger(__name__)
STOP_OR_LENGTH = ("stop", "length")
# How long a started answer waits for a healthy site to continue on, and how often it looks.
_CONTINUE_WAIT_S = 5.0
_CONTINUE_POLL_S = 0.25


@dataclass(frozen=True, slots=True)
class Continuation:
    """An answer moved mid-stream: from which site to which, after how many answer tokens."""

    from_site: str
    to_site: str
    after_tokens: int

    def as_json(self) -> dict[str, object]:
        return {"from": self.from_site, "to": self.to_site, "after_tokens": self.after_tokens}


@dataclass(slots=True, weakref_slot=True)
class Dispatch:
    """One accepted request on its way through its sites."""

    prepared: PreparedCompletion
    site: SiteState
    # Who routed it (another site when this one cannot go on), where its outcome is recorded,
    # the limits it runs under and the metrics it counts in.
    placement: Placement
    recorder: OutcomeRecorder
    limits: DispatchLimits
    metrics: GatewayMetrics
    attempts: int = 1
    # Answer tokens over every site (the client's usage); at the end, the sites' own counts.
    completion_tokens: int = 0
    # Prompt tokens the (last) site took from its prefix cache, as its final chunk says.
    cached_prompt_tokens: int = 0
    finish_reason: str | None = None
    first_token_at: datetime | None = None
    tried: set[str] = field(default_factory=set)
    # Sites that failed this request (unavailable, or broke mid-answer): it never goes back
    # there. A site that only released it (offload, drain) may take it again later.
    failed: set[str] = field(default_factory=set)
    # Monotonic seconds when the request was dispatched (prediction included): TTFT's origin,
    # and the start of its deadline (GATEWAY_REQUEST_TIMEOUT_S, over every site it tries).
    started_at: float = field(default_factory=time.monotonic)
    admission: AdmissionPart | None = None
    continuations: list[Continuation] = field(default_factory=list)
    # What the current site is asked for: the prepared params, or a continuation's.
    _params: GenerateParams | None = None
    # Each choice's answer so far: its token ids (every site's) and the text sent to the caller.
    _answer_ids: dict[int, list[int]] = field(default_factory=dict)
    _sent: dict[int, list[str]] = field(default_factory=dict)
    # Answer tokens the current site was given as part of its prompt (a continuation).
    _before: int = 0
    _splice: Splice | None = None
    # The caller's slot in the gateway's in-flight bound, freed when the request ends (or, if
    # its stream is never consumed, when the object goes away).
    slot: weakref.finalize[[], Dispatch] | None = None
    # The request's place in its site's counters, from its creation (right after routing: the
    # next decision of a burst must see it) to its end, moved with the request from site to
    # site. Released by a finalizer if the request is dropped before it streams.
    _lease: SiteLease = field(init=False)
    _unused: weakref.finalize[[], Dispatch] | None = None
    # Its stream has begun: the lease is the stream's to move and release from then on.
    _streaming: bool = False
    # What its outcome says if it is cancelled (its caller stopped reading or waiting for it).
    cancel_reason: str = "client went away"
    # Its key was revoked while it ran: the site was told to cancel it.
    _revoked: bool = False
    _cancelling: set[asyncio.Task[bool]] = field(default_factory=set)
    # Why the last site could not take it (said in the 503 when no site is left).
    _last_failure: str = ""
    # The answer length routing planned with: the ledger's charge counts down from it (fixed
    # per request; read once, not at every chunk).
    _answer_plan: int = 0
    # Choices not finished yet (n > 1: the request ends when every one has).
    _open_choices: set[int] = field(default_factory=set)
    # The time of an answer its client set no length limit to (gateway/dispatch/answer_time.py).
    _clock: AnswerClock | None = None
    # Told each completed request's answer length (per-adapter length correction); None: nobody.
    lengths: LengthFeedback | None = None

    def __post_init__(self) -> None:
        self._answer_plan = self.prepared.routing.answer_tokens
        n = self.prepared.params.options.n
        self._open_choices = set(range(n))
        self._answer_ids = {i: [] for i in range(n)}
        self._sent = {i: [] for i in range(n)}
        if self.prepared.open_ended:
            self._clock = AnswerClock(self.started_at + self.limits.open_answer_s)
        self._lease = SiteLease.take(self.site, self._planned_charge(self.params))
        # Admitted: its predicted work is an arrival of the model's (the scaling controller's
        # arrival rate), counted once however often it moves later.
        self.site.arrivals.add(len(self.params.prompt_token_ids), self._answer_plan)
        self._unused = weakref.finalize(self, self._lease.release)

    def abandon(self) -> None:
        """Gives the site's place back if the request has not begun to stream (it will not be:
        e.g. it could not be recorded); a stream gives its own back when it ends."""
        if not self._streaming:
            self._lease.release()

    def cancel_unstarted(self, reason: str) -> None:
        """Ends a recorded request whose stream never began and never will (a prompt of a list
        not reached: its client went away, or an earlier prompt failed): recorded cancelled with
        nothing generated, its key settled, its places given back. Nothing if it began: a
        stream ends itself."""
        if self._streaming:
            return
        self._streaming = True
        self._lease.release()
        self._settle()
        self.recorder.record_finished(
            self.prepared.request_id, self._outcome(RequestStatus.CANCELLED, error=reason)
        )
        if self.slot is not None:
            self.slot()

    @property
    def params(self) -> GenerateParams:
        return self._params or self.prepared.params

    async def events(self) -> AsyncIterator[SiteChunk]:
        """Yields chunks with tokens; the last one has finish_reason set. Text is what the
        caller gets: one uninterrupted answer, however many sites produced it.

        The outcome is queued for the request log before the iterator ends (written within
        GATEWAY_REQUEST_LOG_FLUSH_MS); a client that goes away mid-stream gets its request
        recorded as cancelled.
        """
        if self.admission is not None:
            self.admission.watch_revocation(self._stop_for_revocation)
        try:
            async for chunk in self._stream_with_failover():
                if chunk.text:
                    self._sent.setdefault(chunk.index, []).append(chunk.text)
                yield chunk
        except GatewayError as exc:
            self._settle()
            self.recorder.record_finished(
                self.prepared.request_id,
                self._outcome(RequestStatus.FAILED, error=exc.message),
            )
            raise
        except BaseException:  # GeneratorExit or CancelledError: the client went away
            self._settle()
            outcome = self._outcome(RequestStatus.CANCELLED, error=self.cancel_reason)
            self.recorder.record_finished(self.prepared.request_id, outcome)
            raise
        finally:
            if self.slot is not None:
                self.slot()
        self._settle()
        if self.lengths is not None:
            self.lengths.served(self.prepared, self.completion_tokens, self.finish_reason)
        self.recorder.record_finished(
            self.prepared.request_id, self._outcome(RequestStatus.COMPLETED), self._sample()
        )

    def _stop_for_revocation(self) -> None:
        """The key was revoked: the site cancels the request, whose stream then ends with an
        api_key_revoked error (see _observe)."""
        self._revoked = True
        task = asyncio.create_task(self.site.client.cancel(self.params.request_id))
        self._cancelling.add(task)
        task.add_done_callback(self._cancelling.discard)

    def _settle(self) -> None:
        """Charges the caller's key what the request really took: its prompt and the tokens
        generated, also when it failed or was cancelled."""
        if self.admission is not None:
            prompt = len(self.prepared.params.prompt_token_ids)
            self.admission.settle(prompt + self.completion_tokens)

    def _sample(self) -> NewSample | None:
        """A length sample for retraining, from answers that ended on their own or at max_tokens
        (those are censored: the true length is at least what was produced)."""
        if not self.limits.collect_samples or self.finish_reason not in STOP_OR_LENGTH:
            return None
        prepared = self.prepared
        return NewSample(
            model=prepared.model,
            prompt=prepared.prompt_text,
            prompt_tokens=len(prepared.params.prompt_token_ids),
            completion_tokens=self.completion_tokens,
            censored=self.finish_reason == "length",
            predicted_tokens=prepared.params.predicted_tokens,
        )

    def _outcome(self, status: RequestStatus, error: str | None = None) -> Outcome:
        """The request's final outcome; called once, when it ends, so it is counted here."""
        self.metrics.finished(
            self.site.name,
            self.prepared.model,
            status.value,
            (len(self.prepared.params.prompt_token_ids), self.completion_tokens),
            self.prepared.params.predicted_tokens,
        )
        return Outcome(
            status=status,
            site_id=self.site.site_id,
            attempts=self.attempts,
            completion_tokens=self.completion_tokens,
            finish_reason=self.finish_reason,
            error=error,
            first_token_at=self.first_token_at,
            continuations=[c.as_json() for c in self.continuations] or None,
        )

    async def _stream_with_failover(self) -> AsyncIterator[SiteChunk]:
        released_from: SiteState | None = None
        while True:
            if released_from is not None:
                self.recorder.record_offload(self.prepared.request_id, released_from, self.site)
                released_from = None
            self.tried.add(self.site.name)
            self._streaming = True
            # Counted on this attempt's site (the one routing placed it on, or the next),
            # with no await since the last site gave its place back.
            self._lease.move(self.site, self._planned_charge(self.params))
            try:
                generated = self.site.client.generate(self.params, self._time_left_s())
                chunks = generated if self._clock is None else self._clock.read(generated)
                async with aclosing(generated), aclosing(chunks):
                    async for site_chunk in chunks:
                        if site_chunk.finish_reason == "released":
                            released_from = self.site
                            break  # handed back before it started: place it elsewhere
                        chunk = self._observe(site_chunk)
                        self._recharge()
                        if chunk.token_ids or chunk.text or chunk.finish_reason:
                            yield chunk
                        if chunk.finish_reason is not None:
                            self._open_choices.discard(chunk.index)
                            if not self._open_choices:
                                return
                if self._clock is not None and self._clock.ran_out:
                    for index in sorted(self._open_choices):
                        yield self._out_of_time(index)
                    return
            except SiteUnavailable as exc:
                self._last_failure = str(exc)
                self.failed.add(self.site.name)
                if not isinstance(exc, SiteBusy):  # a full queue is no sign of ill health
                    self.site.mark_unhealthy(exc.detail)
                self.metrics.failovers.labels(self.site.name).inc()
                log.warning("%s; moving %s elsewhere", exc, self.prepared.request_id)
            except SiteRejected as exc:
                raise invalid_request(exc.detail) from exc
            except SiteTimedOut as exc:
                raise self._timed_out() from exc
            except SiteFailed as exc:
                self.failed.add(self.site.name)
                started = any(self._answer_ids.values())
                if not started and len(self._open_choices) == self.params.options.n:
                    # Accepted but not started (queued at the site) when the site broke: the
                    # caller has seen nothing, so the request simply goes elsewhere.
                    self.site.mark_unhealthy(exc.detail)
                    self.metrics.failovers.labels(self.site.name).inc()
                    log.warning("%s before any token; moving %s elsewhere", exc,
                                self.prepared.request_id)  # fmt: skip
                    self._move_elsewhere()
                    continue
                if (
                    len(self.continuations) >= self.limits.max_continuations
                    or self.params.options.n > 1
                ):
                    # Several choices are one answer each: they do not continue elsewhere.
                    raise upstream_failed(str(exc)) from exc
                # The site broke under a started answer (died, lost its connection, its engine
                # failed): the rest of the answer is generated elsewhere.
                self.site.mark_unhealthy(exc.detail)
                self.metrics.continuations.labels(self.site.name).inc()
                log.warning("%s; continuing %s elsewhere", exc, self.prepared.request_id)
                done = await self._continue_elsewhere(exc)
                if done is not None:
                    yield done
                    return
                continue
            finally:
                # This attempt's site, though a handler may already point self.site elsewhere.
                self._lease.release()
            self._move_elsewhere()

    def _time_left_s(self) -> float:
        """What is left of the request's deadline; a request past it ends (the site it was on
        saw the same deadline and cancelled it)."""
        left = self.started_at + self.limits.request_timeout_s - time.monotonic()
        if left <= 0:
            raise self._timed_out()
        return left

    def _timed_out(self) -> GatewayError:
        return request_timed_out(
            f"request {self.prepared.request_id} did not finish within "
            f"GATEWAY_REQUEST_TIMEOUT_S={self.limits.request_timeout_s:g}s"
        )

    def _recharge(self) -> None:
        """Keeps the site's outstanding-token ledger at prompt + predicted remaining answer."""
        self._lease.recharge(self._planned_charge(self.params))

    def _planned_charge(self, params: GenerateParams) -> int:
        remaining = max(self._answer_plan - self.completion_tokens, 0)
        return len(params.prompt_token_ids) + remaining

    def _observe(self, chunk: SiteChunk) -> SiteChunk:
        """Counts the site's chunk and returns it as the caller sees it: text joined across a
        continuation's seam; the finishing chunk with the usage over every site (the others'
        usage fields are the site's own: the answer's usage is read from the dispatch)."""
        if chunk.token_ids and self.first_token_at is None:
            self.first_token_at = utcnow()
            self.metrics.ttft_seconds.labels(self.site.name).observe(
                time.monotonic() - self.started_at
            )
        self._answer_ids.setdefault(chunk.index, []).extend(chunk.token_ids)
        self.completion_tokens += len(chunk.token_ids)
        text, finish_reason = chunk.text, chunk.finish_reason
        if self._splice is not None:
            text = self._splice.feed(text)
            if self._splice.stopped and finish_reason is None:
                finish_reason = "stop"  # a stop string across the seam: the site cannot see it
            elif finish_reason is not None:
                text += self._splice.flush()
        if finish_reason is not None:
            if chunk.finish_reason is not None:
                # The site's own count is authoritative (it includes tokens cut by a stop
                # string); a continuation's site counts only what it generated.
                self.completion_tokens = self._before + chunk.completion_tokens
                # Of the client's prompt: a continuation's site also had answer tokens cached.
                prompt = len(self.prepared.params.prompt_token_ids)
                self.cached_prompt_tokens = min(chunk.cached_prompt_tokens, prompt)
            self.finish_reason = finish_reason
            if finish_reason == "cancelled" and self._revoked:
                raise Unauthenticated(
                    "the API key of this request was revoked", code="api_key_revoked"
                )
            if finish_reason == "cancelled":
                raise upstream_failed(f"site {self.site.name} cancelled the request")
        if finish_reason is None and text is chunk.text:
            return chunk  # the common chunk, as the site sent it (usage is the dispatch's)
        return SiteChunk(  # not dataclasses.replace: this runs for every chunk
            accepted=chunk.accepted,
            token_ids=chunk.token_ids,
            text=text,
            finish_reason=finish_reason,
            prompt_tokens=len(self.prepared.params.prompt_token_ids),
            completion_tokens=self.completion_tokens,
            index=chunk.index,
            logprobs=chunk.logprobs,
        )

    async def _continue_elsewhere(self, failure: SiteCallError) -> SiteChunk | None:
        """Moves a started answer to another site: its prompt is the original prompt plus the
        answer tokens kept, it generates what max_tokens leaves, with the same sampling (a
        seeded sampler counts on from the kept tokens). Returns a final chunk instead when
        nothing is left to generate."""
        base = self.prepared.params
        point = self._resume_point(0)  # one choice: several do not continue elsewhere
        kept = len(point.kept_token_ids)
        self._answer_ids[0] = list(point.kept_token_ids)
        self.completion_tokens = kept
        left = base.max_tokens - kept
        if left <= 0:  # every token arrived, only the site's final chunk was lost
            self.finish_reason = "length"
            return SiteChunk(
                accepted=True,
                token_ids=(),
                text=point.carry,
                finish_reason="length",
                prompt_tokens=len(base.prompt_token_ids),
                completion_tokens=kept,
            )
        predicted = base.predicted_tokens
        params = replace(
            base,
            prompt_token_ids=base.prompt_token_ids + point.kept_token_ids,
            max_tokens=left,
            predicted_tokens=max(predicted - kept, 1) if predicted is not None else None,
            generated_before=kept,
        )
        next_site = await self._site_to_continue_on(params)
        if (
            next_site is not None
            and base.options.constraint is not None
            and "continue_constraint" not in next_site.client.capabilities
        ):
            # Its grammar would start over on the answer's second half: never a loose answer.
            raise upstream_failed(
                f"{failure} mid-stream, and site {next_site.name} cannot continue a "
                f"constrained answer (request {self.prepared.request_id})"
            )
        if next_site is None:
            raise service_unavailable(
                f"{failure} mid-stream, and no other site can continue request "
                f"{self.prepared.request_id} (tried: {', '.join(sorted(self.tried))})"
            )
        self.continuations.append(Continuation(self.site.name, next_site.name, kept))
        self._params, self._before = params, kept
        self._splice = Splice(base.options.stop, pending=point.carry)
        self.site = next_site
        self.attempts += 1
        return None

    def _resume_point(self, index: int) -> ResumePoint:
        """Where choice `index`'s answer stands: the tokens whose text is whole, and the text
        of them the caller has not been sent (held back by the site)."""
        return resume_point(
            self._answer_ids[index],
            "".join(self._sent[index]),
            lambda ids: self.placement.decode_answer(self.prepared.model, list(ids)),
        )

    def _out_of_time(self, index: int) -> SiteChunk:
        """The last chunk of choice `index` when its answer's time ran out: finish_reason
        "length", with the text its site held back (text that might have begun a stop
        string); the answer is billed the tokens that arrived."""
        self.finish_reason = "length"
        self._open_choices.discard(index)
        self.metrics.answers_out_of_time.labels(self.site.name).inc()
        return SiteChunk(
            accepted=True,
            token_ids=(),
            text=self._resume_point(index).carry,
            finish_reason="length",
            prompt_tokens=len(self.prepared.params.prompt_token_ids),
            completion_tokens=self.completion_tokens,
            index=index,
        )

    async def _site_to_continue_on(self, params: GenerateParams) -> SiteState | None:
        """A site for the rest of a started answer. When none is healthy right now (a burst of
        missed health checks can mark every site down at once), waits a little for one rather
        than cutting off an answer the client is already reading."""
        waited = 0.0
        routing = self.prepared.routing_for(params)
        while True:
            site = self.placement.reroute(self.prepared, self.failed, routing)
            if site is not None or waited >= min(_CONTINUE_WAIT_S, self._time_left_s()):
                return site
            await asyncio.sleep(_CONTINUE_POLL_S)
            waited += _CONTINUE_POLL_S

    def _move_elsewhere(self) -> None:
        """Places a request that has not started on its site (the site was unavailable or
        released it) on another site, with the params it had."""
        # Not back to the site it leaves (it released the request or failed), nor to any site
        # that failed it; a site that released it earlier may take it now.
        excluded = self.failed | {self.site.name}
        next_site = self.placement.reroute(
            self.prepared, excluded, self.prepared.routing_for(self.params)
        )
        if next_site is None:
            last = f"; last: {self._last_failure}" if self._last_failure else ""
            raise service_unavailable(
                f"no other site can take request {self.prepared.request_id} "
                f"(tried: {', '.join(sorted(self.tried))}{last})"
            )
        self.site = next_site
        self.attempts += 1
