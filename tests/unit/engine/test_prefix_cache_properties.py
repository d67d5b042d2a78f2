"""Property test of prefix caching: random add / step / cancel / release / preemption sequences
with prompts that share prefixes, under tiny device caches and host tiers.

Besides the block accounting of test_block_accounting_properties.py (whose driver this extends),
a model of the KV cache checks what the cache is for: every slot records which sequence wrote it
at which position; the scheduler's host copies move those records between blocks and host slots
in the order the runner runs them; and before a step's chunks write anything, every position a
chunk reads (all positions before its start) must hold KV written at that position by a sequence
whose tokens up to it are the reader's own. A shared, evicted, wrongly indexed or
not-yet-written block fails that check. Reads are checked before the step's own writes land, so
a chunk may never depend on a block that another chunk of the same step writes (the runner may
run them in either order). After every operation: refcounts, no block both free and referenced,
every sequence's block ids equal a fresh computation from its tokens, indexed blocks hold their
holder's ids, and the counters add up.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fedllm_contract.block_hash import prompt_block_hashes
from site_engine.engine.core.scheduler import SchedulerConfig
from site_engine.engine.core.sequence import Sequence
from site_engine.engine.core.types import SchedulerOutput
from tests.unit.engine.test_block_accounting_properties import CONFIG_FIELDS, Driver

MODEL = "m"
# Prompts start with a prefix of this one more often than not, so blocks are shared.
COMMON = (3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8)

configs = st.builds(
    SchedulerConfig,
    **{
        **CONFIG_FIELDS,
        "num_blocks": st.integers(3, 8),
        "prefix_caching": st.just(True),
        "model_name": st.just(MODEL),
        "host_kv_blocks": st.sampled_from([0, 1, 3, 6]),
    },
)
operations = st.sampled_from(["burst", "burst", "step", "step", "step", "add", "cancel", "release"])
Writer = tuple[Sequence, int]  # (sequence, position) whose KV a slot holds


class CachingDriver(Driver):
    def __init__(self, config: SchedulerConfig, data: Any) -> None:
        super().__init__(config, data)
        # Request ids are reused once finished: sequences are told apart by identity.
        self.salts: dict[int, str] = {}
        self.every_seq: list[Sequence] = []
        self.salt = ""
        self.device: list[list[Writer | None]] = [
            [None] * config.block_size for _ in range(config.num_blocks)
        ]
        self.host: dict[int, list[Writer | None]] = {}

    def draw_prompt(self, num_prompt: int) -> list[int]:
        shared = self.data.draw(st.integers(0, num_prompt), label="shared prefix")
        tail = self.data.draw(
            st.lists(st.integers(1, 9), min_size=num_prompt - shared, max_size=num_prompt - shared)
        )
        return [*COMMON[:shared], *tail][:num_prompt]

    def add_options(self) -> dict[str, Any]:
        self.salt = self.data.draw(st.sampled_from(["", "", "tenant-b"]), label="salt")
        return {"cache_salt": self.salt}

    def add(self) -> None:
        known = set(map(id, self.seqs.values()))
        super().add()
        for seq in self.seqs.values():
            if id(seq) not in known:
                self.salts[id(seq)] = self.salt
                self.every_seq.append(seq)  # alive, so that no other object takes its id

    def scheduled(self, out: SchedulerOutput) -> None:
        size = self.sched.config.block_size
        assert 0 <= out.kv_copies_before_step <= len(out.kv_copies)
        for copy in out.kv_copies:
            if copy.to_host:
                self.host[copy.slot] = list(self.device[copy.block])
            else:
                assert copy.slot in self.host, "copied back from a host slot never written"
                self.device[copy.block] = list(self.host[copy.slot])
        for chunk in out.chunks:
            reader = self.seqs[chunk.request_id]
            for position in range(chunk.start_position):
                writer = self.device[chunk.block_table[position // size]][position % size]
                assert writer is not None, f"{chunk.request_id} reads an unwritten slot"
                seq, written_at = writer
                assert written_at == position, f"{chunk.request_id} reads position {written_at}"
                assert (
                    seq.all_token_ids[: position + 1] == (reader.all_token_ids[: position + 1])
                ), f"{chunk.request_id} reads KV of another prefix at {position}"
                assert self.salts[id(seq)] == self.salts[id(reader)], "KV of another salt"
        for chunk in out.chunks:
            seq = self.seqs[chunk.request_id]
            for position in range(chunk.start_position, chunk.start_position + chunk.num_tokens):
                block = chunk.block_table[position // size]
                # Written only by its one holder, never shared.
                assert self.sched.block_manager.refcount(block) == 1
                self.device[block][position % size] = (seq, position)

    def check(self) -> None:
        super().check()
        size = self.sched.config.block_size
        for request_id, seq in self.seqs.items():
            if not seq.block_hashes:
                continue
            tokens = seq.all_token_ids[: len(seq.block_hashes) * size]
            expected = prompt_block_hashes(tokens, size, MODEL, self.salts[id(seq)])
            assert seq.block_hashes == expected, f"{request_id}: block ids out of step"
        stats = self.sched.stats()
        assert 0 <= stats.prefix_cache_host_hits <= stats.prefix_cache_hits
        assert stats.prefix_cache_hits <= stats.prefix_cache_queries
        assert stats.kv_blocks_cached <= self.sched.config.num_blocks


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, ops=st.lists(operations, min_size=5, max_size=40), data=st.data())
def test_prefix_cache_keeps_kv_and_accounting_right(
    config: SchedulerConfig, ops: list[str], data: Any
) -> None:
    driver = CachingDriver(config, data)
    for op in ops:
        getattr(driver, op)()
        driver.check()
    driver.drain()
    stats = driver.sched.stats()
    event(f"hits: {stats.prefix_cache_hits > 0}, host hits: {stats.prefix_cache_host_hits > 0}")
    event(f"host copies: {stats.host_kv_blocks_offloaded > 0}")
