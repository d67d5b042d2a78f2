"""Idle memory first: the gateway's placement of a short peak's instance in the free top of a
held GPU's KV cache (gateway/scaling/idle_memory.py), against each site's real lending
bookkeeping (site_engine/engine/core/kv_lending.py on a BlockManager), and the policy's choice
between it and a new GPU (gateway/scaling/policy.py, `short_peak_s`)."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from pathlib import Path

import pytest

from gateway.federation import SiteConfig
from gateway.scaling.config import LocalSlot, ScalingConfigError, parse_scaling
from gateway.scaling.idle_memory import MIB, IdleMemory, LeaseLost, LendFailed, Room, beside
from gateway.scaling.policy import (
    ModelObservation,
    ModelState,
    ScaleOut,
    ScalingRule,
    SiteObservation,
    Verdict,
    decide,
)
from gateway.scaling.site_lender import SiteLender
from gateway.sites.grpc_client import GrpcSiteClient
from gateway.sites.interface import KvLease
from gateway.sites.registry import SiteRegistry, SiteState
from site_engine.engine.core.block_manager import BlockManager
from site_engine.engine.core.kv_lending import Lending, lend, lendable_bytes, take_back
from site_engine.engine.memory_plan import KvPlan

BLOCK = 16
BLOCK_BYTES = MIB  # one MiB a block: budgets in whole blocks
GPU0 = LocalSlot((("CUDA_VISIBLE_DEVICES", "0"),), ("--device", "cuda"))
GPU1 = LocalSlot((("CUDA_VISIBLE_DEVICES", "1"),), ("--device", "cuda"))


class Site:
    """One site's KV cache and its lending, as the site keeps them."""

    def __init__(self, blocks: int) -> None:
        self.manager = BlockManager(blocks, BLOCK)
        self.plan = KvPlan(blocks, BLOCK, BLOCK_BYTES, 4 * BLOCK, None, 0)
        self.lending: Lending | None = None

    def held(self) -> set[int]:
        return {b for rid in self.manager.request_ids() for b in self.manager.block_table(rid)}


class Sites:
    """The lending calls answered by each site's own bookkeeping, each lending held under the
    lease it was made with (a return or renewal naming another does nothing, as at a site);
    `unreachable` sites fail the call (LendFailed), `lost_answer` ones lend and then fail the
    call, and `overstating` ones report more than they lent."""

    def __init__(self, **sites: Site) -> None:
        self.sites = sites
        self.unreachable: set[str] = set()
        self.lost_answer: set[str] = set()
        self.overstating: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.leases: dict[str, str] = {}  # site -> the lease its lending is held under

    async def room(self, site: str) -> int:
        if site in self.unreachable:
            raise LendFailed(f"{site}: connection refused")
        s = self.sites[site]
        return lendable_bytes(s.manager, s.plan)

    async def lend(self, site: str, wanted_bytes: int, lease: KvLease) -> int:
        self.calls.append(("lend", site))
        if site in self.unreachable:
            raise LendFailed(f"{site}: connection refused")
        s = self.sites[site]
        s.lending = lend(s.manager, s.plan, wanted_bytes)
        s.plan = s.lending.plan
        self.leases[site] = lease.id
        if site in self.lost_answer:
            raise LendFailed(f"{site}: deadline exceeded")
        return s.lending.bytes * (2 if site in self.overstating else 1)

    async def take_back(self, site: str, lease_id: str) -> None:
        self.calls.append(("take_back", site))
        if site in self.unreachable:
            raise LendFailed(f"{site}: connection refused")
        s = self.sites[site]
        if self.leases.get(site) != lease_id or s.lending is None:
            return  # not this lease's: nothing changes
        s.plan = take_back(s.manager, s.lending, s.plan)
        s.lending = None
        del self.leases[site]

    async def renew(self, site: str, lease: KvLease) -> None:
        self.calls.append(("renew", site))
        if self.leases.get(site) != lease.id:
            raise LeaseLost(f"{site}: no such lease")


def test_the_site_with_most_room_lends_and_gets_it_back_on_retire() -> None:
    a, b = Site(20), Site(40)
    sites = Sites(a=a, b=b)
    memory = IdleMemory(sites)
    rooms = [Room("a", GPU0, 16 * MIB), Room("b", GPU1, 36 * MIB)]
    borrowing = asyncio.run(memory.place("x", rooms, 10 * MIB))
    assert borrowing is not None
    assert (borrowing.lender, borrowing.bytes) == ("b", 10 * MIB)
    assert b.manager.num_lent_blocks == 10
    assert b.plan.num_blocks == 30
    assert a.manager.num_lent_blocks == 0
    # The instance runs on b's GPU with exactly the lent memory as its KV cache.
    placed = beside(borrowing)
    assert placed.env == GPU1.env
    assert placed.args == ("--device", "cuda", "--kv-cache-mib", "10")
    assert asyncio.run(memory.retire("x"))
    assert b.manager.num_lent_blocks == 0
    assert b.plan.num_blocks == 40
    assert b.manager.num_free_blocks == 40
    assert memory.borrowings() == []
    assert not asyncio.run(memory.retire("x"))  # nothing borrowed any more: nothing given back
    b.manager.check_invariants()


def test_never_more_than_what_is_lendable() -> None:
    a = Site(20)
    sites = Sites(a=a)
    memory = IdleMemory(sites)
    # Its lendable share is under the budget: not even asked.
    assert asyncio.run(memory.place("x", [Room("a", GPU0, 8 * MIB)], 10 * MIB)) is None
    assert sites.calls == []
    # A site answering more than it said it could lend: given back, and no placement.
    sites.overstating.add("a")
    assert asyncio.run(memory.place("x", [Room("a", GPU0, 12 * MIB)], 10 * MIB)) is None
    assert sites.calls == [("lend", "a"), ("take_back", "a")]
    assert a.manager.num_lent_blocks == 0
    assert a.plan.num_blocks == 20


def test_a_failed_lend_falls_back_to_the_next_gpu_then_to_a_new_one() -> None:
    a, b = Site(40), Site(20)
    sites = Sites(a=a, b=b)
    sites.unreachable.add("a")
    memory = IdleMemory(sites)
    rooms = [Room("a", GPU0, 36 * MIB), Room("b", GPU1, 16 * MIB)]
    borrowing = asyncio.run(memory.place("x", rooms, 8 * MIB))
    assert borrowing is not None
    assert borrowing.lender == "b"
    # a's lease is given back in case it lent before its answer was lost (it did not).
    assert sites.calls == [("lend", "a"), ("take_back", "a"), ("lend", "b")]
    # b lends to one instance at a time and a is unreachable: the next one needs a new GPU.
    assert asyncio.run(memory.place("y", rooms, 8 * MIB)) is None
    assert [b.instance for b in memory.borrowings()] == ["x"]


def test_a_placement_never_takes_memory_a_running_sequence_holds() -> None:
    """The gateway's figure of a site's room is older than the site's cache: a sequence grew
    into the top since. The site refuses (its tail stops at the held block) and the instance
    goes to a new GPU; no held block is lent."""
    a = Site(20)
    a.manager.grow("r1", 4 * BLOCK)  # blocks 0-3
    a.manager.grow("r2", 16 * BLOCK)  # 4-19: the top
    a.manager.free("r1")
    before = a.held()
    memory = IdleMemory(Sites(a=a))
    assert asyncio.run(memory.place("x", [Room("a", GPU0, 16 * MIB)], 4 * MIB)) is None
    assert a.manager.num_lent_blocks == 0
    assert a.held() == before
    a.manager.check_invariants()


def test_a_lending_whose_answer_was_lost_is_given_back_by_its_lease() -> None:
    """The site lent, then its answer went missing: the placement does not count it, and the
    return naming the lease gives the site its memory back at once (not at the lease's end)."""
    a, b = Site(20), Site(20)
    sites = Sites(a=a, b=b)
    sites.lost_answer.add("a")
    memory = IdleMemory(sites)
    rooms = [Room("a", GPU0, 16 * MIB), Room("b", GPU1, 12 * MIB)]
    borrowing = asyncio.run(memory.place("x", rooms, 4 * MIB))
    assert borrowing is not None
    assert borrowing.lender == "b"
    assert (a.lending, a.plan.num_blocks, a.manager.num_lent_blocks) == (None, 20, 0)
    assert sites.leases == {"b": borrowing.lease.id}  # one lease per lending, each its own
    assert len(borrowing.lease.id) >= 32
    assert borrowing.lease.id not in repr(borrowing)  # a secret: out of logs and tracebacks


def test_leases_are_renewed_a_third_of_their_term_after_the_last_renewal() -> None:
    now = [0.0]
    a = Site(20)
    sites = Sites(a=a)
    memory = IdleMemory(sites, lease_ttl_s=30.0, clock=lambda: now[0])
    borrowing = asyncio.run(memory.place("x", [Room("a", GPU0, 16 * MIB)], 4 * MIB))
    assert borrowing is not None
    assert borrowing.lease.ttl_s == 30.0
    for at, renewed in ((5.0, False), (9.9, False), (10.0, True), (15.0, False), (20.0, True)):
        now[0] = at
        sites.calls.clear()
        asyncio.run(memory.renew_due())
        assert (sites.calls == [("renew", "a")]) is renewed, at
    # The site took the lending back (the lease lapsed while the gateway could not renew):
    # logged, not renewed again, and a retire's return names the lease and changes nothing.
    sites.leases.clear()
    now[0] = 40.0
    asyncio.run(memory.renew_due())
    now[0] = 100.0
    sites.calls.clear()
    asyncio.run(memory.renew_due())
    assert sites.calls == []
    assert asyncio.run(memory.retire("x"))
    assert sites.calls == [("take_back", "a")]
    assert a.lending is not None  # the fake site's lending stands: the return was not its lease


def test_bad_budgets_and_a_second_placement_of_one_instance_are_refused() -> None:
    memory = IdleMemory(Sites(a=Site(20)))
    with pytest.raises(ValueError, match="at least 1 MiB"):
        asyncio.run(memory.place("x", [Room("a", GPU0, 16 * MIB)], 1000))
    assert asyncio.run(memory.place("x", [Room("a", GPU0, 16 * MIB)], 4 * MIB)) is not None
    with pytest.raises(ValueError, match="already borrows"):
        asyncio.run(memory.place("x", [Room("a", GPU0, 16 * MIB)], 4 * MIB))


RULE = ScalingRule("m", max_sites=3, lead_time_s=10.0, settle_s=0.0, out_after_s=0.0,
                   out_cooldown_s=0.0, short_peak_s=30.0)  # fmt: skip


def scale_out(rule: ScalingRule, backlog_s: float, arrivals_s: float) -> Verdict:
    """The scale-out for one site with `backlog_s` of work and `arrivals_s` of work arrived
    per second over the last 20 s (1,000 answer tokens: one second of a site)."""
    state = ModelState()
    sites = (SiteObservation("a", True, True, backlog_s),)
    for now in range(21):
        tokens = round(arrivals_s * now * rule.site_tokens_per_s)
        observed = ModelObservation("m", sites, arrived_answer_tokens=tokens)
        state, verdict = decide(rule, state, observed, float(now))
    assert isinstance(verdict.action, ScaleOut), verdict.reason
    return verdict


def action(verdict: Verdict) -> ScaleOut:
    assert isinstance(verdict.action, ScaleOut)
    return verdict.action


def test_a_short_peak_goes_to_idle_memory_and_a_sustained_one_to_a_new_gpu() -> None:
    # A burst of 10 s of work with arrivals at half a site: one site clears the 8 s over the
    # 2 s line in 16 s, within short_peak_s (30 s).
    said = scale_out(RULE, 10.0, 0.5)
    burst = action(said)
    assert said.reason.endswith("s: idle memory first"), said.reason
    assert burst.idle_memory
    assert 14.0 < burst.peak_s < 18.0
    # Arrivals beyond what the site serves: the peak lasts as long as they do.
    said = scale_out(RULE, 3.0, 1.5)
    sustained = action(said)
    assert said.reason.endswith("a sustained peak: a new GPU"), said.reason
    assert not sustained.idle_memory
    assert sustained.peak_s == math.inf
    # The same burst with a 10 s notion of short: a new GPU; with 0, idle memory is off.
    assert not action(scale_out(replace(RULE, short_peak_s=10.0), 10.0, 0.5)).idle_memory
    assert not action(scale_out(replace(RULE, short_peak_s=0.0), 10.0, 0.5)).idle_memory


def test_short_peak_s_is_validated() -> None:
    with pytest.raises(ValueError, match="short_peak_s"):
        ScalingRule("m", short_peak_s=-1.0)
    bad = b"""{"models": [{"model": "m", "short_peak_s": -5,
               "actuator": {"kind": "signal"}}]}"""
    with pytest.raises(ScalingConfigError, match="short_peak_s"):
        parse_scaling(bad, Path("."), frozenset({"m"}))
    good = b"""{"models": [{"model": "m", "short_peak_s": 20, "actuator": {"kind": "signal"}}]}"""
    config = parse_scaling(good, Path("."), frozenset({"m"}))
    assert config.rules["m"].short_peak_s == 20.0


def test_rooms_leave_out_a_lending_site_one_without_room_and_one_unreachable() -> None:
    a, b, c, d = Site(20), Site(40), Site(8), Site(20)
    a.manager.grow("r", 20 * BLOCK)  # the whole cache held: no room
    sites = Sites(a=a, b=b, c=c, d=d)
    sites.unreachable.add("c")
    memory = IdleMemory(sites)
    candidates = [("a", GPU0), ("b", GPU1), ("c", GPU0), ("d", GPU1)]
    rooms = asyncio.run(memory.rooms(candidates))
    assert rooms == [Room("b", GPU1, 36 * MIB), Room("d", GPU1, 16 * MIB)]
    assert asyncio.run(memory.place("x", rooms, 4 * MIB)) is not None  # from b, the most room
    assert memory.borrows("x")
    assert [r.site for r in asyncio.run(memory.rooms(candidates))] == ["d"]


def test_the_site_lender_fails_with_lend_failed_on_any_call_error() -> None:
    """Real gRPC to a port nobody serves, and a site the registry does not hold."""
    config = SiteConfig("gone", "local", "local", "127.0.0.1:9", "m")

    async def calls() -> None:
        client = GrpcSiteClient("gone", config.endpoint, 0.2)  # its channel is this loop's
        registry = SiteRegistry([SiteState(config, 1, client)])
        lender = SiteLender(registry)
        lease = KvLease("x" * 32, 60.0)
        calls = (lender.room("gone"), lender.lend("gone", MIB, lease),
                 lender.take_back("gone", lease.id), lender.renew("gone", lease))  # fmt: skip
        for call in calls:
            with pytest.raises(LendFailed, match="gone"):
                await call
        with pytest.raises(LendFailed, match="not in the registry"):
            await lender.room("other")
        # IdleMemory turns the failure into no room (and no placement).
        memory = IdleMemory(lender)
        assert await memory.rooms([("gone", GPU0)]) == []
        assert await memory.place("x", [Room("gone", GPU0, 8 * MIB)], MIB) is None
        await registry.close()

    asyncio.run(calls())


def test_idle_memory_kv_mib_is_for_a_local_actuator() -> None:
    bad = (
        b"""{"models": [{"model": "m", "actuator": {"kind": "signal", "idle_memory_kv_mib": 4}}]}"""
    )
    with pytest.raises(ScalingConfigError, match="idle_memory_kv_mib"):
        parse_scaling(bad, Path("."), frozenset({"m"}))
    good = b"""{"models": [{"model": "m", "actuator": {"kind": "local", "command": ["x"],
                "slots": [{}], "idle_memory_kv_mib": 4}}]}"""
    config = parse_scaling(good, Path("."), frozenset({"m"}))
    assert config.models[0].actuator.idle_memory_kv_mib == 4


def test_a_borrower_borrows_its_overhead_too_and_keeps_only_its_kv_budget_for_the_cache() -> None:
    a = Site(40)
    memory = IdleMemory(Sites(a=a))
    # 10 MiB of KV cache and 6 MiB of weights and activations: 16 MiB lent, a 10 MiB cache.
    borrowing = asyncio.run(memory.place("x", [Room("a", GPU0, 36 * MIB)], 16 * MIB))
    assert borrowing is not None
    assert borrowing.bytes == 16 * MIB
    assert beside(borrowing, 6 * MIB).args[-2:] == ("--kv-cache-mib", "10")
    with pytest.raises(ValueError, match="no KV cache"):
        beside(borrowing, 16 * MIB)


def test_idle_memory_overhead_needs_a_kv_budget_and_a_local_actuator() -> None:
    local = b""""kind": "local", "command": ["x"], "slots": [{}]"""
    alone = b"""{"models": [{"model": "m", "actuator": {%s, "idle_memory_overhead_mib": 6}}]}"""
    with pytest.raises(ScalingConfigError, match="without idle_memory_kv_mib"):
        parse_scaling(alone % local, Path("."), frozenset({"m"}))
    signal = b"""{"models": [{"model": "m", "actuator": {"kind": "signal",
                  "idle_memory_overhead_mib": 6}}]}"""
    with pytest.raises(ScalingConfigError, match="for a local actuator"):
        parse_scaling(signal, Path("."), frozenset({"m"}))
    both = b"""{"models": [{"model": "m", "actuator": {%s, "idle_memory_kv_mib": 4,
                "idle_memory_overhead_mib": 6}}]}"""
    config = parse_scaling(both % local, Path("."), frozenset({"m"}))
    assert config.models[0].actuator.idle_memory_overhead_mib == 6
