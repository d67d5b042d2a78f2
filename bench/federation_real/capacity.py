"""The pair's capacity, measured through the gateway before the arms (issue 78): the offered
loads are multiples of it.

The saturation phase: closed-loop streams (bench/serving_path/clients.py, each request sent
once) of the run's own workload (ShareGPT-like lengths, prompts of their own seed and marker),
as many as every
site's batch slots plus (sites - 1/2) x the gateway's per-site queue bound (`saturation_streams`):
whichever site routing favours, each one's batch is full and its queue non-empty, and the
gateway refuses none. From `settle_s` on, the windows count what the federation delivered:

- `tokens_per_s`: answer tokens delivered a second (each answer's usage spread over its text
  events: bench/serving_path/figures.py's `window_tokens`), over all windows;
- `rps`, the capacity the loads scale: `tokens_per_s` over the workload's mean answer, i.e. the
  requests a second of the arms' mix that full sites finish. Counting the answers that ended in
  the windows (`finished_rps`, also recorded) would favour short answers: in the first seconds
  of a closed loop the short ones end first, and one 20 s phase holds few of the 1,024-token
  ones from start to end.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from bench.federation_real.presets import CapacityPlan, SiteSetup
from bench.loadgen.client import body
from bench.loadgen.workload import Request
from bench.serving_path.clients import ClientProcesses, Job, Sent
from bench.serving_path.figures import refusals, window_tokens
from bench.serving_path.http_stream import request_bytes


def saturation_streams(sites: Sequence[SiteSetup], queue_bound: int | None) -> int:
    """Every site's slots + (sites - 1/2) x the queue bound (the module docstring): at least
    the other sites' slots and bounds beyond any one site's slots, at most every bound."""
    slots = sum(s.max_num_seqs for s in sites)
    bound = queue_bound or max(s.max_num_seqs for s in sites)
    return slots + math.ceil((len(sites) - 0.5) * bound)


@dataclass(frozen=True, slots=True)
class Capacity:
    rps: float
    tokens_per_s: float
    finished_rps: float
    mean_answer_tokens: float
    window_tokens_per_s: tuple[float, ...]
    window_finished_rps: tuple[float, ...]
    streams: int
    built: int  # requests the streams could send (they ran dry if `sent` came near it)
    sent: int
    refused: int
    cut: int
    refusals: dict[str, int]
    plan: CapacityPlan
    method: str = (
        "closed-loop streams through the gateway (every site's slots + (sites - 1/2) x the "
        "gateway's queue bound), answer tokens delivered a second over the windows after "
        "settle_s, over the workload's mean answer (bench/federation_real/capacity.py)"
    )

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def capacity_of(
    sent: Sequence[Sent],
    edges: Sequence[float],
    mean_answer_tokens: float,
    streams: int,
    plan: CapacityPlan,
    built: int,
) -> Capacity:
    """The capacity from what the streams recorded (the module docstring); `edges` are the
    windows' monotonic edges, as the clients marked them."""
    if len(edges) < 2 or mean_answer_tokens <= 0:
        raise ValueError("a capacity needs a window and a mean answer")
    widths = [b - a for a, b in itertools.pairwise(edges)]
    tokens = [window_tokens(sent, edges, w) for w in range(len(widths))]
    ends = [s.answer.end_s for s in sent if s.answer.complete and s.answer.end_s is not None]
    finished = [sum(a <= e < b for e in ends) for a, b in itertools.pairwise(edges)]
    span = edges[-1] - edges[0]
    tokens_per_s = sum(tokens) / span
    return Capacity(
        rps=tokens_per_s / mean_answer_tokens,
        tokens_per_s=tokens_per_s,
        finished_rps=sum(finished) / span,
        mean_answer_tokens=mean_answer_tokens,
        window_tokens_per_s=tuple(t / w for t, w in zip(tokens, widths, strict=True)),
        window_finished_rps=tuple(f / w for f, w in zip(finished, widths, strict=True)),
        streams=streams,
        built=built,
        sent=len(sent),
        refused=sum(s.answer.status not in (0, 200) for s in sent),
        cut=sum(s.cut for s in sent),
        refusals=refusals(sent),
        plan=plan,
    )


def measure(
    port: int,
    requests: Sequence[Request],
    plan: CapacityPlan,
    streams: int,
    clients: int,
    log: Callable[[str], None],
) -> Capacity:
    """The saturation phase through the gateway at `port` (the module docstring). `requests`:
    the plan's requests_per_stream x `streams` of them, already marked as the phase's own."""
    mean = sum(r.answer_tokens for r in requests) / max(len(requests), 1)
    n = max(1, min(clients, streams))
    start = time.monotonic() + 1.0
    edges = tuple(start + plan.settle_s + plan.window_s * w for w in range(plan.windows + 1))
    jobs = []
    for p in range(n):
        share = tuple(request_bytes(port, body(r)) for r in requests[p::n])
        own = len(range(p, streams, n))  # this process's streams
        jobs.append(Job(port, share, start, start + plan.stop_s, drain_s=0.0, streams=own,
                        ramp_s=plan.ramp_s, windows=edges, once=True))  # fmt: skip
    log(f"capacity: {streams} closed-loop streams from {n} processes for {plan.stop_s:g} s")
    processes = ClientProcesses(jobs)
    processes.start()
    try:
        by_process = processes.gather(timeout_s=plan.stop_s + 60)
    finally:
        processes.kill()
    sent = [item for items, _ in by_process for item in items]
    capacity = capacity_of(sent, edges, mean, streams, plan, len(requests))
    if capacity.sent > 0.9 * len(requests):
        log(f"capacity: WARNING {capacity.sent} of {len(requests)} requests sent: streams ran dry")
    log(
        f"capacity: {capacity.rps:.1f} req/s ({capacity.tokens_per_s:,.0f} answer tok/s over a "
        f"mean answer of {mean:.0f}; finished {capacity.finished_rps:.1f} req/s; windows "
        f"{[round(t) for t in capacity.window_tokens_per_s]} tok/s); {capacity.sent} sent, "
        f"{capacity.refused} refused, {capacity.cut} cut"
    )
    return capacity
