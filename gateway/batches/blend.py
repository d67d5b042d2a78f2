"""BlendServe's order for an offline batch (../shared/papers/blendserve.txt, section 3), pure
and torch-free: a resource-aware prefix tree over the prompts' block ids, sorted by compute
density layer by layer, outliers split off where little sharing is lost, and read by a dual
scanner that takes compute-dense requests from the left and memory-dense ones from the right,
so that what runs together overlaps compute and memory time while prefixes stay shared.

Block ids are the chained prefix-block hashes the gateway routes with
(fedllm_contract/block_hash.py): an id names its block and everything before it, so the trie's
children are keyed by one id each. Compute density is the roofline's: a request's compute time
(2 x parameters FLOPs per token it prefills or decodes) over its memory time (the KV cache its
decode steps read, sum over d steps of (p + i) tokens). Prefill is compute-bound, decode
memory-bound; a long prompt with a short answer is dense, a short prompt with a long answer
sparse. BlendServe samples 1% of answers for their lengths; here the length predictor's answer
lengths come in instead.

Across sites, the scanner's output is cut into contiguous ranges of equal resource (weighted by
the sites' shares): a contiguous run of scanner output is one run from each end of the tree, so
each range keeps the batch's density, and each cut is moved, within a tolerance, to where it
breaks the least shared prefix (between whole subtrees where there is one).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

# Llama-3-8B's shape: 2 (K, V) x 8 KV heads x 128 dims x 32 layers x 2 bytes (bf16).
LLAMA3_8B_KV_BYTES_PER_TOKEN = 2 * 8 * 128 * 32 * 2


@dataclass(frozen=True, slots=True)
class Roofline:
    """The GPU and model constants the densities come from (defaults: Llama-3-8B on an H100,
    dense bf16 peak and HBM3 bandwidth)."""

    peak_flops: float = 989e12
    memory_bytes_per_s: float = 3.35e12
    model_params: float = 8.0e9
    kv_bytes_per_token: float = float(LLAMA3_8B_KV_BYTES_PER_TOKEN)

    def compute_s(self, prefill_tokens: int, answer_tokens: int) -> float:
        """Time of the linear layers over every token prefilled or decoded: compute-bound."""
        return 2.0 * self.model_params * (prefill_tokens + answer_tokens) / self.peak_flops

    def memory_s(self, prompt_tokens: int, answer_tokens: int) -> float:
        """Time of the KV reads of the decode steps: step i reads p + i tokens' K and V."""
        d = max(answer_tokens, 1)  # every request decodes at least its first token
        read_tokens = prompt_tokens * d + d * d / 2.0
        return read_tokens * self.kv_bytes_per_token / self.memory_bytes_per_s


@dataclass(frozen=True, slots=True)
class BlendRequest:
    """One request as the tree sees it: its prompt's full-block ids, prompt length and planned
    answer length."""

    block_ids: tuple[int, ...]
    prompt_tokens: int
    answer_tokens: int


@dataclass(slots=True)
class _Node:
    """A node of the path-compressed trie: it stands for blocks (parent's depth, depth] of the
    prompts below it (one node per branch point, not per block)."""

    depth: int  # blocks from the root
    children: list[_Node] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)  # requests whose blocks end here
    compute: float = 0.0  # the subtree's, each shared block prefilled once
    memory: float = 0.0
    order: list[_Node | int] = field(default_factory=list)  # entries, densest first

    @property
    def density(self) -> float:
        return _ratio(self.compute, self.memory)


def _ratio(compute: float, memory: float) -> float:
    return compute / memory if memory > 0 else float("inf")


@dataclass(frozen=True, slots=True)
class BlendOrder:
    """The scanner's output: request positions in start order, from which end each came
    ("L" dense, "R" sparse), each request's compute and memory time, the root's density and the
    prefix blocks the splitting may cost (an upper bound: a split node's prefix recomputed once
    per part)."""

    order: list[int]
    sides: list[str]
    compute: list[float]
    memory: list[float]
    root_density: float
    split_loss_blocks: int


def _lcp_sorted(requests: Sequence[BlendRequest], order: Sequence[int]) -> list[int]:
    """Blocks each request (in `order`, sorted by block ids) shares with the one before it:
    a binary search over slice equality, which compares in C."""
    out = [0] if order else []  # nothing to order: an empty plan, not a zip of unequal lengths
    for prev, cur in itertools.pairwise(order):
        a, b = requests[prev].block_ids, requests[cur].block_ids
        low, high = 0, min(len(a), len(b))
        while low < high:
            mid = (low + high + 1) // 2
            if a[:mid] == b[:mid]:
                low = mid
            else:
                high = mid - 1
        out.append(low)
    return out


def _trie(requests: Sequence[BlendRequest]) -> tuple[_Node, dict[int, int]]:
    """The path-compressed prefix tree, built from the prompts in sorted order and the blocks
    each shares with the one before (a stack of the rightmost path). Returns the root and each
    node's parent depth (by id)."""
    order = sorted(range(len(requests)), key=lambda p: requests[p].block_ids)
    lcp = _lcp_sorted(requests, order)
    root = _Node(0)
    parent_depth: dict[int, int] = {id(root): 0}
    stack = [root]
    for position, shared in zip(order, lcp, strict=True):
        popped: _Node | None = None
        while stack[-1].depth > shared:
            popped = stack.pop()
        top = stack[-1]
        if top.depth < shared:  # a branch point inside the last popped node's blocks
            assert popped is not None
            branch = _Node(shared, children=[popped])
            top.children[top.children.index(popped)] = branch
            parent_depth[id(branch)], parent_depth[id(popped)] = top.depth, shared
            stack.append(branch)
            top = branch
        depth = len(requests[position].block_ids)
        if depth == top.depth:
            top.requests.append(position)
            continue
        leaf = _Node(depth, requests=[position])
        top.children.append(leaf)
        parent_depth[id(leaf)] = top.depth
        stack.append(leaf)
    return root, parent_depth


def _build(requests: Sequence[BlendRequest], roof: Roofline, block_tokens: int) -> _Node:
    root, parent_depth = _trie(requests)
    block_s = roof.compute_s(block_tokens, 0)
    own = [
        roof.compute_s(max(r.prompt_tokens - len(r.block_ids) * block_tokens, 0), r.answer_tokens)
        for r in requests
    ]
    memory = [roof.memory_s(r.prompt_tokens, r.answer_tokens) for r in requests]
    for node in reversed(_preorder(root)):  # children before parents
        blocks = node.depth - parent_depth[id(node)]
        node.compute = blocks * block_s + sum(own[p] for p in node.requests)
        node.memory = sum(memory[p] for p in node.requests)
        for child in node.children:
            node.compute += child.compute
            node.memory += child.memory

        def density(entry: _Node | int) -> float:
            if isinstance(entry, _Node):
                return entry.density
            return _ratio(own[entry], memory[entry])

        # Algorithm 1 (layer-wise sorting): siblings only, densest first.
        entries: list[_Node | int] = [*node.children, *node.requests]
        node.order = sorted(entries, key=density, reverse=True)
    return root


def _preorder(root: _Node) -> list[_Node]:
    out, stack = [], [root]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children)
    return out


def _leaves(unit: _Node | int) -> list[int]:
    """A unit's requests in depth-first order of the sorted tree."""
    out: list[int] = []
    stack: list[_Node | int] = [unit]
    while stack:
        entry = stack.pop()
        if isinstance(entry, int):
            out.append(entry)
        else:
            stack.extend(reversed(entry.order))
    return out


def _split(root: _Node, budget_tokens: float, block_tokens: int) -> tuple[list[_Node | int], int]:
    """Algorithm 2 (conditional node splitting): a node whose prefix, recomputed once per entry,
    costs more than its share of the budget stays whole; else its entries go their own ways
    (the budget divided among them). Returns the units and the prefix blocks split."""
    units: list[_Node | int] = []
    loss = 0
    stack: list[tuple[_Node | int, float]] = [(root, budget_tokens)]
    while stack:
        entry, budget = stack.pop()
        if isinstance(entry, int):
            units.append(entry)
            continue
        parts = len(entry.order)
        if entry.depth * block_tokens * parts > budget:
            units.append(entry)
            continue
        loss += entry.depth * max(parts - 1, 0)
        stack.extend((child, budget / max(parts, 1)) for child in entry.order)
    return units, loss


def blend_order(
    requests: Sequence[BlendRequest],
    roof: Roofline,
    block_tokens: int,
    *,
    split_budget: float = 0.02,
) -> BlendOrder:
    """Contract: every request position exactly once. The leaves of the density-sorted tree
    (units after splitting, densest first, each depth-first) are read from both ends: the next
    request comes from the dense end while the compute taken so far is below the root's
    density times the memory taken, else from the sparse end. `split_budget` is the share of
    the batch's prompt tokens that splitting may put at stake."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    root = _build(requests, roof, block_tokens)
    budget = split_budget * sum(r.prompt_tokens for r in requests)
    units, loss = _split(root, budget, block_tokens)

    def unit_density(unit: _Node | int) -> float:
        if isinstance(unit, _Node):
            return unit.density
        return _ratio(compute[unit], memory[unit])

    compute = [roof.compute_s(r.prompt_tokens, r.answer_tokens) for r in requests]
    memory = [roof.memory_s(r.prompt_tokens, r.answer_tokens) for r in requests]
    leaves = [p for unit in sorted(units, key=unit_density, reverse=True) for p in _leaves(unit)]
    target = _ratio(sum(compute), sum(memory))
    order, sides = [], []
    left, right = 0, len(leaves) - 1
    taken_compute = taken_memory = 0.0
    while left <= right:
        if taken_compute <= target * taken_memory or taken_memory == 0:
            position, side, left = leaves[left], "L", left + 1
        else:
            position, side, right = leaves[right], "R", right - 1
        order.append(position)
        sides.append(side)
        taken_compute += compute[position]
        taken_memory += memory[position]
    return BlendOrder(order, sides, compute, memory, target, loss)


def dfs_order(requests: Sequence[BlendRequest]) -> list[int]:
    """Depth-first over the prefix tree (SGLang's lpm / dfs-weight family): prompts sorted by
    their block ids, so each request follows the one it shares most with."""
    return sorted(range(len(requests)), key=lambda p: (requests[p].block_ids, p))


def common_blocks(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def shared_blocks(order: Sequence[int], requests: Sequence[BlendRequest], recent: int = 1) -> int:
    """Prefix blocks each request finds in the last `recent` requests before it, summed: what a
    prefix cache that holds the last few prompts saves. Depth-first order with recent=1 reaches
    the tree's whole sharing (total blocks less distinct ones)."""
    total = 0
    for i, position in enumerate(order):
        ids = requests[position].block_ids
        window = order[max(i - recent, 0) : i]
        total += max((common_blocks(ids, requests[p].block_ids) for p in window), default=0)
    return total


def split_ranges(
    blend: BlendOrder,
    requests: Sequence[BlendRequest],
    weights: Sequence[float],
    *,
    tolerance: float = 0.02,
) -> list[list[int]]:
    """Contract: the scanner's output cut into len(weights) contiguous ranges (in order), the
    k-th holding about weights[k] / sum(weights) of the resource (compute + memory time). Each
    cut lies within `tolerance` of the total resource (plus one request) of its target and,
    there, where the two ends' streams lose the fewest shared blocks across it; ties nearest
    the target."""
    if not weights or any(w <= 0 for w in weights):
        raise ValueError("weights must be positive, one per range")
    order = blend.order
    resource = [blend.compute[p] + blend.memory[p] for p in order]
    cumulative = [0.0]
    for r in resource:
        cumulative.append(cumulative[-1] + r)
    total, slack = cumulative[-1], tolerance * cumulative[-1]
    losses = _cut_losses(blend, requests)
    cuts, share, start = [0], 0.0, 0
    for weight in weights[:-1]:
        share += weight / sum(weights)
        goal = share * total
        candidates = [c for c in range(start, len(order) + 1) if abs(cumulative[c] - goal) <= slack]
        if not candidates:  # one request spans the slack: the nearest cut
            candidates = [
                min(range(start, len(order) + 1), key=lambda c: abs(cumulative[c] - goal))
            ]
        best = min(candidates, key=lambda c: (losses[c], abs(cumulative[c] - goal)))
        cuts.append(best)
        start = best
    cuts.append(len(order))
    return [order[a:b] for a, b in itertools.pairwise(cuts)]


def _cut_losses(blend: BlendOrder, requests: Sequence[BlendRequest]) -> list[int]:
    """For each cut 0..n: blocks shared across it by each end's stream (its last request before
    the cut and its first after), in one pass each way."""
    n = len(blend.order)
    losses = [0] * (n + 1)
    for side in ("L", "R"):
        before: list[int | None] = [None] * (n + 1)
        for i in range(n):
            before[i + 1] = i if blend.sides[i] == side else before[i]
        after: int | None = None
        for cut in range(n, -1, -1):
            if cut < n and blend.sides[cut] == side:
                after = cut
            last = before[cut]
            if last is not None and after is not None:
                a, b = requests[blend.order[last]], requests[blend.order[after]]
                losses[cut] += common_blocks(a.block_ids, b.block_ids)
    return losses
