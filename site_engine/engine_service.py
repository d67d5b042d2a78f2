"""Runs an engine on its own thread and exposes it to asyncio code (the gRPC server).

The engine is single-threaded by design: only the engine thread touches it. The asyncio side
sends commands (add, abort, release) through a queue and reads outputs through each request's
Answer (answer_stream.py), so a long model step never blocks the gRPC event loop, and gRPC
traffic never holds up the next step.

A step's outputs leave the engine thread as they came (StepOutputs' columns), in one call per
event loop (issue 66). There each row's token only joins its choice's pending tokens (issue 74);
detokenizing, checking stop strings and building an event happen when the answer's reader takes
them, once for everything pending. A stop string found then ends the choice there (its last
event) and asks the engine thread to abort it; every event of a request, from either thread,
goes through its loop in order, and none follows its last.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Protocol, TypeVar

from transformers import PreTrainedTokenizerBase

from site_engine.answer_stream import Answer, ChoiceStream, OneReader, Reader, StreamEvent
from site_engine.cache_event_journal import CacheEventJournal, Snapshot
from site_engine.detokenizer import IncrementalDetokenizer
from site_engine.engine.core.api import (
    Engine,
    EngineRequest,
    EngineStats,
    RequestRejected,
    StepOutputs,
)
from site_engine.engine.core.outputs import NO_TOKEN
from site_engine.engine.core.types import FinishReason, choice_seed
from site_engine.idle_work import IdleGate, IdleWork
from site_engine.step_rates import StepRates, StepWork

log = logging.getLogger(__name__)
T = TypeVar("T")
_IDLE_WAIT_S = 0.05


class LazyGraphs(Protocol):
    """An engine whose CUDA graphs are captured while it serves (PagedEngine, lazy graphs)."""

    @property
    def graphs_pending(self) -> bool: ...

    def capture_idle_graphs(self) -> int:
        """Captures some of them if nothing runs (the engine's thread); returns how many."""
        ...


class KvReserve(Protocol):
    """An engine that lends the top of its KV cache to its own fine-tuning while a job trains
    (PagedEngine with EngineConfig.finetune_reserve_on_demand)."""

    def reserve_kv(self, wanted_bytes: int) -> bool:
        """Whether the reserve is held now (False: still draining; ask again later)."""
        ...

    def release_kv_reserve(self) -> int: ...


@dataclass(frozen=True, slots=True)
class OnDemandReserve:
    """The fine-tuning reserve taken from the cache only while a job trains."""

    engine: KvReserve
    bytes: int


class DuplicateRequest(ValueError):
    """A request with this id is already queued or running at this site."""


class QueueFull(RuntimeError):
    """The site's waiting queue is at its bound; the caller should try another site."""


class EngineFailure(RuntimeError):
    """The engine step failed while this request was in it; the request did not complete."""


def choice_requests(request: EngineRequest, n: int) -> list[EngineRequest]:
    """The engine requests of a request's n choices: choice 0 keeps its id and seed, choice i
    is `<id>#i` with a seed of its own; several choices are never released for offload (they
    leave a site together or not at all)."""
    if n == 1:
        return [request]
    seed = request.sampling.seed
    return [
        replace(
            request,
            request_id=request.request_id if i == 0 else f"{request.request_id}#{i}",
            sampling=replace(request.sampling, seed=choice_seed(seed, i)),
            releasable=False,
        )
        for i in range(n)
    ]


@dataclass(frozen=True, slots=True)
class CumulativeKv:
    """KV use summed over every engine iteration since start, sampled after each iteration:
    the area under the KV-occupancy curve (MICO's cumulative KV consumption). Engine-agnostic:
    built from the stats every engine reports."""

    block_iterations: int = 0
    token_iterations: int = 0

    def after(self, stats: EngineStats) -> CumulativeKv:
        return CumulativeKv(
            self.block_iterations + stats.kv_blocks_used,
            self.token_iterations + stats.running_tokens,
        )


class EngineService:
    def __init__(
        self,
        engine: Engine,
        tokenizer: PreTrainedTokenizerBase,
        max_waiting: int = 1024,
        idle_work: tuple[IdleWork, IdleGate] | None = None,
        on_idle_unit: Callable[[float, bool], None] | None = None,
        graphs: LazyGraphs | None = None,
        reserve: OnDemandReserve | None = None,
    ) -> None:
        self.engine = engine
        # Fine-tuning's memory held only while a job trains (None: held from the start).
        self._reserve = reserve
        self._reserve_wanted = self._reserve_held = False
        # Lazy graphs (EngineConfig.lazy_graphs): captured while the engine idles; the engine
        # captures some between busy steps itself.
        self._graphs = graphs
        # Fine-tuning's units, run between steps when the gate allows (site_engine/idle_work.py),
        # and who hears of each (its seconds, whether requests were running: the metrics).
        self._idle = idle_work
        self._on_idle_unit = on_idle_unit
        self._idle_unit_end = time.monotonic()  # when the last unit ended (the gate's patience)
        self.idle_units = 0  # units run since start (tests and metrics read it)
        self.tokenizer = tokenizer
        self._max_waiting = max_waiting
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._streams: dict[str, ChoiceStream] = {}  # by engine request id (one per choice)
        # The event loops streams live on (usually one: the server's), replaced whole when one
        # more is seen, so the engine thread reads a consistent tuple.
        self._loops: tuple[asyncio.AbstractEventLoop, ...] = ()
        self._choices: dict[str, list[str]] = {}  # request id -> its choices' engine ids
        self._rates = StepRates()
        # Tokens generated since start (a Prometheus counter of the HTTP face reads it).
        self._generated_total = 0
        self._stats: EngineStats = engine.stats()
        # Replaced whole (never mutated) so the asyncio side reads a consistent pair.
        self._cumulative_kv = CumulativeKv()
        # Prefix-cache events for the load streams that ask for them (grpc_server.py).
        self.cache_journal = CacheEventJournal(engine.limits.kv_block_size)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=10)

    # ---- asyncio side ----------------------------------------------------------------------
    def open_answer(
        self, request: EngineRequest, reader: Reader, stop: tuple[str, ...] = (), n: int = 1
    ) -> tuple[Answer, list[EngineRequest]]:
        """The answer of a request with n choices, read by `reader` on the running loop, and
        the engine requests of its choices, for add()."""
        loop = asyncio.get_running_loop()
        if loop not in self._loops:
            self._loops = (*self._loops, loop)
        choices = choice_requests(request, n)
        detokenizers = [IncrementalDetokenizer(self.tokenizer, stop=stop) for _ in choices]
        answer = Answer.open(
            request.request_id, reader, len(request.prompt_token_ids), detokenizers
        )
        return answer, choices

    def add(self, answer: Answer, choices: list[EngineRequest]) -> Future[None]:
        """Queues the answer's choices in the engine (DuplicateRequest, QueueFull or the
        engine's refusal through the future); from then on its steps reach its reader."""
        return self._submit(lambda: self._add(answer, choices))

    def take(self, answer: Answer) -> list[StreamEvent]:
        """Loop thread: what the answer's choices have pending, an event each (the one a stop
        string ended is aborted in the engine)."""
        return answer.take(self._stop_choice)

    def end(self, answer: Answer) -> None:
        """Its reader went away before it finished (client gone, deadline, connection lost):
        the engine drops it and frees its memory."""
        if not answer.done:
            self._submit(lambda: self._abort(answer.request_id, FinishReason.CANCELLED))

    async def generate(
        self, request: EngineRequest, stop: tuple[str, ...] = (), n: int = 1
    ) -> AsyncIterator[StreamEvent]:
        """Queues the request (n choices of it) and yields its events until every choice has
        finished; abandoning the iterator cancels it. RequestRejected when the engine refuses
        it, at once or later (its constraint failed it: the choices still running end too);
        EngineFailure when the engine broke under it."""
        reader = OneReader()
        answer, choices = self.open_answer(request, reader, stop, n)
        await asyncio.wrap_future(self.add(answer, choices))
        try:
            yield StreamEvent(accepted=True, prompt_tokens=answer.prompt_tokens)
            while not answer.done:
                await reader.wait(answer)
                for event in self.take(answer):
                    if event.rejected:
                        raise RequestRejected(event.error or "the request was refused")
                    if event.error is not None:
                        raise EngineFailure(event.error)
                    yield event
        finally:
            self.end(answer)

    async def cancel(self, request_id: str) -> bool:
        result: bool = await self._call(lambda: self._abort(request_id, FinishReason.CANCELLED))
        return result

    async def release_queued(self, max_requests: int) -> list[EngineRequest]:
        result: list[EngineRequest] = await self._call(lambda: self._release(max_requests))
        return result

    def stats(self) -> EngineStats:
        return self._stats

    def served_adapters(self) -> tuple[str, ...]:
        """The LoRA adapters requests may name (read from the adapter directory, off the
        engine's thread: it touches no engine state)."""
        return self.engine.served_adapters()

    async def load_adapter(self, name: str, path: str) -> None:
        """Off the engine's thread and the event loop: reading an adapter may take seconds."""
        await asyncio.to_thread(self.engine.load_adapter, name, path)

    async def unload_adapter(self, name: str) -> None:
        """On the engine's thread, between steps: it checks the live requests' adapters."""
        await self._call(lambda: self.engine.unload_adapter(name))

    async def kv_room(self) -> int:
        """Idle memory first: what the KV cache could lend now (engine thread)."""
        result: int = await self._call(self.engine.kv_room)
        return result

    async def lend_kv(self, wanted_bytes: int) -> int:
        """On the engine's thread, between steps (the cache shrinks there)."""
        result: int = await self._call(lambda: self.engine.lend_kv(wanted_bytes))
        return result

    async def return_kv(self) -> int:
        result: int = await self._call(self.engine.return_kv)
        return result

    def cumulative_kv(self) -> CumulativeKv:
        return self._cumulative_kv

    def generated_tokens_total(self) -> int:
        return self._generated_total

    async def cache_snapshot(self) -> Snapshot:
        """Every cached block id with the journal position it is current at (engine thread)."""
        result: Snapshot = await self._call(self._take_snapshot)
        return result

    def decode_tokens_per_s(self) -> float:
        return self._rates.decode_tokens_per_s(time.monotonic())

    def prefill_tokens_per_s(self) -> float:
        return self._rates.prefill_tokens_per_s(time.monotonic())

    async def _call(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self._submit(fn))

    def _submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._commands.put((fn, future))
        return future

    # ---- engine thread ---------------------------------------------------------------------
    def _add(self, answer: Answer, choices: list[EngineRequest]) -> None:
        request_id = answer.request_id
        if request_id in self._choices or any(c.request_id in self._streams for c in choices):
            raise DuplicateRequest(f"request {request_id!r} is already at this site")
        # Counted here, on the engine thread, so a burst between two steps cannot overshoot;
        # by the queues' lengths, not the engine's whole stats, whose NumPy over the running
        # rows per request took a third of the engine thread at 256 req/s on an H200 (each such
        # call lets the GIL go: SiteSettings.switch_interval_us).
        waiting, _ = self.engine.queue_lengths()
        if waiting + len(choices) > self._max_waiting:
            raise QueueFull(f"the site's queue is full ({self._max_waiting} waiting requests)")
        added: list[str] = []
        try:
            for choice, stream in zip(choices, answer.choices, strict=True):
                self.engine.add_request(choice)
                added.append(choice.request_id)
                self._streams[choice.request_id] = stream
        except Exception:
            for engine_id in added:  # all choices or none
                self.engine.abort(engine_id, FinishReason.CANCELLED)
                del self._streams[engine_id]
            raise
        self._choices[request_id] = [choice.request_id for choice in choices]

    def _abort(self, request_id: str, reason: FinishReason) -> bool:
        aborted = False
        for engine_id in self._choices.pop(request_id, [request_id]):
            stream = self._streams.pop(engine_id, None)
            aborted = self.engine.abort(engine_id, reason) or aborted
            if stream is not None:
                stream.finish_soon(reason)
        return aborted

    def _take_snapshot(self) -> Snapshot:
        self._record_cache_events()
        journal = self.cache_journal
        return Snapshot(self.engine.cache_snapshot(), journal.position, journal.epoch)

    def _record_cache_events(self) -> None:
        events = self.engine.take_cache_events()
        if events:
            self.cache_journal.append(events)

    def _release(self, max_requests: int) -> list[EngineRequest]:
        released = self.engine.release_queued(max_requests)
        for request in released:
            self._choices.pop(request.request_id, None)
            stream = self._streams.pop(request.request_id, None)
            if stream is not None:
                stream.finish_soon(FinishReason.RELEASED)
        return released

    def _run(self) -> None:
        while not self._stopping.is_set():
            idle = self._idle is not None and self._idle[0].has_work()
            if self._reserve_wanted and not idle:
                self._release_reserve()
            graphs = self._graphs is not None and self._graphs.graphs_pending
            self._drain_commands(block=not (self.engine.has_unfinished() or idle or graphs))
            if graphs and not self.engine.has_unfinished():
                self._capture_idle_graphs()
            if idle:
                self._run_idle_unit()
            if self.engine.has_unfinished():
                began = time.monotonic()
                try:
                    outputs = self.engine.step()
                except Exception as exc:
                    log.exception("engine step failed; failing the requests it held")
                    self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
                    self._record_cache_events()
                    continue
                stats = self.engine.stats()
                prefilled = stats.prompt_tokens_computed - self._stats.prompt_tokens_computed
                # Published before the step's tokens leave: a client holding a token must find
                # the step in the site's load (its request running, its blocks taken), not the
                # load from before it, whatever the thread switch between the two.
                self._publish(stats)
                decoded = self._route(outputs)
                self._record_cache_events()
                ended = time.monotonic()
                self._rates.add(StepWork(ended, ended - began, decoded, decoded > 0, prefilled))
            else:
                self._publish(self.engine.stats())

    def _capture_idle_graphs(self) -> None:
        assert self._graphs is not None
        try:
            self._graphs.capture_idle_graphs()
        except Exception:
            log.exception("capturing CUDA graphs failed; the engine goes on eagerly")
            self._graphs = None

    def _run_idle_unit(self) -> None:
        """One unit of idle work if the gate allows it now (after the commands just taken:
        a request that arrived meanwhile is waiting, and the gate sees it)."""
        assert self._idle is not None
        work, gate = self._idle
        try:
            if self._reserve is not None and not self._hold_reserve():
                return  # the reserve's blocks still drain: the job waits for its memory
            held_s = time.monotonic() - self._idle_unit_end
            stats = self.engine.stats()
            if not gate.allows(stats, work.next_unit_s(), held_s):
                return
            # Alone: nothing in the engine at all (a request between waiting and running, or
            # waiting on its grammar, counts as in).
            seconds = work.run_unit(alone=not self.engine.has_unfinished())
            self._idle_unit_end = time.monotonic()
            if self._on_idle_unit is not None:
                self._on_idle_unit(seconds, stats.num_running > 0)
        except Exception:
            log.exception("idle work failed; the engine goes on")
        self.idle_units += 1

    def _hold_reserve(self) -> bool:
        assert self._reserve is not None
        held = self._reserve.engine.reserve_kv(self._reserve.bytes)
        if held and not self._reserve_held:
            log.info("a job trains: %d bytes of the KV cache lent to it", self._reserve.bytes)
        self._reserve_wanted, self._reserve_held = True, held
        return held

    def _release_reserve(self) -> None:
        assert self._reserve is not None
        try:
            returned = self._reserve.engine.release_kv_reserve()
        except Exception:
            log.exception("the fine-tuning reserve could not go back to the KV cache; retrying")
            return
        self._reserve_wanted = self._reserve_held = False
        if returned:
            log.info("no job trains: %d bytes of reserve back in the KV cache", returned)

    def _publish(self, stats: EngineStats) -> None:
        if stats.iterations > self._stats.iterations:
            self._cumulative_kv = self._cumulative_kv.after(stats)
        self._stats = stats

    def _drain_commands(self, block: bool) -> None:
        try:
            item = (
                self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as exc:  # handed to the awaiting coroutine
                    future.set_exception(exc)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _route(self, outputs: StepOutputs) -> int:
        """Hands a step's outputs to their streams' loops (one call a loop: `_deliver` runs
        there); returns the tokens it decoded. On this thread only what the engine thread owns:
        the streams of requests the engine finished leave `_streams`."""
        tokens = outputs.tokens
        self._generated_total += len(tokens) - tokens.count(NO_TOKEN)
        streams = list(map(self._streams.get, outputs.request_ids))
        ids = outputs.request_ids
        for index in outputs.finished:
            stream = streams[index]
            if stream is not None:
                del self._streams[ids[index]]
                self._forget_choice(ids[index], stream.index)
        if any(streams):
            loops = self._loops
            for loop in loops:
                mine = streams
                if len(loops) > 1:
                    mine = [s if s is not None and s.answer.loop is loop else None for s in streams]
                if loop.is_closed():
                    continue  # a loop whose streams are long gone (a finished test's, say)
                loop.call_soon_threadsafe(_deliver, outputs, mine)
        return outputs.decoded

    def _stop_choice(self, choice: ChoiceStream) -> None:
        """Loop thread: a stop string ended `choice`; the engine thread aborts it."""
        engine_id = engine_request_id(choice.answer.request_id, choice.index)
        self._submit(partial(self._stopped, engine_id))

    def _stopped(self, engine_id: str) -> None:
        """Engine thread: a stop string ended `engine_id` on its loop (its last event is out)."""
        stream = self._streams.pop(engine_id, None)
        if stream is None:
            return  # the engine finished it meanwhile
        self.engine.abort(engine_id, FinishReason.STOP)
        self._forget_choice(engine_id, stream.index)

    def _forget_choice(self, engine_id: str, index: int) -> None:
        """A choice finished: its request is gone from the site once every choice is."""
        request_id = engine_id if index == 0 else engine_id.rsplit("#", 1)[0]
        ids = self._choices.get(request_id)
        if ids is not None and not any(i in self._streams for i in ids):
            del self._choices[request_id]

    def _fail_all(self, message: str) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id, FinishReason.CANCELLED)
            stream.fail_soon(message)
        self._streams.clear()
        self._choices.clear()


def engine_request_id(request_id: str, index: int) -> str:
    """The engine's id of choice `index` of a request (choice_requests names them so)."""
    return request_id if index == 0 else f"{request_id}#{index}"


def _deliver(outputs: StepOutputs, streams: list[ChoiceStream | None]) -> None:
    """Loop thread: each row's token to its choice's pending list, its reader told once (the
    module docstring of answer_stream.py says why nothing more happens here)."""
    finished, logprobs, tokens = outputs.finished, outputs.logprobs, outputs.tokens
    for index, stream in enumerate(streams):
        if stream is None or stream.ended:
            continue
        reason, error = finished.get(index, (None, "")) if finished else (None, "")
        if reason is FinishReason.ERROR:
            # No answer: what came so far was no complete one. The choice is gone from the
            # engine; its reader ends the request's other choices.
            stream.fail(error, True)
            continue
        token = tokens[index]
        if token != NO_TOKEN:
            stream.tokens.append(token)
            if logprobs and index in logprobs:
                stream.logprobs.append(logprobs[index])
            stream.seen += 1
            if stream.seen == 1:
                # Known from the first token on; read then and at the end, not every step.
                stream.cached_prompt_tokens = outputs.cached_prompt_tokens(index)
        if reason is not None:
            stream.cached_prompt_tokens = outputs.cached_prompt_tokens(index)
            stream.end, stream.ended = reason, True
        answer = stream.answer
        if not answer.dirty:
            answer.dirty = True
            answer.reader.ready(answer)
