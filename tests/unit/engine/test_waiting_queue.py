"""The incremental waiting queue (site_engine/engine/core/waiting_queue.py) against the ordering it
replaced: sorting the whole queue every step. Random arrivals, admissions, preemptions, retires
and classes; after every operation the queue must read exactly as the reference sort orders the
same sequences, and a scheduler driven at random must agree with it too. Under SPF with the
overtaking bound, no sequence is admitted after more than the bound's later arrivals of its
class, however long its prediction."""

from __future__ import annotations

import random

import pytest

from fedllm_contract.priority import Priority
from site_engine.engine.core.scheduler import Scheduler
from site_engine.engine.core.scheduling_policy import DEFAULT_SPF_MAX_OVERTAKES, PolicyName
from site_engine.engine.core.sequence import Sequence, SequenceStatus
from site_engine.engine.core.types import SamplingParams
from site_engine.engine.core.waiting_queue import WaitingQueue
from tests.unit.engine.test_scheduler import make, step


def reference_order(
    waiting: list[Sequence], policy: PolicyName, aging: float, bound: int | None = None
) -> list[Sequence]:
    """The ordering the scheduler used before the queue was incremental: sort everything (with
    the overtaking bound's cap on the length ranked by, scheduling_policy.py)."""
    if policy == "spf":
        cap = float("inf") if bound is None or aging == 0 else 0.75 + aging * (bound + 1)

        def spf_key(seq: Sequence) -> tuple[int, bool, float, int]:
            rank = min(seq.expected_output_tokens, cap) + aging * seq.arrival_index
            return (seq.priority, not seq.ever_scheduled, rank, seq.arrival_index)

        return sorted(waiting, key=spf_key)

    def fcfs_key(seq: Sequence) -> tuple[int, bool, int]:
        return (seq.priority, not seq.ever_scheduled, seq.arrival_index)

    return sorted(waiting, key=fcfs_key)


def _fresh(rng: random.Random, arrival: int) -> Sequence:
    max_tokens = rng.randint(1, 64)
    predicted = rng.choice([None, 0, rng.randint(1, 80)])
    seq = Sequence(f"r{arrival}", (1,) * rng.randint(1, 8), SamplingParams(max_tokens),
                   predicted, arrival_index=arrival)  # fmt: skip
    seq.priority = rng.choice(list(Priority))
    return seq


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(("policy", "aging", "bound"), [
    ("fcfs", 0.0, None), ("spf", 0.0, None), ("spf", 0.37, None), ("spf", 2.0, None),
    ("static", 0.0, None), ("spf", 0.37, 5), ("spf", 1.0, 0), ("spf", 2.0, 12),
    ("spf", 0.0, 3)])  # fmt: skip
def test_queue_reads_as_the_reference_sort_after_every_change(
    seed: int, policy: PolicyName, aging: float, bound: int | None
) -> None:
    rng = random.Random(seed)
    queue = WaitingQueue(policy, aging, bound)
    waiting: list[Sequence] = []  # the same sequences, unordered
    running: list[Sequence] = []
    arrivals = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.4:
            seq = _fresh(rng, arrivals)
            arrivals += 1
            queue.add(seq)
            waiting.append(seq)
        elif op < 0.6 and waiting:  # admit the head of a class, now and then one behind it
            priority = rng.choice(list(Priority))
            members = queue.of_class(priority)
            chosen = [s for i, s in enumerate(members[:4]) if i == 0 or rng.random() < 0.5]
            for seq in chosen:
                queue.admitting(seq)
                seq.status, seq.ever_scheduled = SequenceStatus.RUNNING, True
                waiting.remove(seq)
                running.append(seq)
            queue.drop_admitted(priority, len(chosen))
        elif op < 0.8 and running:  # preempt one back to the front of its class
            seq = running.pop(rng.randrange(len(running)))
            seq.status = SequenceStatus.WAITING
            queue.add(seq)
            waiting.append(seq)
        elif waiting:  # retire a waiting one (cancelled, released)
            seq = waiting.pop(rng.randrange(len(waiting)))
            queue.remove(seq)
        assert list(queue) == reference_order(waiting, policy, aging, bound)
        assert len(queue) == len(waiting)
        queue.check()


def test_removing_a_sequence_not_waiting_is_an_error() -> None:
    queue = WaitingQueue("fcfs", 0.0)
    seq = Sequence("a", (1,), SamplingParams(4))
    with pytest.raises(ValueError, match="not waiting"):
        queue.remove(seq)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("policy", ["fcfs", "spf"])
def test_scheduler_admits_in_the_reference_order(seed: int, policy: PolicyName) -> None:
    """A small KV cache, so that sequences are preempted, with random classes and arrivals: each
    step's admissions are the reference order's first waiting sequences, in that order."""
    rng = random.Random(seed)
    sched: Scheduler = make(num_blocks=24, block_size=4, max_num_seqs=6,
                            max_num_batched_tokens=64, policy=policy, spf_aging=0.5)  # fmt: skip
    added = 0
    for _ in range(120):
        for _ in range(rng.randint(0, 3)):
            sched.add(f"r{added}", [1] * rng.randint(1, 12), SamplingParams(rng.randint(1, 16)),
                      rng.choice([None, rng.randint(1, 20)]),
                      priority=rng.choice(list(Priority)))  # fmt: skip
            added += 1
        before = reference_order(list(sched._roster.waiting), policy, 0.5)
        out, _ = step(sched)
        admitted = [s for s in before if s.status is not SequenceStatus.WAITING]
        # Admission is a prefix of each class's reference order (nothing here waits for a
        # grammar or an adapter), and the chunks list them in that order.
        for priority in Priority:
            members = [s for s in before if s.priority is priority]
            taken = [s for s in admitted if s.priority is priority]
            assert members[: len(taken)] == taken
        admitted_ids = [s.request_id for s in admitted]
        new_ids = [c.request_id for c in out.chunks if c.request_id in admitted_ids]
        assert new_ids == [rid for rid in admitted_ids if rid in new_ids]
        assert list(sched._roster.waiting) == reference_order(
            list(sched._roster.waiting), policy, 0.5
        )
        sched.check_invariants()


def _overtakes(admitted: list[Sequence]) -> dict[str, int]:
    """For each sequence, how many of its class that arrived after it were admitted before it."""
    seen: list[Sequence] = []
    out: dict[str, int] = {}
    for seq in admitted:
        out[seq.request_id] = sum(
            1 for s in seen if s.priority is seq.priority and s.arrival_index > seq.arrival_index
        )
        seen.append(seq)
    return out


def _drain_in_queue_order(
    rng: random.Random, aging: float, bound: int | None, arrivals: int
) -> list[Sequence]:
    """Random arrivals (a few very long predictions among short ones, random classes) into a
    queue whose head of a random class is admitted now and then, faster than they come once
    the arrivals stop: the order in which they were admitted."""
    queue = WaitingQueue("spf", aging, bound)
    admitted: list[Sequence] = []
    for i in range(arrivals):
        predicted = 900 if rng.random() < 0.05 else rng.randint(1, 40)
        seq = Sequence(f"r{i}", (1,), SamplingParams(1000), predicted, arrival_index=i)
        seq.priority = rng.choice([Priority.INTERACTIVE, Priority.BATCH])
        queue.add(seq)
        if rng.random() < 0.9:  # a little slower than arrivals: the queue grows
            _admit_head(queue, rng, admitted)
    while queue:
        _admit_head(queue, rng, admitted)
    return admitted


def _admit_head(queue: WaitingQueue, rng: random.Random, admitted: list[Sequence]) -> None:
    classes = [p for p in Priority if queue.count(p)]
    if not classes:
        return
    priority = rng.choice(classes)
    head = queue.of_class(priority)[0]
    queue.admitting(head)
    head.status, head.ever_scheduled = SequenceStatus.RUNNING, True
    queue.drop_admitted(priority, 1)
    admitted.append(head)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("aging", "bound"), [(1.0, 16), (0.25, 40), (3.0, 0), (1.0, 100)])
def test_no_sequence_is_overtaken_by_more_later_arrivals_than_the_bound(
    seed: int, aging: float, bound: int
) -> None:
    admitted = _drain_in_queue_order(random.Random(seed), aging, bound, 2_000)
    worst = max(_overtakes(admitted).values())
    assert worst <= bound
    # The aging alone lets a 900-token prediction be passed by up to ~899 / aging arrivals.
    unbounded = max(
        _overtakes(_drain_in_queue_order(random.Random(seed), aging, None, 2_000)).values()
    )
    assert unbounded > bound


def test_the_scheduler_keeps_the_default_bound_against_a_stream_of_short_requests() -> None:
    """One batch slot, a long prediction first, then a short request every step: SPF admits the
    short ones ahead of it, but no more than the default bound of them (the aging alone, one
    token a step, would let 3,998 pass)."""
    sched: Scheduler = make(
        num_blocks=300, block_size=16, max_num_seqs=1, max_model_len=8192, policy="spf"
    )
    assert sched.config.spf_max_overtakes == DEFAULT_SPF_MAX_OVERTAKES
    sched.add("long", [1], SamplingParams(4000), 4000)
    admitted: list[str] = []
    for i in range(DEFAULT_SPF_MAX_OVERTAKES + 20):
        sched.add(f"s{i}", [1], SamplingParams(1), 1)
        out, _ = step(sched)
        admitted += [c.request_id for c in out.chunks if c.start_position == 0]
        if "long" in admitted:
            break
    assert admitted.index("long") == DEFAULT_SPF_MAX_OVERTAKES


@pytest.mark.parametrize("bound", [0, 5])
def test_the_scheduler_keeps_a_configured_bound(bound: int) -> None:
    """The bound set in the scheduler's config, not the default, is the one its queue keeps."""
    sched: Scheduler = make(
        num_blocks=300, block_size=16, max_num_seqs=1, max_model_len=8192, policy="spf",
        spf_max_overtakes=bound,
    )  # fmt: skip
    sched.add("long", [1], SamplingParams(4000), 4000)
    admitted: list[str] = []
    for i in range(bound + 20):
        sched.add(f"s{i}", [1], SamplingParams(1), 1)
        out, _ = step(sched)
        admitted += [c.request_id for c in out.chunks if c.start_position == 0]
        if "long" in admitted:
            break
    assert admitted.index("long") == bound


@pytest.mark.parametrize("bound", [-1, 1.5, "8"])
def test_a_bad_overtaking_bound_is_refused(bound: object) -> None:
    with pytest.raises(ValueError, match="spf_max_overtakes"):
        make(policy="spf", spf_max_overtakes=bound)
