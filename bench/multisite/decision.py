"""How long one routing decision takes at 9 sites, the predictor excluded.

The policies are the gateway's own (`build_policy`), deciding over the gateway's own site
objects (`SiteState` with a site configuration, an info answer and a load report, exactly what
the registry holds while serving). Between decisions the chosen site's ledger grows by the
request's tokens and every site's pushed load report changes, so no decision sees the same
state twice. Each decision is timed alone with perf_counter_ns.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.federation import SiteConfig
from gateway.routing.policy import POLICY_NAMES, build_policy
from gateway.routing.types import RoutingRequest
from gateway.sites.grpc_client import GrpcSiteClient
from gateway.sites.interface import LoadView, SiteInfoView
from gateway.sites.registry import SiteState

MODEL = "tiny"


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
        max_model_len=1024,
        vocab_size=50257,
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


async def _time_policy(policy_name: str, sites: int, decisions: int, seed: int) -> DecisionTimes:
    rng = random.Random(seed)
    states = []
    for i in range(sites):
        name = f"site-{i + 1}"
        config = SiteConfig(name, "cloud", "region", f"127.0.0.1:{1 + i}", MODEL, 1.0 + i % 3)
        state = SiteState(config, i + 1, GrpcSiteClient(name, config.endpoint, 1.0))
        state.mark_healthy(_info(name))
        state.apply_report(_report(rng, 0))
        states.append(state)
    policy = build_policy(policy_name)
    elapsed: list[float] = []
    cpu: list[float] = []
    try:
        for n in range(decisions):
            request = RoutingRequest(
                model=MODEL,
                prompt_tokens=rng.randrange(4, 200),
                max_tokens=rng.randrange(16, 600),
                predicted_tokens=rng.randrange(1, 400),
                predicted_bucket=rng.randrange(0, 10),
            )
            started, started_cpu = time.perf_counter_ns(), time.thread_time_ns()
            decision = policy.route(request, states)
            cpu.append((time.thread_time_ns() - started_cpu) / 1e6)
            elapsed.append((time.perf_counter_ns() - started) / 1e6)
            if decision.site is not None:
                decision.site.ledger_tokens += request.total_tokens
                decision.site.in_flight += 1
            reporter = states[n % sites]
            reporter.apply_report(_report(rng, n + 1))
    finally:
        for state in states:
            await state.client.close()
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
) -> list[DecisionTimes]:
    """Each policy (default: every configurable one), `decisions` timed decisions each (after
    1,000 warm-up ones)."""

    async def all_policies() -> list[DecisionTimes]:
        results = []
        for name in policies:
            await _time_policy(name, sites, 1_000, seed)  # warm-up
            results.append(await _time_policy(name, sites, decisions, seed))
        return results

    return asyncio.run(all_policies())
