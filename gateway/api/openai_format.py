"""Turns a dispatch's site chunks into OpenAI completion and chat completion objects: one JSON
body, or SSE events."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec

from gateway.api.chat_schemas import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    FunctionDelta,
    ToolCallDelta,
)
from gateway.api.openai_errors import OpenAIError, error_envelope
from gateway.chat.result import collect_chat_completion
from gateway.chat.tool_calls import CallDelta, Part, ToolCallScanner
from gateway.completions.logprobs import (
    ChatLogprobs,
    TextOffsets,
    chat_logprobs,
    completion_logprobs,
)
from gateway.completions.result import (
    Completion,
    CompletionChoice,
    Usage,
    collect_completion,
    finish_reason,
    token_bytes,
    usage,
)
from gateway.completions.sampling_options import served_tier
from gateway.dispatch.request import PreparedCompletion
from gateway.dispatch.stream import Dispatch
from gateway.errors import GatewayError
from gateway.sites.interface import SiteChunk

__all__ = [
    "chat_completion_events",
    "collect_chat_completion",
    "collect_completion",
    "completion_events",
    "merged_completion",
    "prompt_list_events",
]


def _chunk(
    prepared: PreparedCompletion, choices: list[CompletionChoice], counts: Usage | None = None
) -> Completion:
    return Completion(
        prepared.request_id,
        "text_completion",
        prepared.created,
        prepared.served_model,
        choices,
        counts,
    )


def _event(payload: msgspec.Struct) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


# A text no answer holds, whose JSON string marks where a chunk's text goes in its event.
_MARK = "\x01fedllm-text\x01"
_MARK_JSON = msgspec.json.encode(_MARK)


class _TextEvents:
    """The events of an answer's common chunks (a choice's text, nothing else), as the bytes
    around the text, encoded once per choice, with the text's JSON string between them: the
    same bytes as encoding the chunk's object, without building and encoding it for every chunk
    (at a thousand streams, a few percent of the gateway's core)."""

    __slots__ = ("_build", "_frames")

    def __init__(self, build: Callable[[int, str], msgspec.Struct]) -> None:
        self._build = build
        self._frames: dict[int, tuple[bytes, bytes] | None] = {}

    def event(self, index: int, text: str) -> bytes:
        try:
            frame = self._frames[index]
        except KeyError:
            parts = _event(self._build(index, _MARK)).split(_MARK_JSON)
            frame = self._frames[index] = (parts[0], parts[1]) if len(parts) == 2 else None
        if frame is None:  # the mark was elsewhere too (an id or a model name holding it)
            return _event(self._build(index, text))
        return frame[0] + msgspec.json.encode(text) + frame[1]


@dataclass(slots=True)
class _LastWrite:
    """The end of a stream in one write: its last choice's finishing events, the usage event
    and [DONE] (each yield is a socket write to the client)."""

    choices: int
    tail: bytes = b""

    def holds(self, chunk: SiteChunk, events: bytes) -> bool:
        """Keeps `events` for the last write if they finish the stream's only choice."""
        if self.choices == 1 and chunk.finish_reason is not None:
            self.tail += events
            return True
        return False

    def add(self, events: bytes) -> None:
        self.tail += events

    def done(self) -> bytes:
        return self.tail + b"data: [DONE]\n\n"


@dataclass(slots=True)
class _CompletionStream:
    """Per choice: whether its echo went out, and where its text stands (logprobs offsets)."""

    started: set[int] = field(default_factory=set)
    offsets: dict[int, TextOffsets] = field(default_factory=dict)

    def choice(self, dispatch: Dispatch, chunk: SiteChunk) -> CompletionChoice:
        prepared = dispatch.prepared
        text = chunk.text
        if chunk.index not in self.started:
            self.started.add(chunk.index)
            text = (prepared.echo or "") + text
            self.offsets[chunk.index] = TextOffsets(len(prepared.echo or ""))
        logprobs = None
        if prepared.params.options.logprobs and chunk.logprobs:
            offsets = self.offsets[chunk.index]
            logprobs = completion_logprobs(
                chunk.token_ids, chunk.logprobs, token_bytes(dispatch), offsets
            )
        reason = finish_reason(chunk.finish_reason)
        return CompletionChoice(text, chunk.index, logprobs, reason)


async def completion_events(dispatch: Dispatch) -> AsyncIterator[bytes]:
    """SSE stream: one event per site chunk, an optional usage event, then [DONE].

    A failure after the stream started can no longer change the HTTP status, so it is sent as an
    error event (the shape OpenAI uses), followed by [DONE].
    """
    prepared = dispatch.prepared
    state = _CompletionStream()
    last = _LastWrite(prepared.params.options.n)
    plain = not prepared.params.options.logprobs
    texts = _TextEvents(lambda index, text: _chunk(prepared, [CompletionChoice(text, index)]))
    try:
        async for chunk in dispatch.events():
            if plain and chunk.finish_reason is None and chunk.index in state.started:
                yield texts.event(chunk.index, chunk.text)
                continue
            event = _event(_chunk(prepared, [state.choice(dispatch, chunk)]))
            if not last.holds(chunk, event):
                yield event
        if prepared.include_usage:
            last.add(_event(_chunk(prepared, [], usage(dispatch))))
    except (OpenAIError, GatewayError) as exc:
        last.add(_event(error_envelope(exc)))
    yield last.done()


def merged_completion(answers: list[Completion], n: int) -> Completion:
    """One completion of a list of prompts' answers: choices numbered prompt * n + choice,
    usage summed (OpenAI's shape for a list prompt)."""
    choices = [
        msgspec.structs.replace(choice, index=i * n + choice.index)
        for i, answer in enumerate(answers)
        for choice in answer.choices
    ]
    prompt = sum(a.usage.prompt_tokens for a in answers if a.usage is not None)
    completion = sum(a.usage.completion_tokens for a in answers if a.usage is not None)
    first = answers[0]
    return Completion(
        first.id, first.object, first.created, first.model, choices,
        Usage(prompt, completion, prompt + completion),
    )  # fmt: skip


async def prompt_list_events(dispatches: list[Dispatch]) -> AsyncIterator[bytes]:
    """The SSE stream of a list of prompts: each prompt's chunks in turn (under the first
    request's id, choices renumbered prompt * n + choice), one usage chunk for all, [DONE]."""
    first = dispatches[0].prepared
    n = first.params.options.n
    unreached = "its client went away before this prompt's turn"
    try:
        for number, dispatch in enumerate(dispatches):
            state = _CompletionStream()
            async for chunk in dispatch.events():
                choice = state.choice(dispatch, chunk)
                choice.index = number * n + choice.index
                yield _event(_chunk(first, [choice]))
        if first.include_usage:
            totals = [usage(dispatch) for dispatch in dispatches]
            prompt = sum(u.prompt_tokens for u in totals)
            completion = sum(u.completion_tokens for u in totals)
            yield _event(_chunk(first, [], Usage(prompt, completion, prompt + completion)))
    except (OpenAIError, GatewayError) as exc:
        unreached = "an earlier prompt of its request failed"
        yield _event(error_envelope(exc))
    finally:
        for dispatch in dispatches:  # prompts not reached: recorded, settled, slots back
            dispatch.cancel_unstarted(unreached)
    yield b"data: [DONE]\n\n"


def _chat_chunk(
    prepared: PreparedCompletion,
    choices: list[ChatChunkChoice],
    counts: Usage | msgspec.UnsetType | None = None,
) -> ChatCompletionChunk:
    if not prepared.include_usage:
        counts = msgspec.UNSET
    return ChatCompletionChunk(
        prepared.request_id,
        prepared.created,
        prepared.served_model,
        choices,
        service_tier=served_tier(prepared.params.options.priority),
        usage=counts,
    )


def _delta(part: Part, legacy: bool) -> ChatDelta:
    if isinstance(part, str):
        return ChatDelta(content=part)
    function = FunctionDelta(part.arguments, part.name)
    if legacy:
        return ChatDelta(function_call=function)
    first = part.id is not None
    call = ToolCallDelta(part.number, function, part.id, "function" if first else None)
    return ChatDelta(tool_calls=[call])


@dataclass(slots=True)
class _ChatStream:
    """Per choice: its tool-call scanner (when the request has tools)."""

    dispatch: Dispatch
    scanners: dict[int, ToolCallScanner] = field(default_factory=dict)

    def deltas(self, chunk: SiteChunk) -> list[ChatChunkChoice]:
        """The chunk's choice deltas: content, tool calls as they are written, logprobs, and at
        the end its finish reason ("tool_calls" when it called any)."""
        prepared = self.dispatch.prepared
        parsing = prepared.tool_calls
        out: list[ChatChunkChoice] = []
        index = chunk.index
        reason = finish_reason(chunk.finish_reason)
        scanner = None
        if parsing is None:
            parts: list[Part] = [chunk.text] if chunk.text else []
        else:
            scanner = self.scanners.setdefault(index, ToolCallScanner(parsing))
            parts = scanner.feed(chunk.text)
            if chunk.finish_reason is not None:
                parts += scanner.flush(reason)
        legacy = parsing is not None and parsing.legacy_functions
        for part in parts:
            if isinstance(part, CallDelta):
                if legacy and part.number:
                    continue  # a legacy caller is told of its first call only
                if part.id is None and not part.arguments:
                    continue  # a call's end: OpenAI's stream has nothing for it
            out.append(ChatChunkChoice(_delta(part, legacy), index=index))
        if prepared.params.options.logprobs and chunk.logprobs:
            own = token_bytes(self.dispatch)
            values = ChatLogprobs(chat_logprobs(chunk.token_ids, chunk.logprobs, own))
            if not out:
                out.append(ChatChunkChoice(ChatDelta(), index=index))
            out[-1].logprobs = values
        if chunk.finish_reason is not None:
            if scanner is not None:
                reason = scanner.finish_reason(reason)
            out.append(ChatChunkChoice(ChatDelta(), finish_reason=reason, index=index))
        return out


async def chat_completion_events(dispatch: Dispatch) -> AsyncIterator[bytes]:
    """SSE stream of chat.completion.chunk objects: per choice the assistant role, content and
    tool-call deltas, a chunk with the finish reason; an optional usage chunk, then [DONE];
    errors as in completion_events.

    The role chunk waits for the choice's first chunk so that everything is sent from inside
    dispatch.events(), which records the request as cancelled if the client goes away.
    """
    prepared = dispatch.prepared
    started: set[int] = set()
    state = _ChatStream(dispatch)
    last = _LastWrite(prepared.params.options.n)
    plain = prepared.tool_calls is None and not prepared.params.options.logprobs
    texts = _TextEvents(
        lambda index, text: _chat_chunk(
            prepared, [ChatChunkChoice(ChatDelta(content=text), index=index)]
        )
    )
    try:
        async for chunk in dispatch.events():
            if plain and chunk.finish_reason is None and chunk.index in started:
                if chunk.text:
                    yield texts.event(chunk.index, chunk.text)
                continue
            events = []
            if chunk.index not in started:
                started.add(chunk.index)
                role = ChatDelta(role="assistant", content="")
                events.append(
                    _event(_chat_chunk(prepared, [ChatChunkChoice(role, index=chunk.index)]))
                )
            events += [_event(_chat_chunk(prepared, [choice])) for choice in state.deltas(chunk)]
            if not last.holds(chunk, b"".join(events)):
                for event in events:
                    yield event
        if prepared.include_usage:
            last.add(_event(_chat_chunk(prepared, [], usage(dispatch))))
    except (OpenAIError, GatewayError) as exc:
        last.add(_event(error_envelope(exc)))
    yield last.done()
