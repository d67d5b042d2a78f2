"""A pooled site: a site-engine process started ahead of need, waiting unrouted, that becomes a
serving site in about a second when claimed (docs/elastic.md, "The warm pool").

`python -m site_engine --pool [--kv-plan-file F] --model DIR ...` does, before any claim, what
does not depend on where the site will run: the imports (torch, transformers, the engine), the
model's weights read into host memory (the safetensors file's pages sit in the host's page cache
once for every process that reads them; each pooled process holds its own tensors), the
tokenizer, the grammar compiler's pass over the vocabulary and the tokenizer's fingerprint
(another). It initialises no device: a pooled process holds no GPU. It prints
`POOLED pid=N` and waits for one line on stdin, the claim:

    {"args": ["--device", "cuda", "--site-name", "fed-elastic-1", "--port", "0"],
     "env": {"CUDA_VISIBLE_DEVICES": "1"}}

whose environment and arguments complete its command line (later flags win), as a slot's do for
a cold start. Then it takes the device (CUDA is initialised here, under the claim's
CUDA_VISIBLE_DEVICES), copies the weights onto it, sizes its KV cache from the plan recorded
for that card, model and settings (site_engine/kv_plan_record.py: no memory trial; the first
start of a key runs the trial and records it), allocates the cache, captures its graphs, and
serves (`READY port=N`), as a cold start does from there on.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

from fedllm_contract.tokenizer import tokenizer_fingerprint
from site_engine.engine.memory_plan import KvPlan
from site_engine.engine.paged_engine import EngineConfig, plan_kv
from site_engine.kv_plan_record import plan_key, record_plan, recorded_plan
from site_engine.model_loading import TORCH_DTYPES, LoadedModel, load_model, resolve_model_dir
from site_engine.settings import SiteSettings
from site_engine.start_phases import StartPhases

if TYPE_CHECKING:
    from site_engine.engine.grammar_compiler import GrammarCompiler

log = logging.getLogger(__name__)
POOL_FLAG = "--pool"
PLAN_FILE_FLAG = "--kv-plan-file"
DEFAULT_PLAN_FILE = Path.home() / ".cache" / "fedllm" / "kv-plans.json"


class ClaimError(ValueError):
    """The claim line is not what the pool expects; the message says why."""


@dataclass(frozen=True, slots=True)
class PoolArgs:
    site_args: list[str]  # the command line less the pool's own flags
    plan_file: Path


def split_pool_args(argv: list[str]) -> PoolArgs | None:
    """The pool's flags out of a site's command line; None when it is not a pooled start."""
    if POOL_FLAG not in argv:
        return None
    rest, plan_file = [a for a in argv if a != POOL_FLAG], DEFAULT_PLAN_FILE
    if PLAN_FILE_FLAG in rest:
        at = rest.index(PLAN_FILE_FLAG)
        if at + 1 >= len(rest):
            raise ClaimError(f"{PLAN_FILE_FLAG} needs a path")
        plan_file = Path(rest[at + 1])
        del rest[at : at + 2]
    return PoolArgs(rest, plan_file)


@dataclass(frozen=True, slots=True)
class Prepared:
    """What a pooled process built before its claim."""

    loaded: LoadedModel  # on the host
    grammars: GrammarCompiler | None  # None: llguidance is not installed (no constraints)
    plan_file: Path
    tokenizer_fingerprint: str  # a hash over the vocabulary (~0.8 s for GPT-2's on a busy CPU)


def prepare(settings: SiteSettings, plan_file: Path) -> Prepared:
    """The device-free part of a start: weights on the host, tokenizer, grammar compiler."""
    loaded = load_model(
        settings.model_dir, device="cpu", dtype=settings.dtype, tokenizer_dir=settings.tokenizer_dir
    )
    try:
        from site_engine.engine.grammar_compiler import GrammarCompiler
    except ModuleNotFoundError:
        grammars = None  # the engine says so at start-up (PagedEngine.grammars)
    else:
        grammars = GrammarCompiler(
            loaded.tokenizer,
            loaded.vocab_size,
            loaded.eos_token_ids,
            threads=settings.grammar_compile_threads,
            timeout_s=settings.grammar_compile_timeout_s,
        )
    return Prepared(loaded, grammars, plan_file, tokenizer_fingerprint(loaded.tokenizer))


@dataclass(frozen=True, slots=True)
class Claim:
    args: list[str]
    env: dict[str, str]


def read_claim(stream: IO[str]) -> Claim | None:
    """The claim line (None: the pool's owner closed stdin, so the process ends unused)."""
    line = stream.readline()
    if not line:
        return None
    try:
        raw: Any = json.loads(line)
    except ValueError as exc:
        raise ClaimError(f"a claim is one JSON object a line: {exc}") from exc
    if not isinstance(raw, dict):
        raise ClaimError("a claim is a JSON object")
    args, env = raw.get("args", []), raw.get("env", {})
    if not (isinstance(args, list) and all(isinstance(a, str) for a in args)):
        raise ClaimError("a claim's 'args' is a list of strings")
    if not (isinstance(env, dict) and all(isinstance(v, str) for v in env.values())):
        raise ClaimError("a claim's 'env' maps names to strings")
    return Claim(args, env)


def announce_pooled() -> None:
    sys.stdout.write(f"POOLED pid={os.getpid()}\n")
    sys.stdout.flush()


def apply_claim_env(claim: Claim) -> None:
    """Before any device is touched: CUDA reads CUDA_VISIBLE_DEVICES at its initialisation."""
    os.environ.update(claim.env)


def take_device(prepared: Prepared, settings: SiteSettings, phases: StartPhases) -> LoadedModel:
    """The host weights moved onto the claimed device (and dtype, if the claim changed it)."""
    device = torch.device(settings.device)
    if device.type == "cuda":
        torch.cuda.init()  # type: ignore[no-untyped-call]
    phases.mark("device_init")
    loaded = prepared.loaded
    dtype = TORCH_DTYPES[settings.dtype]
    if device != loaded.device or dtype != loaded.dtype:
        loaded.model.to(device=device, dtype=dtype)
        loaded = replace(loaded, device=device, dtype=dtype)
    phases.mark("weights_read")
    return loaded


def planned_kv(
    prepared: Prepared, loaded: LoadedModel, settings: SiteSettings, config: EngineConfig
) -> KvPlan:
    """The plan recorded for this card, model and settings, else the trial's (then recorded)."""
    card = torch.cuda.get_device_name(loaded.device) if loaded.device.type == "cuda" else "cpu"
    key = plan_key(
        card,
        resolve_model_dir(settings.model_dir),
        settings.dtype,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        block_size=config.block_size,
        kv_cache_bytes=config.kv_cache_bytes,
        cuda_graphs=config.cuda_graphs,
        lora=config.lora is not None,
        finetune_reserve_bytes=config.finetune_reserve_bytes,
    )
    plan = recorded_plan(prepared.plan_file, key)
    if plan is not None:
        log.info("KV cache planned from the plan recorded in %s (no trial)", prepared.plan_file)
        return plan
    plan = plan_kv(loaded, config)
    record_plan(prepared.plan_file, key, plan)
    log.info("KV plan recorded in %s for the next pooled start", prepared.plan_file)
    return plan
