"""An approximate index of one site's prefix cache: the blocks of the prompts this gateway sent
there, least recently sent evicted first once they exceed what the site's KV cache holds (SGLang's
router keeps such a tree per worker; here in blocks, not characters).

For sites that stream no cache events: it over-claims (the site may have evicted earlier, other
gateways' traffic competes for the same cache, an answer's own blocks are not known) and
under-claims (blocks other gateways put there). Routing uses it as an estimate, never as truth.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import takewhile

# Prompts are recorded in blocks of this many tokens whatever the site's own block size: an
# estimate needs no finer grain, and one block size lets every such site share one hashing.
HISTORY_BLOCK_TOKENS = 64


class RoutingHistory:
    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self._limit = max_blocks
        self.capacity_blocks: int | None = None
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def bound(self) -> int:
        """The most blocks kept: the site's cache in blocks when known, never over max_blocks."""
        capacity = self.capacity_blocks
        return self._limit if capacity is None else max(1, min(self._limit, capacity))

    def set_capacity_tokens(self, tokens: int | None) -> None:
        """The site's KV cache (device and host tiers) in tokens; None: unknown."""
        self.capacity_blocks = None if not tokens else tokens // HISTORY_BLOCK_TOKENS
        self._evict()

    def record(self, block_ids: Sequence[int]) -> None:
        """Contract: the blocks become the most recently sent, the prompt's first block most
        recent of all: of one prompt the last blocks go first, as a site frees a finished
        request's blocks tail first (vLLM's block pool), keeping the shared leading ones; the
        least recently sent are evicted beyond `bound`."""
        blocks = self._blocks
        for block in reversed(block_ids):
            blocks[block] = None
            blocks.move_to_end(block)
        self._evict()

    def match(self, block_ids: Sequence[int]) -> int:
        """Contract: the length of the longest run of `block_ids` from the first that was
        sent to the site and not evicted since."""
        return len(list(takewhile(self._blocks.__contains__, block_ids)))

    def _evict(self) -> None:
        blocks, bound = self._blocks, self.bound
        while len(blocks) > bound:
            blocks.popitem(last=False)
