"""GenerateStream: a gateway's completions on one gRPC call (issue 74), part of the site's gRPC
adapter (protobuf types stay here and in grpc_server.py).

One Generate call per request cost the site a gRPC message, a proto and a task switch per
token, and the gateway as much again to read it: at a thousand streams that was most of both
processes' CPU. On this call the site answers with one message for everything its requests had
ready: a step's tokens in one message, several steps' when the gateway reads more slowly than the
engine steps (the writer takes what is pending only when the last message went out, so the
slower the reader, the bigger the messages, never the more of them). The chunks inside are
exactly the ones Generate streams, per request and in order; a request that fails gets a
GenerateFailure with the status code Generate would have ended with.

Requests arrive in batches too (a message up carries every start and cancel the gateway had
queued). A request is added to the engine without waiting for the last one's answer, and its
accepted chunk is sent once the engine took it, always before its first tokens: the engine
thread schedules the acceptance on the loop before it runs the step that could make tokens.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc

from fedllm_contract.proto import site_pb2
from site_engine.answer_stream import Answer, StreamEvent
from site_engine.engine.core.api import EngineRequest, RequestRejected
from site_engine.engine_service import DuplicateRequest, EngineService, QueueFull

log = logging.getLogger(__name__)

# A message down is cut after this many chunks: a reader far behind gets several messages, each
# well under the gateway's receive limit even with logprobs.
_MAX_CHUNKS = 2048
# A gateway's chunk interval is taken up to this (a longer one would only delay its answers).
_MAX_INTERVAL_S = 1.0

_REJECTED = grpc.StatusCode.INVALID_ARGUMENT
_REFUSAL_CODES: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (DuplicateRequest, grpc.StatusCode.ALREADY_EXISTS),
    (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),  # InvalidRequest, RequestRejected
)


def refusal_code(exc: Exception) -> grpc.StatusCode:
    """The status Generate ends with for a request the site refuses before it starts."""
    for kind, code in _REFUSAL_CODES:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


@dataclass(slots=True, eq=False)
class StreamCall:
    """One GenerateStream call's answers, and what its writer sends next. The reader of each
    answer (answer_stream.Reader): an answer with news joins `ready`."""

    answers: dict[str, Answer] = field(default_factory=dict)
    ready_answers: list[Answer] = field(default_factory=list)
    accepted: list[Answer] = field(default_factory=list)
    failures: list[tuple[str, grpc.StatusCode, str]] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    # The gateway's chunk interval (GenerateStreamRequest.chunk_interval_ms), in seconds.
    interval_s: float = 0.0

    def ready(self, answer: Answer) -> None:
        self.ready_answers.append(answer)
        self.wake.set()

    def fail(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
        self.failures.append((request_id, code, message))
        self.wake.set()

    def added(self, answer: Answer, future: Future[None]) -> None:
        """The engine's answer to adding `answer` (on the loop, before any step of it)."""
        exc = future.exception()
        if self.answers.get(answer.request_id) is not answer:
            return  # cancelled meanwhile: its end() aborted it in the engine already
        if exc is None:
            self.accepted.append(answer)
            self.wake.set()
            return
        del self.answers[answer.request_id]
        code = refusal_code(exc) if isinstance(exc, Exception) else grpc.StatusCode.INTERNAL
        self.fail(answer.request_id, code, str(exc))


def chunk_into(
    batch: site_pb2.GenerateStreamBatch,
    request_id: str,
    event: StreamEvent,
    finish: site_pb2.FinishReason.ValueType,
) -> None:
    """`event` as the chunk Generate would send (grpc_server._event_to_proto), added in place."""
    chunk = batch.chunks.add(request_id=request_id, token_ids=event.token_ids, text=event.text)
    if event.index:
        chunk.index = event.index
    for value in event.logprobs:
        entry = chunk.logprobs.add(logprob=value.logprob)
        for token_id, logprob in value.top:
            entry.top.add(token_id=token_id, logprob=logprob)
    if event.finish_reason is not None:
        chunk.finish_reason = finish
        chunk.usage.prompt_tokens = event.prompt_tokens
        chunk.usage.completion_tokens = event.completion_tokens
        chunk.usage.cached_prompt_tokens = event.cached_prompt_tokens


FinishCodes = Callable[[object], site_pb2.FinishReason.ValueType]


class StreamWriter:
    """Turns a call's pending news into messages down; one per call, on the call's loop."""

    def __init__(
        self,
        service: EngineService,
        call: StreamCall,
        finish_codes: Callable[[object], site_pb2.FinishReason.ValueType],
    ) -> None:
        self._service = service
        self._call = call
        self._finish_code = finish_codes
        self._timer: asyncio.TimerHandle | None = None

    def _due(self) -> None:
        self._timer = None
        self._call.wake.set()

    def batches(self) -> list[site_pb2.GenerateStreamBatch]:
        """Everything pending, as few messages as _MAX_CHUNKS allows (none: nothing new); an
        answer whose tokens went out less than the gateway's chunk interval ago waits (its
        first tokens and its end do not)."""
        call = self._call
        call.wake.clear()
        batch = site_pb2.GenerateStreamBatch()
        batches = [batch]
        for answer in call.accepted:
            batch.chunks.add(request_id=answer.request_id, accepted=True)
        call.accepted.clear()
        ready, call.ready_answers = call.ready_answers, []
        loop = asyncio.get_running_loop()
        now, interval = loop.time(), call.interval_s
        for answer in ready:
            if call.answers.get(answer.request_id) is not answer:
                continue  # cancelled or failed: nothing more is sent for it
            sent = answer.sent_at
            if sent is not None and now < sent + interval and not answer.ending:
                call.ready_answers.append(answer)  # still dirty: it is not told again
                continue
            if len(batch.chunks) >= _MAX_CHUNKS:
                batch = site_pb2.GenerateStreamBatch()
                batches.append(batch)
            self._take(answer, batch, now)
        if call.ready_answers and self._timer is None:
            # Held answers are looked at again a few times an interval, together.
            self._timer = loop.call_later(max(interval / 4, 0.002), self._due)
        for request_id, code, message in call.failures:
            batch.failures.add(request_id=request_id, code=code.value[0], message=message)
        call.failures.clear()
        return [b for b in batches if b.chunks or b.failures]

    def _take(self, answer: Answer, batch: site_pb2.GenerateStreamBatch, now: float) -> None:
        request_id = answer.request_id
        for event in self._service.take(answer):
            if event.token_ids:
                answer.sent_at = now
            if event.error is not None:
                # A constraint failed it (INVALID_ARGUMENT) or the engine broke under it: its
                # other choices end too, and nothing more is sent for it.
                code = (
                    grpc.StatusCode.INVALID_ARGUMENT if event.rejected else grpc.StatusCode.INTERNAL
                )
                del self._call.answers[request_id]
                self._service.end(answer)
                batch.failures.add(request_id=request_id, code=code.value[0], message=event.error)
                return
            chunk_into(batch, request_id, event, self._finish_code(event.finish_reason))
        if answer.done:
            del self._call.answers[request_id]


class GenerateStreamHandler:
    """The GenerateStream method of the site's servicer (grpc_server.SiteServicer)."""

    _service: EngineService

    def _to_engine_request(self, request: site_pb2.GenerateRequest) -> EngineRequest:
        raise NotImplementedError

    def _finish_to_proto(self, reason: object) -> site_pb2.FinishReason.ValueType:
        raise NotImplementedError

    async def GenerateStream(
        self,
        request_iterator: AsyncIterator[site_pb2.GenerateStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[site_pb2.GenerateStreamBatch]:
        call = StreamCall()
        writer = StreamWriter(self._service, call, self._finish_to_proto)
        reading = asyncio.create_task(self._read_requests(request_iterator, call))
        try:
            while not (reading.done() and not call.answers and not call.failures):
                if not call.wake.is_set():
                    waiting = asyncio.ensure_future(call.wake.wait())
                    await asyncio.wait((waiting, reading), return_when=asyncio.FIRST_COMPLETED)
                    waiting.cancel()
                for batch in writer.batches():
                    yield batch
        finally:
            reading.cancel()
            for answer in call.answers.values():
                self._service.end(answer)

    async def _read_requests(
        self, request_iterator: AsyncIterator[site_pb2.GenerateStreamRequest], call: StreamCall
    ) -> None:
        """Starts and cancels requests as their messages come, until the gateway stops sending."""
        loop = asyncio.get_running_loop()
        async for message in request_iterator:
            for request in message.start:
                self._start(request, call, loop)
            for request_id in message.cancel:
                answer = call.answers.pop(request_id, None)
                if answer is not None:
                    self._service.end(answer)
            call.interval_s = min(max(message.chunk_interval_ms / 1000, 0.0), _MAX_INTERVAL_S)

    def _start(
        self,
        request: site_pb2.GenerateRequest,
        call: StreamCall,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        request_id = request.request_id
        if request_id in call.answers:
            call.fail(request_id, grpc.StatusCode.ALREADY_EXISTS, "request id already on this call")
            return
        try:
            engine_request = self._to_engine_request(request)
        except (ValueError, RequestRejected) as exc:
            call.fail(request_id, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        stop = engine_request.sampling.stop
        answer, choices = self._service.open_answer(
            engine_request, call, stop, request.sampling.n or 1
        )
        call.answers[request_id] = answer
        added = self._service.add(answer, choices)
        # Called on the engine thread once the engine took it (or refused it), so the answer is
        # accepted on the loop before the step that could give it tokens is delivered there.
        added.add_done_callback(
            lambda future: loop.call_soon_threadsafe(call.added, answer, future)
        )
