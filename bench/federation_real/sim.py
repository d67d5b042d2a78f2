"""The real run's scenario in fedsim: the same sites (model shape, batch limits, the KV blocks each
real site reported, its one-way delay as half a round trip, async scheduling as on a GPU), the
same gateway settings (federation.GATEWAY) and routing profile per arm, and the very requests the
real run sent, rebuilt from its workload spec and checked against its fingerprint, each arm's
marker included.

Step times: on a GPU card fedsim models (h100, h200), the card's fitted step model for the
site's shape (`--step-models`, default bench/results/sim/step_models.json: fitted on the step
grid and the engine's own runs, never on a federation); on the CPU, each site's own step cost as
its engine learned it during the run (fedllm_site_step_cost_seconds: base, per token, per KV
position), which makes the CPU comparison a check of the pipeline, not of the simulator.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.federation_real.federation import GATEWAY
from bench.federation_real.metrics import Served, summary
from bench.federation_real.workload import WorkloadSpec, build, fingerprint, marked
from bench.loadgen.workload import Request
from fedsim.cards import CARDS, MODELS, Card, ModelShape
from fedsim.federation import Slo, run
from fedsim.site import SiteSpec
from fedsim.step_models import STEP_MODELS, step_model
from fedsim.step_time import StepTimeModel
from fedsim.workload import SimRequest

# The CPU has no roofline here: its sites' step model is their own learned cost and their KV
# the blocks they reported, so the card's figures are never read.
CPU_CARD = Card("cpu", 0, 0.0, 0.0)


def _model_shape(site: Mapping[str, Any]) -> ModelShape:
    shape = str(site["shape"])
    if shape in MODELS:
        return MODELS[shape]
    return ModelShape(shape, 0, 0, int(site["context"]))


def _step(site: Mapping[str, Any], card: str, step_models: Path) -> StepTimeModel:
    if card != "cpu":
        return step_model(card, str(site["shape"]), step_models)
    cost = site.get("step_cost_s") or {}
    if not cost:
        raise ValueError(f"site {site['name']} reported no learned step cost to simulate it with")
    return StepTimeModel(
        "cpu",
        base_s=float(cost["base"]),
        per_prefill_token_s=float(cost["per_token"]),
        per_decode_row_s=float(cost["per_token"]),
        per_kv_token_s=float(cost["per_context_position"]),
    )


def site_specs(real: Mapping[str, Any], step_models: Path) -> list[SiteSpec]:
    """The simulated sites of a real run's record."""
    card = str(real["card"])
    specs = []
    for site in real["sites"]:
        if int(site["kv_blocks_total"]) <= 0:
            raise ValueError(f"site {site['name']} reported no KV blocks")
        specs.append(
            SiteSpec(
                str(site["name"]),
                CPU_CARD if card == "cpu" else CARDS[card],
                _model_shape(site),
                _step(site, card, step_models),
                rtt_s=2 * float(site["one_way_ms"]) / 1000.0,
                max_num_seqs=int(site["max_num_seqs"]),
                max_num_batched_tokens=int(site["max_num_batched_tokens"]),
                max_model_len=int(site["context"]),
                async_scheduling=card != "cpu",
                kv_blocks=int(site["kv_blocks_total"]),
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


def simulate(
    real: Mapping[str, Any], step_models: Path = STEP_MODELS, traces: Path | None = None
) -> dict[str, dict[str, object]]:
    """Each arm of the real run, simulated: its summary (metrics.summary)."""
    requests = rebuilt(real, traces)
    specs = site_specs(real, step_models)
    slo = Slo(**real["slo"])
    vocab = int(real["workload_spec"]["vocab"])
    out: dict[str, dict[str, object]] = {}
    for arm in real["arms"]:
        settings = replace(GATEWAY, policy=arm)
        result = run(
            specs, sim_requests(marked(requests, arm, vocab)), settings, drain_s=real["drain_s"]
        )
        served = [Served.of_sim(o) for o in result.outcomes]
        out[arm] = summary(
            served,
            slo,
            float(real["workload_spec"]["duration_s"]),
            result.prefix_query_tokens,
            result.prefix_hit_tokens,
        ) | {"offloads": result.offloads, "steps": result.steps}
    return out
