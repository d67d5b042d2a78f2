"""What the benchmark learns of each site before the runs: what it says of itself (site_facts),
and its prefill rate, measured as an operator would before writing it into the federation
file (`prefill_tokens_per_s`; llm-d calibrates its affinity filter's peakPrefillThroughput the
same way): on the idle site, directly (no injected network), prompts of `tokens` fresh random
tokens with one answer token each; rate = tokens / the fastest time to the first token."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Mapping

import grpc

from fedllm_contract.proto import site_pb2, site_pb2_grpc
from fedllm_contract.request_options import RequestOptions
from gateway.sites.grpc_client import GrpcSiteClient
from gateway.sites.interface import GenerateParams


async def _first_token_s(client: GrpcSiteClient, tokens: int, vocab: int, seed: int) -> float:
    rng = random.Random(seed)
    params = GenerateParams(
        request_id=f"calibrate-{uuid.uuid4().hex}",
        prompt_token_ids=tuple(rng.randrange(vocab) for _ in range(tokens)),
        max_tokens=1,
        options=RequestOptions(temperature=0.0, top_p=1.0, ignore_eos=True),
    )
    started = time.perf_counter()
    async for chunk in client.generate(params, timeout_s=120):
        if chunk.token_ids or chunk.finish_reason is not None:
            break
    return time.perf_counter() - started


async def _site_rate(port: int, tokens: int, vocab: int, tries: int) -> float:
    client = GrpcSiteClient("calibrate", f"127.0.0.1:{port}", 30.0)
    try:
        await _first_token_s(client, 16, vocab, -1)  # warm the path
        best = min([await _first_token_s(client, tokens, vocab, i) for i in range(tries)])
    finally:
        await client.close()
    return tokens / best


def prefill_rates(
    site_ports: Mapping[str, int], tokens: int, vocab: int, tries: int = 3
) -> dict[str, float]:
    """Prompt tokens per second of each site (measured one site at a time)."""

    async def measure() -> dict[str, float]:
        return {
            name: round(await _site_rate(port, tokens, vocab, tries), 1)
            for name, port in site_ports.items()
        }

    return asyncio.run(measure())


def site_facts(site_ports: Mapping[str, int]) -> dict[str, dict[str, object]]:
    """What each site says of itself (its KV cache in blocks and tokens, its host-memory tier,
    batch slots, whether it caches prefixes)."""

    async def ask() -> dict[str, dict[str, object]]:
        facts: dict[str, dict[str, object]] = {}
        for name, port in site_ports.items():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                info = await site_pb2_grpc.SiteEngineStub(channel).Info(
                    site_pb2.InfoRequest(), timeout=30
                )
            facts[name] = {
                "kv_blocks": info.kv_blocks_total,
                "kv_block_size": info.kv_block_size,
                "kv_tokens": info.kv_blocks_total * info.kv_block_size,
                "host_kv_blocks": info.host_kv_blocks,
                "max_num_seqs": info.max_num_seqs,
                "prefix_caching": info.prefix_caching,
                "block_hash_scheme": info.block_hash_scheme,
            }
        return facts

    return asyncio.run(ask())
