"""The real side of `python -m bench.federation_real`: the sites started once, then per arm one
gateway that runs every cell (grid.py); before the first arm's cells, a warm-up and, when the
loads are multiples of the capacity, the saturation phase that measures it (capacity.py).

After each arm every cell's NAME_real.json and NAME_requests.json.gz are (re)written with the
arms done so far, so a run cut short keeps what it finished. A cell's file holds the sites (with
the step cost each learned while the cell ran), the gateway's settings, the capacity and how it
was measured, the workload spec and fingerprint, and each arm's figures (arms.py).
"""

from __future__ import annotations

import gzip
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.federation_real.arms import ArmRun, learned_step_cost
from bench.federation_real.capacity import Capacity, measure, saturation_streams
from bench.federation_real.federation import GATEWAY, Federation, site_record
from bench.federation_real.grid import Cell, cell_name, cells
from bench.federation_real.models import ensure_models
from bench.federation_real.presets import Preset
from bench.federation_real.workload import WorkloadSpec, build, describe, fingerprint, marked
from bench.loadgen.workload import Request
from devtools.forkserver import FORK_SERVER_ENV

WARM_UP = 16
# The saturation phase's prompts: a seed of their own, far from any cell's.
CAPACITY_SEED_OFFSET = 100_000


@dataclass
class Invocation:
    """What one invocation runs: the preset (its overrides applied), the card, the seeds, and
    where it writes; `rate`: a rate given outright (no capacity phase)."""

    preset: Preset
    card: str
    seeds: tuple[int, ...]
    workload: str
    rate: float | None
    capacity_rps: float | None
    command: str
    base: str
    out_dir: Path
    work_dir: Path
    tokenizer_dir: Path
    vocab: int
    log: Callable[[str], None]
    capacity: Capacity | None = None
    grid: list[Cell] = field(default_factory=list)
    requests: dict[str, list[Request]] = field(default_factory=dict)
    arms: dict[str, dict[str, Any]] = field(default_factory=dict)
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)
    samples: dict[str, dict[str, list[dict[str, float]]]] = field(default_factory=dict)

    @property
    def gridded(self) -> bool:
        return bool(self.preset.loads) or len(self.seeds) > 1

    def spec(self, seed: int, rate: float) -> WorkloadSpec:
        p = self.preset
        return WorkloadSpec(self.workload, rate, p.duration_s, seed, self.vocab, p.length_scale,
                            p.max_prompt_tokens, p.max_answer_tokens, p.block_tokens)  # fmt: skip


def _capacity(run: ArmRun, inv: Invocation) -> None:
    """The capacity the loads scale (given, or measured now), and the grid's cells."""
    preset = inv.preset
    if preset.loads and inv.capacity_rps is None:
        plan = preset.capacity
        streams = plan.streams or saturation_streams(preset.sites, GATEWAY.site_max_queued_requests)
        count = streams * plan.requests_per_stream
        spec = inv.spec(inv.seeds[0] + CAPACITY_SEED_OFFSET, count / preset.duration_s)
        requests = marked(build(spec), "capacity", inv.vocab)
        inv.capacity = measure(run.gateway.port, requests, plan, streams, preset.clients, inv.log)
        if not run.federation.wait_idle(timeout_s=120):
            raise RuntimeError("the sites still had requests 120 s after the saturation phase")
    rps = inv.capacity.rps if inv.capacity is not None else inv.capacity_rps
    inv.grid = cells(inv.seeds, preset.loads, rps, inv.rate)
    inv.requests = {c.label: build(inv.spec(c.seed, c.rate_rps)) for c in inv.grid}
    for cell in inv.grid:
        inv.log(f"cell {cell.label}: {describe(inv.requests[cell.label])}")


def _arm(federation: Federation, inv: Invocation, arm: str, first: bool) -> None:
    inv.log(f"arm {arm}: gateway starting")
    began = time.monotonic()
    gateway = federation.start_gateway(arm, replace(GATEWAY, policy=arm))
    inv.log(f"arm {arm}: gateway ready in {time.monotonic() - began:.0f} s")
    try:
        run = ArmRun(federation, gateway, arm, inv.preset, inv.vocab, inv.log)
        if first:
            warm = build(inv.spec(inv.seeds[0], WARM_UP / inv.preset.duration_s))
            run.warm_up(warm, WARM_UP)
            _capacity(run, inv)
        for cell in inv.grid:
            figures, rows, samples = run.cell(cell, inv.requests[cell.label])
            inv.arms.setdefault(cell.label, {})[arm] = figures
            inv.rows.setdefault(cell.label, {})[arm] = rows
            for site, taken in samples.items():
                inv.samples.setdefault(cell.label, {}).setdefault(site, []).extend(taken)
    finally:
        gateway.stop(timeout_s=30)


def _payload(inv: Invocation, cell: Cell, scraped: dict[str, dict[str, float]]) -> dict[str, Any]:
    requests, preset = inv.requests[cell.label], inv.preset
    samples = inv.samples.get(cell.label, {})
    return {
        "command": inv.command,
        "preset": preset.name,
        "card": inv.card,
        "cell": cell.label,
        "seed": cell.seed,
        "load": cell.load,
        "capacity": inv.capacity.to_json() if inv.capacity is not None else None,
        "capacity_rps": inv.capacity.rps if inv.capacity is not None else inv.capacity_rps,
        "sites": [
            site_record(s, scraped[s.name])
            | {"learned_step_cost_s": learned_step_cost(samples.get(s.name, []))}
            for s in preset.sites
        ],
        "gateway": asdict(GATEWAY) | {"policy": "per arm"},
        "clients": preset.clients,
        "slo": asdict(preset.slo),
        "drain_s": preset.drain_s,
        "workload_spec": inv.spec(cell.seed, cell.rate_rps).to_json(),
        "workload": describe(requests) | {"fingerprint": fingerprint(requests)},
        "arms": inv.arms.get(cell.label, {}),
    }


def write_cells(inv: Invocation, scraped: dict[str, dict[str, float]]) -> list[Path]:
    """Every cell's files, with the arms done so far."""
    inv.out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for cell in inv.grid:
        if cell.label not in inv.arms:
            continue
        name = cell_name(inv.base, cell, inv.gridded)
        path = inv.out_dir / f"{name}_real.json"
        path.write_text(json.dumps(_payload(inv, cell, scraped), indent=2) + "\n")
        with gzip.open(inv.out_dir / f"{name}_requests.json.gz", "wt") as handle:
            json.dump(inv.rows[cell.label], handle)
        paths.append(path)
    return paths


def real_run(inv: Invocation) -> list[Path]:
    """The module docstring; the cells' NAME_real.json paths."""
    preset = inv.preset
    if preset.device == "cuda":
        # Sites start as processes of their own command line (CUDA in a fork is not safe).
        os.environ.pop(FORK_SERVER_ENV, None)
    models = ensure_models(preset, inv.work_dir, inv.tokenizer_dir)
    inv.log(f"models ready: {sorted(models)}")
    federation = Federation(preset, inv.work_dir, models, inv.tokenizer_dir)
    paths: list[Path] = []
    try:
        federation.start(timeout_s=900 if preset.device == "cuda" else 180)
        inv.log(f"sites serving on {inv.card}: {sorted(federation.sites)}")
        for i, arm in enumerate(preset.arms):
            _arm(federation, inv, arm, first=i == 0)
            paths = write_cells(inv, federation.scrape_all())
            inv.log(f"arm {arm} done; wrote {[p.name for p in paths]}")
    finally:
        federation.close()
    return paths
