"""Idle memory first (CoCoServe, ../shared/papers/cocoserve.txt): a GPU whose KV cache has an
unused share lends the top of that cache to a new instance placed beside it, before a new GPU is
asked for, and takes it back when the neighbour leaves.

Only the top of the cache can go (the neighbour needs one contiguous range of the cache's
memory), and only blocks no sequence holds: the tail stops at the highest block a running
sequence holds (BlockManager.lend_tail), so lending never takes memory a running sequence holds
and never moves one. A lending is all or nothing: a tail too short for the neighbour lends none.
While lent, the scheduler sees as many fewer free blocks (it preempts or queues as it would on
a smaller cache); the lender's plan says the smaller cache.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from site_engine.engine.core.block_manager import BlockManager
from site_engine.engine.memory_plan import KvPlan, blocks_for


@dataclass(frozen=True, slots=True)
class Lending:
    blocks: int  # lent (0: not enough free at the top)
    bytes: int
    plan: KvPlan  # the lender's cache while it lends


def lendable_bytes(manager: BlockManager, plan: KvPlan) -> int:
    """What `lend` would grant now at most (0 while lending): the free top, less the blocks the
    lender keeps for one full-length sequence. The figure a placement weighs a GPU's room by."""
    if manager.num_lent_blocks or manager.draining:
        return 0
    keep = blocks_for(plan.max_model_len, plan.block_size)
    blocks = min(manager.free_tail_blocks(), plan.num_blocks - keep)
    return max(0, blocks) * plan.bytes_per_block


def lend(manager: BlockManager, plan: KvPlan, wanted_bytes: int, drain: bool = False) -> Lending:
    """Lends the top blocks covering `wanted_bytes`, or nothing; one lending at a time. The
    lender keeps at least one full-length sequence's blocks (what its plan promised). `drain`:
    when running sequences hold part of that top, it is drained (BlockManager.drain_tail: no new
    sequence takes its blocks) so that a later call lends it; `end_drain` gives it up."""
    if manager.num_lent_blocks:
        raise ValueError("this cache already lends its top to a neighbour")
    wanted = -(-wanted_bytes // plan.bytes_per_block)
    keep = blocks_for(plan.max_model_len, plan.block_size)
    if wanted < 1 or plan.num_blocks - wanted < keep:
        return Lending(0, 0, plan)
    if drain and manager.drain_tail(wanted):
        return Lending(0, 0, plan)  # still held: lent once their sequences free them
    if manager.lend_tail(wanted) < wanted:
        manager.return_lent()
        return Lending(0, 0, plan)
    manager.end_drain()
    return Lending(
        wanted, wanted * plan.bytes_per_block, replace(plan, num_blocks=plan.num_blocks - wanted)
    )


def take_back(manager: BlockManager, lending: Lending, plan: KvPlan) -> KvPlan:
    """The neighbour left (its memory freed): the lent blocks are the lender's again."""
    manager.return_lent()
    manager.end_drain()
    return replace(plan, num_blocks=lending.plan.num_blocks + lending.blocks)
