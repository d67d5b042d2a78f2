"""The prefix-reuse runs of `python -m bench.federation --workload
trace|shared_prefix|sharegpt|text` (issue 34): one federation, every arm (our gateways with their
routing profiles, SGLang's router in front of the same sites), the knee of each bisected
(knee.py), hit rates and load per site.

1. Models, sites (each with its OpenAI HTTP face for SGLang's router, and its host-memory tier
   when the engine has one), the latency injector.
2. What each site says of itself (KV blocks and tokens, host tier), then its prefill rate,
   measured on the idle site (calibrate.py) and written into every gateway's federation file,
   as an operator would (`prefill_tokens_per_s`; only the cost-model profiles read it).
3. With the `text` workload and an arm that serves the adapted predictor: the train split served
   through a sample-collecting gateway and the predictor retrained from it (adapt.py).
4. Every arm started, the sweep, the decision-time phase, the result files.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from functools import cache
from pathlib import Path
from typing import Any

from bench.federation.adapt import offline_scores, serve_and_retrain
from bench.federation.calibrate import prefill_rates, site_facts
from bench.federation.cluster import ARMS, Federation, Gateway
from bench.federation.knee import knee_sweep
from bench.federation.metrics import RunSummary
from bench.federation.options import Options
from bench.federation.prefix_workloads import (
    for_run,
    read_mt_bench,
    read_trace,
    reusable_share,
    served_answer_lengths,
    shared_prefix_requests,
    trace_requests,
)
from bench.federation.report import finish, sweep_payload, write
from bench.federation.runs import Runner
from bench.federation.text_tokens import WordTokens
from bench.federation.text_workload import TextPrompt, text_prompts, text_requests
from bench.federation.topology import PrefixRuns, write_model
from bench.federation.workload import Pools, Request, arrivals, describe, load_pools, scaled
from bench.multisite.throttle import stop_all
from fedllm_contract.tokenizer import load_tokenizer

_STARTED = time.monotonic()
HOST_TIER_FLAG = "--host-kv-cache-gib"


def log(message: str) -> None:
    print(f"[{time.monotonic() - _STARTED:6.0f}s] {message}", flush=True)


class Source:
    """A workload's requests per rate (built once), and each arm's run of them."""

    def __init__(self, options: Options, runs: PrefixRuns, words: WordTokens, vocab: int) -> None:
        self._options, self._runs, self._words, self._vocab = options, runs, words, vocab
        self._build = cache(self._requests)
        self._pools = cache(self._load_pools)
        self._text = cache(self._text_prompts)

    def _text_prompts(self, split: str) -> tuple[TextPrompt, ...]:
        cap = self._runs.shape.max_prompt_tokens - 8  # room for the run's marker
        return text_prompts(self._words, split, cap, data_dir=self._options.data_dir)

    @property
    def words(self) -> WordTokens:
        return self._words

    def replayed(self, split: str) -> dict[str, int]:
        """Each of the split's prompts (as sent) and its answer length as the sites replay it."""
        shape = self._runs.shape
        return {
            p.text: scaled(p.answer_tokens, shape.answer_scale, shape.max_answer_tokens)
            for p in self._text(split)
        }

    def text_split(self, split: str, rate: float, duration_s: float) -> list[Request]:
        """The `text` workload's requests of one split (train: what adapt.py serves)."""
        shape = self._runs.shape
        return text_requests(
            self._text(split), rate, duration_s, self._options.seed,
            answer_scale=shape.answer_scale, max_answer_tokens=shape.max_answer_tokens,
            split=split,
        )  # fmt: skip

    def _load_pools(self) -> Pools:
        return load_pools(
            lambda text: self._words.encode_text(text),
            self._vocab,
            data_dir=self._options.data_dir,
            max_prompt_tokens=self._runs.shape.max_prompt_tokens - 8,
        )

    def _requests(self, rate: float) -> tuple[Request, ...]:
        options, runs, words = self._options, self._runs, self._words
        shape, seed = runs.shape, options.seed
        if options.workload == "trace":
            records = read_trace(options.trace_file)
            return tuple(trace_requests(records, words, rate, runs.duration_s, seed, shape))
        if options.workload == "text":
            return tuple(self.text_split("test", rate, runs.duration_s))
        if options.workload == "shared_prefix":
            questions = read_mt_bench(options.mt_bench_file)
            answers = served_answer_lengths()
            built = shared_prefix_requests(
                questions, answers, words, rate, runs.duration_s, seed, shape
            )
            return tuple(built)
        return tuple(
            arrivals(
                self._pools(),
                rate,
                runs.duration_s,
                seed,
                answer_scale=shape.answer_scale,
                max_prompt_tokens=shape.max_prompt_tokens - 8,
                max_answer_tokens=shape.max_answer_tokens,
                words=words,
            )
        )

    def for_arm(self, rate: float, arm: str) -> Sequence[Request]:
        return for_run(self._build(rate), self._words, f"{arm}-{rate:g}")

    def describe(self, rate: float) -> dict[str, Any]:
        requests = self._build(rate)
        return {
            **describe(requests),
            "reusable_share_unbounded": round(reusable_share(requests, 16), 3),
        }


def _host_tier(runs: PrefixRuns) -> tuple[str, ...]:
    """The host-memory tier's flag, when the engine has one (issue 33) and the preset asks."""
    if runs.host_kv_gib <= 0:
        return ()
    shown = subprocess.run(
        [sys.executable, "-m", "site_engine", "--help"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return (HOST_TIER_FLAG, f"{runs.host_kv_gib:g}") if HOST_TIER_FLAG in shown else ()


def _label(options: Options, runs: PrefixRuns, host: Sequence[str]) -> str:
    shape = runs.shape
    scale = (
        "CPU scale, tiny random models: only the trend means anything. "
        if (options.preset.name == "cpu")
        else ""
    )
    return (
        f"**{scale}Workload {options.workload}.** A trace block id is {shape.block_tokens} "
        f"tokens (input lengths scaled by {shape.block_tokens}/512), prompts cut at "
        f"{shape.max_prompt_tokens} tokens, answers replayed at {shape.answer_scale:g}x their "
        f"length (at most {shape.max_answer_tokens}), a system prompt of {shape.system_tokens} "
        f"tokens; {runs.duration_s:g} s of arrivals a run, at most {runs.drain_s:g} s of drain. "
        + (f"Sites' host tier: {host[1]} GiB each." if host else "Sites without a host tier.")
    )


def _start_arms(
    federation: Federation, options: Options, weights: Mapping[str, float]
) -> list[Gateway]:
    arms = [ARMS[name] for name in options.arms]
    ours = [arm for arm in arms if arm.router == "gateway"]
    log(f"starting {len(ours)} gateways: {', '.join(a.name for a in ours)}")
    with ThreadPoolExecutor(max_workers=max(1, len(ours))) as pool:
        started = list(pool.map(lambda arm: federation.start_gateway(arm, weights), ours))
    for arm in arms:
        if arm.router == "sglang" and options.sglang_router is not None:
            log(f"starting SGLang's router ({options.sglang_router})")
            started.append(federation.start_sglang_router(arm, options.sglang_router))
    order = {name: i for i, name in enumerate(options.arms)}
    return sorted(started, key=lambda g: order[g.arm.name])


def _adapt(
    federation: Federation, options: Options, source: Source, weights: Mapping[str, float]
) -> dict[str, Any]:
    """The predictor adapted from served train-split traffic (adapt.py), scored offline on the
    measured (test-split) prompts beside the base."""
    runs, base = options.prefix, options.predictor_dir
    if runs is None or base is None:  # Options checks both
        raise ValueError("the adaptation needs the prefix runs and a base predictor")
    rate = runs.rates[options.workload][0]
    served = source.text_split("train", rate, options.adapt_samples / rate)
    out = options.work_dir / "predictor-adapted"
    shutil.rmtree(out, ignore_errors=True)  # a candidate of an earlier run in this work dir
    report = serve_and_retrain(
        federation, weights, for_run(served, source.words, "adapt"), base=base, out=out,
        mode=options.adapt_mode, drain_s=runs.drain_s, log=log,
    )  # fmt: skip
    federation.adapted_predictor_dir = out
    prompts = source.replayed("test")
    report["offline_on_test_split"] = offline_scores(
        {"base": base, "adapted": out}, list(prompts), list(prompts.values())
    )
    report["test_prompts_scored"] = len(prompts)
    return report


def run_reuse(options: Options, command: str) -> Path:
    runs = options.prefix
    if runs is None:
        raise ValueError(f"preset {options.preset.name} has no prefix runs")
    started = time.monotonic()
    preset = options.preset
    tokenizer = load_tokenizer(options.tokenizer_dir)
    vocab = len(tokenizer)
    words = WordTokens.of(
        lambda text: tokenizer.encode(text, add_special_tokens=False), tokenizer.decode, vocab
    )
    source = Source(options, runs, words, vocab)
    weights = preset.capacity_weights(vocab)
    coarse = runs.rates[options.workload]
    host = _host_tier(runs)
    payload: dict[str, Any] = {
        "label": _label(options, runs, host),
        "preset": preset.name,
        "workload": options.workload,
        "arms": {name: asdict(ARMS[name]) for name in options.arms},
        "sglang_router": str(options.sglang_router) if options.sglang_router else None,
        "predictor": str(options.predictor_dir) if options.predictor_dir else None,
        "shape": asdict(runs.shape),
        "coarse_rates": list(coarse),
        "bisections": runs.bisections,
        "duration_s": runs.duration_s,
        "drain_s": runs.drain_s,
        "workloads": {f"{rate:g}": source.describe(rate) for rate in coarse},
    }
    if options.sglang_router is None and "sglang_router" not in options.arms:
        payload["sglang_router"] = "not installed: arm left out"
    models = {}
    for shape in preset.shapes:
        out = options.work_dir / "models" / f"{shape.name}-{vocab}"
        models[shape.name] = write_model(out, shape, options.tokenizer_dir)
    federation = Federation(
        preset, options.work_dir, models, options.tokenizer_dir, options.predictor_dir
    )
    federation.site_args = host
    try:
        log(f"starting {len(preset.sites)} sites and the latency injector")
        federation.start_sites()
        facts = site_facts(federation.site_ports)
        rates = prefill_rates(federation.site_ports, runs.calibration_tokens, vocab)
        log(f"prefill tokens/s: {rates}")
        federation.site_extras = {n: {"prefill_tokens_per_s": r} for n, r in rates.items()}
        payload["sites"] = [
            {
                **asdict(site),
                "capacity_weight": weights[site.name],
                "prefill_tokens_per_s": rates[site.name],
                **facts[site.name],
            }
            for site in preset.sites
        ]
        if options.adapts:
            payload["adaptation"] = _adapt(federation, options, source, weights)
        gateways = _start_arms(federation, options, weights)
        capacity = {name: int(str(f["kv_tokens"])) for name, f in facts.items()}
        runner = Runner(
            federation,
            federation.metrics_ports,
            runs.drain_s,
            runs.duration_s,
            log,
            capacity_tokens=capacity,
        )

        def checkpoint(results: Mapping[str, Sequence[RunSummary]]) -> None:
            payload["sweep"] = sweep_payload(results, weights)
            write(options.out_dir, options.name, command, payload, options.name)

        results = knee_sweep(runner, gateways, source.for_arm, coarse, runs.bisections, checkpoint)
        payload["sweep"] = sweep_payload(results, weights)
    finally:
        stop_all()
        federation.close()
    elapsed = time.monotonic() - started
    return finish(
        options.phases, options.decisions, options.out_dir, options.name, command, payload,
        elapsed, log,
    )  # fmt: skip
