"""llguidance and xgrammar compared on what our engine needs of a grammar engine, on SmolLM2's
49k-token vocabulary and the schemas clients send (bench/structured/schemas.py):

- compile: the time from a JSON schema to a matcher that gives its first token mask (what a
  request with a schema not seen before pays once; both engines cache by schema after that);
- mask cost: the time to compute one token mask, averaged over every step of constrained walks;
- coverage: whether the engine takes the schema, and whether every answer it lets through
  validates (a schema taken but not enforced is the failure we must never serve): random walks
  under the engine's masks, each finished answer checked with jsonschema_rs (formats on).

    python -m bench.structured.grammar_engines --tokenizer var/models/SmolLM2-135M-Instruct-*

Needs both engines importable: llguidance is a dependency of the site; xgrammar is not (pip
install --target DIR xgrammar==0.2.8 apache-tvm-ffi, then PYTHONPATH=DIR). Writes
bench/results/structured_output/grammar_engines.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import jsonschema_rs
import numpy as np
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from bench.common import results_dir
from bench.structured.schemas import edge_schemas, realistic_schemas

RESULTS = results_dir("structured_output")
MAX_WALK_TOKENS = 400
# Tokens that close strings, objects and arrays: walks prefer them half the time, so that they
# end within MAX_WALK_TOKENS instead of wandering through 49k-token strings.
_CLOSERS = ('"', "}", "]", ",")


class Walker(Protocol):
    def mask(self) -> np.ndarray: ...  # int32 words, bit i of the vocabulary = token i allowed

    def consume(self, token: int) -> bool: ...

    def done(self) -> bool: ...


@dataclass
class SchemaResult:
    schema: str
    taken: bool
    error: str = ""
    compile_ms: float = 0.0
    mask_us: list[float] = field(default_factory=list)
    walks: int = 0
    finished: int = 0
    invalid: int = 0


def _allowed(words: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def _walk(
    walker: Walker, tokenizer: PreTrainedTokenizerBase, closers: np.ndarray, rng: random.Random
) -> tuple[list[int] | None, list[float]]:
    """One answer under the masks: the tokens (None if it did not finish) and mask times (us)."""
    vocab = len(closers)
    eos = tokenizer.eos_token_id
    tokens: list[int] = []
    times: list[float] = []
    for _ in range(MAX_WALK_TOKENS):
        start = time.perf_counter()
        words = walker.mask()
        times.append((time.perf_counter() - start) * 1e6)
        allowed = _allowed(words, vocab)
        if len(allowed) == 0:
            return None, times
        if eos in allowed and rng.random() < 0.5:
            return tokens, times
        preferred = allowed[closers[allowed]]
        pool = preferred if len(preferred) and rng.random() < 0.5 else allowed
        token = int(pool[rng.randrange(len(pool))])
        if token == eos:
            return tokens, times
        if not walker.consume(token):
            return None, times
        tokens.append(token)
        if walker.done():
            return tokens, times
    return None, times


class _Llg:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab: int) -> None:
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.vocab = vocab

    def compile(self, schema: dict[str, Any]) -> Callable[[], Walker]:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        error = self.llg.LLMatcher.validate_grammar(grammar, self.tok)
        if error:
            raise ValueError(error)
        llg, tok, vocab = self.llg, self.tok, self.vocab

        class W:
            def __init__(self) -> None:
                self.m = llg.LLMatcher(tok, grammar)
                if self.m.is_error():
                    raise ValueError(self.m.get_error())

            def mask(self) -> np.ndarray:
                words = np.zeros((vocab + 31) // 32, dtype=np.int32)
                self.m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
                return words

            def consume(self, token: int) -> bool:
                return bool(self.m.consume_token(token))

            def done(self) -> bool:
                return bool(self.m.is_stopped())

        return W


class _Xgr:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab: int) -> None:
        import xgrammar  # type: ignore[import-not-found,unused-ignore]

        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.vocab = vocab

    def compile(self, schema: dict[str, Any]) -> Callable[[], Walker]:
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        compiled = compiler.compile_json_schema(json.dumps(schema), strict_mode=True)
        xgr, vocab = self.xgr, self.vocab

        class W:
            def __init__(self) -> None:
                self.m = xgr.GrammarMatcher(compiled)
                self.bitmask = xgr.allocate_token_bitmask(1, vocab)

            def mask(self) -> np.ndarray:
                self.m.fill_next_token_bitmask(self.bitmask, 0)
                return np.asarray(self.bitmask[0].numpy(), dtype=np.int32)

            def consume(self, token: int) -> bool:
                return bool(self.m.accept_token(token))

            def done(self) -> bool:
                return bool(self.m.is_terminated())

        return W


def _measure(
    engine: _Llg | _Xgr,
    name: str,
    schema: dict[str, Any],
    tokenizer: PreTrainedTokenizerBase,
    closers: np.ndarray,
    walks: int,
) -> SchemaResult:
    result = SchemaResult(schema=name, taken=True)
    start = time.perf_counter()
    try:
        make = engine.compile(schema)
        first = make()
        first.mask()
    except Exception as exc:  # the engine refuses the schema: say why
        return SchemaResult(schema=name, taken=False, error=str(exc)[:200])
    result.compile_ms = (time.perf_counter() - start) * 1000
    validator = jsonschema_rs.validator_for(schema, validate_formats=True)
    rng = random.Random(f"{name}")
    for _ in range(walks):
        tokens, times = _walk(make(), tokenizer, closers, rng)
        result.walks += 1
        result.mask_us.extend(times)
        if tokens is None:
            continue
        result.finished += 1
        text = tokenizer.decode(tokens)
        try:
            valid = validator.is_valid(json.loads(text))
        except ValueError:
            valid = False
        result.invalid += int(not valid)
    return result


def _stored(result: SchemaResult) -> dict[str, Any]:
    """A schema's result as the JSON file keeps it: mask times summarised, not every step."""
    stored = asdict(result)
    times = stored.pop("mask_us")
    stored["mask_steps"] = len(times)
    stored["mask_us_median"] = statistics.median(times) if times else None
    stored["mask_us_p99"] = float(np.percentile(times, 99)) if times else None
    return stored


def _summary(results: list[SchemaResult]) -> dict[str, Any]:
    taken = [r for r in results if r.taken]
    masks = [t for r in taken for t in r.mask_us]
    return {
        "schemas": len(results),
        "taken": len(taken),
        "taken_but_not_enforced": [r.schema for r in taken if r.invalid],
        "refused": {r.schema: r.error for r in results if not r.taken},
        "compile_ms_median": statistics.median([r.compile_ms for r in taken]) if taken else None,
        "compile_ms_max": max((r.compile_ms for r in taken), default=None),
        "mask_us_median": statistics.median(masks) if masks else None,
        "mask_us_p99": float(np.percentile(masks, 99)) if masks else None,
        "mask_steps": len(masks),
        "walks_finished": sum(r.finished for r in taken),
        "walks": sum(r.walks for r in taken),
    }


def _markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Grammar engines on SmolLM2's vocabulary",
        "",
        f"`{report['command']}`",
        "",
        f"Vocabulary: {report['vocab']} tokens; {report['walks_per_schema']} constrained random "
        "walks per schema, every finished answer validated with jsonschema_rs (formats on).",
        "",
        "| engine | schemas taken | taken but not enforced | compile ms (median / max) | "
        "mask us (median / p99) | walks finished |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in report["engines"].items():
        s = s["summary"]
        loose = ", ".join(s["taken_but_not_enforced"]) or "-"
        lines.append(
            f"| {name} | {s['taken']}/{s['schemas']} | {loose} "
            f"| {s['compile_ms_median']:.1f} / {s['compile_ms_max']:.1f} "
            f"| {s['mask_us_median']:.0f} / {s['mask_us_p99']:.0f} "
            f"| {s['walks_finished']}/{s['walks']} |"
        )
    lines += ["", "Refused schemas (the engine's own words):", ""]
    for name, s in report["engines"].items():
        for schema, error in s["summary"]["refused"].items():
            lines.append(f"- {name}, {schema}: {error}")
    lines += ["", "Per schema (compile ms, median mask us, invalid answers / finished walks):", ""]
    lines.append("| schema | " + " | ".join(report["engines"]) + " |")
    lines.append("|---|" + "---|" * len(report["engines"]))
    for index, schema in enumerate(report["schemas"]):
        cells = []
        for s in report["engines"].values():
            r = s["results"][index]
            if not r["taken"]:
                cells.append("refused")
                continue
            mask = r["mask_us_median"] or 0.0
            cells.append(f"{r['compile_ms']:.1f} ms, {mask:.0f} us, {r['invalid']}/{r['finished']}")
        lines.append(f"| {schema} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--walks", type=int, default=5)
    parser.add_argument("--engines", default="llguidance,xgrammar")
    parser.add_argument("--out", type=Path, default=RESULTS / "grammar_engines")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = len(tokenizer)
    texts = tokenizer.convert_ids_to_tokens(list(range(vocab)))
    closers = np.array([any(c in (t or "") for c in _CLOSERS) and len(t) <= 2 for t in texts])
    schemas = {**realistic_schemas(), **edge_schemas()}
    makers: dict[str, type[_Llg] | type[_Xgr]] = {"llguidance": _Llg, "xgrammar": _Xgr}
    engines: dict[str, Any] = {}
    for name in args.engines.split(","):
        engine = makers[name](tokenizer, vocab)
        results = [
            _measure(engine, schema_name, schema, tokenizer, closers, args.walks)
            for schema_name, schema in schemas.items()
        ]
        engines[name] = {"summary": _summary(results), "results": [_stored(r) for r in results]}
        print(name, json.dumps(engines[name]["summary"], indent=1))
    report = {
        "command": f"python -m bench.structured.grammar_engines --tokenizer {args.tokenizer} "
        f"--walks {args.walks}",
        "vocab": vocab,
        "walks_per_schema": args.walks,
        "schemas": list(schemas),
        "engines": engines,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".md").write_text(_markdown(report))
    print(_markdown(report))


if __name__ == "__main__":
    main()
