"""The four faults of issue 9, each with real processes on one cluster (2 sites, a gateway on
PostgreSQL): every request a client sent either completed or got a retryable error; none lost.

The cluster is shared to keep CI short: each test leaves it whole again (sites restarted or
thawed); the gateway restart comes last.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest

from devtools.faults import scenarios
from devtools.faults.cluster import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


@pytest.fixture(scope="module")
def cluster(make_cluster: Callable[..., Cluster]) -> Cluster:
    return make_cluster()


@pytest.fixture
def whole(cluster: Cluster) -> Iterator[Cluster]:
    """Every site alive and healthy before the test and again after it."""
    yield cluster
    for name, process in cluster.sites.items():
        cluster.thaw(name)
        if not process.alive():
            cluster.restart_site(name)
        cluster.wait_site_health(name, True, 60.0)


def show(figures: dict[str, object]) -> None:
    print()
    for key, value in figures.items():
        print(f"  {key}: {value}")


def test_a_site_killed_mid_stream(whole: Cluster) -> None:
    figures = asyncio.run(scenarios.kill_site_mid_stream(whole))
    show(figures)
    assert figures["on_victim"]  # the kill really hit live streams
    assert figures["elsewhere"]
    # Streams on the surviving site are untouched: whole answers.
    assert figures["elsewhere_completed"] == figures["elsewhere"]
    assert figures["lost"] == 0, figures["lost_detail"]
    assert figures["completed"] + figures["retryable"] == figures["sent"]


def test_load_reports_stall(whole: Cluster) -> None:
    figures = asyncio.run(scenarios.stall_site(whole, stale_s=2.0))
    show(figures)
    # Seen by two unanswered health checks in a row (1 s deadline each, a 0.5 s period between:
    # ~3 s; stalled load reports alone no longer take a site down), plus slack for a busy
    # 2-core machine.
    assert figures["seconds_to_unhealthy"] <= 2.0 + 4.0
    assert figures["sent_while_unhealthy"] > 0
    assert figures["sent_while_unhealthy_to_victim"] == 0
    assert figures["held_completed"] == figures["held_by_frozen_site"]
    assert figures["sent_after_recovery_to_victim"] > 0  # back in rotation after SIGCONT
    assert figures["lost"] == 0, figures["lost_detail"]
    assert figures["completed"] == figures["sent"]


def test_database_connection_dropped(whole: Cluster) -> None:
    figures = asyncio.run(scenarios.drop_database(whole))
    show(figures)
    assert all(n > 0 for n in figures["backends_terminated"])
    assert figures["completed"] > 0
    assert figures["lost"] == 0, figures["lost_detail"]
    assert figures["completed"] + figures["retryable"] == figures["sent"]


def test_gateway_killed_and_restarted(whole: Cluster) -> None:
    figures = asyncio.run(scenarios.kill_gateway_and_restart(whole))
    show(figures)
    assert figures["lost"] == 0, figures["lost_detail"]
    assert figures["retryable"] == figures["sent"]  # all were cut by the kill or sent to it dead
    assert figures["retried_lost"] == 0, figures["retry_lost_detail"]
    assert 0 < figures["batch_done_before_kill"] < figures["batch_items"]
    assert figures["batch_status"] == "completed"
    assert figures["batch_items_completed_whole"] == figures["batch_items"]
    assert figures["batch_item_rows_per_custom_id"] == [1]
    if figures["idempotency_key_supported"]:
        assert figures["replayed_same_answer"] is True
