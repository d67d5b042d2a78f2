"""Shared pieces of the benchmarks: result files and Markdown tables."""

from __future__ import annotations

import json
import platform
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


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
    directory: Path | None = None,
) -> Path:
    """Writes bench/results/NAME.json and NAME.md (the command that made them included), or
    into `directory` when given."""
    results_dir = directory if directory is not None else RESULTS_DIR
    results_dir.mkdir(parents=True, exist_ok=True)
    stamped = {
        "command": command,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        **payload,
    }
    json_path = results_dir / f"{name}.json"
    json_path.write_text(json.dumps(stamped, indent=2) + "\n")
    (results_dir / f"{name}.md").write_text(
        f"# {name}\n\nCommand: `{command}`\n\nMachine: {stamped['machine']}\n\n{markdown}\n"
    )
    return json_path
