"""The real site with the synthetic engine (bench/serving_path/synthetic_engine.py) in place of
the model's: `python -m site_engine`'s own start (site_engine.__main__.serve: the engine
service, the gRPC server, metrics, the detokenizer) with only the engine built here.

    python -m bench.serving_path.site --step-ms 10 [--data-dir D] SITE_ARGS...

SITE_ARGS are `python -m site_engine`'s (a model directory for the tokenizer and the context;
`--max-num-seqs` is the engine's rows a step). The tokens are the site tokenizer's ids of LIMA's
reference answers (real chat text). Prints `READY port=N` like the site.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, cast

from bench.engine.paths import resolve_data_dir
from bench.serving_path.synthetic_engine import SyntheticEngine
from predictor.datasets import load_corpus
from site_engine.__main__ import parse_args, serve
from site_engine.model_loading import LoadedModel, load_model
from site_engine.pool import Prepared
from site_engine.settings import SiteSettings
from site_engine.start_phases import StartPhases

if TYPE_CHECKING:
    from site_engine.engine.paged_engine import PagedEngine

# Enough answers for ~60k tokens: no two of a thousand rows read the same stretch at once.
TEXT_ANSWERS = 200


def answer_token_ids(loaded: LoadedModel, data_dir: Path | None) -> list[int]:
    records = load_corpus("lima", resolve_data_dir(data_dir))[:TEXT_ANSWERS]
    ids: list[int] = []
    for record in records:
        ids.extend(loaded.tokenizer.encode(record.response))
    return ids


def build_synthetic(
    step_s: float,
    data_dir: Path | None,
    settings: SiteSettings,
    phases: StartPhases,
    prepared: Prepared | None,
) -> tuple[LoadedModel, PagedEngine]:
    """site_engine.__main__'s EngineBuilder: the model directory's tokenizer and context, the
    synthetic engine of --max-num-seqs rows."""
    loaded = load_model(settings.model_dir, tokenizer_dir=settings.tokenizer_dir)
    phases.mark("weights_read")
    engine = SyntheticEngine(
        rows=settings.max_num_seqs or 1024,
        step_s=step_s,
        token_ids=answer_token_ids(loaded, data_dir),
        max_model_len=loaded.max_model_len,
    )
    # The start reads of the engine only what the synthetic one has (graphs_pending,
    # served_adapters, the Engine protocol); it is typed as the model's engine it replaces.
    return loaded, cast("PagedEngine", engine)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.serving_path.site", description=__doc__)
    parser.add_argument("--step-ms", type=float, default=10.0, help="the engine's step period")
    parser.add_argument("--data-dir", type=Path, default=None, help="where lima.json is")
    args, site_args = parser.parse_known_args(argv)
    settings = parse_args([*site_args, "--task", "generate", "--device", "cpu"])
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    build = partial(build_synthetic, args.step_ms / 1000.0, args.data_dir)
    asyncio.run(serve(settings, build_engine=build))


if __name__ == "__main__":
    main()
