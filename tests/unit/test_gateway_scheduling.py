"""The gateway's scheduling policy (gateway/__main__.py): SCHED_BATCH for the thread that starts
the gateway and every thread it starts afterwards, and a setting that keeps the default."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import pytest

from gateway.__main__ import use_batch_scheduling
from gateway.settings import GatewaySettings

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling only")


def _in_a_fresh_thread(switch: Callable[[], bool]) -> dict[str, object]:
    """What `switch` returns, the policy of the thread that ran it and of a thread it started."""
    seen: dict[str, object] = {}

    def run() -> None:
        seen["set"] = switch()
        seen["policy"] = os.sched_getscheduler(0)
        child = threading.Thread(target=lambda: seen.setdefault("child", os.sched_getscheduler(0)))
        child.start()
        child.join()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen


def test_batch_scheduling_covers_the_thread_and_the_threads_it_starts() -> None:
    seen = _in_a_fresh_thread(use_batch_scheduling)
    assert seen == {"set": True, "policy": os.SCHED_BATCH, "child": os.SCHED_BATCH}
    assert os.sched_getscheduler(0) != os.SCHED_BATCH  # the test's own thread is untouched


def test_the_setting_is_on_unless_turned_off(tmp_path) -> None:
    federation = tmp_path / "federation.json"
    federation.write_text('{"models": [], "sites": []}')
    env = {"GATEWAY_FEDERATION_FILE": str(federation)}
    assert GatewaySettings.from_env(env).server.batch_scheduling is True
    off = GatewaySettings.from_env(env | {"GATEWAY_BATCH_SCHEDULING": "false"})
    assert off.server.batch_scheduling is False
