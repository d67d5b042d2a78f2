"""Stateful property test of the BlockManager alone: random sequences of grow / free / can_grow
against a plain model of what each request asked for.

After every step: no block is in two tables, free + used == total, every table holds exactly
blocks_needed(the most tokens its request ever asked for) blocks, a failed grow changed nothing,
and can_grow predicts grow. Checked through the public API, independently of check_invariants
(which is also called, so the two must agree).
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from site_engine.engine.core.block_manager import BlockManager, OutOfBlocks

REQUEST_IDS = st.sampled_from([f"r{i}" for i in range(6)])


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(1, 1)
        # The model: request id -> the most token slots it asked for (tables never shrink).
        self.asked: dict[str, int] = {}

    @initialize(num_blocks=st.integers(1, 12), block_size=st.integers(1, 4))
    def make(self, num_blocks: int, block_size: int) -> None:
        self.manager = BlockManager(num_blocks, block_size)
        self.asked = {}

    def _tables(self) -> dict[str, tuple[int, ...]]:
        return {rid: self.manager.block_table(rid) for rid in self.manager.request_ids()}

    @rule(request_id=REQUEST_IDS, num_tokens=st.integers(0, 40))
    def grow(self, request_id: str, num_tokens: int) -> None:
        before, free_before = self._tables(), self.manager.num_free_blocks
        refused: tuple[int, int] | None
        target = max(num_tokens, self.asked.get(request_id, 0))
        missing = self.manager.blocks_needed(target) - len(before.get(request_id, ()))
        predicted = self.manager.can_grow(request_id, num_tokens)
        assert predicted == (missing <= free_before)
        try:
            table = self.manager.grow(request_id, num_tokens)
        except OutOfBlocks as exc:
            refused = (exc.needed, exc.free)
        else:
            refused = None
        if refused is not None:
            assert not predicted
            assert refused == (missing, free_before)
            assert self._tables() == before  # nothing allocated, not even an empty table
            assert self.manager.num_free_blocks == free_before
            return
        assert predicted
        assert table[: len(before.get(request_id, ()))] == before.get(request_id, ())
        assert self.manager.num_free_blocks == free_before - missing
        self.asked[request_id] = target

    @precondition(lambda self: bool(self.asked))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.asked)), label="free")
        held = len(self.manager.block_table(request_id))
        free_before = self.manager.num_free_blocks
        assert self.manager.free(request_id) == held
        assert self.manager.num_free_blocks == free_before + held
        del self.asked[request_id]

    @rule(request_id=REQUEST_IDS)
    def free_unknown_is_loud(self, request_id: str) -> None:
        if request_id in self.asked:
            return
        before = self._tables()
        try:
            self.manager.free(request_id)
        except KeyError:
            pass
        else:
            raise AssertionError(f"freeing {request_id!r}, which holds no table, did not fail")
        assert self._tables() == before

    @invariant()
    def no_block_owned_twice(self) -> None:
        held = [block for table in self._tables().values() for block in table]
        assert len(held) == len(set(held))
        assert all(0 <= block < self.manager.num_blocks for block in held)

    @invariant()
    def free_plus_used_is_total(self) -> None:
        held = sum(len(table) for table in self._tables().values())
        assert self.manager.num_used_blocks == held
        assert self.manager.num_free_blocks + held == self.manager.num_blocks

    @invariant()
    def tables_cover_exactly_what_was_asked(self) -> None:
        assert set(self.manager.request_ids()) == set(self.asked)
        for request_id, tokens in self.asked.items():
            table = self.manager.block_table(request_id)
            assert len(table) == self.manager.blocks_needed(tokens), (request_id, tokens, table)
            assert len(table) * self.manager.block_size >= tokens

    @invariant()
    def agrees_with_its_own_check(self) -> None:
        self.manager.check_invariants()


BlockManagerMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerMachine = BlockManagerMachine.TestCase


def test_everything_freed_returns_every_block() -> None:
    """The end state the machine does not force: free everything and the pool is whole."""
    manager = BlockManager(8, 3)
    for index, tokens in enumerate((1, 4, 9, 0, 6)):  # 1 + 2 + 3 + 0 + 2 blocks: all 8
        manager.grow(f"r{index}", tokens)
    assert manager.num_free_blocks == 0
    for request_id in sorted(manager.request_ids()):
        manager.free(request_id)
    assert (manager.num_free_blocks, manager.num_used_blocks) == (8, 0)
    manager.check_invariants()
