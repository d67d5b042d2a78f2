"""A request's answer between the engine's steps and whoever reads it (issue 74).

A step hands its tokens to the event loop once (EngineService._route); there, each row's token
is only appended to its choice's pending list, and the answer's reader is woken if it was
waiting. The reader takes everything pending when it runs: the tokens of one step, or of
several when it lags, detokenized in one call and sent as one event. So nothing on the loop
costs per token but an append, a reader that falls behind gets bigger events rather than more
of them, and the work per event (a gRPC message, a proto) is paid per reader turn, not per
token. vLLM v1 merges a request's outputs the same way when its consumer lags
(RequestOutputCollector); SGLang's detokenizer batches them per step.

Everything here runs on the answer's event loop, except where a method says otherwise.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from site_engine.detokenizer import IncrementalDetokenizer
from site_engine.engine.core.types import FinishReason, TokenLogprob


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One message of an answer; the first has accepted=True and no tokens.

    `index` says which choice the tokens are of (a request with n choices); completion_tokens
    counts that choice's tokens so far, except on a finishing event as `EngineService.generate`
    yields it, where it counts every choice's (the request's usage, once the last choice
    finishes)."""

    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    accepted: bool = False
    error: str | None = None
    # With error: the request's own fault (its constraint failed it), not the engine's.
    rejected: bool = False
    cached_prompt_tokens: int = 0
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()


class Reader(Protocol):
    """Who reads an answer: told when it has something to take, once per time it had none."""

    def ready(self, answer: Answer) -> None: ...


@dataclass(slots=True, eq=False)
class ChoiceStream:
    """One choice's tokens from the steps not taken yet, and where its text stands."""

    answer: Answer
    index: int
    detokenizer: IncrementalDetokenizer
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # Its end, once a step (or an abort) ended it: nothing is appended after.
    end: FinishReason | None = None
    error: str | None = None
    rejected: bool = False
    ended: bool = False
    # Its last event was taken: it takes nothing more.
    closed: bool = False
    seen: int = 0  # tokens a step gave it (taken or not)
    completion_tokens: int = 0  # tokens taken into events
    cached_prompt_tokens: int = 0

    def ready(self) -> None:
        answer = self.answer
        if not answer.dirty:
            answer.dirty = True
            answer.reader.ready(answer)

    def finish(self, reason: FinishReason) -> None:
        """Ends the choice with `reason` (no-op if it already ended)."""
        if not self.ended:
            self.end, self.ended = reason, True
            self.ready()

    def fail(self, message: str, rejected: bool = False) -> None:
        """Ends the choice with an error."""
        if not self.ended:
            self.error, self.rejected, self.ended = message, rejected, True
            self.ready()

    def finish_soon(self, reason: FinishReason) -> None:
        """Any thread: finish() on the answer's loop."""
        self.answer.loop.call_soon_threadsafe(self.finish, reason)

    def fail_soon(self, message: str) -> None:
        """Any thread: fail() on the answer's loop."""
        self.answer.loop.call_soon_threadsafe(self.fail, message, False)

    def take(self) -> tuple[StreamEvent | None, bool]:
        """The event of what is pending (None: nothing), and whether a stop string ended the
        choice just now (its engine request must then be aborted)."""
        if self.closed or not (self.tokens or self.ended):
            return None, False
        if self.error is not None:
            self.closed = True
            event = StreamEvent(
                error=self.error,
                rejected=self.rejected,
                prompt_tokens=self.answer.prompt_tokens,
                completion_tokens=self.completion_tokens,
                index=self.index,
            )
            return event, False
        tokens, logprobs = self.tokens, self.logprobs
        self.tokens, self.logprobs = [], []
        detokenizer, stopped = self.detokenizer, False
        text, taken = detokenizer.push_until_stop(tokens)
        if taken < len(tokens) or (detokenizer.stopped and not self.ended):
            # A stop string: the answer ends at the token that completed it.
            del tokens[taken:], logprobs[taken:]
            stopped = not self.ended
            self.end, self.ended = FinishReason.STOP, True
        self.completion_tokens += len(tokens)
        if self.ended:
            self.closed = True
            text += detokenizer.flush()
        event = StreamEvent(
            token_ids=tuple(tokens),
            text=text,
            finish_reason=self.end,
            prompt_tokens=self.answer.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_prompt_tokens=self.cached_prompt_tokens,
            index=self.index,
            logprobs=tuple(logprobs),
        )
        return event, stopped


@dataclass(slots=True, eq=False)
class Answer:
    """One request's choices, as its reader takes them."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    reader: Reader
    prompt_tokens: int
    choices: list[ChoiceStream] = field(default_factory=list)
    # Something is pending and the reader was told (it is told again only after it took).
    dirty: bool = False
    # Each choice's tokens as last taken: a finishing event carries their sum (the usage).
    choice_tokens: list[int] = field(default_factory=list)
    # When its tokens last went to its reader (loop time; None: none yet), for a reader that
    # paces them (grpc_generate_stream.py).
    sent_at: float | None = None

    @classmethod
    def open(
        cls,
        request_id: str,
        reader: Reader,
        prompt_tokens: int,
        detokenizers: list[IncrementalDetokenizer],
    ) -> Answer:
        answer = cls(request_id, asyncio.get_running_loop(), reader, prompt_tokens)
        answer.choices = [ChoiceStream(answer, i, d) for i, d in enumerate(detokenizers)]
        answer.choice_tokens = [0] * len(detokenizers)
        return answer

    @property
    def done(self) -> bool:
        """Every choice's last event was taken."""
        return all(choice.closed for choice in self.choices)

    @property
    def ending(self) -> bool:
        """A choice's end waits to be taken (no pacing holds it back)."""
        return any(choice.ended and not choice.closed for choice in self.choices)

    def take(self, stopped: Callable[[ChoiceStream], None]) -> list[StreamEvent]:
        """What every choice has pending, an event each; `stopped(choice)` for a choice a stop
        string ended. A finishing event counts every choice's tokens (the request's usage)."""
        self.dirty = False
        events = []
        for choice in self.choices:
            event, stop = choice.take()
            if event is None:
                continue
            if stop:
                stopped(choice)
            self.choice_tokens[choice.index] = event.completion_tokens
            if event.finish_reason is not None:
                event = _with_completion_tokens(event, sum(self.choice_tokens))
            events.append(event)
        return events


def _with_completion_tokens(event: StreamEvent, tokens: int) -> StreamEvent:
    if event.completion_tokens == tokens:
        return event
    return StreamEvent(
        token_ids=event.token_ids,
        text=event.text,
        finish_reason=event.finish_reason,
        prompt_tokens=event.prompt_tokens,
        completion_tokens=tokens,
        cached_prompt_tokens=event.cached_prompt_tokens,
        index=event.index,
        logprobs=event.logprobs,
    )


@dataclass(slots=True, eq=False)
class OneReader:
    """The reader of one answer, awaiting it (EngineService.generate)."""

    waiter: asyncio.Future[None] | None = None

    def ready(self, answer: Answer) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, answer: Answer) -> None:
        """Returns once the answer has something to take."""
        while not answer.dirty:
            self.waiter = answer.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
