"""Which device blocks about to be evicted are worth a copy to the host tier, and how many copies
one step may carry.

Copying every block ahead of its eviction moved 188 GB to host memory in 94 s on a real chat
trace near capacity (issue 50): the copies competed with the steps and TTFT p50 tripled, for a
tier most of whose blocks were never read back. A block is copied only if it is likely to be
read again (LMCache and vLLM's offloading connectors filter the same way):

- it was hit before: a prefix that served one admission tends to serve more (system prompts,
  few-shot headers, documents several requests ask about); its hit count is kept by the device
  index (`BlockIndex.record_hit`);
- or it belongs to a conversation still active: a request that finished (or was preempted)
  within the last `active_window_steps` steps; a multi-turn chat's next turn resends the whole
  previous prompt and answer, so those blocks are the next turn's prefix.

And at most `blocks_per_step` copies are decided per step (a bandwidth share: the setting
SITE_HOST_KV_OFFLOAD_BYTES_PER_STEP over the bytes of a block); a wanted block the budget left
out is simply evicted when its turn comes (counted as skipped). The window is counted in engine
steps, not seconds, so that a replay on a step clock caches the same blocks on any machine.
Pure Python, no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class OffloadLimits:
    """`blocks_per_step`: copies to the host tier decided per step at most (>= 1).
    `active_window_steps`: how long after its request left a block counts as of an active
    conversation (0: only blocks hit before are copied)."""

    blocks_per_step: int = 64
    active_window_steps: int = 2000

    def __post_init__(self) -> None:
        if not isinstance(self.blocks_per_step, int) or self.blocks_per_step < 1:
            raise ValueError(f"blocks_per_step must be an int >= 1, got {self.blocks_per_step!r}")
        if not isinstance(self.active_window_steps, int) or self.active_window_steps < 0:
            raise ValueError(
                f"active_window_steps must be an int >= 0, got {self.active_window_steps!r}"
            )


@dataclass(slots=True)
class OffloadCounters:
    """Cumulative, in blocks: copied to the host, wanted but evicted uncopied because the
    per-step budget ran out, and evicted uncopied because the policy did not want them."""

    offloaded: int = 0
    skipped_budget: int = 0
    declined: int = 0


class OffloadPolicy:
    """The selection and the per-step budget; `step` advances its clock once per step."""

    def __init__(self, limits: OffloadLimits | None = None) -> None:
        self.limits = limits or OffloadLimits()
        self.counters = OffloadCounters()
        self._step = 0
        self._left = self.limits.blocks_per_step
        # Block id -> the step its request left at, oldest first (pruned as the window moves).
        self._recent: OrderedDict[int, int] = OrderedDict()

    @property
    def budget_left(self) -> int:
        return self._left

    def step(self) -> None:
        """A new step: a fresh budget, and blocks of requests that left before the window
        forgotten."""
        self._step += 1
        self._left = self.limits.blocks_per_step
        horizon = self._step - self.limits.active_window_steps
        recent = self._recent
        while recent:
            block_hash, left_at = next(iter(recent.items()))
            if left_at >= horizon:
                break
            del recent[block_hash]

    def left(self, hashes: Iterable[int]) -> None:
        """The blocks (ids) of a request that just finished or was preempted: its conversation
        is active, its next turn starts with them."""
        if not self.limits.active_window_steps:
            return
        recent, now = self._recent, self._step
        for block_hash in hashes:
            recent[block_hash] = now
            recent.move_to_end(block_hash)

    def wanted(self, block_hash: int, hits: int) -> bool:
        """Whether a block with this id, hit `hits` times, is worth a copy."""
        return hits > 0 or block_hash in self._recent

    def take(self) -> bool:
        """One copy from this step's budget; False (nothing taken) once it is spent."""
        if self._left <= 0:
            return False
        self._left -= 1
        self.counters.offloaded += 1
        return True

    def evicted_uncopied(self, block_hash: int, hits: int) -> None:
        """A block left the device with no copy on the host: count why."""
        if self.wanted(block_hash, hits):
            self.counters.skipped_budget += 1
        else:
            self.counters.declined += 1
