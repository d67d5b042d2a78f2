"""The bounded soak (CI length: FEDLLM_SOAK_SECONDS, default 60 s of traffic on 3 sites);
`python -m bench.faults --minutes N` runs a longer one and writes its figures."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

import pytest

from devtools.faults.cluster import Cluster
from devtools.faults.soak import soak

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


def test_soak_with_random_faults(make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster(("site-a", "site-b", "site-c"))
    seconds = float(os.environ.get("FEDLLM_SOAK_SECONDS", "60"))
    figures = asyncio.run(soak(cluster, seconds, seed=int(os.environ.get("FEDLLM_SOAK_SEED", "1"))))
    print()
    for key, value in figures.items():
        print(f"  {key}: {value}")
    assert sum(figures["faults_injected"].values()) >= 3
    assert figures["completed"] > 0
    assert figures["lost"] == 0, figures["lost_detail"]
    assert figures["completed"] + figures["retryable"] == figures["sent"]
