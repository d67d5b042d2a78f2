"""Reading request traces: arrival times, prompt and answer lengths, and where a trace has them,
prompt-block hashes (Mooncake's `hash_ids`, one id per 512 tokens) and prompt text.

Two formats, by the file's suffix:
- JSON lines (`.jsonl`), Mooncake's schema: `timestamp` (milliseconds), `input_length`,
  `output_length`, optional `hash_ids`, and optional `prompt` (text: the served predictor reads
  it; without it the predictor is a stand-in, fedsim/workload.py);
- CSV (`.csv`), the Azure LLM inference 2023 schema: `TIMESTAMP`, `ContextTokens`,
  `GeneratedTokens`.

A malformed row is an error naming the file and line, never skipped.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path


class TraceError(ValueError):
    """A trace file that cannot be read as a trace, or one too short for the run asked of it."""


@dataclass(frozen=True, slots=True)
class Lengths:
    """(prompt tokens, answer tokens) of one request, when it came (seconds from the trace's
    start), the blocks its prompt is made of where the trace says (`hash_ids`), and its text
    where the trace has it."""

    prompt: int
    answer: int
    at_s: float = 0.0
    hash_ids: tuple[int, ...] = ()
    text: str | None = None


def read_trace(path: Path) -> list[Lengths]:
    """The requests of a trace file (the module docstring); TraceError if it is not one."""
    if not path.is_file():
        raise TraceError(f"trace file {path} does not exist")
    if path.suffix == ".jsonl":
        return jsonl_lengths(path)
    if path.suffix == ".csv":
        return azure_lengths(path)
    raise TraceError(f"trace file {path}: expected .jsonl (Mooncake's schema) or .csv (Azure's)")


def jsonl_lengths(path: Path) -> list[Lengths]:
    rows: list[Lengths] = []
    with path.open() as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                text = r.get("prompt")
                if text is not None and not isinstance(text, str):
                    raise TypeError("prompt must be text")
                rows.append(
                    Lengths(
                        int(r["input_length"]),
                        max(1, int(r["output_length"])),
                        float(r["timestamp"]) / 1000.0,
                        tuple(int(h) for h in r.get("hash_ids", ())),
                        text,
                    )
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceError(f"{path}:{number}: not a trace row ({exc!r})") from exc
    if not rows:
        raise TraceError(f"trace file {path} holds no requests")
    return rows


def azure_lengths(path: Path) -> list[Lengths]:
    """Azure LLM inference 2023 (conv or code): context and generated tokens, arrival offsets."""
    rows: list[Lengths] = []
    start: datetime | None = None
    with path.open() as handle:
        for number, row in enumerate(csv.DictReader(handle), 2):
            try:
                at = datetime.fromisoformat(row["TIMESTAMP"][:26])
                start = start or at
                rows.append(
                    Lengths(
                        int(row["ContextTokens"]),
                        max(1, int(row["GeneratedTokens"])),
                        (at - start).total_seconds(),
                    )
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceError(f"{path}:{number}: not a trace row ({exc!r})") from exc
    if not rows:
        raise TraceError(f"trace file {path} holds no requests")
    return rows
