"""How long one routing decision takes at 9 sites, the predictor excluded.

The policies are the gateway's own (`build_policy`), deciding over the gateway's own site
objects (`SiteState` with a site configuration, an info answer and a load report, exactly what
the registry holds while serving). Between decisions the chosen site's ledger grows by the
request's tokens and every site's pushed load report changes, so no decision sees the same
state twice. Each decision is timed alone with perf_counter_ns.

Every site follows cache events: its prefix index holds `index_blocks / sites` block ids of 16
tokens (1M over 9 sites by default), some of them the blocks of a few hot 2,048-token prompts
(each on a few sites), the rest other chains. Every request carries its 2,304 prompt tokens:
half continue a hot prompt (a long match on the sites that hold it), half are new. The
decision computes the request's block ids (144 of them) itself, as the first policy reading
prefixes does on the request path.

    python -m bench.decision_time [--sites 9] [--decisions 20000]   # a table on stdout
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace

from bench.common import markdown_table
from fedllm_contract.block_hash import prompt_block_hashes
from fedllm_contract.cache_events import CHAIN_START, BlocksStored, CacheEventBatch
from gateway.federation import SiteConfig
from gateway.routing.policy import POLICY_NAMES, build_policy
from gateway.routing.prefix.site_prefix import SitePrefix
from gateway.routing.types import RoutingRequest
from gateway.sites.grpc_client import GrpcSiteClient
from gateway.sites.interface import LoadView, SiteInfoView
from gateway.sites.lease import SiteLease
from gateway.sites.registry import SiteState

MODEL = "tiny"
BLOCK = 16
HOT_PROMPTS = 32
PROMPT = 2048
SUFFIX = 256
INDEX_BLOCKS = 1_000_000
VOCAB = 50257


@dataclass(frozen=True, slots=True)
class DecisionTimes:
    policy: str
    sites: int
    decisions: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    # The deciding thread's own CPU time: what the policy costs, without the time another
    # process held the core (wall time on a loaded machine counts preemptions).
    cpu_p50_ms: float = 0.0
    cpu_p99_ms: float = 0.0

    def to_json(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "sites": self.sites,
            "decisions": self.decisions,
            "p50_ms": round(self.p50_ms, 4),
            "p99_ms": round(self.p99_ms, 4),
            "max_ms": round(self.max_ms, 4),
            "cpu_p50_ms": round(self.cpu_p50_ms, 4),
            "cpu_p99_ms": round(self.cpu_p99_ms, 4),
        }


def _info(name: str) -> SiteInfoView:
    return SiteInfoView(
        site_name=name,
        model=MODEL,
        max_model_len=8192,
        vocab_size=VOCAB,
        tokenizer_fingerprint="bench",
        device="cpu",
        dtype="float32",
        kv_block_size=16,
        kv_blocks_total=1 << 16,
        max_num_seqs=8,
        engine="paged-fcfs",
        version="bench",
    )


def _report(rng: random.Random, sequence: int) -> LoadView:
    queued, running = rng.randrange(0, 50), rng.randrange(0, 9)
    return LoadView(
        queued_requests=queued,
        running_requests=running,
        queued_prompt_tokens=queued * 20,
        running_tokens=running * 60,
        predicted_remaining_tokens=(queued + running) * 55,
        kv_blocks_used=running * 4,
        kv_blocks_total=1 << 16,
        decode_tokens_per_s=400.0,
        iterations=sequence,
        sequence=sequence,
    )


def _percentile(sorted_values: list[float], share: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(share * len(sorted_values)))]


def _tokens(rng: random.Random, count: int) -> tuple[int, ...]:
    """`count` token ids, uniform below VOCAB: 16-bit draws with those past it rejected (a
    third the time of one randrange a token, which made most of a run's time)."""
    drawn: list[int] = []
    while len(drawn) < count:
        wanted = count - len(drawn)
        raw = array("H", rng.randbytes(2 * (wanted + wanted // 3 + 8)))
        drawn.extend([token for token in raw if token < VOCAB])
    return tuple(drawn[:count])


def _hot_prompts(rng: random.Random) -> list[tuple[int, ...]]:
    return [_tokens(rng, PROMPT) for _ in range(HOT_PROMPTS)]


def _prefix(rng: random.Random, hot: list[tuple[int, ...]], blocks: int) -> SitePrefix:
    """A site's index after a snapshot: a third of the hot prompts' blocks, and other chains of
    128 blocks up to `blocks` ids."""
    prefix = SitePrefix(max_blocks=blocks + 1)
    events = [
        BlocksStored(tuple(prompt_block_hashes(p, BLOCK, MODEL)), CHAIN_START)
        for p in rng.sample(hot, HOT_PROMPTS // 3)
    ]
    held = sum(len(e.block_ids) for e in events)
    while held < blocks:
        length = min(128, blocks - held)
        events.append(BlocksStored(tuple(rng.getrandbits(64) for _ in range(length)), CHAIN_START))
        held += length
    prefix.apply(CacheEventBatch(1, BLOCK, 1, tuple(events), snapshot=True))
    return prefix


def _states(sites: int, rng: random.Random, index_blocks: int) -> list[SiteState]:
    hot = _hot_prompts(random.Random(1))
    states = []
    for i in range(sites):
        name = f"site-{i + 1}"
        config = SiteConfig(name, "cloud", "region", f"127.0.0.1:{1 + i}", MODEL, 1.0 + i % 3)
        state = SiteState(
            config,
            i + 1,
            GrpcSiteClient(name, config.endpoint, 1.0),
            prefix=_prefix(rng, hot, index_blocks // sites),
        )
        state.mark_healthy(_info(name))
        state.apply_report(_report(rng, 0))
        states.append(state)
    return states


def _request(rng: random.Random, hot: list[tuple[int, ...]]) -> RoutingRequest:
    fresh = rng.random() >= 0.5
    head = _tokens(rng, PROMPT) if fresh else rng.choice(hot)
    tokens = (*head, *_tokens(rng, SUFFIX))
    return RoutingRequest(
        model=MODEL,
        prompt_tokens=len(tokens),
        max_tokens=rng.randrange(16, 600),
        predicted_tokens=rng.randrange(1, 400),
        predicted_bucket=rng.randrange(0, 10),
        prompt_token_ids=tokens,
    )


@dataclass(frozen=True, slots=True)
class _Workload:
    """A seed's requests, drawn once for every policy, and the generator's state after them
    (the load reports between decisions continue from it)."""

    requests: tuple[RoutingRequest, ...]
    rng_state: tuple[object, ...]

    @classmethod
    def draw(cls, decisions: int, seed: int) -> _Workload:
        rng = random.Random(seed)
        hot = _hot_prompts(random.Random(1))
        requests = tuple(_request(rng, hot) for _ in range(decisions))
        return cls(requests, rng.getstate())

    def fresh(self) -> tuple[list[RoutingRequest], random.Random]:
        """Copies without the block ids an earlier policy computed (RoutingRequest keeps them):
        every policy pays for hashing the prompt, as on the request path."""
        rng = random.Random()
        rng.setstate(self.rng_state)
        return [replace(request) for request in self.requests], rng


async def _time_policy(
    policy_name: str, states: list[SiteState], workload: _Workload
) -> DecisionTimes:
    requests, rng = workload.fresh()
    decisions = len(requests)
    policy = build_policy(policy_name)
    leases: list[SiteLease] = []
    elapsed: list[float] = []
    cpu: list[float] = []
    sites = len(states)
    for n, request in enumerate(requests):
        started, started_cpu = time.perf_counter_ns(), time.thread_time_ns()
        decision = policy.route(request, states)
        cpu.append((time.thread_time_ns() - started_cpu) / 1e6)
        elapsed.append((time.perf_counter_ns() - started) / 1e6)
        if decision.site is not None:  # counted on its site, as a dispatch would be
            leases.append(SiteLease.take(decision.site, request.total_tokens))
        reporter = states[n % sites]
        reporter.apply_report(_report(rng, n + 1))
    for lease in leases:  # the next policy starts from idle sites
        lease.release()
    elapsed.sort()
    cpu.sort()
    return DecisionTimes(
        policy_name,
        sites,
        decisions,
        _percentile(elapsed, 0.5),
        _percentile(elapsed, 0.99),
        elapsed[-1],
        _percentile(cpu, 0.5),
        _percentile(cpu, 0.99),
    )


def time_decisions(
    sites: int = 9,
    decisions: int = 20_000,
    seed: int = 0,
    policies: Sequence[str] = POLICY_NAMES,
    index_blocks: int = INDEX_BLOCKS,
) -> list[DecisionTimes]:
    """Each policy (default: every configurable one), `decisions` timed decisions each (after
    1,000 warm-up ones), over `sites` sites whose indexes hold `index_blocks` ids together."""

    async def all_policies() -> list[DecisionTimes]:
        states = _states(sites, random.Random(seed), index_blocks)
        warm_up, timed = _Workload.draw(1_000, seed + 1), _Workload.draw(decisions, seed)
        try:
            results = []
            for name in policies:
                await _time_policy(name, states, warm_up)
                results.append(await _time_policy(name, states, timed))
            return results
        finally:
            for state in states:
                await state.client.close()

    return asyncio.run(all_policies())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.decision_time")
    parser.add_argument("--sites", type=int, default=9)
    parser.add_argument("--decisions", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = [
        (t.policy, t.p50_ms, t.p99_ms, t.max_ms, t.cpu_p50_ms, t.cpu_p99_ms)
        for t in time_decisions(args.sites, args.decisions, args.seed)
    ]
    header = ("policy", "p50 ms", "p99 ms", "max ms", "CPU p50 ms", "CPU p99 ms")
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
