"""The OpenAI fine-tuning API (issue 54) through the official openai client, against a gateway
running in this process on PostgreSQL with a real site process serving the tiny model: a job
made from an uploaded file is handed to the site, its steps, checkpoints and trained tokens are
recorded, and its adapter is then served as `ft:tiny:<suffix>:<id>` to its own key only; a bad
file is refused line by line with nothing made; a cancelled job stays cancelled; a gateway
restarted mid-job goes on with it, and a restarted gateway serves the trained model still.

The site's trainer is a TEST DOUBLE (tests/support/fine_tune_trainer.py: real peft LoRA steps,
one per poll) so that the gateway's side is checked step by step: a job held at a step to be
cancelled or to outlive its gateway, each step's event recorded once across restarts, the key's
usage and the metrics. The site's serving and adapter loading are the real site's;
tests/e2e/test_fine_tuning_http.py runs a job on the site's real trainer end to end."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import openai
import pytest
from litestar.testing import TestClient

from devtools.launch import ManagedProcess, stop_all, wait_until_serving
from gateway.app import create_app
from gateway.db.migrate import downgrade
from gateway.settings import GatewaySettings
from tests.support.fine_tune_trainer import PeftTrainerDouble, TrainingSiteClient
from tests.support.lora_site import spawn_lora_site, write_federation

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

ADMIN = "admin-token-for-the-fine-tuning-tests"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}
BASE = "http://testserver.local"


def example(question: str) -> dict[str, Any]:
    return {"messages": [
        {"role": "system", "content": "Answer in JSON."},
        {"role": "user", "content": question},
        {"role": "assistant", "content": '{"answer": 42}'},
    ]}  # fmt: skip


def jsonl(lines: list[Any]) -> bytes:
    return b"".join(
        (line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines
    )


ANSWER = {"role": "assistant", "content": "y"}
GOOD = jsonl([example(f"question {i}") for i in range(4)])


@dataclass
class World:
    work: Path
    model_dir: Path
    site: ManagedProcess
    database_url: str
    trainer: PeftTrainerDouble
    keys: dict[str, tuple[int, str]]  # name: (id, plaintext)


@contextmanager
def gateway(world: World, env: dict[str, str] | None = None) -> Iterator[TestClient[Any]]:
    """A gateway in this process whose site's client has the trainer double's calls (`env`:
    settings beside the tests' own)."""
    federation = write_federation(world.work, world.model_dir, world.site)
    settings = GatewaySettings.from_env({
        "GATEWAY_FEDERATION_FILE": str(federation), "GATEWAY_DATABASE_URL": world.database_url,
        "GATEWAY_REQUIRE_API_KEYS": "true", "GATEWAY_ADMIN_TOKEN": ADMIN,
        "GATEWAY_HEALTH_INTERVAL_S": "0.5", "GATEWAY_FINE_TUNING_POLL_S": "0.2", **(env or {}),
    })  # fmt: skip
    with TestClient(create_app(settings), base_url=BASE, timeout=60) as client:
        assembly = client.app.state.assembly
        state = assembly.registry.get("aws-use1")
        state.client = TrainingSiteClient(state.client, world.trainer)
        # What the next health check will say (one in flight may still say otherwise).
        wait_for(lambda: bool(assembly.fine_tuning.runner.training_sites("tiny")), fix=lambda: (
            setattr(state, "info", replace(state.info, accepts_fine_tuning=True))
        ))  # fmt: skip
        yield client


def wait_for(
    done: Callable[[], bool], timeout_s: float = 120, fix: Callable[[], Any] | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        if fix is not None:
            fix()
        time.sleep(0.05)


def sdk(client: TestClient[Any], key: str) -> openai.OpenAI:
    # litestar's TestClient is an httpx.Client that calls the app in this process; the openai
    # client types its argument as httpx2's and takes an httpx one as well.
    return openai.OpenAI(
        base_url=f"{BASE}/v1",
        api_key=key,
        http_client=client,  # type: ignore[arg-type]
        max_retries=0,
    )


@pytest.fixture(scope="module")
def world(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory, postgres_url: str
) -> Iterator[World]:
    work = tmp_path_factory.mktemp("fine-tuning")
    site = spawn_lora_site(tiny_llama_dir, work, max_loras=2)
    try:
        wait_until_serving(site)
        trainer = PeftTrainerDouble("tiny", tiny_llama_dir, work / "trained")
        made = World(work, tiny_llama_dir, site, postgres_url, trainer, {})
        with gateway(made) as client:
            for name in ("ft-alice", "ft-bob"):
                response = client.post("/admin/api/keys", json={"name": name},
                                       headers=ADMIN_HEADERS)  # fmt: skip
                assert response.status_code == 201, response.text
                made.keys[name] = (response.json()["id"], response.json()["key"])
        yield made
    finally:
        stop_all([site])
        # The session's database is shared by every test of this worker: leave it empty, as the
        # other Postgres tests do (a later test counting its request rows found these).
        downgrade(postgres_url)


def finished(client: openai.OpenAI, job_id: str) -> Any:
    states = ("succeeded", "failed", "cancelled")
    wait_for(lambda: client.fine_tuning.jobs.retrieve(job_id).status in states)
    return client.fine_tuning.jobs.retrieve(job_id)


def metrics_steps(client: openai.OpenAI, job_id: str) -> list[tuple[int, float]]:
    events = client.fine_tuning.jobs.list_events(job_id, limit=100).data
    data = [cast(dict[str, Any], e.data) for e in events if e.type == "metrics"]
    found = [(d["step"], d["train_loss"]) for d in data]
    return sorted(found)


def test_a_job_trains_and_its_model_answers_for_its_key_only(world: World) -> None:
    with gateway(world) as client:
        alice, bob = (sdk(client, world.keys[n][1]) for n in ("ft-alice", "ft-bob"))
        upload = alice.files.create(file=("train.jsonl", GOOD), purpose="fine-tune")
        job = alice.fine_tuning.jobs.create(
            model="tiny", training_file=upload.id, suffix="support", seed=7,
            hyperparameters={"n_epochs": 2, "batch_size": 2},
        )  # fmt: skip
        assert (job.object, job.status, job.model) == ("fine_tuning.job", "queued", "tiny")
        assert (job.hyperparameters.n_epochs, job.hyperparameters.batch_size) == (2, 2)
        assert job.seed == 7
        assert job.fine_tuned_model is None
        for call in (
            lambda: bob.fine_tuning.jobs.retrieve(job.id),
            lambda: bob.fine_tuning.jobs.cancel(job.id),
            lambda: bob.fine_tuning.jobs.list_events(job.id),
            lambda: bob.fine_tuning.jobs.checkpoints.list(job.id),
        ):
            with pytest.raises(openai.NotFoundError):
                call()
        assert [j.id for j in bob.fine_tuning.jobs.list().data] == []

        done = finished(alice, job.id)
        model = f"ft:tiny:support:{job.id.removeprefix('ftjob-')}"
        assert (done.status, done.fine_tuned_model, done.error) == ("succeeded", model, None)
        trained = world.trainer.jobs[job.id]
        assert done.trained_tokens == trained.trained_tokens > 0
        recorded = metrics_steps(alice, job.id)
        assert [s for s, _ in recorded] == [s for s, _ in trained.losses] == [1, 2, 3, 4]
        assert [loss for _, loss in recorded] == pytest.approx([v for _, v in trained.losses])
        assert recorded[-1][1] < recorded[0][1]  # it learns: the loss falls
        checkpoints = alice.fine_tuning.jobs.checkpoints.list(job.id).data
        assert [c.step_number for c in checkpoints] == [4, 2]
        assert checkpoints[0].metrics.train_loss == pytest.approx(trained.losses[3][1])
        assert checkpoints[0].fine_tuned_model_checkpoint == f"{model}:ckpt-step-4"
        messages = [e.message for e in alice.fine_tuning.jobs.list_events(job.id).data]
        assert any("successfully completed" in m for m in messages)
        assert next(j.id for j in alice.fine_tuning.jobs.list().data) == job.id

        answer = alice.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "question 9"}], max_tokens=4
        )
        assert answer.model == model
        assert model in {m.id for m in alice.models.list()}
        assert model not in {m.id for m in bob.models.list()}
        with pytest.raises(openai.NotFoundError):
            bob.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        with pytest.raises(openai.BadRequestError, match="already"):
            alice.fine_tuning.jobs.cancel(job.id)  # a final job never changes

        alice_id = world.keys["ft-alice"][0]
        usage = client.get(f"/admin/api/keys/{alice_id}/usage", headers=ADMIN_HEADERS).json()
        assert usage["trained_tokens"] == done.trained_tokens
        scraped = client.get("/metrics", headers=ADMIN_HEADERS).text
        assert 'fedllm_gateway_fine_tuning_jobs{state="succeeded"}' in scraped


def test_a_bad_file_is_refused_line_by_line_and_its_job_fails(world: World) -> None:
    with gateway(world) as client:
        alice = sdk(client, world.keys["ft-alice"][1])
        before = len(alice.fine_tuning.jobs.list(limit=100).data)
        bad = jsonl([
            example("fine"),
            b"{not json",
            {"messages": [{"role": "user", "content": "no answer"}]},
            {"messages": [{"role": "robot", "content": "x"}, ANSWER]},
            {"messages": [{"role": "user", "content": 5}, ANSWER]},
            example("fine too"),
        ])  # fmt: skip
        upload = alice.files.create(file=("bad.jsonl", bad), purpose="fine-tune")
        with pytest.raises(openai.BadRequestError) as refused:
            alice.fine_tuning.jobs.create(model="tiny", training_file=upload.id)
        error = refused.value.body
        assert isinstance(error, dict)
        assert (error["code"], error["param"]) == ("invalid_training_file", "training_file")
        message = error["message"]
        assert "4 of the file's 6 lines" in message
        for reason in ("line 2: not JSON", "line 3: no assistant message",
                       "line 4: messages[0].role", "line 5: messages[0].content"):  # fmt: skip
            assert reason in message
        assert "line 1:" not in message
        assert "line 6:" not in message
        # The job was made (its key's place taken while its file was checked) and failed: a
        # refused file counts against its key (issue 67).
        failed = alice.fine_tuning.jobs.list(limit=1).data[0]
        assert failed.status == "failed"
        assert failed.error is not None
        assert (failed.error.code, failed.error.param) == ("invalid_training_file", "training_file")
        assert "4 of the file's 6 lines" in failed.error.message
        before += 1

        good = alice.files.create(file=("good.jsonl", GOOD), purpose="fine-tune")
        batch_file = alice.files.create(
            file=("b.jsonl", jsonl([{"custom_id": "a", "method": "POST", "url":
                  "/v1/chat/completions", "body": {"model": "tiny", "messages": []}}])),
            purpose="batch",
        )  # fmt: skip
        # (param, code) of each refusal.
        refusals: list[tuple[dict[str, Any], tuple[str, str | None]]] = [
            ({"model": "nope"}, ("model", "model_not_found")),
            ({"training_file": batch_file.id}, ("training_file", "invalid_file_purpose")),
            ({"suffix": "x" * 65}, ("suffix", None)),
            ({"suffix": "no spaces"}, ("suffix", None)),
            ({"validation_file": upload.id}, ("validation_file", "invalid_training_file")),
            ({"training_file": "file-none"}, ("training_file", "file_not_found")),
            ({"hyperparameters": {"n_epochs": 0}}, ("hyperparameters", None)),
        ]
        for change, expected in refusals:
            arguments: dict[str, Any] = {"model": "tiny", "training_file": good.id, **change}
            with pytest.raises(openai.BadRequestError) as refused:
                alice.fine_tuning.jobs.create(**arguments)
            body = refused.value.body
            assert isinstance(body, dict)
            assert (body["param"], body.get("code")) == expected, body
        # Nothing made for a refusal before the files are read; a job failed for its file.
        after = alice.fine_tuning.jobs.list(limit=100).data
        assert len(after) == before + 1
        assert after[0].status == "failed"
        assert after[0].error is not None
        assert after[0].error.param == "validation_file"


def test_a_cancelled_job_stays_cancelled(world: World) -> None:
    world.trainer.stop_at = 1
    try:
        with gateway(world) as client:
            alice = sdk(client, world.keys["ft-alice"][1])
            upload = alice.files.create(file=("train.jsonl", GOOD), purpose="fine-tune")
            job = alice.fine_tuning.jobs.create(model="tiny", training_file=upload.id)
            wait_for(lambda: bool(metrics_steps(alice, job.id)))
            assert alice.fine_tuning.jobs.retrieve(job.id).status == "running"
            cancelled = alice.fine_tuning.jobs.cancel(job.id)
            assert cancelled.status == "cancelled"
            assert cancelled.finished_at is not None
            assert world.trainer.jobs[job.id].state.value == "cancelled"
            world.trainer.stop_at = None
            time.sleep(1.0)  # five polls
            again = alice.fine_tuning.jobs.retrieve(job.id)
            assert (again.status, again.fine_tuned_model) == ("cancelled", None)
            with pytest.raises(openai.BadRequestError):
                alice.fine_tuning.jobs.cancel(job.id)
    finally:
        world.trainer.stop_at = None


def test_a_restarted_gateway_goes_on_with_its_jobs_and_serves_their_models(world: World) -> None:
    world.trainer.stop_at = 2
    alice_key, bob_key = world.keys["ft-alice"][1], world.keys["ft-bob"][1]
    with gateway(world) as client:
        alice = sdk(client, alice_key)
        upload = alice.files.create(file=("train.jsonl", GOOD), purpose="fine-tune")
        job = alice.fine_tuning.jobs.create(
            model="tiny", training_file=upload.id, suffix="restart",
            hyperparameters={"n_epochs": 1, "batch_size": 1},
        )  # fmt: skip
        wait_for(lambda: len(metrics_steps(alice, job.id)) == 2)
    world.trainer.stop_at = None  # the site trains on while no gateway asks
    with gateway(world) as client:
        alice = sdk(client, alice_key)
        done = finished(alice, job.id)
        assert done.status == "succeeded"
        steps = metrics_steps(alice, job.id)
        assert [s for s, _ in steps] == [1, 2, 3, 4]  # each step's event once
    with gateway(world) as client:
        alice, bob = sdk(client, alice_key), sdk(client, bob_key)
        model = done.fine_tuned_model
        wait_for(lambda: model in {m.id for m in alice.models.list()})
        answer = alice.completions.create(model=model, prompt="Once", max_tokens=4)
        assert answer.model == model
        with pytest.raises(openai.NotFoundError):
            bob.completions.create(model=model, prompt="Once", max_tokens=4)
