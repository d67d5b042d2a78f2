"""Labels the corpora with the served model's own answer lengths, using the real site engine.

    python -m predictor.label_served --model path/to/model.gguf \
        --out predictor/labels/smollm2-135m-instruct [--device cuda] [--limit N]

Each prompt of ../shared/datasets is rendered with the model's chat template as one user turn
(what the gateway sends for a chat request), then answered by a `PagedEngine` (iteration-level
batching, the same engine the sites run) with the deployment's sampling: greedy, up to
`--max-tokens`, stopping at the model's EOS. The answer's length in the model's tokens is what
the gateway records as a served request's completion tokens, so a predictor trained on these
labels predicts what routing will see.

`--heldout alpaca_eval` labels AlpacaEval's 805 instructions from ../shared/heldout instead
(predictor.heldout; `--heldout-dir` / FEDLLM_HELDOUT_DIR): held-out prompts, whose labels only
ever *report* a predictor with fixed settings (`python -m bench.predictor.rank --heldout`);
write them outside the repository, e.g. var/predictor/heldout-labels/NAME.

Prompts are visited in one seeded order spread over all corpora, so a partial run is still a
fair sample; labels are appended as answers finish and a rerun skips what is done (resumable).
Greedy answers are deterministic for a given device and dtype; across dtypes or batch mixes a
few answers may differ by rounding, as they would between two sites.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from predictor.cli import command_parser
from predictor.datasets import PromptRecord, load_corpus
from predictor.heldout import HELDOUT_SETS, load_heldout
from predictor.served_labels import (
    LabelManifest,
    ServedLabel,
    append_labels,
    prompt_digest,
    read_labels,
    write_manifest,
)
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import FinishReason, SamplingParams
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.model_loading import LoadedModel, load_model
from site_engine.settings import default_model_name

log = logging.getLogger("predictor.label_served")

LABEL_CORPORA = ("alpaca", "dolly", "lima", "gsm8k")
_FLUSH_EVERY = 256


@dataclass(frozen=True, slots=True)
class PendingPrompt:
    record: PromptRecord
    token_ids: tuple[int, ...]


def render_prompt(loaded: LoadedModel, prompt: str) -> tuple[int, ...]:
    """The token ids the gateway sends for a one-turn chat: template text, no added specials."""
    tokenizer = loaded.tokenizer
    if not tokenizer.chat_template:
        raise SystemExit("the model's tokenizer has no chat template: cannot render chat prompts")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    return tuple(tokenizer.encode(str(text), add_special_tokens=False))


def _records_of(corpus: str, data_dir: Path | None, heldout_dir: Path | None) -> list[PromptRecord]:
    if corpus in HELDOUT_SETS:
        return load_heldout(corpus, heldout_dir)
    return load_corpus(corpus, data_dir)  # type: ignore[arg-type]


def ordered_records(
    corpora: Sequence[str], data_dir: Path | None, seed: int, heldout_dir: Path | None = None
) -> list[PromptRecord]:
    records = [r for corpus in corpora for r in _records_of(corpus, data_dir, heldout_dir)]
    random.Random(seed).shuffle(records)
    return records


def _todo(
    loaded: LoadedModel, records: list[PromptRecord], done: set[tuple[str, int]], max_tokens: int
) -> Iterator[PendingPrompt]:
    limit = loaded.max_model_len - 1
    for record in records:
        if (record.corpus, record.index) in done:
            continue
        ids = render_prompt(loaded, record.prompt)
        if len(ids) > limit:
            log.warning(
                "%s[%d]: %d prompt tokens, longer than the context; skipped",
                record.corpus,
                record.index,
                len(ids),
            )
            continue
        yield PendingPrompt(record, ids)


def label(
    loaded: LoadedModel,
    pending: Iterator[PendingPrompt],
    out: Path,
    *,
    max_tokens: int,
    engine_config: EngineConfig,
    limit: int | None,
) -> int:
    """Runs the engine over `pending`, keeping its queue full; returns how many were labelled."""
    engine = PagedEngine(loaded, engine_config)
    in_flight: dict[str, tuple[PendingPrompt, list[int]]] = {}
    finished: list[ServedLabel] = []
    labelled = submitted = generated = 0
    started = last_report = time.monotonic()
    queue_depth = 2 * engine_config.max_num_seqs
    exhausted = False
    while True:
        while (
            not exhausted and len(in_flight) < queue_depth and (limit is None or submitted < limit)
        ):
            item = next(pending, None)
            if item is None:
                exhausted = True
                break
            request_id = f"{item.record.corpus}-{item.record.index}"
            # Leave room in the context: a long prompt may not answer max_tokens tokens.
            room = min(max_tokens, loaded.max_model_len - len(item.token_ids))
            engine.add_request(
                EngineRequest(request_id, item.token_ids, SamplingParams(room, temperature=0.0))
            )
            in_flight[request_id] = (item, [])
            submitted += 1
        if not in_flight:
            break
        for output in engine.step():
            item, tokens = in_flight[output.request_id]
            tokens.extend(output.new_token_ids)
            generated += len(output.new_token_ids)
            if output.finish_reason is None:
                continue
            del in_flight[output.request_id]
            finished.append(_label_of(item, len(tokens), output.finish_reason))
        if len(finished) >= _FLUSH_EVERY:
            append_labels(out, finished)
            labelled += len(finished)
            finished = []
        now = time.monotonic()
        if now - last_report > 30:
            last_report = now
            log.info(
                "%d labelled, %d in flight, %.0f answer tok/s",
                labelled + len(finished),
                len(in_flight),
                generated / (now - started),
            )
    append_labels(out, finished)
    labelled += len(finished)
    elapsed = time.monotonic() - started
    log.info(
        "done: %d labelled in %.0f s (%.0f answer tok/s)",
        labelled,
        elapsed,
        generated / max(elapsed, 1e-9),
    )
    return labelled


def _label_of(item: PendingPrompt, answer_tokens: int, reason: FinishReason) -> ServedLabel:
    return ServedLabel(
        corpus=item.record.corpus,
        index=item.record.index,
        prompt_sha256=prompt_digest(item.record.prompt),
        prompt_tokens=len(item.token_ids),
        answer_tokens=answer_tokens,
        finish_reason="stop" if reason is FinishReason.STOP else "length",
    )


def main(argv: list[str] | None = None) -> None:
    parser = command_parser("predictor.label_served", __doc__)
    parser.add_argument(
        "--model",
        type=Path,
        required=True,
        help="GGUF file, or a transformers / GGUF model directory",
    )
    parser.add_argument("--model-name", help="the name the gateway serves it by")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--data-dir", type=Path)
    sets = parser.add_mutually_exclusive_group()
    sets.add_argument("--corpora", nargs="+", default=list(LABEL_CORPORA), choices=LABEL_CORPORA)
    sets.add_argument(
        "--heldout",
        choices=HELDOUT_SETS,
        help="label a held-out prompt set instead of the corpora (report-only data)",
    )
    parser.add_argument("--heldout-dir", type=Path)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0, help="order of the prompts")
    parser.add_argument("--limit", type=int, help="label at most this many (more on a rerun)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--threads", type=int, help="torch threads on CPU")
    args = parser.parse_args(argv)
    corpora = (args.heldout,) if args.heldout else tuple(args.corpora)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    manifest = LabelManifest(
        model=args.model_name or default_model_name(args.model),
        max_tokens=args.max_tokens,
        temperature=0.0,
        seed=args.seed,
        chat_template=True,
        dtype=args.dtype,
        corpora=corpora,
        extra={"device": args.device, "engine": "site_engine.PagedEngine"},
    )
    write_manifest(args.out, manifest)
    done = {label.key for label in read_labels(args.out)}
    records = ordered_records(corpora, args.data_dir, args.seed, args.heldout_dir)
    log.info("%d prompts, %d already labelled", len(records), len(done))
    config = EngineConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
    )
    label(
        loaded,
        _todo(loaded, records, done, args.max_tokens),
        args.out,
        max_tokens=args.max_tokens,
        engine_config=config,
        limit=args.limit,
    )


if __name__ == "__main__":
    main()
