"""Which running sequence a priority class preempts, and whether preempting lower classes would
make room for an admission (site_engine/engine/core/scheduling/ plans the steps). Pure Python.

The rules: a sequence is preempted for a higher class's slot or blocks, or for the KV growth of
its own class; the victim is of the lowest class running, the most recently admitted of it (it
has done the least work of its class, and re-prefills the least). A victim is taken only when
taking all candidates would make the room asked for: one that could not help would only lose
its work.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence as Seq

from site_engine.engine.core.block_manager import BlockManager, CacheHit
from site_engine.engine.core.sequence import Sequence


def pick_victim(running: Seq[Sequence], lowest: int) -> Sequence | None:
    """Of `running` (in admission order), the one to preempt first among those of class
    `lowest` or below (a value past BATCH matches none): the lowest class, the newest of it."""
    victim: Sequence | None = None
    for seq in reversed(running):
        if seq.priority >= lowest and (victim is None or seq.priority > victim.priority):
            victim = seq
    return victim


def room_without(
    blocks: BlockManager, victims: Seq[Sequence], hit: CacheHit, num_tokens_total: int
) -> bool:
    """Whether an admission with `hit` for `num_tokens_total` slots would get its blocks once
    every one of `victims` gave its own back: BlockManager.can_admit's sum ahead of time. A
    block goes back when all its holders are victims; one of the hit's blocks that goes back
    costs a free block again as an idle hit, so only the others count."""
    held = Counter(block for victim in victims for block in blocks.block_table(victim.request_id))
    hit_blocks = set(hit.device_blocks)
    freed = sum(
        1
        for block, count in held.items()
        if blocks.refcount(block) == count and block not in hit_blocks
    )
    idle_hits = len(hit.device_blocks) - blocks.shared_in_use(hit)
    fresh = max(blocks.blocks_needed(num_tokens_total) - len(hit.device_blocks), 0)
    return fresh + idle_hits <= blocks.num_free_blocks + freed
