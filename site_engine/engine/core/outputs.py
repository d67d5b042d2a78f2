"""What a step gives back: each sampled request's new token, as columns (issue 66).

A step of 1,024 decoding sequences used to hand its caller 1,024 RequestOutput objects built on
the engine's thread. StepOutputs keeps them as parallel lists (request ids, tokens) plus the few
entries that need more (a finish, an error, logprobs), so the step builds no object per row; a
caller that wants objects iterates it and gets RequestOutput, built then, on its own time (the
engine service reads the columns). Imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, overload

from site_engine.engine.core.types import FinishReason, TokenLogprob

NO_TOKEN = -1  # an entry that brings no token (its request failed, or was refused one)


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """New tokens of one request from one step; finish_reason is set on its last output."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    # Prompt tokens whose KV came from the prefix cache (known from the first output on).
    cached_prompt_tokens: int = 0
    # The sampled token's log probability, when the request asked for logprobs.
    logprobs: TokenLogprob | None = None
    # With FinishReason.ERROR: why the request failed (the client's error message).
    error: str = ""


class StepOutputs(Seq[RequestOutput]):
    """One step's outputs: entry i is request_ids[i]'s token tokens[i] (NO_TOKEN: none), its
    finish (reason, error) if in `finished`, its logprobs if in `logprobs`. `sources[i]` is what
    knows the request's cached prompt tokens (its sequence: `num_cached_prompt_tokens`), or an
    int."""

    __slots__ = ("decoded", "finished", "logprobs", "request_ids", "sources", "tokens")

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.tokens: list[int] = []
        self.sources: list[Any] = []
        self.finished: dict[int, tuple[FinishReason, str]] = {}
        self.logprobs: dict[int, TokenLogprob] = {}
        # Tokens of requests past their first (decodes): a step's decode rate.
        self.decoded = 0

    def add_rows(self, request_ids: list[str], tokens: list[int], sources: list[Any]) -> int:
        """Appends many entries with a token each and nothing else; the index of the first."""
        first = len(self.request_ids)
        self.request_ids += request_ids
        self.tokens += tokens
        self.sources += sources
        return first

    def add(
        self,
        request_id: str,
        token: int = NO_TOKEN,
        finish: FinishReason | None = None,
        error: str = "",
        source: Any = 0,
    ) -> int:
        """Appends one entry; its index."""
        index = len(self.request_ids)
        self.request_ids.append(request_id)
        self.tokens.append(token)
        self.sources.append(source)
        if finish is not None:
            self.finished[index] = (finish, error)
        return index

    def finish(self, index: int, reason: FinishReason, error: str = "") -> None:
        self.finished[index] = (reason, error)

    def drop_token(self, index: int) -> None:
        """Entry `index` brings no token after all (its grammar refused it)."""
        self.tokens[index] = NO_TOKEN

    def extend(self, other: StepOutputs) -> None:
        offset = len(self.request_ids)
        self.decoded += other.decoded
        self.request_ids += other.request_ids
        self.tokens += other.tokens
        self.sources += other.sources
        self.finished.update({i + offset: v for i, v in other.finished.items()})
        self.logprobs.update({i + offset: v for i, v in other.logprobs.items()})

    def cached_prompt_tokens(self, index: int) -> int:
        source = self.sources[index]
        return source if isinstance(source, int) else int(source.num_cached_prompt_tokens)

    def output(self, index: int) -> RequestOutput:
        token = self.tokens[index]
        reason, error = self.finished.get(index, (None, ""))
        return RequestOutput(
            self.request_ids[index],
            () if token == NO_TOKEN else (token,),
            reason,
            self.cached_prompt_tokens(index),
            self.logprobs.get(index),
            error,
        )

    def __len__(self) -> int:
        return len(self.request_ids)

    @overload
    def __getitem__(self, index: int) -> RequestOutput: ...

    @overload
    def __getitem__(self, index: slice) -> list[RequestOutput]: ...

    def __getitem__(self, index: int | slice) -> RequestOutput | list[RequestOutput]:
        if isinstance(index, slice):
            return [self.output(i) for i in range(len(self))[index]]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.output(index)

    def __iter__(self) -> Iterator[RequestOutput]:
        return (self.output(i) for i in range(len(self.request_ids)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Seq) and not isinstance(other, str):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"StepOutputs({list(self)!r})"

    __hash__ = None  # type: ignore[assignment]
