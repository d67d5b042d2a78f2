"""The serving path's own CPU on the virtual clock (issue 78): what the gateway's event loop and
each site's serving thread spend on a request, a chunk and a token, and the gateway's chunk
pacing, so that a simulated federation delays first tokens and deliveries as a busy gateway does.

- The gateway is one event loop: one CPU whose work queues (`CpuServer`, first come first
  served). A request costs `request_s` when it arrives (its parsing, routing, record; it is
  routed once that work is done); each chunk it streams to a client costs `chunk_s` plus
  `token_s` a token, and reaches the client when that work is done. Idle, the delay is the work
  itself (~1 ms a request, ~50 us a chunk); as the work nears one core, the queue before it
  grows without bound, as a saturated gateway's loop lag does.
- Chunk pacing (GATEWAY_STREAM_CHUNKS_PER_S, gateway/sites/grpc_generate_stream.py's
  ChunkPacer): with n answers streaming, an answer's chunks go out at most every n / budget
  seconds (counted from when the loop streamed the last one), the tokens that came meanwhile
  merged into one chunk; its first token and its finish are never held. And as the gateway's
  reader takes every chunk filed for its request since it last ran: tokens that come while the
  answer's chunk still waits for the loop join that chunk (a lagging loop streams fewer,
  fuller chunks).
- The chunk budget's governor (GATEWAY_STREAM_CHUNKS_MIN_PER_S, gateway/sites/chunk_governor.py):
  the real loop checks itself every PERIOD_S and cuts the budget while it wakes late; here a
  check due at t wakes when the loop's queued work is done (its lag the backlog then), feeds
  the same ChunkGovernor, and the next is due PERIOD_S after it woke.
- A site's serving side (its gRPC writer, on a thread of its own beside the engine's) costs
  `site_token_s` a token: a step's tokens reach its writer when that work is done, and the
  writer paces them by the interval the gateway last told it (fedsim/site_writer.py), so a
  chunk waits at both ends, as in the real federation.

The defaults are the CPU-mode serving-path benchmark's (`python -m bench.serving_path --mode cpu`:
bench/results/serving_path/serving_path_cpu_r87.md, a least-squares fit over four runs of one
gateway process on SQLite: ~0.84-0.98 ms a request, ~42-50 us a chunk, ~0.3-1.2 us a token; the
site 3.1-3.5 us a delivered token, 5.4 on another 2-core machine). `ServingCosts.scaled` moves
the gateway's three costs together (another machine's CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from random import Random

from fedsim.events import EventLoop
from fedsim.site_writer import SiteWriter
from gateway.settings import SitesSettings
from gateway.sites.chunk_governor import PERIOD_S, ChunkGovernor

_CHUNKS_PER_S = SitesSettings().stream_chunks_per_s
_CHUNKS_MIN_PER_S = SitesSettings().stream_chunks_min_per_s


@dataclass(frozen=True, slots=True)
class ServingCosts:
    """Seconds of CPU a request, a chunk and a token cost the gateway's event loop, a token the
    site's serving thread, and the gateway's chunk budget a second (the module docstring)."""

    request_s: float = 1.0e-3
    chunk_s: float = 50e-6
    token_s: float = 0.2e-6
    chunks_per_s: float = _CHUNKS_PER_S
    site_token_s: float = 3.4e-6
    chunks_min_per_s: float = _CHUNKS_MIN_PER_S

    def governor(self) -> ChunkGovernor | None:
        """The budget's governor, as the real gateway runs one (assembly.py); None: fixed."""
        return ChunkGovernor.of(self.chunks_per_s, self.chunks_min_per_s)

    def scaled(self, factor: float) -> ServingCosts:
        """The gateway's costs times `factor` (its CPU slower or faster than the benchmark's)."""
        return replace(
            self,
            request_s=self.request_s * factor,
            chunk_s=self.chunk_s * factor,
            token_s=self.token_s * factor,
        )

    def gateway_seconds(self, requests: int, chunks: int, tokens: int) -> float:
        """What the gateway's loop spends on that much work."""
        return requests * self.request_s + chunks * self.chunk_s + tokens * self.token_s

    def to_json(self) -> dict[str, float]:
        return {
            "request_s": self.request_s,
            "chunk_s": self.chunk_s,
            "token_s": self.token_s,
            "chunks_per_s": self.chunks_per_s,
            "site_token_s": self.site_token_s,
            "chunks_min_per_s": self.chunks_min_per_s,
        }


def has_text(rng: Random, text_share: float, tokens: int) -> bool:
    """Whether a chunk of `tokens` tokens carries text, where each token does with probability
    `text_share` (SiteSpec.text_share): the client counts a chunk, and its first token, only
    then (bench/serving_path/http_stream.py counts events whose text is not empty)."""
    if text_share >= 1.0:
        return tokens > 0
    return tokens > 0 and rng.random() < 1.0 - (1.0 - text_share) ** tokens


class CpuServer:
    """One thread's CPU: work submitted at `now` starts once the work before it is done (first
    come first served) and ends its own seconds later. Deterministic costs, so a piece of work's
    end is known when it is submitted."""

    __slots__ = ("busy_s", "free_at")

    def __init__(self) -> None:
        self.free_at = 0.0
        self.busy_s = 0.0

    def submit(self, now: float, seconds: float) -> float:
        """When work of `seconds` submitted at `now` is done."""
        self.free_at = max(now, self.free_at) + seconds
        self.busy_s += seconds
        return self.free_at


@dataclass(slots=True)
class _Stream:
    """One answer's pacing: tokens held, when the loop streamed its last chunk, and the chunk
    waiting for the loop (its tokens, whether it ends the answer, when the loop takes it)."""

    held: int = 0
    sent_at: float | None = None
    flushing: bool = False
    closed: bool = False
    queued: int = 0
    queued_finish: bool = False
    queued_start: float = -1.0


# What the gateway does with a chunk once its loop has streamed it: (request id, tokens in it,
# whether it is the answer's last).
Deliver = Callable[[str, int, bool], None]
# What the gateway does with a chunk a site's writer sent: (site, engine request id, tokens,
# whether it ends the answer).
ToGateway = Callable[[str, str, int, bool], None]


@dataclass
class ServingPath:
    """The gateway's loop, the sites' serving threads and the chunk pacing of one simulated
    federation (the module docstring). The gateway tells it when an answer starts streaming
    (`opened`, once a request is placed) and ends (`closed`); it calls `deliver` for every
    chunk when the chunk reaches the client."""

    loop: EventLoop
    costs: ServingCosts
    deliver: Deliver
    gateway: CpuServer = field(default_factory=CpuServer)
    sites: dict[str, CpuServer] = field(default_factory=dict)
    writers: dict[str, SiteWriter] = field(default_factory=dict)
    chunks: int = 0
    tokens: int = 0
    requests: int = 0
    _streams: dict[str, _Stream] = field(default_factory=dict)
    _governor: ChunkGovernor | None = None
    _horizon_s: float = 0.0

    def start(self, horizon_s: float) -> None:
        """The budget's governor checks the loop from now until `horizon_s` (if it has one)."""
        self._governor = self.costs.governor()
        self._horizon_s = horizon_s
        if self._governor is not None:
            self.loop.at(self.loop.now() + PERIOD_S, self._check)

    def _check(self) -> None:
        """A check due now wakes when the loop's queued work is done; the next PERIOD_S later."""
        assert self._governor is not None
        lag = max(0.0, self.gateway.free_at - self.loop.now())
        self._governor.observe(lag)
        due = self.loop.now() + lag + PERIOD_S
        if due <= self._horizon_s:
            self.loop.at(due, self._check)

    def admit(self, then: Callable[[], None]) -> None:
        """A request arrived: `then` (its routing) runs once the loop has done its work."""
        self.requests += 1
        done = self.gateway.submit(self.loop.now(), self.costs.request_s)
        self.loop.at(done, then)

    def site_delay(self, site: str, tokens: int) -> float:
        """Seconds before a step's `tokens` leave site `site` (its serving thread's queue)."""
        if tokens <= 0 or self.costs.site_token_s <= 0:
            return 0.0
        server = self.sites.setdefault(site, CpuServer())
        now = self.loop.now()
        return server.submit(now, tokens * self.costs.site_token_s) - now

    def writer(self, site: str, one_way_s: float, to_gateway: ToGateway) -> SiteWriter:
        """Site `site`'s GenerateStream writer (fedsim/site_writer.py): what it sends reaches
        `to_gateway` (site, engine request id, tokens, whether it ends) `one_way_s` later."""
        writer = self.writers.get(site)
        if writer is None:

            def send(request_id: str, tokens: int, finish: bool) -> None:
                self.loop.after(one_way_s, partial(to_gateway, site, request_id, tokens, finish))

            writer = self.writers[site] = SiteWriter(self.loop, send)
        return writer

    def opened(self, request_id: str) -> None:
        self._streams.setdefault(request_id, _Stream())

    def closed(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def interval_s(self) -> float:
        """The least time between two chunks of an answer now (ChunkPacer.interval_s)."""
        budget = self.costs.chunks_per_s
        if budget <= 0:
            return 0.0
        share = self._governor.share if self._governor is not None else 1.0
        return len(self._streams) / (budget * share)

    def arrived(self, request_id: str, tokens: int, finish: bool) -> None:
        """Tokens of an answer reached the gateway: sent now (its first, its finish, or its
        interval passed) or held until the interval ends."""
        stream = self._streams.get(request_id)
        if stream is None or stream.closed:
            return
        stream.held += tokens
        now = self.loop.now()
        due = None if stream.sent_at is None else stream.sent_at + self.interval_s()
        # The loop has not taken the answer's last chunk yet: these join it (`_send`).
        if finish or due is None or now >= due or now < stream.queued_start:
            self._send(request_id, stream, finish)
        elif not stream.flushing:
            stream.flushing = True
            self.loop.at(due, partial(self._flush, request_id, stream))

    def _flush(self, request_id: str, stream: _Stream) -> None:
        stream.flushing = False
        if not stream.closed and stream.held:
            self._send(request_id, stream, False)

    def _send(self, request_id: str, stream: _Stream, finish: bool) -> None:
        tokens, stream.held = stream.held, 0
        if not tokens and not finish:
            return
        now = self.loop.now()
        stream.closed = finish
        self.tokens += tokens
        if now < stream.queued_start:  # its chunk still waits for the loop: one chunk
            stream.queued += tokens
            stream.queued_finish |= finish
            return
        cost = self.costs.chunk_s + self.costs.token_s * tokens
        done = self.gateway.submit(now, cost)
        self.chunks += 1
        stream.queued, stream.queued_finish, stream.queued_start = tokens, finish, done - cost
        if tokens:  # the pacing counts from when the loop streams a chunk with tokens
            stream.sent_at = done - cost
        self.loop.at(done, partial(self._streamed, request_id, stream))

    def _streamed(self, request_id: str, stream: _Stream) -> None:
        tokens, finish = stream.queued, stream.queued_finish
        stream.queued, stream.queued_finish = 0, False
        self.deliver(request_id, tokens, finish)
