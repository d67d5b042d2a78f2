"""A cluster to break: real sites, a real gateway subprocess, the session's PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devtools.faults.cluster import GATEWAY_ENV, Cluster


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
