"""KV-cache plans recorded per card, model and engine settings, so that a pooled start sizes its
cache without the memory trial (site_engine/pool.py).

The trial (site_engine/engine/memory_trial.py) runs the largest step, the sampler and a graph of
each kind to measure what the engine needs besides its cache: seconds of a GPU start. What it
measures depends only on the card, the model and the settings that shape a step, which the key
names; a start on the same key plans from the same measurement (the arithmetic of
memory_plan.plan_kv_cache, unchanged). A file that cannot be read or a key it lacks: the trial
runs, as in a cold start, and its plan is recorded.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from site_engine.engine.memory_plan import KvPlan, TrialMeasurement

log = logging.getLogger(__name__)


def plan_key(device: str, model: Path, dtype: str, **settings: object) -> str:
    """The card (its name), the model (its resolved path), dtype and step-shaping settings."""
    shaped = ",".join(f"{name}={settings[name]}" for name in sorted(settings))
    return f"{device}|{model.resolve()}|{dtype}|{shaped}"


def _plan_of(raw: dict[str, Any]) -> KvPlan:
    measurement = raw.get("measurement")
    return KvPlan(
        num_blocks=int(raw["num_blocks"]),
        block_size=int(raw["block_size"]),
        bytes_per_block=int(raw["bytes_per_block"]),
        max_model_len=int(raw["max_model_len"]),
        measurement=TrialMeasurement(**measurement) if measurement else None,
        reserve=int(raw["reserve"]),
    )


def recorded_plan(path: Path, key: str) -> KvPlan | None:
    """The plan recorded under `key`, or None (no file, no such key, or unreadable: said)."""
    try:
        plans = json.loads(path.read_text())
        raw = plans.get(key)
        return _plan_of(raw) if raw is not None else None
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        log.warning("KV plans in %s unreadable (%s): the memory trial runs", path, exc)
        return None


def record_plan(path: Path, key: str, plan: KvPlan) -> None:
    """Adds (replaces) `key`'s plan; written whole through a temporary file and a rename, so a
    reader never sees half of it."""
    try:
        plans = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        plans = {}
    plans[key] = asdict(plan)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(plans, indent=1, sort_keys=True))
    partial.replace(path)
