"""Summarizes a stored federation result again from its runs and rewrites its Markdown and
plot (after a change to the summary, or to finish a checkpoint of a run cut short):

    python -m bench.federation.render bench/results/federation/federation_h200.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from bench.federation.report import derive_sweep, with_headline, write_pages


def render(path: Path) -> None:
    stored = json.loads(path.read_text())
    if "sweep" in stored:
        weights = {site["name"]: site["capacity_weight"] for site in stored["sites"]}
        stored["sweep"] = derive_sweep(stored["sweep"]["runs"], weights)
    with_headline(stored)
    path.write_text(json.dumps(stored, indent=2, allow_nan=False) + "\n")
    write_pages(path, stored, path.stem)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.federation.render")
    parser.add_argument("results", type=Path, nargs="+")
    for path in parser.parse_args(argv).results:
        render(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
