"""Idle memory first: the top of the KV cache lent to a neighbour instance on this GPU, or held
as the site's own fine-tuning reserve while a job trains (PagedEngine's lending component).

A lending takes only blocks no sequence holds (core/kv_lending.py), and really releases their
memory: the cache shrinks a layer at a time (ModelRunner.resize_kv), and grows back when the
lending ends, the blocks below both sizes kept. The reserve is lent the same way, after draining
the blocks running sequences hold in it (no new sequence takes them meanwhile).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from site_engine.engine.core.block_manager import BlockManager
from site_engine.engine.core.kv_lending import Lending, lend, lendable_bytes, take_back
from site_engine.engine.memory_plan import KvPlan

log = logging.getLogger(__name__)


class KvLender:
    """The cache's plan as it is now (shrunk while lending), and what is lent."""

    def __init__(self, plan: KvPlan, resize: Callable[[int], None]) -> None:
        self.plan = plan
        self._resize = resize  # the cache to this many blocks (raises if it cannot be had)
        # The top of the cache lent to a neighbour instance (idle memory first), or None.
        self.lending: Lending | None = None
        self.reserved = False  # the lending is the trainer's reserve (reserve)

    def room(self, manager: BlockManager) -> int:
        """Bytes `lend` could lend now (0 while lending)."""
        return lendable_bytes(manager, self.plan)

    def lend(self, manager: BlockManager, wanted_bytes: int) -> int:
        """Lends the free top of the cache covering `wanted_bytes` and releases its memory: the
        bytes lent (0: refused, nothing lent; also when the shrink could not allocate its one
        new layer). ValueError while lending."""
        if wanted_bytes < 1:
            raise ValueError(f"a lending needs at least one byte, not {wanted_bytes}")
        if manager.draining:
            return 0  # the trainer's reserve is being drained: nothing for a neighbour
        return self._take(manager, wanted_bytes, drain=False)

    def reserve(self, manager: BlockManager, wanted_bytes: int) -> bool:
        """The site's own fine-tuning takes `wanted_bytes` from the top of the cache while a job
        trains: lent as to a neighbour, after draining it when running sequences hold part of
        it. Whether the reserve is held now; False: not yet (call again between steps), or the
        cache lends to a neighbour."""
        if self.lending is not None:
            return self.reserved
        self.reserved = self._take(manager, wanted_bytes, drain=True) > 0
        return self.reserved

    def release_reserve(self, manager: BlockManager) -> int:
        """No job trains: the reserve (or a drain toward it) is the cache's again; the bytes
        given back."""
        if not self.reserved:
            manager.end_drain()
            return 0
        returned = self._give_back(manager)
        self.reserved = False
        return returned

    def give_back(self, manager: BlockManager) -> int:
        """The neighbour left: the cache grows back and the lent blocks are the scheduler's
        again; the bytes returned (0: nothing was lent, or the lending is the trainer's
        reserve). Raises if the memory cannot be had again (the blocks stay lent)."""
        if self.reserved:
            return 0  # the trainer's reserve, not a neighbour's: release_reserve gives it back
        return self._give_back(manager)

    def _take(self, manager: BlockManager, wanted_bytes: int, drain: bool) -> int:
        lending = lend(manager, self.plan, wanted_bytes, drain=drain)
        if not lending.blocks:
            return 0
        try:
            self._resize(lending.plan.num_blocks)
        except torch.OutOfMemoryError:
            log.warning("the KV cache could not shrink to lend %d bytes", lending.bytes)
            take_back(manager, lending, self.plan)
            return 0
        self.lending, self.plan = lending, lending.plan
        return lending.bytes

    def _give_back(self, manager: BlockManager) -> int:
        lending = self.lending
        if lending is None:
            return 0
        self._resize(lending.plan.num_blocks + lending.blocks)
        self.plan = take_back(manager, lending, self.plan)
        self.lending = None
        return lending.bytes
