"""The incremental waiting queue (site_engine/engine/core/waiting_queue.py) against the ordering it
replaced: sorting the whole queue every step. Random arrivals, admissions, preemptions, retires
and classes; after every operation the queue must read exactly as the reference sort orders the
same sequences, and a scheduler driven at random must agree with it too."""

from __future__ import annotations

import random

import pytest

from fedllm_contract.priority import Priority
from site_engine.engine.core.scheduler import Scheduler
from site_engine.engine.core.scheduling_policy import PolicyName
from site_engine.engine.core.sequence import Sequence, SequenceStatus
from site_engine.engine.core.types import SamplingParams
from site_engine.engine.core.waiting_queue import WaitingQueue
from tests.unit.engine.test_scheduler import make, step


def reference_order(waiting: list[Sequence], policy: PolicyName, aging: float) -> list[Sequence]:
    """The ordering the scheduler used before the queue was incremental: sort everything."""
    if policy == "spf":

        def spf_key(seq: Sequence) -> tuple[int, bool, float, int]:
            rank = seq.expected_output_tokens + aging * seq.arrival_index
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
@pytest.mark.parametrize(("policy", "aging"), [("fcfs", 0.0), ("spf", 0.0), ("spf", 0.37),
                                               ("spf", 2.0), ("static", 0.0)])  # fmt: skip
def test_queue_reads_as_the_reference_sort_after_every_change(
    seed: int, policy: PolicyName, aging: float
) -> None:
    rng = random.Random(seed)
    queue = WaitingQueue(policy, aging)
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
        assert list(queue) == reference_order(waiting, policy, aging)
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
        before = reference_order(list(sched._waiting), policy, 0.5)
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
        assert list(sched._waiting) == reference_order(list(sched._waiting), policy, 0.5)
        sched.check_invariants()
