"""The gateway's checks of fine-tuning files, between keys (issue 75, MED-1 and LOW-3), against a
real site process that takes jobs (the tiny Llama on the CPU), through the official openai
client:

- a cancelled job's check stops at once: its create answers, and another key's check, which
  waited for the one checking process, runs (one key stacked cancelled checks there at no cost,
  and another key's 8-line create took 66.8 s);
- keys take turns: another key's check goes before a key's second one;
- the checking process starts, its tokenizer loaded, before the first create needs it (a fresh
  gateway's first create took 67 s under load);
- the checking process ends with the gateway: a clean SIGTERM leaves no process of it behind
  (it and multiprocessing's resource tracker were orphaned to init, 2 of 2 stops).

The checks run at 1% of a CPU (GATEWAY_FINE_TUNING_VALIDATION_CPU_SHARE), and each line of SLOW
has its tokens counted (it has more bytes than the tiny model's context), so SLOW is checked for
many minutes: a check still under way is one that was not stopped.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
from litestar.testing import TestClient

from devtools.launch import start_gateway, stop_all
from gateway.app import create_app
from gateway.settings import GatewaySettings
from tests.integration.test_fine_tuning_api import ADMIN, BASE, example, jsonl, sdk, wait_for
from tests.integration.test_fine_tuning_limits import make_key
from tests.support.training_site import start_training_site

pytestmark = pytest.mark.slow

SLOW = (json.dumps(example("word " * 400)).encode() + b"\n") * 10_000
SMALL = jsonl([example("q")])
CHECKING = {
    "GATEWAY_FINE_TUNING_VALIDATION_WORKERS": "1",
    "GATEWAY_FINE_TUNING_VALIDATION_CPU_SHARE": "0.01",
}


@pytest.fixture(scope="module")
def site(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    work = tmp_path_factory.mktemp("checks")
    process = start_training_site(tiny_llama_dir, work)
    try:
        yield work
    finally:
        stop_all([process])


@contextmanager
def gateway(site: Path, work: Path, **env: str) -> Iterator[TestClient[Any]]:
    settings = GatewaySettings.from_env({
        "GATEWAY_FEDERATION_FILE": str(site / "federation.json"),
        "GATEWAY_DATABASE_URL": f"sqlite+aiosqlite:///{work / 'gateway.db'}",
        "GATEWAY_REQUIRE_API_KEYS": "true", "GATEWAY_ADMIN_TOKEN": ADMIN,
        "GATEWAY_HEALTH_INTERVAL_S": "0.5", "GATEWAY_FINE_TUNING_POLL_S": "0.2",
        **CHECKING, **env,
    })  # fmt: skip
    with TestClient(create_app(settings), base_url=BASE, timeout=600) as http:
        fine_tuning = http.app.state.assembly.fine_tuning
        wait_for(lambda: bool(fine_tuning.runner.training_sites("tiny")))
        # Its checking process started (a check made before waits for it, and keys' turns
        # begin when it takes the first).
        wait_for(lambda: fine_tuning.checker.ready() == 1)
        yield http


def descendants(pid: int) -> set[int]:
    """The processes below `pid`, from /proc."""
    children: dict[int, set[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            children.setdefault(int(stat[1]), set()).add(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        below = children.get(todo.pop(), set()) - found
        found |= below
        todo += below
    return found


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after its name: state, parent, ... (None: gone)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def still_running(pids: set[int], within_s: float) -> set[int]:
    """Those of `pids` that run (not gone, not a zombie) after `within_s` at most."""
    deadline, tick = time.monotonic() + within_s, threading.Event()
    while True:
        running = {p for p in pids if (stat := _stat(p)) is not None and stat[0] != "Z"}
        if not running or time.monotonic() > deadline:
            return running
        tick.wait(0.05)


def statuses(client: openai.OpenAI) -> list[str]:
    return [job.status for job in client.fine_tuning.jobs.list().data]


def test_a_cancelled_jobs_check_stops_at_once_and_holds_no_other_key(
    site: Path, tmp_path: Path
) -> None:
    # The gateway stops first, its checks with it, so that a failure leaves no create waiting.
    with ThreadPoolExecutor(2) as pool, gateway(site, tmp_path) as http:
        alice, bob = (sdk(http, make_key(http, name)) for name in ("ck-alice", "ck-bob"))
        slow = alice.files.create(file=("slow.jsonl", SLOW), purpose="fine-tune")
        small = bob.files.create(file=("small.jsonl", SMALL), purpose="fine-tune")
        made = pool.submit(alice.fine_tuning.jobs.create, model="tiny", training_file=slow.id)
        wait_for(lambda: statuses(alice) == ["validating_files"])
        (job,) = alice.fine_tuning.jobs.list().data
        waiting = pool.submit(bob.fine_tuning.jobs.create, model="tiny", training_file=small.id)
        wait_for(lambda: statuses(bob) == ["validating_files"])
        assert alice.fine_tuning.jobs.cancel(job.id).status == "cancelled"
        # Its check stopped: its create answers, and the other key's check, which waited for
        # the one checking process, runs.
        assert made.result(timeout=60).status == "cancelled"
        assert waiting.result(timeout=60).status == "queued"
        # Nothing of alice's is checked any more: she may make a job again at once.
        again = pool.submit(alice.fine_tuning.jobs.create, model="tiny", training_file=slow.id)
        wait_for(lambda: "validating_files" in statuses(alice))
        latest = alice.fine_tuning.jobs.list().data[0]
        alice.fine_tuning.jobs.cancel(latest.id)
        assert again.result(timeout=60).status == "cancelled"


def test_another_keys_check_goes_before_a_keys_second(site: Path, tmp_path: Path) -> None:
    with (
        ThreadPoolExecutor(3) as pool,
        gateway(site, tmp_path, GATEWAY_FINE_TUNING_VALIDATIONS_PER_KEY="2") as http,
    ):
        carol, dave = (sdk(http, make_key(http, name)) for name in ("ck-carol", "ck-dave"))
        slow = carol.files.create(file=("slow.jsonl", SLOW), purpose="fine-tune")
        small = dave.files.create(file=("small.jsonl", SMALL), purpose="fine-tune")
        made = []
        for _ in range(2):
            made.append(pool.submit(carol.fine_tuning.jobs.create, model="tiny",
                                    training_file=slow.id))  # fmt: skip
            wait_for(lambda: statuses(carol) == ["validating_files"] * len(made))
        second, first = carol.fine_tuning.jobs.list().data  # newest first
        waiting = pool.submit(dave.fine_tuning.jobs.create, model="tiny", training_file=small.id)
        wait_for(lambda: statuses(dave) == ["validating_files"])
        carol.fine_tuning.jobs.cancel(first.id)
        # The process is free: the other key's check goes first, carol's second waits.
        assert waiting.result(timeout=60).status == "queued"
        assert carol.fine_tuning.jobs.retrieve(second.id).status == "validating_files"
        carol.fine_tuning.jobs.cancel(second.id)
        assert [m.result(timeout=60).status for m in made] == ["cancelled", "cancelled"]


def test_the_checking_process_starts_before_the_first_create(site: Path, tmp_path: Path) -> None:
    """A fresh gateway's first create waited for the process to start and load its tokenizer
    (67 s under load): it starts, its tokenizer loaded, once the gateway sees a site that
    trains jobs, before any create."""
    with gateway(site, tmp_path) as http:  # which waits for no more than that
        client = sdk(http, make_key(http, "ck-erin"))
        upload = client.files.create(file=("t.jsonl", SMALL), purpose="fine-tune")
        assert client.fine_tuning.jobs.create(model="tiny", training_file=upload.id).status == (
            "queued"
        )


def test_the_checking_process_ends_with_the_gateway(site: Path, tmp_path: Path) -> None:
    gateway = start_gateway(
        federation_file=site / "federation.json",
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}",
        log_dir=tmp_path,
        env={"GATEWAY_FINE_TUNING_POLL_S": "0.2", **CHECKING},
    )
    left: set[int] = set()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="unused",
                               max_retries=0, timeout=600)  # fmt: skip
        upload = client.files.create(file=("t.jsonl", SMALL), purpose="fine-tune")

        def created() -> bool:  # once the gateway knows the site takes jobs
            try:
                client.fine_tuning.jobs.create(model="tiny", training_file=upload.id)
            except openai.BadRequestError as exc:
                if "model_not_available" not in str(exc):
                    raise
                return False
            return True

        wait_for(created)  # its file checked in the checking process
        # A check under way when the gateway stops (the 2 of 2 stops): a checking
        # process that was idle found its parent gone and ended, a busy one went on.
        # Its client gone, as the were: the gateway waits for no request when it stops.
        slow = client.files.create(file=("slow.jsonl", SLOW), purpose="fine-tune")
        with pytest.raises(openai.APITimeoutError):
            client.with_options(timeout=3).fine_tuning.jobs.create(
                model="tiny", training_file=slow.id
            )
        assert statuses(client)[0] == "validating_files"
        children = descendants(gateway.popen.pid)
        assert children
        gateway.popen.send_signal(signal.SIGTERM)
        gateway.popen.wait(timeout=60)
        assert "Application shutdown complete" in gateway.log_tail(5)  # a clean stop
        left = still_running(children, within_s=10)
        commands = [(Path("/proc") / str(p) / "cmdline").read_bytes() for p in left]
        assert not left, commands
    finally:
        stop_all([gateway])
        for pid in left:  # the orphans of a gateway that left them, not the next test's
            os.kill(pid, signal.SIGKILL)
