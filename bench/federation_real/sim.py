"""The real run's scenario in fedsim: the same sites (model shape, batch limits, the KV blocks each
real site reported, its one-way delay as half a round trip, async scheduling as on a GPU), the
same gateway settings (federation.GATEWAY) and routing profile per arm, and the very requests the
real run sent, rebuilt from its workload spec and checked against its fingerprint, each arm's
marker included.

Step times (`step_source`): `fitted`, the GPU default: the card's fitted step model for the
site's shape (`--step-models`, default bench/results/sim/step_models.json: fitted on the step
grid and the engine's own runs, never on a federation), times the served site's measured
slowdown over its bare engine (`served_step_scale`: the serving-path bench's GPU mode on the
card, with the serving path only); `learned`, the CPU's: each site's own
step cost as its engine learned it while the arm ran (fedllm_site_step_cost_seconds: base, per
token, per KV position; the median of the samples taken while it was busy, arms.py; the cell's,
both arms', in a record from before the arm's was kept), the card's own fit at the arm's load:
on the 2-core CPU a site's mean step differed 1.6x between the arms of one cell; plus, on every
step, what the site's loop spent outside engine.step() in that arm (arms.step_overhead_s: 0.6-1
ms a step there, which the learned cost, fitted to engine.step(), leaves out). On the CPU that
makes the comparison a check of the pipeline.

The serving path (`serving`): `bench`, the default: the gateway's loop and the sites' serving
threads as CPUs at the CPU-mode serving-path benchmark's costs (fedsim/serving_path.py, the
federation's GATEWAY.serving); `measured`: the gateway's costs scaled so that the arms' modelled
CPU equals the gateway's CPU the real run measured on the same work (its requests, the chunks and
tokens its clients got); `none`: the simulator before issue 78 (free and instant).

A served site's process (`site_cpu`): `process`, the default with fitted steps, its steps take at
least `served_token_floor_s` a token they give (its engine's host work and its serving thread
share one interpreter lock: what the serving-path bench's site delivered at most on the card),
its serving thread then queueing nothing of its own; `thread`: that thread on a CPU of its own
(fedsim/serving_path.py's `site_token_s`), the twin of r90.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.federation_real.federation import GATEWAY
from bench.federation_real.metrics import Served, summary
from bench.federation_real.presets import SHAPES
from bench.federation_real.workload import WorkloadSpec, build, fingerprint, marked
from bench.loadgen.workload import Request
from fedsim.cards import CARDS, MODELS, Card, ModelShape
from fedsim.federation import RunResult, Slo, run
from fedsim.serving_path import ServingCosts
from fedsim.site import SiteSpec
from fedsim.step_models import STEP_MODELS, step_model
from fedsim.step_time import StepTimeModel
from fedsim.workload import SimRequest

SERVING_RESULTS = Path(__file__).resolve().parents[1] / "results" / "serving_path"
# The CPU has no roofline here: its sites' step model is their own learned cost and their KV
# the blocks they reported, so the card's figures are never read.
CPU_CARD = Card("cpu", 0, 0.0, 0.0)
SERVING = ("bench", "measured", "none")
SITE_CPU = ("process", "thread")
STEP_SOURCES = ("fitted", "learned")


def _model_shape(site: Mapping[str, Any]) -> ModelShape:
    shape = str(site["shape"])
    if shape in MODELS:
        return MODELS[shape]
    return ModelShape(shape, 0, 0, int(site["context"]))


def _step(
    site: Mapping[str, Any],
    card: str,
    step_models: Path,
    source: str,
    arm_site: Mapping[str, Any],
) -> StepTimeModel:
    if card != "cpu" and source == "fitted":
        return step_model(card, str(site["shape"]), step_models)
    # The arm's busy-time median (arms.py: `_sites`), else the cell's, else (a record from before
    # issue 78) the last scrape's.
    cost = (
        arm_site.get("learned_step_cost_s")
        or site.get("learned_step_cost_s")
        or site.get("step_cost_s")
        or {}
    )
    if not cost:
        raise ValueError(f"site {site['name']} reported no learned step cost to simulate it with")
    # What the service's loop adds to each step, outside engine.step() (arms.step_overhead_s):
    # the learned cost is fitted to engine.step() alone.
    overhead = float(arm_site.get("step_overhead_s") or 0.0)
    return StepTimeModel(
        card,
        base_s=float(cost["base"]) + overhead,
        per_prefill_token_s=float(cost["per_token"]),
        per_decode_row_s=float(cost["per_token"]),
        per_kv_token_s=float(cost["per_context_position"]),
    )


def text_share(site: Mapping[str, Any], tokenizer_ids: int) -> float:
    """The share of the site's answer tokens that carry text: the bench's models have random
    weights, so a greedy token is any id of the model's vocabulary alike, and one past the
    tokenizer's `tokenizer_ids` ids decodes to nothing (site_engine/detokenizer.py). The GPU
    shapes' 128,256 ids over GPT-2's 50,257: 0.39 (the real detokenizer on uniform ids: 0.40 with
    text). A shape the presets do not know, or no tokenizer's size: 1."""
    shape = SHAPES.get(str(site["shape"]))
    if shape is None or tokenizer_ids <= 0:
        return 1.0
    return min(1.0, tokenizer_ids / int(shape["vocab_size"]))


def served_step_scale(card: str, results: Path = SERVING_RESULTS) -> tuple[float, str]:
    """How much longer a served site's steps are than its engine's alone, on `card`: the
    serving-path bench's GPU mode runs the same requests at the same times through a site
    process (its gRPC loop, detokenizer and service beside the engine's loop) and in process;
    its TPOT p50 path over engine, at its lowest rate with nothing refused or cut (the H200:
    1B shape, 160 req/s, 5.76 / 5.06 ms = 1.14). The fitted step models are a bare engine's
    (the grid's kernels, the decode sweep's host term). 1 where the card has no such run; and
    the file it came from."""
    path = results / f"serving_path_gpu_{card}.json"
    if not path.is_file():
        return 1.0, ""
    data = json.loads(path.read_text())
    clean = [r for r in data["path"] if not data["refused"].get(r) and not data["cut"].get(r)]
    if not clean:
        return 1.0, ""
    rate = min(clean, key=float)
    engine = float(data["engine"][rate]["tpot_p50_s"])
    return float(data["path"][rate]["tpot_p50_s"]) / engine, f"{path.name} at {rate} req/s"


def served_token_floor_s(card: str, results: Path = SERVING_RESULTS) -> tuple[float, str]:
    """The least seconds a served site's step takes per token it gives on `card`
    (SiteSpec.token_floor_s): the serving-path bench's GPU mode on the card, at the rate where
    its path fell furthest behind its engine, there being set by the site process (its engine
    and serving threads on one interpreter lock): one over the tokens a second it delivered (the
    H200: 1B shape, 256 req/s, 51.3k against the engine's 59.4k in process, 19.5 us; it held
    1.07 cores). 0 where the card has no such run, or its path kept up at every rate; and the
    file it came from."""
    path = results / f"serving_path_gpu_{card}.json"
    if not path.is_file():
        return 0.0, ""
    data = json.loads(path.read_text())
    behind = {r: float(v) for r, v in data["path_vs_engine_tokens"].items() if float(v) < 0.95}
    if not behind:
        return 0.0, ""
    rate = min(behind, key=lambda r: behind[r])
    delivered = float(data["path"][rate]["output_tokens_per_s"])
    return 1.0 / delivered, f"{path.name} at {rate} req/s"


def site_specs(
    real: Mapping[str, Any],
    step_models: Path,
    step_source: str = "fitted",
    step_scale: float = 1.0,
    arm: Mapping[str, Any] | None = None,
    token_floor_s: float = 0.0,
) -> list[SiteSpec]:
    """The simulated sites of a real run's record (`step_scale`: SiteSpec.step_scale); `arm`:
    the arm's real figures, whose sites' learned step costs a learned step source takes first
    (on a shared CPU one arm's steps are not another's)."""
    arm_sites = arm.get("sites", {}) if arm is not None else {}
    card = str(real["card"])
    # A record without its workload (a hand-made one) has no tokenizer to say: text always.
    tokenizer_ids = int(real.get("workload_spec", {}).get("vocab", 0))
    specs = []
    for site in real["sites"]:
        arm_site = arm_sites.get(site["name"], {})
        if int(site["kv_blocks_total"]) <= 0:
            raise ValueError(f"site {site['name']} reported no KV blocks")
        specs.append(
            SiteSpec(
                str(site["name"]),
                CPU_CARD if card == "cpu" else CARDS[card],
                _model_shape(site),
                _step(site, card, step_models, step_source, arm_site),
                rtt_s=2 * float(site["one_way_ms"]) / 1000.0,
                max_num_seqs=int(site["max_num_seqs"]),
                max_num_batched_tokens=int(site["max_num_batched_tokens"]),
                max_model_len=int(site["context"]),
                async_scheduling=card != "cpu",
                kv_blocks=int(site["kv_blocks_total"]),
                text_share=text_share(site, tokenizer_ids),
                step_scale=step_scale,
                token_floor_s=token_floor_s,
            )
        )
    return specs


def sim_requests(requests: Sequence[Request]) -> list[SimRequest]:
    """As the real client sends them: max_tokens = the answer, no prediction (the gateway plans
    with max_tokens)."""
    return [
        SimRequest(r.id, r.at_s, r.prompt_token_ids, r.answer_tokens, r.answer_tokens)
        for r in requests
    ]


def rebuilt(real: Mapping[str, Any], traces: Path | None) -> list[Request]:
    """The real run's requests, rebuilt; ValueError if they are not the ones it sent."""
    spec = WorkloadSpec.from_json(dict(real["workload_spec"]))
    if spec.source != "sharegpt" and not Path(spec.source).is_file():
        if traces is None:
            raise FileNotFoundError(f"no trace at {spec.source}: name its folder with --traces")
        spec = replace(spec, source=str(traces / Path(spec.source).name))
    requests = build(spec)
    if fingerprint(requests) != real["workload"]["fingerprint"]:
        raise ValueError("the rebuilt requests differ from the real run's (fingerprint)")
    return requests


def serving_costs(real: Mapping[str, Any], serving: str) -> tuple[ServingCosts | None, float]:
    """The twin's serving path (module docstring) and the factor on the bench's gateway costs."""
    costs = GATEWAY.serving or ServingCosts()
    # The chunk budget the real gateway ran with; a record from before its governor (issue 78,
    # r92) ran a fixed one.
    ran = real.get("gateway", {}).get("serving") or {}
    if "chunks_per_s" in ran:
        budget = float(ran["chunks_per_s"])
        costs = replace(
            costs,
            chunks_per_s=budget,
            chunks_min_per_s=float(ran.get("chunks_min_per_s", 0.0)),
        )
    if serving == "none":
        return None, 0.0
    if serving == "bench":
        return costs, 1.0
    arms = real["arms"].values()
    measured = sum(float(a["cpu_s"]["gateway"]) for a in arms)
    modelled = sum(
        costs.gateway_seconds(int(a["requests"]), int(a["chunks"]), int(a["delivered_tokens"]))
        for a in arms
    )
    if measured <= 0 or modelled <= 0:
        raise ValueError("no gateway CPU measured to scale the serving costs to")
    return costs.scaled(measured / modelled), measured / modelled


def _arm_figures(
    result: RunResult, served: list[Served], real: Mapping[str, Any]
) -> dict[str, object]:
    slo = Slo(**real["slo"])
    window = float(real["workload_spec"]["duration_s"])
    first = Counter(o.first_site for o in result.outcomes if o.first_site)
    return summary(served, slo, window, result.prefix_query_tokens, result.prefix_hit_tokens) | {
        "offloads": result.offloads,
        "steps": result.steps,
        "placed_first": dict(sorted(first.items())),
        "refused": result.rejected,
        "gateway_cpu_s": result.gateway_cpu_s,
        # As the real run counts them: the events with text its clients got (arms.py).
        "chunks": result.client_chunks,
        "gateway_chunks": result.gateway_chunks,
        "sites": {
            name: {"steps": steps, "step_s_mean": result.site_busy[name] / steps if steps else None}
            for name, steps in result.site_steps.items()
        },
    }


def simulate(
    real: Mapping[str, Any],
    step_models: Path = STEP_MODELS,
    traces: Path | None = None,
    serving: str = "bench",
    step_source: str = "fitted",
    site_cpu: str = "process",
    chunks_min_per_s: float | None = None,
) -> tuple[dict[str, dict[str, object]], dict[str, Any]]:
    """Each arm of the real run, simulated: its summary (metrics.summary) and more; and how it
    was simulated. `chunks_min_per_s`: the twin's gateway with that chunk-budget floor, not the
    real run's (a what-if: the budget's governor, gateway/sites/chunk_governor.py)."""
    requests = rebuilt(real, traces)
    learned = real["card"] == "cpu" or step_source == "learned"
    # A learned cost was learned in service already; without the serving path none is paid.
    served, served_from = (1.0, "")
    floor_s, floor_from = (0.0, "")
    if not learned and serving != "none":
        served, served_from = served_step_scale(str(real["card"]))
        if site_cpu == "process":
            floor_s, floor_from = served_token_floor_s(str(real["card"]))
    vocab = int(real["workload_spec"]["vocab"])
    costs, scale = serving_costs(real, serving)
    if costs is not None and chunks_min_per_s is not None:
        costs = replace(costs, chunks_min_per_s=chunks_min_per_s)
    if costs is not None and floor_s:
        # The serving thread's work is inside the floor's seconds a token: not queued again.
        costs = replace(costs, site_token_s=0.0)
    out: dict[str, dict[str, object]] = {}
    for arm, figures in real["arms"].items():
        settings = replace(GATEWAY, policy=arm, serving=costs)
        specs = site_specs(real, step_models, step_source, served, figures, floor_s)
        marker = str(figures.get("marker", arm))  # before issue 78: the arm's name
        result = run(
            specs, sim_requests(marked(requests, marker, vocab)), settings, drain_s=real["drain_s"]
        )
        out[arm] = _arm_figures(result, [Served.of_sim(o) for o in result.outcomes], real)
    steps = "each site's learned step cost" if learned else f"the card's ({step_models.name})"
    if served_from:
        steps += f" x {served:.3f} served ({served_from})"
    if floor_from:
        steps += f", at least {floor_s * 1e6:.1f} us a token the step gives ({floor_from})"
    info = {
        "step_source": "learned" if learned else "fitted",
        "step_models": str(step_models),
        "serving": serving,
        "serving_costs": costs.to_json() if costs is not None else None,
        "gateway_cost_scale": scale,
        "served_step_scale": served,
        "served_step_scale_from": served_from,
        "site_cpu": site_cpu if floor_from else "thread",
        "token_floor_s": floor_s,
        "token_floor_from": floor_from,
        "summary": f"step times from {steps}; serving path {serving}"
        + (f" (gateway costs x {scale:.2f})" if serving == "measured" else "")
        + (
            f"; the gateway's chunk budget {costs.chunks_per_s:g}/s, its floor "
            f"{costs.chunks_min_per_s:g}/s"
            if costs is not None
            else ""
        ),
    }
    return out, info
