"""Adapter routing on the simulator: the sites count their adapter reads and the adapters they
served, and routing by residency (GATEWAY_ADAPTER_ROUTING=affinity) reads adapters from disk
less often and spreads fewer adapters per site than adapter-blind completion_cost."""

from __future__ import annotations

import dataclasses

from fedsim.federation import RunResult, run
from fedsim.gateway import GatewaySettings
from fedsim.workload import WorkloadSpec, build
from gateway.routing.adapter_affinity import AdapterRouting
from tests.unit.fedsim.test_fedsim import _spec


def _run(adapter_routing: AdapterRouting) -> RunResult:
    sites = [
        dataclasses.replace(
            _spec(f"s{i}", 0.01 * (i + 1)),
            max_num_seqs=16,
            max_loras=2,
            max_cpu_loras=4,
            adapter_load_s=0.2,
        )
        for i in range(4)
    ]
    # 12 adapters: all fit in the four sites' host memory together (16), not in any one's (4).
    spec = WorkloadSpec("sharegpt", 15.0, 2.0, 0, "none", 512, adapters=12, adapter_share=1.0)
    settings = GatewaySettings(policy="completion_cost", adapter_routing=adapter_routing)
    return run(sites, build(spec), settings, drain_s=60.0)


def test_affinity_loads_fewer_adapters_than_blind_routing() -> None:
    affinity, blind = _run("affinity"), _run("blind")
    assert affinity.completed == blind.completed == affinity.requests
    # Every site served some adapter, and each adapter read counts once per read.
    assert all(n > 0 for n in blind.adapters_served.values())
    assert all(
        loads >= served
        for loads, served in zip(
            blind.adapter_loads.values(), blind.adapters_served.values(), strict=True
        )
    )
    loads = sum(affinity.adapter_loads.values()), sum(blind.adapter_loads.values())
    served = sum(affinity.adapters_served.values()), sum(blind.adapters_served.values())
    # Identical runs if the gateway ignored residency (the arms differ in nothing else); the
    # sizes of the gain are fedsim.adapter_study's to measure, at scale.
    assert loads[0] < loads[1], (loads, served)
    assert served[0] < served[1], (loads, served)
