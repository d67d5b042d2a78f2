"""The four offline mixes of bench/engine/batch_order.py, after BlendServe's Table 2 (two compute
densities x 5% / 35% shared prefixes), built from the development datasets
(../shared/datasets, or --data-dir / FEDLLM_DATA_DIR; read, never copied).

- Dense requests: long prompts with short answers. Prompts are Dolly and GSM8K prompts strung
  together up to a length drawn between the preset's bounds; answers take the lengths of random
  Alpaca answers (short: median 43 GPT-2 tokens), clipped to the preset's short-answer bounds.
- Sparse requests: short prompts with long answers. Prompts are random Alpaca prompts; answers
  take the lengths of LIMA answers (median 371, p90 1549), clipped to the preset's bounds.
- The share of sparse requests is chosen so that the mix's roofline density (the batch plan's,
  gateway/batches/blend.py) is the mix's target.
- Sharing: requests are dealt at random into groups, each behind its own system prompt (text of
  Alpaca answers), of a length that makes the shared tokens the target share of all prompt
  tokens.
- Predicted lengths: the true length times a lognormal error (sigma 0.5, seeded), which stands
  for the length predictor's error; the true lengths are what the engine is made to generate
  (`ignore_eos`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.batches.blend import Roofline
from predictor.datasets import load_corpus

Encode = Callable[[str], list[int]]
MIXES: dict[str, tuple[float, float]] = {
    # name: (target density, shared prompt share)
    "dense_35": (1.4, 0.35),
    "dense_5": (1.4, 0.05),
    "sparse_35": (0.9, 0.35),
    "sparse_5": (0.9, 0.05),
}
HIGH_DENSITY = ("dense_35", "dense_5")
PREDICTION_SIGMA = 0.5


@dataclass(frozen=True, slots=True)
class Item:
    prompt: tuple[int, ...]
    true_tokens: int
    predicted_tokens: int
    dense: bool


@dataclass(frozen=True, slots=True)
class Pools:
    dense_prompts: list[list[int]]
    sparse_prompts: list[list[int]]
    short_answers: list[int]
    long_answers: list[int]
    filler: list[int]  # system prompt text


def load_pools(data_dir: Path | None, encode: Encode, limit: int) -> Pools:
    """Token ids of up to `limit` prompts of each kind and the answer lengths."""
    dolly = [r.prompt for r in load_corpus("dolly", data_dir)]
    gsm8k = [r.prompt for r in load_corpus("gsm8k", data_dir)]
    alpaca = load_corpus("alpaca_random", data_dir)
    lima = load_corpus("lima", data_dir)
    return Pools(
        dense_prompts=[encode(t) for t in (dolly + gsm8k)[:limit]],
        sparse_prompts=[encode(r.prompt) for r in alpaca[:limit]],
        short_answers=[len(encode(r.response)) for r in alpaca[:limit]],
        long_answers=[len(encode(r.response)) for r in lima],
        filler=[t for r in alpaca[limit : limit + 400] for t in encode(r.response)],
    )


def _dense_prompt(pools: Pools, rng: random.Random, length: int) -> tuple[int, ...]:
    tokens: list[int] = []
    while len(tokens) < length:
        tokens += rng.choice(pools.dense_prompts)
    return tuple(tokens[:length])


def _clip(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def _predicted(true: int, rng: random.Random, cap: int) -> int:
    return _clip(round(true * math.exp(rng.gauss(0.0, PREDICTION_SIGMA))), 1, cap)


def _density(items: Sequence[Item], roof: Roofline, shared_tokens: int = 0) -> float:
    """BlendServe's density of a set with shared prefixes: compute less the shared prefill
    (computed once), over memory."""
    compute = sum(roof.compute_s(len(i.prompt), i.true_tokens) for i in items)
    compute -= roof.compute_s(shared_tokens, 0)
    memory = sum(roof.memory_s(len(i.prompt), i.true_tokens) for i in items)
    return compute / memory


def build_mix(name: str, pools: Pools, p: dict[str, Any], roof: Roofline, seed: int) -> list[Item]:
    """`p["items"]` requests of the mix `name` in submission (random) order."""
    density, share = MIXES[name]
    rng = random.Random(f"{name}-{seed}")
    n = p["items"]
    dense = [
        Item(
            _dense_prompt(pools, rng, rng.randint(*p["dense_prompt"])),
            t := _clip(rng.choice(pools.short_answers), *p["short_answer"]),
            _predicted(t, rng, p["max_answer"]),
            True,
        )
        for _ in range(n)
    ]
    sparse = [
        Item(
            tuple(rng.choice(pools.sparse_prompts)[: p["sparse_prompt"][1]]),
            t := _clip(rng.choice(pools.long_answers), *p["long_answer"]),
            _predicted(t, rng, p["max_answer"]),
            False,
        )
        for _ in range(n)
    ]

    # The share of sparse requests that gives the target density with the system prompts in
    # (density falls as it grows), each try dealt alike.
    def dealt(sparse_count: int) -> tuple[list[Item], int]:
        deal = random.Random(f"{name}-{seed}-deal")
        items = dense[: n - sparse_count] + sparse[:sparse_count]
        deal.shuffle(items)
        return _with_system_prompts(items, pools, share, p, deal)

    low, high = 0, n
    while low < high:
        mid = (low + high) // 2
        items, saved = dealt(mid)
        if _density(items, roof, saved) > density:
            low = mid + 1
        else:
            high = mid
    return dealt(low)[0]


def _with_system_prompts(
    items: list[Item], pools: Pools, share: float, p: dict[str, Any], rng: random.Random
) -> tuple[list[Item], int]:
    """Deals the items into groups behind system prompts of S tokens, S such that the shared
    tokens are `share` of all prompt tokens: (n - groups) * S = share * (P + n * S). Returns
    the items and the prompt tokens that sharing saves."""
    n, groups = len(items), max(1, len(items) // p["group_size"])
    total = sum(len(i.prompt) for i in items)
    size = math.ceil(share * total / max((n - groups) - share * n, 1))
    size = min(size, p["max_system_prompt"])
    heads = [
        (*tuple(pools.filler[g * 7919 % max(len(pools.filler) - size, 1) :][:size]), g)
        for g in range(groups)
    ]
    dealt = [rng.randrange(groups) for _ in items]
    saved = (len(items) - len(set(dealt))) * (size + 1)
    return [
        Item(heads[g] + i.prompt, i.true_tokens, i.predicted_tokens, i.dense)
        for g, i in zip(dealt, items, strict=True)
    ], saved


def mix_facts(
    items: Sequence[Item], roof: Roofline, block_ids: Sequence[tuple[int, ...]], block: int
) -> dict[str, Any]:
    """What the mix turned out to be: its density with the shared blocks prefilled once."""
    blocks = [b for ids in block_ids for b in ids]
    shared = len(blocks) - len(set(blocks))
    return {
        "items": len(items),
        "dense_items": sum(i.dense for i in items),
        "density": round(_density(items, roof, shared * block), 3),
        "prompt_tokens": sum(len(i.prompt) for i in items),
        "answer_tokens": sum(i.true_tokens for i in items),
        "shared_block_share": round(shared / max(len(blocks), 1), 3),
    }
