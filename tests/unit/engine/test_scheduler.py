"""Scheduler behaviour driven by hand-made ModelRunnerOutputs (no model)."""

from __future__ import annotations

from collections.abc import Mapping
from itertools import pairwise
from typing import Any

import pytest

from fedllm_contract.priority import Priority
from site_engine.engine.core.scheduler import ClassLoad, Scheduler, SchedulerConfig, SchedulerStats
from site_engine.engine.core.scheduling_policy import PolicyName, admission_order
from site_engine.engine.core.sequence import Sequence, SequenceStatus, SequenceUpdate
from site_engine.engine.core.types import (
    FinishReason,
    ModelRunnerOutput,
    SamplingParams,
    ScheduledChunk,
    SchedulerOutput,
)

EOS = 0


def make(**overrides: Any) -> Scheduler:
    values: dict[str, Any] = {
        "num_blocks": 64,
        "block_size": 4,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "max_model_len": 256,
        "eos_token_ids": frozenset({EOS}),
        "watermark": 0.0,
    }
    values.update(overrides)
    return Scheduler(SchedulerConfig(**values))


def sp(max_tokens: int, *, ignore_eos: bool = False) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)


def fake_token(chunk: ScheduledChunk) -> int:
    """Never EOS, and tells which generation step produced it."""
    return 100 + chunk.num_generated


def check_chunk(sched: Scheduler, chunk: ScheduledChunk) -> None:
    seq = sched.get(chunk.request_id)
    assert seq is not None
    assert seq.status is SequenceStatus.RUNNING
    end = chunk.start_position + chunk.num_tokens
    # Scheduled positions count as computed at once; a sampled chunk leaves one token pending.
    assert end == seq.num_computed_tokens
    assert chunk.token_ids == seq.all_token_ids[chunk.start_position : end]
    assert chunk.sample == (end == seq.num_tokens - seq.num_pending)
    assert seq.num_pending == int(chunk.sample)  # schedule -> update: nothing pending before
    assert chunk.num_generated == seq.num_output_tokens - int(chunk.sample)
    assert len(chunk.block_table) * sched.config.block_size >= end


def step(
    sched: Scheduler, tokens: Mapping[str, int] | None = None
) -> tuple[SchedulerOutput, list[SequenceUpdate]]:
    out = sched.schedule()
    assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
    assert len(out.chunks) <= sched.config.max_num_seqs
    for chunk in out.chunks:
        check_chunk(sched, chunk)
    tokens = tokens or {}
    sampled = {
        c.request_id: tokens.get(c.request_id, fake_token(c)) for c in out.chunks if c.sample
    }
    updates = list(sched.update(out, ModelRunnerOutput(sampled)))
    sched.check_invariants()
    return out, updates


def run_to_completion(
    sched: Scheduler, max_steps: int = 1000
) -> tuple[list[SchedulerOutput], dict[str, list[int]]]:
    outputs: list[SchedulerOutput] = []
    generated: dict[str, list[int]] = {}
    while sched.has_unfinished():
        out, updates = step(sched)
        outputs.append(out)
        for update in updates:
            generated.setdefault(update.request_id, []).extend(update.new_token_ids)
        assert len(outputs) < max_steps, "no progress"
    assert sched.stats().kv_blocks_used == 0
    return outputs, generated


def first_scheduled_order(outputs: list[SchedulerOutput]) -> list[str]:
    order: list[str] = []
    for out in outputs:
        order.extend(c.request_id for c in out.chunks if c.request_id not in order)
    return order


# ---------------------------------------------------------------- iteration-level retirement


def test_finished_sequence_is_retired_at_once_and_next_is_admitted_next_step() -> None:
    sched = make(max_num_seqs=1)
    a = sched.add("a", [1, 2, 3], sp(2))
    sched.add("b", [4, 5], sp(2))
    step(sched)
    _, updates = step(sched)
    assert updates == [SequenceUpdate("a", (101,), FinishReason.LENGTH)]
    assert a.status is SequenceStatus.FINISHED
    assert a.output_token_ids == [100, 101]
    assert sched.get("a") is None
    assert sched.stats().kv_blocks_used == 0
    out = sched.schedule()
    assert [c.request_id for c in out.chunks] == ["b"]
    assert out.finished_request_ids == frozenset({"a"})


# ---------------------------------------------------------------- adaptive batch size


@pytest.mark.parametrize(
    ("predicted", "watermark", "admitted"),
    [
        # 8-token prompts, max_tokens=32, 20 blocks of 4 tokens.
        (None, 0.0, 2),  # plan 8 + 32 = 40 tokens = 10 blocks each: 2 * 10 = 20 fit
        (32, 0.0, 2),  # a prediction of max_tokens plans the same
        (4, 0.0, 6),  # plan 8 + 4 = 12 tokens = 3 blocks each: 6 * 3 = 18 <= 20 < 21
        (0, 0.0, 6),  # a prediction is clamped to >= 1 token: 9 tokens = 3 blocks
        (4, 0.15, 5),  # watermark int(20 * 0.15) = 3 blocks: 5 * 3 = 15 <= 17 < 18
    ],
)
def test_predicted_length_admits_more_than_max_tokens(
    predicted: int | None, watermark: float, admitted: int
) -> None:
    sched = make(
        num_blocks=20, block_size=4, max_num_seqs=16, max_model_len=64, watermark=watermark
    )
    for i in range(8):
        sched.add(f"r{i}", range(1, 9), sp(32), predicted_tokens=predicted)
    out, _ = step(sched)
    assert len(out.chunks) == admitted
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting) == (admitted, 8 - admitted)
    # Only computed tokens hold memory: 8 prompt tokens = 2 blocks per sequence.
    assert stats.kv_blocks_used == 2 * admitted


def test_underestimated_predictions_still_finish_exactly() -> None:
    sched = make(num_blocks=12, block_size=4, max_num_seqs=16, max_model_len=64)
    seqs = [sched.add(f"r{i}", range(1, 9), sp(12), predicted_tokens=1) for i in range(6)]
    outputs, generated = run_to_completion(sched)
    assert any(out.preempted_request_ids for out in outputs)
    for seq in seqs:
        assert generated[seq.request_id] == [100 + i for i in range(12)]
        assert seq.finish_reason is FinishReason.LENGTH


# ---------------------------------------------------------------- limits per step


def test_max_num_seqs_is_respected() -> None:
    sched = make(max_num_seqs=2)
    for i in range(5):
        sched.add(f"r{i}", [1, 2], sp(3))
    out, _ = step(sched)
    assert [c.request_id for c in out.chunks] == ["r0", "r1"]
    assert (sched.stats().num_running, sched.stats().num_waiting) == (2, 3)
    outputs, _ = run_to_completion(sched)
    assert max(len(out.chunks) for out in outputs) <= 2


def test_token_budget_is_shared_by_decodes_and_prefill_chunks() -> None:
    sched = make(max_num_batched_tokens=10)
    for rid in "abcd":
        sched.add(rid, [1, 2, 3, 4], sp(3))
    out, _ = step(sched)
    assert [(c.request_id, c.num_tokens, c.sample) for c in out.chunks] == [
        ("a", 4, True),
        ("b", 4, True),
        ("c", 2, False),
    ]
    out, _ = step(sched)
    assert [(c.request_id, c.num_tokens, c.sample) for c in out.chunks] == [
        ("a", 1, True),
        ("b", 1, True),
        ("c", 2, True),
        ("d", 4, True),
    ]
    outputs, _ = run_to_completion(sched)
    assert all(out.num_batched_tokens <= 10 for out in outputs)


def test_chunked_prefill_samples_only_on_the_last_chunk() -> None:
    sched = make(max_num_batched_tokens=4, block_size=4)
    prompt = tuple(range(1, 11))
    sched.add("long", prompt, sp(2))
    expected = [
        (prompt[0:4], 0, 1, False),
        (prompt[4:8], 4, 2, False),
        (prompt[8:10], 8, 3, True),
        ((100,), 10, 3, True),
    ]
    tables = []
    for token_ids, start, num_blocks, sample in expected:
        out, _ = step(sched)
        (chunk,) = out.chunks
        assert (chunk.token_ids, chunk.start_position, chunk.sample) == (token_ids, start, sample)
        assert len(chunk.block_table) == num_blocks
        tables.append(chunk.block_table)
    # Later tables extend earlier ones: computed KV never moves.
    assert all(later[: len(earlier)] == earlier for earlier, later in pairwise(tables))
    assert not sched.has_unfinished()


# ---------------------------------------------------------------- recompute preemption


@pytest.mark.parametrize("budget", [64, 2])
def test_preemption_recomputes_prompt_and_generated_tokens(budget: int) -> None:
    sched = make(num_blocks=4, block_size=2, max_model_len=16, max_num_batched_tokens=budget)
    a = sched.add("a", [1, 2], sp(5), predicted_tokens=1)
    b = sched.add("b", [3, 4], sp(5), predicted_tokens=1)
    outputs, generated = run_to_completion(sched)
    preempting = [out for out in outputs if out.preempted_request_ids]
    assert preempting
    assert all(out.preempted_request_ids <= out.finished_request_ids for out in preempting)
    assert b.num_preemptions >= 1
    assert sched.stats().num_preemptions == a.num_preemptions + b.num_preemptions
    # b's re-prefill starts at position 0 and covers prompt + the tokens it had generated.
    redo = [
        c
        for out in outputs
        for c in out.chunks
        if c.request_id == "b" and c.start_position == 0 and c.num_generated > 0
    ]
    assert redo
    assert redo[0].token_ids[:2] == (3, 4)
    assert redo[0].token_ids[2:] == tuple(100 + i for i in range(len(redo[0].token_ids) - 2))
    for seq in (a, b):
        assert generated[seq.request_id] == [100, 101, 102, 103, 104]
        assert seq.output_token_ids == generated[seq.request_id]
        assert seq.finish_reason is FinishReason.LENGTH


def test_lone_sequence_that_cannot_grow_is_preempted_in_static_batch() -> None:
    # Static batch: finished member "a" keeps its blocks, so "b" runs out and is preempted;
    # that ends the batch, frees "a"'s blocks, and "b" comes back alone.
    sched = make(policy="static", num_blocks=4, block_size=2, max_model_len=16)
    sched.add("a", [1, 2], sp(1), predicted_tokens=1)
    b = sched.add("b", [3, 4], sp(6), predicted_tokens=1)
    outputs, generated = run_to_completion(sched)
    assert any(out.preempted_request_ids == {"b"} for out in outputs)
    assert generated["b"] == [100 + i for i in range(6)]
    assert b.num_preemptions == 1


def test_no_admission_in_a_step_that_preempted() -> None:
    sched = make(num_blocks=4, block_size=2, max_model_len=16)
    sched.add("a", [1, 2], sp(5), predicted_tokens=1)
    sched.add("b", [3, 4], sp(5), predicted_tokens=1)
    for _ in range(3):
        step(sched)
    sched.add("c", [5], sp(1))
    out, _ = step(sched)  # a needs a third block: b, admitted last, gives its two back
    assert out.preempted_request_ids == {"b"}
    assert [c.request_id for c in out.chunks] == ["a"]


# ---------------------------------------------------------------- finishing


@pytest.mark.parametrize(
    ("script", "ignore_eos", "max_tokens", "expected", "reason"),
    [
        ([EOS], False, 5, [EOS], FinishReason.STOP),
        ([7, EOS, 7], False, 5, [7, EOS], FinishReason.STOP),
        ([EOS, EOS, 7], True, 3, [EOS, EOS, 7], FinishReason.LENGTH),
        ([7, 8, 9, 10], False, 3, [7, 8, 9], FinishReason.LENGTH),
    ],
)
def test_stop_conditions(
    script: list[int],
    ignore_eos: bool,
    max_tokens: int,
    expected: list[int],
    reason: FinishReason,
) -> None:
    sched = make()
    seq = sched.add("a", [1, 2, 3], sp(max_tokens, ignore_eos=ignore_eos))
    last: list[SequenceUpdate] = []
    for token in script:
        if not sched.has_unfinished():
            break
        _, last = step(sched, {"a": token})
    assert seq.output_token_ids == expected
    assert last[-1].finish_reason is reason
    assert seq.finish_reason is reason
    assert sched.stats().kv_blocks_used == 0


def test_context_full_finishes_with_length() -> None:
    sched = make(max_model_len=10)
    seq = sched.add("a", range(1, 7), sp(4))
    run_to_completion(sched)
    assert seq.num_tokens == 10
    assert seq.finish_reason is FinishReason.LENGTH


# ---------------------------------------------------------------- cancel


def test_cancel_frees_blocks_at_once() -> None:
    sched = make()
    a = sched.add("a", range(1, 10), sp(8))
    step(sched)
    assert sched.stats().kv_blocks_used == 3
    assert sched.finish("a", FinishReason.CANCELLED)
    assert sched.stats().kv_blocks_used == 0
    assert (a.status, a.finish_reason) == (SequenceStatus.FINISHED, FinishReason.CANCELLED)
    before = sched.stats()
    assert not sched.finish("a", FinishReason.CANCELLED)
    assert not sched.finish("unknown", FinishReason.CANCELLED)
    assert sched.stats() == before
    out = sched.schedule()
    assert out.is_empty
    assert out.finished_request_ids == {"a"}
    assert sched.schedule().finished_request_ids == frozenset()


def test_cancel_waiting_and_between_schedule_and_update() -> None:
    sched = make(max_num_seqs=2)
    sched.add("a", [1, 2], sp(4))
    sched.add("b", [3, 4], sp(4))
    sched.add("c", [5, 6], sp(4))
    assert sched.finish("c", FinishReason.CANCELLED)
    assert sched.stats().num_waiting == 2
    out = sched.schedule()
    assert out.finished_request_ids == set()  # c never ran: nothing of it for the runner to drop
    assert sched.finish("a", FinishReason.STOP)  # e.g. a stop string seen while the step ran
    updates = sched.update(out, ModelRunnerOutput({"a": 100, "b": 100}))
    assert [u.request_id for u in updates] == ["b"]
    sched.check_invariants()
    assert sched.schedule().finished_request_ids == {"a"}


# ---------------------------------------------------------------- release for offloading


def test_release_queued_returns_never_started_ones_from_the_tail() -> None:
    sched = make(num_blocks=4, block_size=2, max_model_len=16)
    sched.add("a", [1, 2], sp(5), predicted_tokens=1)
    b = sched.add("b", [3, 4], sp(5), predicted_tokens=1)
    for _ in range(3):
        step(sched)
    out, _ = step(sched)
    assert out.preempted_request_ids == {"b"}
    for rid in "cde":
        sched.add(rid, [5, 6], sp(2))
    assert sched.release_queued(0) == []
    released = sched.release_queued(2)
    assert [seq.request_id for seq in released] == ["d", "e"]
    assert all(seq.finish_reason is FinishReason.RELEASED for seq in released)
    assert [seq.request_id for seq in sched.release_queued(10)] == ["c"]
    assert sched.release_queued(10) == []
    assert b.status is SequenceStatus.WAITING
    assert sched.get("b") is b
    sched.check_invariants()
    # Never scheduled: the model runner never saw them, so they are not reported as finished.
    assert not {"c", "d", "e"} & sched.schedule().finished_request_ids
    with pytest.raises(ValueError, match="max_requests"):
        sched.release_queued(-1)


def test_a_released_request_may_come_back_at_once() -> None:
    """Offloaded to another site and handed back here (A -> B -> A): its id is free again at
    once, also on an idle engine that schedules no step in between. Before, a retired id stayed
    taken until the next step ("request_id is already in use")."""
    sched = make()
    sched.add("x", [1, 2], sp(4))
    (released,) = sched.release_queued(1)
    assert released.request_id == "x"
    back = sched.add("x", [1, 2], sp(4))
    assert sched.get("x") is back
    sched.add("queued", [3], sp(2))
    assert sched.finish("queued", FinishReason.CANCELLED)  # cancelled while waiting: the same
    sched.add("queued", [3], sp(2))
    out, _ = step(sched)
    assert {c.request_id for c in out.chunks} == {"x", "queued"}
    assert not out.finished_request_ids
    sched.check_invariants()


def test_release_queued_follows_spf_order() -> None:
    sched = make(policy="spf", spf_aging=0.0)
    sched.add("long", [1], sp(64), predicted_tokens=50)
    sched.add("short", [1], sp(64), predicted_tokens=2)
    sched.add("none", [1], sp(20))
    assert [seq.request_id for seq in sched.release_queued(1)] == ["long"]
    assert [seq.request_id for seq in sched.release_queued(1)] == ["none"]


# ---------------------------------------------------------------- static batches


def test_static_batch_runs_until_longest_member_finishes() -> None:
    sched = make(policy="static", max_num_seqs=2)
    a = sched.add("a", [1, 2, 3, 4], sp(2))
    sched.add("b", [5, 6, 7, 8], sp(5))
    sched.add("c", [9], sp(1))
    out, _ = step(sched)
    assert [c.request_id for c in out.chunks] == ["a", "b"]
    held = sched.stats().kv_blocks_used
    step(sched)
    assert a.finish_reason is FinishReason.LENGTH
    assert sched.stats().kv_blocks_used >= held  # a's blocks stay with the batch
    for i in range(3):
        out, _ = step(sched)
        assert [c.request_id for c in out.chunks] == ["b"]  # a is not computed, c not admitted
        assert out.finished_request_ids == ({"a"} if i == 0 else set())  # a's output is final
    assert sched.stats().num_waiting == 1
    assert not sched.get("b")
    assert sched.stats().kv_blocks_used == 0
    out, _ = step(sched)
    assert [c.request_id for c in out.chunks] == ["c"]


def test_fcfs_admits_into_the_freed_slot_mid_batch() -> None:
    sched = make(policy="fcfs", max_num_seqs=2)
    sched.add("a", [1, 2, 3, 4], sp(2))
    sched.add("b", [5, 6, 7, 8], sp(5))
    sched.add("c", [9], sp(1))
    step(sched)
    step(sched)
    out, _ = step(sched)
    assert [c.request_id for c in out.chunks] == ["b", "c"]


def test_static_batch_may_exceed_one_steps_token_budget() -> None:
    sched = make(policy="static", max_num_seqs=3, max_num_batched_tokens=4)
    for rid in "abcd":
        sched.add(rid, [1, 2, 3, 4], sp(2))
    out, _ = step(sched)
    assert [c.request_id for c in out.chunks] == ["a"]
    assert sched.stats().num_running == 3
    outputs, _ = run_to_completion(sched)
    assert first_scheduled_order(outputs) == ["a", "b", "c", "d"]
    d_first = next(i for i, out in enumerate(outputs) if "d" in {c.request_id for c in out.chunks})
    # d waited for the whole first batch, and nothing joined d's batch.
    assert all({c.request_id for c in out.chunks} == {"d"} for out in outputs[d_first:])
    assert all("d" not in {c.request_id for c in out.chunks} for out in outputs[:d_first])


# ---------------------------------------------------------------- policies


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("fcfs", ["a", "b", "c", "d"]), ("spf", ["b", "d", "c", "a"])],
)
def test_policy_admission_order(policy: str, expected: list[str]) -> None:
    sched = make(policy=policy, max_num_seqs=1, spf_aging=0.0)
    sched.add("a", [1], sp(64), predicted_tokens=50)
    sched.add("b", [1], sp(64), predicted_tokens=5)
    sched.add("c", [1], sp(20))
    sched.add("d", [1], sp(64), predicted_tokens=10)
    outputs, _ = run_to_completion(sched)
    assert first_scheduled_order(outputs) == expected


@pytest.mark.parametrize(("aging", "position"), [(0.0, 40), (1.0, 28), (2.0, 14)])
def test_spf_aging_bounds_how_many_later_arrivals_overtake(aging: float, position: int) -> None:
    # Rank = expected length + aging * arrival_index: "long" (30 tokens, arrival 0) ranks ahead
    # of a 1-token request arriving at i once 1 + aging * i >= 30.
    long = Sequence("long", (1,), sp(64), predicted_tokens=30, arrival_index=0)
    shorts = [
        Sequence(f"s{i}", (1,), sp(64), predicted_tokens=1, arrival_index=i) for i in range(1, 41)
    ]
    order = admission_order([*shorts, long], "spf", aging)
    assert order.index(long) == position


@pytest.mark.parametrize("policy", ["fcfs", "spf", "static"])
def test_preempted_sequences_come_first(policy: PolicyName) -> None:
    fresh = Sequence("fresh", (1,), sp(4), predicted_tokens=1, arrival_index=0)
    back = Sequence("back", (1,), sp(64), predicted_tokens=60, arrival_index=5)
    back.ever_scheduled = True
    assert admission_order([fresh, back], policy, 0.0) == [back, fresh]


# ---------------------------------------------------------------- add() and config validation


@pytest.mark.parametrize(
    ("request_id", "prompt", "max_tokens", "predicted", "message"),
    [
        ("x", [], 4, None, "prompt is empty"),
        ("x", [1] * 40, 4, None, r"40 tokens, more than max_model_len=32"),
        ("x", [1] * 30, 4, None, r"\+ max_tokens \(4\) exceeds max_model_len=32"),
        ("x", [1] * 20, 12, None, "needs up to 8 KV blocks, the whole cache has 7"),
        ("dup", [1], 4, None, "already in use"),
        ("x", [1], 4, -1, "predicted_tokens must be >= 0"),
    ],
)
def test_add_rejects_with_clear_message_and_no_state_change(
    request_id: str, prompt: list[int], max_tokens: int, predicted: int | None, message: str
) -> None:
    sched = make(num_blocks=7, block_size=4, max_model_len=32)
    dup = sched.add("dup", [1, 2], sp(2))
    before = sched.stats()
    with pytest.raises(ValueError, match=message):
        sched.add(request_id, prompt, sp(max_tokens), predicted_tokens=predicted)
    assert sched.stats() == before
    assert sched.get("dup") is dup
    assert sched.get("x") is None
    assert sched.add("next", [1], sp(1)).arrival_index == 1
    sched.check_invariants()


def test_request_id_is_reusable_only_after_its_finish_was_reported() -> None:
    """A request some step ran: the runner must drop its state before the id is new again.
    (One that never ran is free at once: test_a_released_request_may_come_back_at_once.)"""
    sched = make()
    sched.add("a", [1], sp(4))
    step(sched)
    sched.finish("a", FinishReason.CANCELLED)
    with pytest.raises(ValueError, match="already in use"):
        sched.add("a", [1], sp(1))
    assert sched.schedule().finished_request_ids == {"a"}
    sched.add("a", [1], sp(1))


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        ({"num_blocks": 0}, ValueError, "num_blocks"),
        ({"block_size": -1}, ValueError, "block_size"),
        ({"max_num_seqs": 0}, ValueError, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, ValueError, "max_num_batched_tokens"),
        ({"max_model_len": 0}, ValueError, "max_model_len"),
        ({"policy": "lifo"}, ValueError, "policy must be one of"),
        ({"watermark": 1.0}, ValueError, "watermark"),
        ({"watermark": -0.1}, ValueError, "watermark"),
        ({"spf_aging": -1.0}, ValueError, "spf_aging"),
        ({"eos_token_ids": {1}}, TypeError, "frozenset"),
    ],
)
def test_config_validation(overrides: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        make(**overrides)


# ---------------------------------------------------------------- update() misuse and stats


def test_update_without_a_sampled_token_raises_and_changes_nothing() -> None:
    sched = make()
    seq = sched.add("a", [1, 2], sp(3))
    out = sched.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        sched.update(out, ModelRunnerOutput({}))
    assert (seq.num_computed_tokens, seq.num_pending, seq.output_token_ids) == (2, 1, [])
    sched.update(out, ModelRunnerOutput({"a": 5}))
    with pytest.raises(ValueError, match="stale"):
        sched.update(out, ModelRunnerOutput({"a": 5}))


def test_stats() -> None:
    sched = make(max_num_seqs=1, block_size=4)
    sched.add("a", [1, 2, 3, 4, 5], sp(10), predicted_tokens=4)
    sched.add("b", [1, 2, 3], sp(6))
    assert sched.stats().predicted_remaining_tokens == 4 + 6
    assert sched.stats().queued_prompt_tokens == 5 + 3
    assert sched.queue_lengths() == (2, 0)
    step(sched)
    assert sched.queue_lengths() == (1, 1)
    # a: 5 prompt tokens computed (2 blocks), 1 of its 4 predicted tokens generated.
    assert sched.stats() == SchedulerStats(
        num_waiting=1,
        num_running=1,
        queued_prompt_tokens=3,
        predicted_remaining_tokens=3 + 6,
        kv_blocks_used=2,
        kv_blocks_total=64,
        cached_tokens=5,
        iterations=1,
        num_preemptions=0,
        prompt_tokens_computed=5,
        by_class=(
            # Its queued prompt, the running one's KV, both their predicted answers.
            ClassLoad(Priority.INTERACTIVE, 1, 1, 0, 3, 5, 3 + 6),
            ClassLoad(Priority.FLEX, 0, 0, 0),
            ClassLoad(Priority.BATCH, 0, 0, 0),
        ),
    )
    sched.finish("a", FinishReason.CANCELLED)
    sched.finish("b", FinishReason.CANCELLED)
    assert sched.queue_lengths() == (0, 0)
    assert sched.schedule().is_empty
    assert sched.stats().iterations == 1
    assert not sched.has_unfinished()


class CountingGuide:
    """A grammar that allows tokens below `limit` and is complete after `length` of them."""

    def __init__(self, length: int, limit: int = 1000) -> None:
        self.length, self.limit = length, limit
        self.consumed: list[int] = []

    def consume(self, token: int) -> bool:
        self.consumed.append(token)
        return token < self.limit

    def fill_mask(self, words: object) -> None:
        raise AssertionError("the scheduler never reads masks")

    def is_finished(self) -> bool:
        return len(self.consumed) >= self.length

    @property
    def error(self) -> str:
        refused = [t for t in self.consumed if t >= self.limit]
        return f"token {refused[0]} is over {self.limit}" if refused else ""


def test_advance_guides_moves_grammars_once_and_update_keeps_its_verdicts() -> None:
    sched = make()
    guide, stray = CountingGuide(length=2), CountingGuide(length=5, limit=150)
    sched.add("g", [1, 2, 3], sp(10), guide=guide)
    sched.add("s", [4, 5, 6], sp(10), guide=stray)
    sched.add("free", [7, 8, 9], sp(3))
    for expected in ([100], [100, 101]):
        out = sched.schedule()
        result = ModelRunnerOutput(
            {c.request_id: (200 if c.request_id == "s" else fake_token(c)) for c in out.chunks}
        )
        sched.advance_guides(out, result)
        assert guide.consumed == expected  # before update: the next step's mask reads it
        updates = {u.request_id: u for u in sched.update(out, result)}
        assert guide.consumed == expected  # update took the verdict, it did not consume again
        sched.check_invariants()
        if expected == [100]:
            # A token its grammar refused ends the request in an error, once: no clean stop,
            # and the token is no part of the answer.
            assert updates["s"].finish_reason is FinishReason.ERROR
            assert updates["s"].new_token_ids == ()
            assert "token 200 is over 150" in updates["s"].error
            assert stray.consumed == [200]
    assert updates["g"].finish_reason is FinishReason.STOP  # complete after two tokens
    assert updates["free"].finish_reason is None


def test_advance_guides_refuses_a_step_out_of_order() -> None:
    sched = make()
    sched.add("g", [1, 2, 3], sp(10), guide=CountingGuide(length=3))
    first = sched.schedule()
    second = sched.schedule()
    with pytest.raises(ValueError, match="oldest"):
        sched.advance_guides(second, ModelRunnerOutput({"g": 100}))
    sched.advance_guides(first, ModelRunnerOutput({"g": 100}))
    sched.update(first, ModelRunnerOutput({"g": 100}))


def test_a_request_awaiting_its_grammar_waits_without_holding_up_the_queue() -> None:
    """A constrained request whose grammar is still compiling (off the engine's thread) stays
    queued and is passed over by admission, strict order or not, until its grammar is set;
    it counts as waiting, is not released for offload, and can be cancelled meanwhile."""
    sched = make(max_num_seqs=2)
    sched.add("json", [1, 2, 3], sp(3), awaiting_guide=True)
    sched.add("free", [4, 5, 6], sp(3))
    sched.add("gone", [7, 8, 9], sp(3), awaiting_guide=True)
    out, _ = step(sched)
    assert [c.request_id for c in out.chunks] == ["free"]
    assert sched.stats().num_waiting == 2
    # Not offloaded: its grammar is compiling here, and would compile again elsewhere.
    assert sched.release_queued(2) == []
    with pytest.raises(ValueError, match="not waiting for its grammar"):
        sched.set_guide("free", CountingGuide(length=2))
    assert sched.finish("gone", FinishReason.CANCELLED)
    sched.set_guide("json", CountingGuide(length=2))
    out, updates = step(sched)
    assert [c.request_id for c in out.chunks] == ["free", "json"]
    assert {u.request_id: u.finish_reason for u in updates} == {"free": None, "json": None}
    _, updates = step(sched)
    assert {u.request_id: u.finish_reason for u in updates}["json"] is FinishReason.STOP
