"""A site's GenerateStream writer on the virtual clock: the site end of the chunk pacing
(site_engine/grpc_generate_stream.py's StreamWriter, issue 74).

The gateway tells each site its chunk interval (GenerateStreamRequest.chunk_interval_ms: its
ChunkPacer's streams over its chunk budget, sent with every message up, i.e. with each request it
starts there), and the site holds an answer's tokens until that interval has passed since it last
sent some of them (its first tokens and its end are never held). The writer looks at its answers
only when woken: when a step's tokens reach it, and, while some answer is held, on a timer of a
quarter of the interval (at least 2 ms). So an answer's tokens leave the site at the first wake at
or after its due time, several steps' worth to a message, and the gateway's own pacing (fedsim/
serving_path.py) mostly finds them due already. Before this the simulator paced at the gateway
only: its chunks held ~1.4 tokens where the real ones held ~3.3 (bench/results/federation_real/
twin_fidelity_r88.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fedsim.events import EventLoop
from site_engine.engine.core.outputs import NO_TOKEN, StepOutputs
from site_engine.engine.core.types import FinishReason

# site_engine/grpc_generate_stream.py: the longest interval a site honours, and its timer's
# share of the interval and floor.
MAX_INTERVAL_S = 1.0
TIMER_SHARE = 0.25
TIMER_FLOOR_S = 0.002

# What the writer does with the tokens it sends: (engine request id, tokens, whether it ends).
Send = Callable[[str, int, bool], None]


@dataclass(slots=True)
class _Answer:
    """One answer's tokens the writer has not sent, whether the last of them ends it, and when
    it last sent tokens of it (None: never, so its first are not held)."""

    pending: int = 0
    ending: bool = False
    sent_at: float | None = None


class SiteWriter:
    """One site's writer (the module docstring): tokens come in per step (`tokens`, then `wake`
    once for the step), and leave by `send` when due."""

    def __init__(self, loop: EventLoop, send: Send) -> None:
        self._loop = loop
        self._send = send
        self.interval_s = 0.0
        self._answers: dict[str, _Answer] = {}
        self._ready: dict[str, None] = {}  # answers with news, in the order they had it
        self._timer = False
        self.messages = 0

    def told(self, interval_s: float) -> None:
        """A message up from the gateway carried its chunk interval."""
        self.interval_s = min(max(interval_s, 0.0), MAX_INTERVAL_S)

    def tokens(self, request_id: str, tokens: int, finish: bool) -> None:
        """A step gave the answer `tokens` (0 or 1) and perhaps its end."""
        answer = self._answers.setdefault(request_id, _Answer())
        answer.pending += tokens
        answer.ending |= finish
        self._ready[request_id] = None

    def wake(self) -> None:
        """The writer's turn (StreamWriter.batches): every answer with news that is due goes."""
        now, interval = self._loop.now(), self.interval_s
        ready, self._ready = self._ready, {}
        sent = False
        for request_id in ready:
            answer = self._answers[request_id]
            due = answer.sent_at is None or now >= answer.sent_at + interval
            if not (due or answer.ending):
                self._ready[request_id] = None  # still held: looked at again on the timer
                continue
            if answer.pending:
                answer.sent_at = now
            self._send(request_id, answer.pending, answer.ending)
            sent = True
            answer.pending = 0
            if answer.ending:
                del self._answers[request_id]
        self.messages += sent
        if self._ready and not self._timer:
            self._timer = True
            self._loop.after(max(interval * TIMER_SHARE, TIMER_FLOOR_S), self._due)

    def _due(self) -> None:
        self._timer = False
        self.wake()

    def step(self, updates: StepOutputs) -> None:
        """A step's tokens reach the writer (a row the offload released sends nothing: the
        offload answers for it), then the writer's turn."""
        tokens, finished = updates.tokens, updates.finished
        for index, request_id in enumerate(updates.request_ids):
            finish = finished.get(index)
            if finish is not None and finish[0] is FinishReason.RELEASED:
                self.drop(request_id)
                continue
            self.tokens(request_id, int(tokens[index] != NO_TOKEN), finish is not None)
        self.wake()

    def clear(self) -> None:
        """The site died: its streams broke, nothing it held is sent."""
        self._answers.clear()
        self._ready.clear()

    def drop(self, request_id: str) -> None:
        """The answer left the site (released, lost): nothing more is sent for it."""
        self._answers.pop(request_id, None)
        self._ready.pop(request_id, None)
