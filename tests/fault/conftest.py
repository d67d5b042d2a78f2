"""A cluster to break: real sites, a real gateway subprocess, the session's PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.fault.cluster import Cluster

# A stalled (SIGSTOPped) site seen within seconds: two unanswered 1 s health checks in a row;
# one batch item per site at a time and a short lease so a batch is caught half done and
# resumed soon after a gateway dies.
GATEWAY_ENV = {
    "GATEWAY_LOAD_REPORT_STALE_S": "2",
    "GATEWAY_CONNECT_TIMEOUT_S": "1",
    "GATEWAY_HEALTH_FAILURES_TO_DOWN": "2",
    "GATEWAY_BATCH_SITE_CONCURRENCY": "1",
    "GATEWAY_BATCH_LEASE_S": "2",
}


@pytest.fixture(scope="module")
def make_cluster(
    tiny_llama_dir: Path, postgres_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., Cluster]]:
    """Starts clusters on the session's PostgreSQL database; stops them and empties the
    database (downgrade) at the end of the module."""
    from gateway.db.migrate import downgrade

    started: list[Cluster] = []

    def make(site_names: tuple[str, ...] = ("site-a", "site-b")) -> Cluster:
        cluster = Cluster(
            tiny_llama_dir,
            tmp_path_factory.mktemp("cluster"),
            postgres_url,
            site_names=site_names,
            gateway_env=GATEWAY_ENV,
        )
        started.append(cluster)
        return cluster.start()

    yield make
    for cluster in started:
        cluster.stop()
    downgrade(postgres_url)
