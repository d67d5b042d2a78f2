"""What a new schema's compile costs another tenant (issue 48): one client streams 24-token
answers back to back while another sends constrained requests whose schema is new every time
(a fresh nonce: no cache has it), as large as the gateway lets through (an `anyOf` of 900
objects, ~230 KiB). Measured at the engine service, the site's asyncio face, on the CPU: the
streaming client's time per answer and its longest gap between two tokens, alone and beside the
compiles. On the code before issue 48 the compile ran on the engine's thread and every token of
the site waited for it.

    python -m site_engine.make_model --out /tmp/tiny --tokenizer ../shared/tokenizers/gpt2
    python -m bench.structured.grammar_stall --model-dir /tmp/tiny --seconds 15 --threads 1

(`--name grammar_stall_before` on a checkout of the code before, for the comparison in
docs/security.md.) A random two-layer model steps in milliseconds, so a stall shows whole;
SmolLM2 (`--model-dir var/models/SmolLM2-135M-Instruct-*`) works too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from bench.common import command_line, markdown_table, results_dir, write_results
from fedllm_contract.grammar import ConstraintSpec
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import SamplingParams
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.engine_service import EngineService
from site_engine.model_loading import LoadedModel, load_model

BRANCHES = 900


def fresh_schema(key_chars: int) -> str:
    nonce = uuid.uuid4().hex[:8]
    pad = "x" * key_chars
    branches = [
        {"type": "object", "properties": {f"{pad}{nonce}{i}": {"type": "integer"}},
         "required": [f"{pad}{nonce}{i}"], "additionalProperties": False}
        for i in range(BRANCHES)
    ]  # fmt: skip
    return json.dumps({"anyOf": branches})


async def victim(service: EngineService, prompt: tuple[int, ...], until: float) -> dict[str, Any]:
    latencies: list[float] = []
    worst_gap = 0.0
    gaps: list[float] = []
    n = 0
    while time.monotonic() < until:
        n += 1
        sampling = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        request = EngineRequest(f"victim-{n}", prompt, sampling)
        began = last = time.monotonic()
        async for event in service.generate(request):
            if event.token_ids:
                now = time.monotonic()
                gaps.append(now - last)
                worst_gap = max(worst_gap, now - last)
                last = now
        latencies.append(time.monotonic() - began)
    gaps.sort()
    return {
        "answers": len(latencies),
        "answer_s_median": statistics.median(latencies),
        "answer_s_max": max(latencies),
        "token_gap_ms_p99": gaps[int(len(gaps) * 0.99)] * 1000,
        "token_gap_ms_max": worst_gap * 1000,
    }


async def attacker(
    service: EngineService, prompt: tuple[int, ...], until: float, key_chars: int
) -> dict[str, Any]:
    sent = refused = 0
    size = 0
    while time.monotonic() < until:
        sent += 1
        schema = fresh_schema(key_chars)
        size = len(schema)
        spec = ConstraintSpec("json_schema", schema=schema)
        sampling = SamplingParams(max_tokens=8, temperature=0.0, constraint=spec)
        try:
            async for _ in service.generate(EngineRequest(f"schema-{sent}", prompt, sampling)):
                pass
        except ValueError:  # RequestRejected: refused (its compile ran past the site's limit)
            refused += 1
    return {"schemas_sent": sent, "schemas_refused": refused, "schema_kib": size / 1024}


async def arm(
    loaded: LoadedModel, seconds: float, compiles: bool, key_chars: int
) -> dict[str, Any]:
    engine = PagedEngine(loaded, EngineConfig(max_num_seqs=8))
    engine.grammars()  # the token trie: built at a site's start-up, not measured
    service = EngineService(engine, loaded.tokenizer)
    service.start()
    prompt = tuple(loaded.tokenizer.encode("Say hello to the world.", add_special_tokens=False))
    until = time.monotonic() + seconds
    try:
        tasks = [victim(service, prompt, until)]
        if compiles:
            tasks.append(attacker(service, prompt, until, key_chars))
        results = await asyncio.gather(*tasks)
    finally:
        service.stop()
    merged: dict[str, Any] = {"compiles": compiles}
    for result in results:
        merged.update(result)
    return merged


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--key-chars", type=int, default=70, help="padding of each key")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--name", default="grammar_stall")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model_dir)
    arms = [asyncio.run(arm(loaded, args.seconds, c, args.key_chars)) for c in (False, True)]
    header = ["compiles beside", "answers", "answer s (median)", "answer s (max)",
              "token gap ms (p99)", "token gap ms (max)", "schemas sent", "KiB each"]  # fmt: skip
    rows = [
        [r["compiles"], r["answers"], r["answer_s_median"], r["answer_s_max"],
         r["token_gap_ms_p99"], r["token_gap_ms_max"], r.get("schemas_sent", 0),
         r.get("schema_kib", 0.0)]
        for r in arms
    ]  # fmt: skip
    table = markdown_table(header, rows)
    print(table)
    command = command_line(__spec__.name, argv)
    write_results(args.name, {"arms": arms}, table, command, results_dir("structured_output"))


if __name__ == "__main__":
    main()
