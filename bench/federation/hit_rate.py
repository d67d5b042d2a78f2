"""How much of the prompts the sites found cached, two ways:

- measured: the sites' own prefix-cache counters (vLLM's names, `prefix_cache_queries` and
  `prefix_cache_hits`, any prefix), differenced over a run; absent while the engines do not
  cache prefixes (they say nothing then, and the report says so).
- simulated: for arms whose answers name their site, an LRU cache of each site's KV capacity in
  16-token blocks, fed the prompts each site was sent in arrival order (blocks hit only as the
  longest cached run from a prompt's first block): how much reuse the routing *placed* where it
  could be cached, whatever the engine does with it.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from itertools import takewhile

from bench.federation.workload import Request
from fedllm_contract.block_hash import block_hashes

SIM_BLOCK_TOKENS = 16
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})? ([0-9.eE+-]+|NaN)$", re.MULTILINE)


def prefix_counters(metrics_text: str) -> tuple[float, float] | None:
    """(queries, hits) in tokens, summed over labels; None when the site exports neither. Our
    sites' metrics port names them `fedllm_site_prefix_cache_{queries,hits}_tokens_total`, their
    HTTP face and vLLM `vllm:prefix_cache_{queries,hits}_total`; where an exposition has both
    spellings, vLLM's is read (once: the two count the same tokens)."""
    counters: dict[str, list[float]] = {}  # family prefix -> [queries, hits]
    for name, _labels, value in _SAMPLE.findall(metrics_text):
        if value == "NaN":
            continue
        base = name.removesuffix("_total").removesuffix("_tokens")
        for slot, suffix in enumerate(("prefix_cache_queries", "prefix_cache_hits")):
            if base.endswith(suffix):
                pair = counters.setdefault(base.removesuffix(suffix), [0.0, 0.0])
                pair[slot] += float(value)
    if not counters:
        return None
    prefix = "vllm:" if "vllm:" in counters else min(counters)
    queries, hits = counters[prefix]
    return queries, hits


def measured_hit_rate(
    before: Mapping[str, tuple[float, float] | None],
    after: Mapping[str, tuple[float, float] | None],
) -> dict[str, float | None]:
    rates: dict[str, float | None] = {}
    for site, end in after.items():
        start = before.get(site)
        if end is None or start is None:
            rates[site] = None
            continue
        queries, hits = end[0] - start[0], end[1] - start[1]
        rates[site] = round(hits / queries, 4) if queries > 0 else None
    return rates


def simulated_hit_rate(
    served: Sequence[tuple[str, Request]], capacity_tokens: Mapping[str, int]
) -> dict[str, float]:
    """Per site (and "all"), prompt tokens found in its LRU cache / prompt tokens it was sent."""
    caches: dict[str, OrderedDict[int, None]] = {site: OrderedDict() for site in capacity_tokens}
    sent: dict[str, int] = dict.fromkeys(capacity_tokens, 0)
    hit: dict[str, int] = dict.fromkeys(capacity_tokens, 0)
    for site, request in sorted(served, key=lambda pair: pair[1].at_s):
        if site not in caches:
            continue
        cache = caches[site]
        ids = block_hashes(request.prompt_token_ids, SIM_BLOCK_TOKENS, 0)
        run = len(list(takewhile(cache.__contains__, ids)))
        sent[site] += len(request.prompt_token_ids)
        hit[site] += run * SIM_BLOCK_TOKENS
        for block in reversed(ids):  # a prompt's first blocks stay longest
            cache[block] = None
            cache.move_to_end(block)
        bound = max(1, capacity_tokens[site] // SIM_BLOCK_TOKENS)
        while len(cache) > bound:
            cache.popitem(last=False)
    rates = {site: round(hit[site] / sent[site], 4) if sent[site] else 0.0 for site in sent}
    total = sum(sent.values())
    rates["all"] = round(sum(hit.values()) / total, 4) if total else 0.0
    return rates
