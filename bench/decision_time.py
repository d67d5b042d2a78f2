"""How long one routing decision takes at 9 sites and more, the predictor excluded.

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

The sites are linked as the gateway's registry links them (same-model peers), so a site that
has not measured its own prefill rate reads its peers' median, as in the gateway.

    python -m bench.decision_time [--sites 9] [--decisions 20000]   # a table on stdout
    python -m bench.decision_time --sites 9 64 256 --rounds 3 --out bench/results/routing
        # decision_time.{json,md}: `decision_us` {sites: CPU p50 us of the default policy}

How the cost grows with the sites is what the rounds measure: each round times every site
count once, in turn, so a busy spell of this shared machine falls on all of them; the figure is
the median over rounds of each round's CPU p50 (min-max beside it).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.common import command_line, markdown_table, write_results
from fedllm_contract.block_hash import prompt_block_hashes
from fedllm_contract.cache_events import CHAIN_START, BlocksStored, CacheEventBatch
from gateway.federation import SiteConfig
from gateway.routing.policy import POLICY_NAMES, build_policy
from gateway.routing.prefix.site_prefix import SitePrefix
from gateway.routing.types import RoutingRequest
from gateway.settings import RoutingSettings
from gateway.sites.grpc_client import GrpcSiteClient
from gateway.sites.interface import LoadView, SiteInfoView
from gateway.sites.lease import SiteLease
from gateway.sites.registry import SiteRegistry, SiteState

MODEL = "tiny"
BLOCK = 16
HOT_PROMPTS = 32
HOT_HOLDERS = 3
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


def _prefix(held_hot: list[tuple[int, ...]], rng: random.Random, blocks: int) -> SitePrefix:
    """A site's index after a snapshot: the blocks of the hot prompts it holds, and other chains
    of 128 blocks up to `blocks` ids."""
    prefix = SitePrefix(max_blocks=blocks + 1)
    events = [
        BlocksStored(tuple(prompt_block_hashes(p, BLOCK, MODEL)), CHAIN_START) for p in held_hot
    ]
    held = sum(len(e.block_ids) for e in events)
    while held < blocks:
        length = min(128, blocks - held)
        events.append(BlocksStored(tuple(rng.getrandbits(64) for _ in range(length)), CHAIN_START))
        held += length
    prefix.apply(CacheEventBatch(1, BLOCK, 1, tuple(events), snapshot=True))
    return prefix


def _hot_holders(sites: int, rng: random.Random) -> list[list[int]]:
    """Which hot prompts each site holds: every hot prompt on HOT_HOLDERS sites (on all of
    them when there are fewer), as prefix-aware routing keeps a prompt's requests on a few
    sites whatever the federation's size (9 sites: about a third of the hot prompts each)."""
    held: list[list[int]] = [[] for _ in range(sites)]
    for prompt in range(HOT_PROMPTS):
        for site in rng.sample(range(sites), min(HOT_HOLDERS, sites)):
            held[site].append(prompt)
    return held


def _states(sites: int, rng: random.Random, index_blocks: int) -> list[SiteState]:
    """The sites' states, linked as same-model peers by a registry (as the gateway's are)."""
    states = _unlinked_states(sites, rng, index_blocks)
    SiteRegistry(states)
    return states


def _unlinked_states(sites: int, rng: random.Random, index_blocks: int) -> list[SiteState]:
    hot = _hot_prompts(random.Random(1))
    holders = _hot_holders(sites, rng)
    states = []
    for i in range(sites):
        name = f"site-{i + 1}"
        config = SiteConfig(name, "cloud", "region", f"127.0.0.1:{1 + i}", MODEL, 1.0 + i % 3)
        state = SiteState(
            config,
            i + 1,
            GrpcSiteClient(name, config.endpoint, 1.0),
            prefix=_prefix([hot[p] for p in holders[i]], rng, index_blocks // sites),
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


def growth(
    site_counts: Sequence[int],
    policies: Sequence[str],
    decisions: int,
    rounds: int,
    seed: int = 0,
) -> dict[str, Any]:
    """Every policy at every site count, `rounds` times in turn: per policy and site count the
    CPU p50 of each round (microseconds), their median, and that median over the first count's."""
    per_round: dict[str, dict[int, list[float]]] = {
        p: {n: [] for n in site_counts} for p in policies
    }
    for _ in range(rounds):
        for sites in site_counts:
            for run in time_decisions(sites, decisions, seed, policies=policies):
                per_round[run.policy][sites].append(run.cpu_p50_ms * 1000.0)
    out: dict[str, Any] = {}
    for policy, by_sites in per_round.items():
        medians = {n: statistics.median(values) for n, values in by_sites.items()}
        first = medians[site_counts[0]]
        out[policy] = {
            "cpu_p50_us": {str(n): round(m, 1) for n, m in medians.items()},
            "cpu_p50_us_rounds": {str(n): [round(v, 1) for v in vs] for n, vs in by_sites.items()},
            f"vs_{site_counts[0]}_sites": {str(n): round(m / first, 3) for n, m in medians.items()},
        }
    return out


def _growth_markdown(payload: dict[str, Any], default: str) -> str:
    counts = list(payload["decision_us"])
    lines = [
        f"`decision_us` ({default}, the default policy): "
        + ", ".join(f"{n} sites {payload['decision_us'][n]:.0f} us" for n in counts)
        + f"; 64 over 9 sites: {payload['ratio_64_vs_9']}.",
        "",
        "| policy | " + " | ".join(f"{n} sites: CPU p50 us (min-max)" for n in counts) + " |",
        "|---|" + "---|" * len(counts),
    ]
    for policy, row in payload["policies"].items():
        cells = []
        for n in counts:
            values = row["cpu_p50_us_rounds"][n]
            cells.append(f"{row['cpu_p50_us'][n]:.0f} ({min(values):.0f}-{max(values):.0f})")
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.decision_time")
    parser.add_argument("--sites", type=int, nargs="+", default=[9])
    parser.add_argument("--decisions", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", nargs="+", default=None, help="default: every policy")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write decision_time.{json,md}")
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.sites) or args.rounds < 1 or args.decisions < 1:
        parser.error("--sites, --rounds and --decisions must be >= 1")
    policies = tuple(args.policies or POLICY_NAMES)
    unknown = set(policies) - set(POLICY_NAMES)
    if unknown:
        parser.error(f"unknown policies {sorted(unknown)}; known: {sorted(POLICY_NAMES)}")
    if args.out is None:
        for sites in args.sites:
            rows = [
                (t.policy, t.sites, t.p50_ms, t.p99_ms, t.max_ms, t.cpu_p50_ms, t.cpu_p99_ms)
                for t in time_decisions(sites, args.decisions, args.seed, policies)
            ]
            header = ("policy", "sites", "p50 ms", "p99 ms", "max ms", "CPU p50 ms", "CPU p99 ms")
            print(markdown_table(header, rows))
        return
    product = RoutingSettings().policy
    default = product if product in policies else policies[0]
    found = growth(args.sites, policies, args.decisions, args.rounds, args.seed)
    payload: dict[str, Any] = {
        "default_policy": default,
        "decisions": args.decisions,
        "rounds": args.rounds,
        "decision_us": found[default]["cpu_p50_us"],
        "policies": found,
    }
    if 9 in args.sites and 64 in args.sites:
        payload["ratio_64_vs_9"] = round(
            payload["decision_us"]["64"] / payload["decision_us"]["9"], 3
        )
    else:
        payload["ratio_64_vs_9"] = None
    command = command_line("bench.decision_time", argv)
    path = write_results(
        "decision_time", payload, _growth_markdown(payload, default), command, args.out
    )
    print(path.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
