"""Fine-tuning jobs reconciled between the gateway and a real training site (issue 67), through
the official openai client against a gateway on PostgreSQL and a real site process serving and
training the tiny model (SITE_FINETUNE_RESERVE_BYTES > 0: its real trainer, no double):

- a job cancelled while its site reads its file leaves nothing training there, and the site
  refuses a second start of it (it used to parse the file inside the start, where no cancel could
  reach it, and 7 of 8 such jobs trained on);
- a cancel the site could not receive is sent again until the site has it;
- a job the site holds that the gateway does not hold as live is cancelled there;
- a start whose file the site reads for longer than the start's deadline is sent once (it used
  to be sent again at every deadline, each copy parsed at once);
- a key's 4-step job trains beside another key's 2,500-step one, not after it.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import openai
import pytest
from litestar.testing import TestClient

from devtools.launch import ManagedProcess, spawn_site, stop_all, wait_until_serving
from fedllm_contract.fine_tuning import (
    FineTuneHyperparameters,
    FineTuneProgress,
    FineTuneSpec,
    FineTuneState,
)
from fedllm_contract.proto import site_pb2_grpc
from fedllm_contract.proto.fine_tuning import spec_to_proto
from gateway.app import create_app
from gateway.db.migrate import downgrade
from gateway.settings import GatewaySettings
from gateway.sites import grpc_client
from gateway.sites.grpc_client import GrpcSiteClient
from gateway.sites.interface import FineTuneCallRefused
from tests.integration.test_fine_tuning_api import (
    ADMIN,
    ADMIN_HEADERS,
    BASE,
    example,
    jsonl,
    sdk,
    wait_for,
)
from tests.support.lora_site import write_federation

pytestmark = [pytest.mark.postgres, pytest.mark.slow]
T = TypeVar("T")
# Thousands of examples: the site reads (renders and tokenizes) them for seconds.
BIG = jsonl([example(f"question {i}") for i in range(20_000)])
SMALL = jsonl([example(f"question {i}") for i in range(4)])
# Read in well under a second, trained for minutes (20,000 steps at 50 epochs): a job that cannot
# end on its own while a test waits for the gateway to cancel it (4 lines x 50 epochs could, on a
# fast machine, before the gateway's first pass).
LONG_TRAINING = jsonl([example(f"question {i}") for i in range(400)])


@dataclass
class World:
    work: Path
    model_dir: Path
    site: ManagedProcess
    database_url: str


@pytest.fixture(scope="module")
def world(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory, postgres_url: str
) -> Iterator[World]:
    work = tmp_path_factory.mktemp("fine-tuning-reconciled")
    (work / "lora").mkdir()
    env = {
        "SITE_FINETUNE_RESERVE_BYTES": str(1 << 30),
        "SITE_FINETUNE_DIR": str(work / "finetune"),
        "SITE_FINETUNE_CHECKPOINT_EVERY": "100000",
    }
    args = ["--lora-dir", str(work / "lora"), "--max-loras", "2", "--max-lora-rank", "8"]
    site = spawn_site(model_dir=tiny_llama_dir, site_name="aws-use1", model_name="tiny",
                      log_dir=work, extra_args=args, env=env)  # fmt: skip
    try:
        wait_until_serving(site)
        yield World(work, tiny_llama_dir, site, postgres_url)
    finally:
        stop_all([site])
        downgrade(postgres_url)  # leave the worker's database empty, as the other tests do


@contextmanager
def gateway(world: World) -> Iterator[TestClient[Any]]:
    federation = write_federation(world.work, world.model_dir, world.site)
    settings = GatewaySettings.from_env({
        "GATEWAY_FEDERATION_FILE": str(federation), "GATEWAY_DATABASE_URL": world.database_url,
        "GATEWAY_REQUIRE_API_KEYS": "true", "GATEWAY_ADMIN_TOKEN": ADMIN,
        "GATEWAY_HEALTH_INTERVAL_S": "0.5", "GATEWAY_FINE_TUNING_POLL_S": "0.2",
    })  # fmt: skip
    with TestClient(create_app(settings), base_url=BASE, timeout=60) as client:
        runner = client.app.state.assembly.fine_tuning.runner
        wait_for(lambda: bool(runner.training_sites("tiny")))
        yield client


def at_site(world: World, call: Callable[[GrpcSiteClient], Awaitable[T]]) -> T:
    """`call` with a client of the site of its own (the tests' view of the site)."""

    async def run() -> T:
        client = GrpcSiteClient("aws-use1", f"127.0.0.1:{world.site.port}", 10.0)
        try:
            return await call(client)
        finally:
            await client.close()

    return asyncio.run(run())


def site_progress(world: World, job_id: str) -> FineTuneProgress | None:
    """The job as the site has it (None: the site does not know it)."""
    try:
        return at_site(world, lambda site: site.fine_tune_progress(job_id))
    except FineTuneCallRefused as exc:
        if exc.reason == "not_found":
            return None
        raise


def key(client: TestClient[Any], name: str) -> openai.OpenAI:
    """A client of a key of its own (a test's jobs never count against another's limits)."""
    response = client.post("/admin/api/keys", json={"name": name}, headers=ADMIN_HEADERS)
    assert response.status_code == 201, response.text
    return sdk(client, response.json()["key"])


def site_step(world: World, job_id: str) -> int:
    progress = site_progress(world, job_id)
    return progress.step if progress is not None else -1


def messages(client: openai.OpenAI, job_id: str) -> list[str]:
    return [e.message for e in client.fine_tuning.jobs.list_events(job_id, limit=100).data]


def hyper(epochs: int) -> Any:
    return {"n_epochs": epochs, "batch_size": 1}


def test_a_job_cancelled_while_its_site_reads_its_file_trains_nothing_there(world: World) -> None:
    with gateway(world) as client:
        alice = key(client, "ft-orphan")
        upload = alice.files.create(file=("big.jsonl", BIG), purpose="fine-tune")
        job = alice.fine_tuning.jobs.create(model="tiny", training_file=upload.id)
        assert job.status == "queued"
        wait_for(lambda: site_progress(world, job.id) is not None)
        reading = site_progress(world, job.id)
        assert reading is not None
        # The site answered the start before reading the file: its steps are not known yet.
        assert (reading.state, reading.total_steps) == (FineTuneState.QUEUED, 0)
        cancelled = alice.fine_tuning.jobs.cancel(job.id)
        assert cancelled.status == "cancelled"
        assert not any("could not be told" in m for m in messages(alice, job.id))
        at = site_progress(world, job.id)
        assert at is not None
        assert at.state is FineTuneState.CANCELLED
        assert at_site(world, lambda site: site.live_fine_tunes()) == []
        time.sleep(3.0)  # the rest of its file, had it been read on, and some training
        at = site_progress(world, job.id)
        assert at is not None
        assert (at.state, at.total_steps, at.step, at.trained_tokens) == (
            FineTuneState.CANCELLED, 0, 0, 0,
        )  # fmt: skip
        log = (world.work / "site-aws-use1.log").read_text(errors="replace")
        assert f"fine-tuning job {job.id}: the reading of its files stopped" in log
        # A second start of the job is refused by the site: it is never read or trained again.
        again = FineTuneSpec(job.id, "tiny", SMALL, None, FineTuneHyperparameters(1, 1, 1.0), 1)

        async def start_again(site: GrpcSiteClient) -> grpc.StatusCode:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{world.site.port}") as channel:
                stub = site_pb2_grpc.SiteEngineStub(channel)
                try:
                    await stub.StartFineTune(spec_to_proto(again), timeout=10)
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
            return grpc.StatusCode.OK

        assert at_site(world, start_again) is grpc.StatusCode.ALREADY_EXISTS
        assert alice.fine_tuning.jobs.retrieve(job.id).status == "cancelled"


def test_a_cancel_the_site_missed_is_sent_again_until_it_confirms(world: World) -> None:
    with gateway(world) as client:
        alice = key(client, "ft-missed")
        upload = alice.files.create(file=("small.jsonl", SMALL), purpose="fine-tune")
        job = alice.fine_tuning.jobs.create(
            model="tiny", training_file=upload.id, hyperparameters=hyper(50)
        )
        wait_for(lambda: site_step(world, job.id) >= 1)  # training at the site
        world.site.popen.send_signal(signal.SIGSTOP)
        try:
            cancelled = alice.fine_tuning.jobs.cancel(job.id)  # the site cannot answer
            assert cancelled.status == "cancelled"
            assert any("could not be told" in m for m in messages(alice, job.id))
        finally:
            world.site.popen.send_signal(signal.SIGCONT)
        wait_for(lambda: "cancelled there" in " ".join(messages(alice, job.id)), timeout_s=60)
        at = site_progress(world, job.id)
        assert at is not None
        assert at.state is FineTuneState.CANCELLED
        assert at.step < at.total_steps  # stopped, not trained to its end
        assert alice.fine_tuning.jobs.retrieve(job.id).status == "cancelled"


def test_a_job_the_gateway_does_not_hold_is_cancelled_at_its_site(world: World) -> None:
    fifty_epochs = FineTuneHyperparameters(50, 1, 1.0)
    stray = FineTuneSpec("ftjob-stray", "tiny", LONG_TRAINING, None, fifty_epochs, 1)
    at_site(world, lambda site: site.start_fine_tune(stray))
    with gateway(world):
        wait_for(lambda: site_progress(world, "ftjob-stray") is not None)
        wait_for(lambda: getattr(site_progress(world, "ftjob-stray"), "state", None)
                 is FineTuneState.CANCELLED)  # fmt: skip
    assert "ftjob-stray" not in at_site(world, lambda site: site.live_fine_tunes())


class CountingStarts:
    """The site's real client, its starts counted."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.starts = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    async def start_fine_tune(self, spec: FineTuneSpec) -> FineTuneProgress:
        self.starts += 1
        progress: FineTuneProgress = await self._real.start_fine_tune(spec)
        return progress


def test_a_file_read_past_the_starts_deadline_is_sent_once(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 67: a 60 MiB file went to its site six times in four minutes, once per deadline."""
    monkeypatch.setattr(grpc_client, "_FINE_TUNE_TIMEOUT_S", 1.0)  # the read takes seconds
    with gateway(world) as client:
        state = client.app.state.assembly.registry.get("aws-use1")
        counting = CountingStarts(state.client)
        state.client = counting
        alice = key(client, "ft-resent")
        upload = alice.files.create(file=("big.jsonl", BIG), purpose="fine-tune")
        job = alice.fine_tuning.jobs.create(
            model="tiny", training_file=upload.id, hyperparameters={"n_epochs": 1}
        )
        wait_for(lambda: alice.fine_tuning.jobs.retrieve(job.id).status == "running")
        assert counting.starts == 1
        alice.fine_tuning.jobs.cancel(job.id)
        log = (world.work / "site-aws-use1.log").read_text(errors="replace")
        assert log.count(f"fine-tuning job {job.id} accepted") == 1


def test_a_short_job_of_one_key_trains_beside_a_long_job_of_another(world: World) -> None:
    """Issue 67: key B's 4-step job sat queued 90 s behind key A's 2,500-step job."""
    with gateway(world) as client:
        alice, bob = key(client, "ft-long"), key(client, "ft-short")
        many = alice.files.create(
            file=("many.jsonl", jsonl([example(f"q{i}") for i in range(50)])), purpose="fine-tune"
        )
        long = alice.fine_tuning.jobs.create(
            model="tiny", training_file=many.id, hyperparameters=hyper(50)
        )
        wait_for(lambda: alice.fine_tuning.jobs.retrieve(long.id).status == "running")
        few = bob.files.create(file=("few.jsonl", SMALL), purpose="fine-tune")
        short = bob.fine_tuning.jobs.create(
            model="tiny", training_file=few.id, hyperparameters=hyper(1)
        )
        states = ("succeeded", "failed", "cancelled")
        wait_for(lambda: bob.fine_tuning.jobs.retrieve(short.id).status in states)
        done = bob.fine_tuning.jobs.retrieve(short.id)
        assert (done.status, done.error) == ("succeeded", None)
        still = alice.fine_tuning.jobs.retrieve(long.id)
        assert still.status == "running"
        at = site_progress(world, long.id)
        assert at is not None
        assert at.step < at.total_steps == 2500
        alice.fine_tuning.jobs.cancel(long.id)
