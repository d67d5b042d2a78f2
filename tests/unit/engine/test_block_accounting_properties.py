"""Property test: random interleavings of add / step / cancel / release under tiny KV caches.

After every operation the scheduler's queues, the sequences and the block tables agree, no
block is leaked or freed twice, running sequences hold exactly the blocks their computed tokens
need, and once everything has finished every block is free again.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from site_engine.engine.core.scheduler import Scheduler, SchedulerConfig
from site_engine.engine.core.sequence import Sequence, SequenceStatus
from site_engine.engine.core.types import (
    PENDING_TOKEN,
    FinishReason,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
)

EOS = 0
MAX_MODEL_LEN = 16

# The fields' strategies, by name: test_prefix_cache_properties.py adds the cache's.
CONFIG_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "num_blocks": st.integers(3, 6),
    "block_size": st.integers(1, 3),
    "max_num_seqs": st.integers(1, 4).map(lambda n: 5 - n),
    "max_num_batched_tokens": st.integers(1, 12),
    "max_model_len": st.just(MAX_MODEL_LEN),
    "policy": st.sampled_from(["fcfs", "spf", "static"]),
    "eos_token_ids": st.just(frozenset({EOS})),
    "watermark": st.sampled_from([0.0, 0.2]),
    "spf_aging": st.sampled_from([0.0, 1.0]),
}
configs = st.builds(SchedulerConfig, **CONFIG_FIELDS)
operations = st.sampled_from(["burst", "burst", "step", "step", "step", "add", "cancel", "release"])


class Driver:
    """Runs the scheduler like an engine would and checks it after every operation."""

    def __init__(self, config: SchedulerConfig, data: Any) -> None:
        self.sched = Scheduler(config)
        self.data = data
        self.seqs: dict[str, Sequence] = {}
        self.streamed: dict[str, list[int]] = {}
        self.next_id = 0
        # Async scheduling: step N+1 is scheduled before step N's tokens are applied.
        self.lookahead = bool(data.draw(st.booleans(), label="lookahead"))
        self.in_flight: list[tuple[SchedulerOutput, dict[str, int]]] = []

    def check(self) -> None:
        self.sched.check_invariants()
        blocks = self.sched.block_manager
        for seq in self.sched._roster.running:
            assert len(blocks.block_table(seq.request_id)) == blocks.blocks_needed(
                seq.num_computed_tokens
            )

    def add(self) -> None:
        draw = self.data.draw
        request_id = draw(st.sampled_from([*self.seqs, "fresh"])) if draw(st.booleans()) else ""
        if request_id in ("", "fresh"):
            request_id = f"r{self.next_id}"
        # Mostly requests that fit the tiny cache; now and then any size, to hit the rejections.
        config = self.sched.config
        capacity = min(config.num_blocks * config.block_size, MAX_MODEL_LEN)
        any_size = draw(st.integers(0, 9)) == 9
        num_prompt = draw(st.integers(0, 8) if any_size else st.integers(1, min(6, capacity - 1)))
        room = max(capacity - num_prompt + 1, 1)
        # Biased to long outputs: sequences that outgrow their plan are what forces preemption.
        longest = min(6, room)
        max_tokens = draw(
            st.integers(1, 8)
            if any_size
            else st.integers(1, longest).map(lambda n: longest + 1 - n)
        )
        prompt = self.draw_prompt(num_prompt)
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=draw(st.booleans()))
        # Short predictions over-admit, which is what drives preemption. (Hypothesis favours the
        # first element of sampled_from and small integers; the orders here rely on that.)
        predicted = draw(st.sampled_from([1, 0, 2, None]) | st.integers(0, 10))
        before = self.sched.stats()
        try:
            seq = self.sched.add(
                request_id, prompt, sampling, predicted_tokens=predicted, **self.add_options()
            )
        except ValueError:
            assert self.sched.stats() == before
            return
        self.next_id += 1
        self.seqs[request_id] = seq
        self.streamed[request_id] = []

    def draw_prompt(self, num_prompt: int) -> list[int]:
        return self.data.draw(st.lists(st.integers(1, 9), min_size=num_prompt, max_size=num_prompt))

    def add_options(self) -> dict[str, Any]:
        return {}

    def scheduled(self, out: SchedulerOutput) -> None:
        """Called with every step as soon as it is scheduled and checked."""

    def burst(self) -> None:
        # Several arrivals between two steps are admitted together: that over-commits the cache.
        for _ in range(self.data.draw(st.integers(2, 4))):
            self.add()

    def step(self, draw_tokens: bool = True) -> None:
        out = self.sched.schedule()
        assert out.preempted_request_ids <= out.finished_request_ids
        assert out.num_batched_tokens <= self.sched.config.max_num_batched_tokens
        assert len({c.request_id for c in out.chunks}) == len(out.chunks)
        for chunk in out.chunks:
            seq = self.seqs[chunk.request_id]
            end = chunk.start_position + chunk.num_tokens
            assert seq.status is SequenceStatus.RUNNING
            assert chunk.token_ids == seq.all_token_ids[chunk.start_position : end]
            assert len(chunk.block_table) * self.sched.config.block_size >= end
            # The runner writes KV through this table: every block must still belong to `seq`.
            table = self.sched.block_manager.block_table(seq.request_id)
            assert table[: len(chunk.block_table)] == chunk.block_table
            # Only a decode chunk may feed a token that is still on the device.
            if PENDING_TOKEN in chunk.token_ids:
                assert self.lookahead
                assert chunk.token_ids == (PENDING_TOKEN,)
        self.scheduled(out)
        if draw_tokens and out.chunks and self.data.draw(st.integers(0, 7)) == 7:
            # A cancel that lands while the step runs: its chunk must be ignored by update().
            victim = self.data.draw(st.sampled_from(out.chunks)).request_id
            self.sched.finish(victim, FinishReason.CANCELLED)
        # Mapped so that the simplest draw is not EOS: sequences should mostly run long.
        tokens = st.integers(0, 15).map(lambda n: (n + 1) % 16)
        sampled = {
            c.request_id: self.data.draw(tokens) if draw_tokens else 1
            for c in out.chunks
            if c.sample
        }
        self.in_flight.append((out, sampled))
        if not self.lookahead or len(self.in_flight) > 1 or not out.chunks:
            self.apply_oldest()

    def apply_oldest(self) -> None:
        out, sampled = self.in_flight.pop(0)
        for update in self.sched.update(out, ModelRunnerOutput(sampled)):
            self.streamed[update.request_id].extend(update.new_token_ids)

    def cancel(self) -> None:
        request_id = self.data.draw(st.sampled_from([*self.seqs, "unknown"]))
        live = self.sched.get(request_id) is not None
        assert self.sched.finish(request_id, FinishReason.CANCELLED) == live

    def release(self) -> None:
        count = self.data.draw(st.integers(0, 2))
        for seq in self.sched.release_queued(count):
            assert not seq.ever_scheduled
            assert seq.finish_reason is FinishReason.RELEASED

    def drain(self) -> None:
        for _ in range(2000):
            if not self.sched.has_unfinished():
                break
            self.step(draw_tokens=False)  # drawing here would only slow hypothesis down
            self.check()
        while self.in_flight:
            self.apply_oldest()
        assert not self.sched.has_unfinished(), "no progress"
        stats = self.sched.stats()
        assert stats.kv_blocks_used == 0
        assert self.sched.block_manager.num_free_blocks == self.sched.config.num_blocks
        for request_id, seq in self.seqs.items():
            self.check_finished(seq, self.streamed[request_id])
            event(f"finish reason {seq.finish_reason}")
        # Lets --hypothesis-show-statistics confirm the interesting paths are exercised.
        event(f"lookahead {self.lookahead}, preempted: {stats.num_preemptions > 0}")
        event(f"seqs: {min(len(self.seqs), 5)}")

    def check_finished(self, seq: Sequence, streamed: list[int]) -> None:
        assert seq.status is SequenceStatus.FINISHED
        assert streamed == seq.output_token_ids
        assert seq.num_output_tokens <= seq.sampling.max_tokens
        if seq.finish_reason is FinishReason.LENGTH:
            assert seq.num_output_tokens == seq.sampling.max_tokens
        if seq.finish_reason is FinishReason.STOP:
            assert seq.output_token_ids[-1] == EOS
            assert not seq.sampling.ignore_eos
        if seq.finish_reason is FinishReason.RELEASED:
            assert not seq.output_token_ids


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, ops=st.lists(operations, min_size=5, max_size=40), data=st.data())
def test_block_accounting_survives_random_interleavings(
    config: SchedulerConfig, ops: list[str], data: Any
) -> None:
    driver = Driver(config, data)
    for op in ops:
        getattr(driver, op)()
        driver.check()
    driver.drain()
