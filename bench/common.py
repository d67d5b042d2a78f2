"""Shared pieces of the benchmarks: result files and Markdown tables."""

from __future__ import annotations

import json
import platform
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# One folder per benchmark under bench/results (its README.md indexes the current figure of each
# claim); a run that a later one replaces moves to that folder's archive/.
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def results_dir(benchmark: str) -> Path:
    """Where a benchmark's results go by default: bench/results/BENCHMARK."""
    return RESULTS_DIR / benchmark


def machine() -> dict[str, Any]:
    import os

    import torch

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _cpu_model() -> str | None:
    """The processor's name (Linux): CPU latencies mean little without it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(value: object) -> str:
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def command_line(module: str, argv: Sequence[str] | None) -> str:
    """How a benchmark was invoked, for its results file: `python -m MODULE ARGS` (the process's
    own arguments when `argv` is None)."""
    return f"python -m {module} " + " ".join(sys.argv[1:] if argv is None else argv)


def write_results(
    name: str,
    payload: dict[str, Any],
    markdown: str,
    command: str,
    directory: Path,
) -> Path:
    """Writes DIRECTORY/NAME.json and NAME.md (the command that made them included);
    `directory` is the benchmark's folder (`results_dir(...)`) unless the command named another."""
    directory.mkdir(parents=True, exist_ok=True)
    stamped = {
        "command": command,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        **payload,
    }
    json_path = directory / f"{name}.json"
    json_path.write_text(json.dumps(stamped, indent=2) + "\n")
    (directory / f"{name}.md").write_text(
        f"# {name}\n\nCommand: `{command}`\n\nMachine: {stamped['machine']}\n\n{markdown}\n"
    )
    return json_path


def write_one_site_federation(path: Path, model_dir: Path, port: int) -> None:
    """A federation file of one model, `tiny` (its tokenizer in `model_dir`), served by one
    local site `s` on `port`: what the single-site benches put a gateway in front of."""
    site = {"name": "s", "cloud": "aws", "region": "us-east-1",
            "endpoint": f"127.0.0.1:{port}", "model": "tiny"}  # fmt: skip
    models = [{"name": "tiny", "tokenizer": str(model_dir)}]
    path.write_text(json.dumps({"models": models, "sites": [site]}))
