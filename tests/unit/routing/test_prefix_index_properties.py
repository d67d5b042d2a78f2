"""Property tests of the precise prefix index (gateway/routing/prefix/site_index.py) against a
simulated site: whatever the delivery does to the site's batches (loses, repeats or reorders
them), across cache clears, site restarts and several gateway replicas, the index never claims a
block the site does not hold; and with nothing lost since its last snapshot it knows exactly what
the site holds.

Consistency of replicas, as these tests pin it: each replica consumes a stream of its own; a
replica that lost a batch matches nothing for the site until its own re-subscription brings a
snapshot, and two replicas that each lost nothing since their snapshots hold the same view."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from fedllm_contract.cache_events import CHAIN_START, CacheEventBatch, Tier
from gateway.routing.prefix.site_index import ApplyOutcome, SiteCacheIndex
from tests.unit.routing.cache_site import CacheSite, Stream

FATES = ("ok", "ok", "drop", "repeat", "late")
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.integers(0, 50), st.integers(1, 4)),
        # a chain stored under a block the site no longer holds (against the site's contract,
        # or a parent the index never saw): held by the site, never matchable
        st.tuples(st.just("orphan"), st.integers(0, 50), st.integers(1, 3)),
        st.tuples(st.just("evict"), st.integers(0, 50), st.integers(1, 3)),
        st.tuples(st.just("to_host"), st.integers(0, 50), st.integers(1, 3)),
        st.tuples(st.just("evict_host"), st.integers(0, 50), st.integers(1, 3)),
        st.tuples(st.just("clear"), st.booleans(), st.just(0)),
        st.tuples(st.just("restart"), st.just(0), st.just(0)),
        # the site sends a batch on every stream; what happens to it on the way to replica 0
        # and to replica 1
        st.tuples(st.just("flush"), st.sampled_from(FATES), st.sampled_from(FATES)),
        st.tuples(st.just("flush"), st.sampled_from(FATES), st.sampled_from(FATES)),
    ),
    min_size=3,
    max_size=60,
)


@dataclass
class Replica:
    """One gateway's consumer of its own stream: applies what arrives, re-subscribes on a gap."""

    site: CacheSite
    index: SiteCacheIndex
    stream: Stream = field(default_factory=Stream)
    late: CacheEventBatch | None = None
    lost_since_snapshot: bool = False

    def __post_init__(self) -> None:
        self.site.streams.append(self.stream)
        self.resubscribe()

    def resubscribe(self) -> None:
        _, snapshot = self.site.subscribe(self.stream)
        self.late = None
        self.lost_since_snapshot = False
        assert self.index.apply(snapshot) is ApplyOutcome.APPLIED

    def flush(self, fate: str = "ok") -> None:
        """The site sends this stream's next batch; the delivery does what `fate` says."""
        batch = self.site.batch(self.stream)
        arriving: list[CacheEventBatch] = []
        if fate == "drop":
            self.lost_since_snapshot = True
        elif fate == "repeat":
            arriving = [batch, batch]
        elif fate == "late":  # overtaken by the next batch
            if self.late is not None:
                arriving = [batch, self.late]
            self.late = batch if self.late is None else None
        else:
            arriving = [batch]
        for delivered in arriving:
            gap = self.index.apply(delivered) is ApplyOutcome.GAP
            if gap:
                self.resubscribe()  # a new call: what was still in flight on the old one is gone
            self.assert_safe()
            if gap:
                break

    def assert_safe(self) -> None:
        """Never a claim that the site's truth at the batch the index applied last does not
        back; nothing at all while stale."""
        index = self.index
        if index.stale:
            assert index.match(list(range(1, 400))) == (0, 0)
            return
        truth = self.stream.truths[index.sequence]
        for block, bits in index.holds().items():
            assert bits & ~truth.get(block, 0) == 0, (block, bits, truth.get(block))


def run(ops, replicas: int = 1, max_blocks: int = 10_000) -> tuple[CacheSite, list[Replica]]:
    site = CacheSite()
    consumers = [Replica(site, SiteCacheIndex(max_blocks)) for _ in range(replicas)]
    for op, a, b in ops:
        if op == "flush":
            for replica, fate in zip(consumers, (a, b), strict=False):
                replica.flush(fate)
            continue
        blocks = sorted(site.held)
        pick = blocks[a % len(blocks) : a % len(blocks) + b] if blocks else []
        if op == "store":
            parent = blocks[a % len(blocks)] if blocks and a % 3 else CHAIN_START
            site.store_chain(parent, b, Tier.DEVICE)
        elif op == "orphan":
            site.store_chain(site.next_id + 1000, b, Tier.DEVICE)
        elif op == "evict":
            site.remove(pick, Tier.DEVICE)
        elif op == "to_host":
            site.move_to_host(pick)
        elif op == "evict_host":
            site.remove(pick, Tier.HOST)
        elif op == "clear" and a:
            for replica in consumers:
                replica.flush("ok")
            site.start_over()
        elif op == "clear":
            site.clear()
        elif op == "restart":
            site.restart()
            for replica in consumers:  # its stream broke: it subscribes again
                replica.resubscribe()
    return site, consumers


@settings(max_examples=400, deadline=None)
@given(OPS)
def test_never_claims_a_block_the_site_does_not_hold(ops) -> None:
    run(ops)


def reachable(site: CacheSite) -> dict[int, int]:
    """The blocks a match can use: held, and every block before them held too."""

    def anchored(block: int) -> bool:
        while block != CHAIN_START:
            if block not in site.held:
                return False
            block = site.parents[block]
        return True

    return {block: bits for block, bits in site.held.items() if anchored(block)}


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_knows_every_matchable_block_when_nothing_is_lost(ops) -> None:
    site, (replica,) = run([(op, "ok", "ok") if op == "flush" else (op, a, b) for op, a, b in ops])
    replica.flush()
    assert not replica.index.stale
    held = replica.index.holds()
    assert held.items() >= reachable(site).items()
    assert held.items() <= site.held.items()
    if not any(op == "orphan" for op, _, _ in ops):
        assert replica.index.orphans == 0


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_replicas_agree_once_neither_lost_a_batch_since_its_snapshot(ops) -> None:
    site, replicas = run(ops, replicas=2)
    for replica in replicas:
        replica.late = None
        replica.flush()
    clean = [r for r in replicas if not r.lost_since_snapshot]
    for replica in clean:
        assert replica.index.holds().items() >= reachable(site).items()
    if len(clean) == 2:  # every prompt (a chain from the first block) matches alike on both
        ours, theirs = (replica.index for replica in clean)
        for block in site.held:
            chain = [block]
            while site.parents.get(chain[-1], CHAIN_START) != CHAIN_START:
                chain.append(site.parents[chain[-1]])
            assert ours.match(chain[::-1]) == theirs.match(chain[::-1])


@settings(max_examples=200, deadline=None)
@given(OPS, st.integers(1, 12))
def test_a_bounded_index_under_claims_but_never_over_claims(ops, bound) -> None:
    _, (replica,) = run(ops, max_blocks=bound)
    assert len(replica.index) <= bound


@settings(max_examples=200, deadline=None)
@given(OPS, st.lists(st.integers(1, 300), max_size=30))
def test_a_match_is_the_longest_held_run_from_the_first_block(ops, prompt) -> None:
    _, (replica,) = run(ops)
    held = replica.index.holds()
    run_length = 0
    while run_length < len(prompt) and prompt[run_length] in held:
        run_length += 1
    on_device = sum(1 for block in prompt[:run_length] if held[block] & Tier.DEVICE)
    assert replica.index.match(prompt) == (run_length, on_device)
