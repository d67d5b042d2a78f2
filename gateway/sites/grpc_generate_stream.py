"""Completions on one GenerateStream call per site (issue 74), part of the gRPC adapter
(grpc_client.py): protobuf types do not leave it.

A Generate call per request cost the gateway a gRPC read, a proto conversion and a task switch
per token, on one event loop; at a thousand streams that was most of the gateway's CPU. Here
every request to a site rides one call: a message up starts (and cancels) every request the
gateway had queued, and a message down brings every chunk the site had ready, which the call's
reader only files under its request. A request's reader takes all of its chunks filed since it
last ran and merges those of each choice into one: when the gateway lags, a client's chunks
carry several tokens (OpenAI's chunk format allows it) instead of the work per chunk piling up.

What a request's caller sees is what one Generate call gave: the same chunks (merged), the same
failures for the same status codes (SiteRejected, SiteBusy, SiteUnavailable, SiteFailed,
SiteTimedOut), and closing the iterator early cancels the request at the site. The call breaking
(the site gone, its connection lost) fails every request on it, as each call would have failed;
the next request opens a new call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence

import grpc

from fedllm_contract.proto import site_pb2, site_pb2_grpc
from gateway.sites.interface import SiteCallError, SiteChunk, TokenLogprob

_FINISH_FROM_PROTO = {
    site_pb2.FINISH_REASON_STOP: "stop",
    site_pb2.FINISH_REASON_LENGTH: "length",
    site_pb2.FINISH_REASON_CANCELLED: "cancelled",
    site_pb2.FINISH_REASON_RELEASED: "released",
}
# What a request's failure is, given the status code, its detail and whether it was accepted.
StatusError = Callable[[grpc.StatusCode, str, bool], SiteCallError]
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _logprobs(chunk: site_pb2.GenerateChunk) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(lp.logprob, tuple((t.token_id, None, t.logprob) for t in lp.top))
        for lp in chunk.logprobs
    )


def site_chunk(chunk: site_pb2.GenerateChunk) -> SiteChunk:
    if not chunk.finish_reason:  # the common chunk: tokens, no usage (read once per answer)
        logprobs = _logprobs(chunk) if chunk.logprobs else ()
        return SiteChunk(chunk.accepted, tuple(chunk.token_ids), chunk.text, None, 0, 0, 0,
                         chunk.index, logprobs)  # fmt: skip
    usage = chunk.usage
    return SiteChunk(
        accepted=chunk.accepted,
        token_ids=tuple(chunk.token_ids),
        text=chunk.text,
        finish_reason=_FINISH_FROM_PROTO.get(chunk.finish_reason),
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_prompt_tokens=usage.cached_prompt_tokens,
        index=chunk.index,
        logprobs=_logprobs(chunk) if chunk.logprobs else (),
    )


def merged_chunk(chunks: Sequence[site_pb2.GenerateChunk]) -> SiteChunk:
    """One choice's consecutive chunks as one: their tokens, text and logprobs in order, the
    last one's finish and usage."""
    if len(chunks) == 1:
        return site_chunk(chunks[0])
    last = chunks[-1]
    return SiteChunk(
        accepted=any(chunk.accepted for chunk in chunks),
        token_ids=tuple(token for chunk in chunks for token in chunk.token_ids),
        text="".join(chunk.text for chunk in chunks),
        finish_reason=_FINISH_FROM_PROTO.get(last.finish_reason),
        prompt_tokens=last.usage.prompt_tokens,
        completion_tokens=last.usage.completion_tokens,
        cached_prompt_tokens=last.usage.cached_prompt_tokens,
        index=last.index,
        logprobs=tuple(lp for chunk in chunks for lp in _logprobs(chunk)),
    )


def merged_chunks(chunks: list[site_pb2.GenerateChunk]) -> list[SiteChunk]:
    """A request's chunks as one per choice, each choice's in order (choices are independent
    streams: their relative order carries nothing)."""
    if len(chunks) == 1:
        return [site_chunk(chunks[0])]
    by_choice: dict[int, list[site_pb2.GenerateChunk]] = {}
    for chunk in chunks:
        by_choice.setdefault(chunk.index, []).append(chunk)
    return [merged_chunk(group) for group in by_choice.values()]


class _Mailbox:
    """One request's chunks filed by the call's reader, until the request's reader takes them."""

    __slots__ = ("accepted", "broken", "chunks", "expired", "failure", "holding", "last", "waiter")

    def __init__(self) -> None:
        self.chunks: list[site_pb2.GenerateChunk] = []
        self.accepted = False
        # A chunk with a finish (or the box's end) is filed: no interval holds it back.
        self.last = False
        self.failure: tuple[grpc.StatusCode, str] | None = None
        self.broken: tuple[grpc.StatusCode, str] | None = None
        self.expired = False
        self.waiter: asyncio.Future[None] | None = None
        # The reader holds its chunks for the stream interval: only an end wakes it sooner.
        self.holding = False

    @property
    def news(self) -> bool:
        return bool(self.chunks) or self.ended

    @property
    def ended(self) -> bool:
        return self.failure is not None or self.broken is not None or self.expired

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        while not self.news:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    async def hold(self, delay_s: float) -> None:
        """Lets `delay_s` pass unless the answer's last chunk (or its end) comes first."""
        loop = asyncio.get_running_loop()
        self.waiter = loop.create_future()
        self.holding = True
        timer = loop.call_later(delay_s, self.wake)
        try:
            await self.waiter
        finally:
            timer.cancel()
            self.waiter, self.holding = None, False

    def expire(self) -> None:
        self.expired = True
        self.wake()


class ChunkPacer:
    """The chunks a second this gateway process sends its clients, shared by the answers it
    streams from this project's sites (GATEWAY_STREAM_CHUNKS_PER_S; 0: no bound). Each chunk is
    a socket write and a pass through dispatch and the answer's format whatever its tokens, so
    at a thousand streams one gateway spent most of a core per token on chunks of one token.
    With n answers streaming, an answer's chunks come at most every n / budget seconds: a
    handful of answers stream as they come, many stream their tokens several to a chunk. Its
    first token and its finish are never held. `share`: the part of the budget a busy loop
    streams at now (gateway/sites/chunk_governor.py sets it; 1 when nothing does)."""

    __slots__ = ("chunks_per_s", "share", "streams")

    def __init__(self, chunks_per_s: float = 0.0) -> None:
        self.chunks_per_s = chunks_per_s
        self.share = 1.0
        self.streams = 0

    def interval_s(self) -> float:
        """The least time between two chunks of an answer now."""
        return self.streams / (self.chunks_per_s * self.share) if self.chunks_per_s else 0.0


class StreamCall:
    """One open GenerateStream call: its reader and writer tasks, and its requests' mailboxes."""

    def __init__(self, stub: site_pb2_grpc.SiteEngineStub, pacer: ChunkPacer) -> None:
        self._call = stub.GenerateStream()
        self._pacer = pacer
        self._boxes: dict[str, _Mailbox] = {}
        self._starts: list[site_pb2.GenerateRequest] = []
        self._cancels: list[str] = []
        self._send = asyncio.Event()
        self.broken: tuple[grpc.StatusCode, str] | None = None
        self._tasks = (asyncio.create_task(self._read()), asyncio.create_task(self._write()))

    def open(self, request: site_pb2.GenerateRequest) -> _Mailbox:
        """Files the request's chunks from now on and queues its start."""
        box = _Mailbox()
        if self.broken is not None:
            box.broken = self.broken
            return box
        self._boxes[request.request_id] = box
        self._starts.append(request)
        self._send.set()
        return box

    def close(self, request_id: str, cancel: bool) -> None:
        """Stops filing the request's chunks; `cancel`: the site drops it too."""
        self._boxes.pop(request_id, None)
        if cancel and self.broken is None:
            self._cancels.append(request_id)
            self._send.set()

    def shut(self) -> None:
        self._break(grpc.StatusCode.CANCELLED, "the gateway closed the call")
        self._call.cancel()

    async def _read(self) -> None:
        boxes = self._boxes
        try:
            async for batch in self._call:
                for chunk in batch.chunks:
                    box = boxes.get(chunk.request_id)
                    if box is None:
                        continue  # cancelled here while its chunks were on their way
                    if chunk.accepted:
                        box.accepted = True
                    box.chunks.append(chunk)
                    if chunk.finish_reason:
                        box.last = True
                    if box.waiter is not None and (box.last or not box.holding):
                        box.wake()
                for failure in batch.failures:
                    box = boxes.pop(failure.request_id, None)
                    if box is not None:
                        box.failure = (_CODES.get(failure.code, grpc.StatusCode.UNKNOWN),
                                       failure.message)  # fmt: skip
                        box.wake()
        except grpc.aio.AioRpcError as exc:
            self._break(exc.code(), exc.details() or exc.code().name)
            return
        self._break(grpc.StatusCode.UNAVAILABLE, "the site ended the generation stream")

    async def _write(self) -> None:
        try:
            while self.broken is None:
                await self._send.wait()
                self._send.clear()
                message = site_pb2.GenerateStreamRequest(
                    start=self._starts,
                    cancel=self._cancels,
                    chunk_interval_ms=self._pacer.interval_s() * 1000,
                )
                self._starts, self._cancels = [], []
                await self._call.write(message)
        except grpc.aio.AioRpcError as exc:
            self._break(exc.code(), exc.details() or exc.code().name)
        except asyncio.InvalidStateError:
            # The call ended (its reader says how); a write after that is refused this way.
            self._break(grpc.StatusCode.UNAVAILABLE, "the generation stream ended")

    def _break(self, code: grpc.StatusCode, detail: str) -> None:
        if self.broken is not None:
            return
        self.broken = (code, detail)
        for box in self._boxes.values():
            box.broken = self.broken
            box.wake()
        self._boxes.clear()
        self._send.set()  # the writer sees `broken` and ends


class GenerateStreams:
    """A site's generation traffic on one GenerateStream call at a time (GrpcSiteClient)."""

    def __init__(
        self,
        stub: site_pb2_grpc.SiteEngineStub,
        error: StatusError,
        pacer: ChunkPacer | None = None,
    ) -> None:
        self._stub = stub
        self._error = error
        self._pacer = pacer or ChunkPacer()
        self._call: StreamCall | None = None

    def _open_call(self) -> StreamCall:
        call = self._call
        if call is None or call.broken is not None:
            call = self._call = StreamCall(self._stub, self._pacer)
        return call

    async def generate(
        self, request: site_pb2.GenerateRequest, choices: int, timeout_s: float
    ) -> AsyncGenerator[SiteChunk, None]:
        """The request's chunks (a choice's chunks filed since the last turn merged into one)
        until every choice finished; closing early cancels it at the site."""
        call = self._open_call()
        box = call.open(request)
        loop = asyncio.get_running_loop()
        timer = loop.call_later(timeout_s, box.expire)
        pacer = self._pacer
        pacer.streams += 1
        sent_at: float | None = None  # when tokens last went out (the pacing counts from it)
        finished = 0
        try:
            while finished < choices:
                if not box.news:
                    await box.wait()
                if sent_at is not None and not (box.last or box.ended):
                    delay = sent_at + pacer.interval_s() - loop.time()
                    if delay > 0:
                        await box.hold(delay)
                if box.chunks:
                    chunks, box.chunks = box.chunks, []
                    for chunk in merged_chunks(chunks):
                        finished += chunk.finish_reason is not None
                        if chunk.token_ids:
                            sent_at = loop.time()
                        yield chunk
                    continue
                raise self._ended(box)
        finally:
            pacer.streams -= 1
            timer.cancel()
            # The site drops it unless it ended there (a failure, the call lost) or finished.
            gone = box.failure is not None or box.broken is not None
            call.close(request.request_id, cancel=finished < choices and not gone)

    def _ended(self, box: _Mailbox) -> SiteCallError:
        if box.failure is not None:
            return self._error(*box.failure, box.accepted)
        if box.broken is not None:
            return self._error(*box.broken, box.accepted)
        # The request's deadline passed (its site is told to drop it).
        return self._error(grpc.StatusCode.DEADLINE_EXCEEDED, "", box.accepted)

    async def close(self) -> None:
        if self._call is not None:
            self._call.shut()
            self._call = None
