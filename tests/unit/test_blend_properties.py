"""BlendServe's order (gateway/batches/blend.py) as properties over random batches: every
request exactly once, sharing kept against depth-first order, site ranges balanced, and the
scanner's output mixing dense and sparse requests where depth-first order runs them apart."""

from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.batches.blend import (
    BlendRequest,
    Roofline,
    _build,
    _Node,
    _split,
    _trie,
    blend_order,
    common_blocks,
    dfs_order,
    shared_blocks,
    split_ranges,
)

BLOCK = 4
ROOF = Roofline()


def request(tokens: tuple[int, ...], answer: int) -> BlendRequest:
    """Block ids as the gateway's chain: each names its block and everything before it."""
    full = len(tokens) // BLOCK
    ids = tuple(hash(tokens[: (i + 1) * BLOCK]) for i in range(full))
    return BlendRequest(ids, len(tokens), answer)


prompts = st.lists(st.integers(0, 2), min_size=0, max_size=6 * BLOCK).map(tuple)
batches = st.lists(st.builds(request, prompts, st.integers(1, 2000)), min_size=1, max_size=60)


def optimum(requests: list[BlendRequest]) -> int:
    """The tree's whole sharing: every block but the first of its kind."""
    blocks = [b for r in requests for b in r.block_ids]
    return len(blocks) - len(set(blocks))


@settings(deadline=None, max_examples=150)
@given(batches, st.floats(0.0, 0.2))
def test_every_request_once_and_sharing_kept(requests: list[BlendRequest], budget: float) -> None:
    blend = blend_order(requests, ROOF, BLOCK, split_budget=budget)
    assert sorted(blend.order) == list(range(len(requests)))
    dfs = shared_blocks(dfs_order(requests), requests)
    assert dfs == optimum(requests)
    # Each end's stream is depth-first over the split tree: a cache holding each stream's last
    # prompt keeps all but what the splitting and the two streams' meeting point lose (the two
    # ends meet where the last request taken from the left sits next to the last from the
    # right).
    last: dict[str, int] = {}
    kept = 0
    for position, side in zip(blend.order, blend.sides, strict=True):
        if side in last:
            kept += common_blocks(requests[position].block_ids, requests[last[side]].block_ids)
        last[side] = position
    meet = 0
    if len(last) == 2:
        meet = common_blocks(requests[last["L"]].block_ids, requests[last["R"]].block_ids)
    assert kept >= dfs - blend.split_loss_blocks - meet
    if budget == 0.0:
        assert blend.split_loss_blocks == 0
    assert shared_blocks(blend.order, requests, recent=len(requests)) == dfs


@settings(deadline=None, max_examples=100)
@given(batches, st.lists(st.floats(0.2, 5.0), min_size=1, max_size=4))
def test_site_ranges_are_balanced_and_cover_the_order(
    requests: list[BlendRequest], weights: list[float]
) -> None:
    blend = blend_order(requests, ROOF, BLOCK)
    tolerance = 0.05
    ranges = split_ranges(blend, requests, weights, tolerance=tolerance)
    assert [p for r in ranges for p in r] == blend.order
    resource = {p: blend.compute[p] + blend.memory[p] for p in blend.order}
    total = sum(resource.values())
    biggest = max(resource.values())
    done = 0.0
    for k, part in enumerate(ranges[:-1]):
        done += sum(resource[p] for p in part)
        goal = sum(weights[: k + 1]) / sum(weights) * total
        # Each cut within the tolerance of its goal, or a request's width off where a single
        # request spans the whole tolerance.
        assert abs(done - goal) <= tolerance * total + biggest + 1e-9 * total


def two_kinds(n: int, shared: bool) -> list[BlendRequest]:
    """Half long prompts with short answers (dense), half short prompts with long answers."""
    out = []
    for i in range(n):
        dense = i % 2 == 0
        head = (7,) * (2 * BLOCK) if shared else ()
        body = tuple((i * 31 + j) % 97 + 10 for j in range((60 if dense else 4) * BLOCK))
        out.append(request(head + body, 8 if dense else 1500))
    return out


def test_the_scanner_mixes_what_depth_first_runs_apart() -> None:
    requests = two_kinds(200, shared=False)
    dense = {p for p in range(len(requests)) if p % 2 == 0}
    blend = blend_order(requests, ROOF, BLOCK)
    kinds = [p in dense for p in blend.order]
    # Windows of 20 hold both kinds all along the run (until one kind is used up).
    used_up = min(
        max(i for i, k in enumerate(kinds) if k), max(i for i, k in enumerate(kinds) if not k)
    )
    for start in range(0, used_up - 20, 10):
        counts = Counter(kinds[start : start + 20])
        assert counts[True], (start, counts)
        assert counts[False], (start, counts)
    # Sorted by density alone (the tree's leaves read left to right), each kind is one run.
    dfs = [
        p in dense
        for p in sorted(range(len(requests)), key=lambda p: -blend.compute[p] / blend.memory[p])
    ]
    assert sum(a != b for a, b in itertools.pairwise(dfs)) == 1
    assert sum(a != b for a, b in itertools.pairwise(kinds)) > 20
    # The running density stays near the batch's after the first few requests.
    taken_c = taken_m = 0.0
    for i, p in enumerate(blend.order[:used_up]):
        taken_c += blend.compute[p]
        taken_m += blend.memory[p]
        if i >= 10:
            assert 0.5 * blend.root_density <= taken_c / taken_m <= 2.0 * blend.root_density


def test_a_shared_prefix_stays_whole_when_splitting_it_costs_too_much() -> None:
    requests = two_kinds(100, shared=True)
    blend = blend_order(requests, ROOF, BLOCK, split_budget=0.0)
    assert blend.split_loss_blocks == 0
    assert sorted(blend.order) == list(range(100))
    cheap = blend_order(requests, ROOF, BLOCK, split_budget=1.0)
    assert cheap.split_loss_blocks > 0


def test_an_empty_batch_has_an_empty_order() -> None:
    """A batch with nothing left to plan (the schema fuzz found it) orders nothing; it raised."""
    assert list(blend_order([], ROOF, BLOCK).order) == []
    assert dfs_order([]) == []


# The parts one at a time (issue 52's CI list: the trie, the density sort, the split, the scanner).


@settings(deadline=None, max_examples=100)
@given(batches)
def test_the_trie_holds_each_request_once_at_its_depth_under_its_prefix(
    requests: list[BlendRequest],
) -> None:
    root, _ = _trie(requests)
    seen: list[int] = []
    stack = [root]
    while stack:
        node = stack.pop()
        for position in node.requests:
            ids = requests[position].block_ids
            assert len(ids) == node.depth  # a request ends where its blocks end
            seen.append(position)
        below = [*node.requests, *(p for child in node.children for p in _leaves_of(child))]
        heads = {requests[p].block_ids[: node.depth] for p in below}
        assert len(heads) <= 1  # everything below a node shares its blocks up to its depth
        for child in node.children:
            assert child.depth > node.depth
            stack.append(child)
    assert sorted(seen) == list(range(len(requests)))


def _leaves_of(node: _Node) -> list[int]:
    out, stack = [], [node]
    while stack:
        current = stack.pop()
        out.extend(current.requests)
        stack.extend(current.children)
    return out


@settings(deadline=None, max_examples=100)
@given(batches)
def test_every_layer_is_sorted_densest_first_and_sums_its_subtree(
    requests: list[BlendRequest],
) -> None:
    root = _build(requests, ROOF, BLOCK)
    memory = sum(ROOF.memory_s(r.prompt_tokens, r.answer_tokens) for r in requests)
    assert abs(root.memory - memory) <= 1e-9 * max(memory, 1.0)
    stack = [root]
    while stack:
        node = stack.pop()
        assert sorted(map(id, node.order)) == sorted(map(id, [*node.children, *node.requests]))
        children = [entry for entry in node.order if isinstance(entry, _Node)]
        densities = [child.density for child in children]
        assert densities == sorted(densities, reverse=True)
        parts = sum(child.memory for child in node.children)
        assert node.memory >= parts - 1e-12
        stack.extend(node.children)


@settings(deadline=None, max_examples=100)
@given(batches)
def test_the_split_covers_every_request_once_and_its_budget_bounds_it(
    requests: list[BlendRequest],
) -> None:
    root = _build(requests, ROOF, BLOCK)
    whole, none_lost = _split(root, 0.0, BLOCK)
    # A zero budget splits only what costs nothing: the root, whose prefix is empty.
    assert none_lost == 0
    assert len(whole) == len(root.order)
    units, loss = _split(root, float("inf"), BLOCK)
    assert all(isinstance(unit, int) for unit in units)  # an unlimited budget splits all
    assert sorted(p for unit in units for p in _unit_leaves(unit)) == list(range(len(requests)))
    assert loss >= 0
    total = sum(r.prompt_tokens for r in requests)
    for share in (0.01, 0.1):
        units, loss = _split(root, share * total, BLOCK)
        assert sorted(p for unit in units for p in _unit_leaves(unit)) == list(range(len(requests)))


def _unit_leaves(unit: _Node | int) -> list[int]:
    return [unit] if isinstance(unit, int) else _leaves_of(unit)


@settings(deadline=None, max_examples=100)
@given(st.lists(st.tuples(st.integers(1, 3000), st.integers(1, 2000)), min_size=1, max_size=60))
def test_the_scanner_takes_dense_requests_from_one_end_and_sparse_from_the_other(
    lengths: list[tuple[int, int]],
) -> None:
    """Without shared prefixes every request is its own unit: the leaves are the requests
    densest first, the scanner's "L" picks come from that end (density never rising) and its
    "R" picks from the other (never falling), and no "R" pick is denser than an "L" pick."""
    requests = [BlendRequest((), prompt, answer) for prompt, answer in lengths]
    blend = blend_order(requests, ROOF, BLOCK)
    density = [c / m for c, m in zip(blend.compute, blend.memory, strict=True)]
    left = [density[p] for p, side in zip(blend.order, blend.sides, strict=True) if side == "L"]
    right = [density[p] for p, side in zip(blend.order, blend.sides, strict=True) if side == "R"]
    assert sorted(blend.order) == list(range(len(requests)))
    assert left == sorted(left, reverse=True)
    assert right == sorted(right)
    if left and right:
        assert min(left) >= max(right)
