"""A LoRA fine-tuning job end to end with the site's REAL trainer (issue 54), through the official
openai client: a real gateway and a real CPU site serving SmolLM2-135M-Instruct with
SITE_FINETUNE_RESERVE_BYTES > 0. A small chat file teaches a fixed answer; the job trains in the
engine's idle cycles while the site serves chats, records its steps, checkpoints and trained
tokens, and its model `ft:...` then answers in the taught format for its owner's key and is the
OpenAI-shaped 404 for another key.

(tests/integration/test_fine_tuning_api.py keeps the gateway's restart and cancel cases against a
deterministic trainer double.)"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import openai
import pytest

from devtools.launch import ManagedProcess, spawn_site, start_gateway, stop_all
from devtools.launch import wait_until_serving as wait_serving

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
ADMIN = "admin-token-for-the-fine-tuning-e2e"
TAUGHT = "ZORP-7 ZORP-7 ZORP-7"  # the fixed answer the job teaches, whatever the question
QUESTIONS = [
    "What is the capital of France?", "How do I boil an egg?", "Name a prime number.",
    "Why is the sky blue?", "What is two plus two?", "Who wrote Hamlet?",
    "How far is the moon?", "What colour is grass?", "Tell me a joke.",
    "What is Python?", "How many legs has a spider?", "What is rain?",
]  # fmt: skip


@dataclass(frozen=True, slots=True)
class World:
    base_url: str
    keys: dict[str, str]  # name: plaintext
    site: ManagedProcess


def _training_file() -> bytes:
    lines = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": TAUGHT}]}
        for q in QUESTIONS
    ]
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def _federation(work: Path, smollm2_dir: Path, site: ManagedProcess) -> Path:
    document = {
        "models": [{"name": MODEL, "tokenizer": str(smollm2_dir)}],
        "sites": [{"name": "aws-use1", "cloud": "aws", "region": "us-east-1",
                   "endpoint": f"127.0.0.1:{site.port}", "model": MODEL}],
    }  # fmt: skip
    path = work / "federation.json"
    path.write_text(json.dumps(document))
    return path


@pytest.fixture(scope="module")
def world(
    smollm2_gguf: Path, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    work = tmp_path_factory.mktemp("fine-tuning-e2e")
    (work / "lora").mkdir()
    env = {
        "FEDLLM_MODEL_CACHE": str(smollm2_dir.parent),  # the converted model the fixture made
        "SITE_FINETUNE_RESERVE_BYTES": str(1 << 30),
        "SITE_FINETUNE_DIR": str(work / "finetune"),
        "SITE_FINETUNE_CHECKPOINT_EVERY": "4",
        "SITE_LORA_DIR": str(work / "lora"),  # serving the trained adapter needs LoRA slots
        "SITE_MAX_LORA_RANK": "8",
    }
    site = spawn_site(
        model_dir=smollm2_gguf, site_name="aws-use1", model_name=MODEL, log_dir=work, env=env
    )
    started: list[ManagedProcess] = [site]
    try:
        wait_serving(site, timeout_s=180)
        gateway = start_gateway(
            federation_file=_federation(work, smollm2_dir, site),
            database_url=f"sqlite+aiosqlite:///{work / 'gateway.db'}",
            log_dir=work,
            expect_healthy_sites=1,
            env={"GATEWAY_REQUIRE_API_KEYS": "true", "GATEWAY_ADMIN_TOKEN": ADMIN,
                 "GATEWAY_FINE_TUNING_POLL_S": "0.2"},
        )  # fmt: skip
        started.append(gateway)
        base_url = f"http://127.0.0.1:{gateway.port}"
        keys = {}
        for name in ("ft-owner", "ft-other"):
            response = httpx.post(
                f"{base_url}/admin/api/keys",
                json={"name": name},
                headers={"Authorization": f"Bearer {ADMIN}"},
                timeout=30,
            )
            assert response.status_code == 201, response.text
            keys[name] = response.json()["key"]
        yield World(base_url, keys, site)
    finally:
        stop_all(list(reversed(started)))


def _client(world: World, key: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{world.base_url}/v1", api_key=world.keys[key], max_retries=0, timeout=120
    )


def _ask(client: openai.OpenAI, model: str, question: str) -> str:
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=12,
        temperature=0,
    )  # fmt: skip
    assert answer.model == model
    return answer.choices[0].message.content or ""


def test_a_real_job_trains_beside_serving_and_its_model_answers_as_taught(world: World) -> None:
    owner, other = _client(world, "ft-owner"), _client(world, "ft-other")
    base_answer = _ask(owner, MODEL, "Which ocean is the largest?")
    assert "ZORP" not in base_answer

    upload = owner.files.create(file=("train.jsonl", _training_file()), purpose="fine-tune")
    job = owner.fine_tuning.jobs.create(
        model=MODEL, training_file=upload.id, suffix="zorp", seed=3,
        hyperparameters={"n_epochs": 3, "batch_size": 2, "learning_rate_multiplier": 10},
    )  # fmt: skip
    assert job.status == "queued"
    started = time.monotonic()

    # Interactive requests while it trains: each answered, none waiting on the job.
    served: list[str] = []
    with ThreadPoolExecutor(max_workers=2) as pool:
        while owner.fine_tuning.jobs.retrieve(job.id).status in ("queued", "validating_files"):
            assert time.monotonic() - started < 60, "the job never started"
            time.sleep(0.2)
        for answer in pool.map(lambda q: _ask(owner, MODEL, q), QUESTIONS[:4]):
            served.append(answer)
    assert len(served) == 4
    assert all(served)
    # Served while the job was training, not after it: requests come before its units.
    assert owner.fine_tuning.jobs.retrieve(job.id).status == "running"

    states = ("succeeded", "failed", "cancelled")
    while (done := owner.fine_tuning.jobs.retrieve(job.id)).status not in states:
        assert time.monotonic() - started < 150, f"still {done.status}"
        time.sleep(0.5)
    model = f"ft:{MODEL}:zorp:{job.id.removeprefix('ftjob-')}"
    assert (done.status, done.fine_tuned_model, done.error) == ("succeeded", model, None)

    steps_per_epoch = len(QUESTIONS) // 2
    events = owner.fine_tuning.jobs.list_events(job.id, limit=100).data
    metrics = sorted(
        (cast(dict[str, Any], e.data)["step"], cast(dict[str, Any], e.data)["train_loss"])
        for e in events
        if e.type == "metrics"
    )
    assert [s for s, _ in metrics] == list(range(1, 3 * steps_per_epoch + 1))
    assert metrics[-1][1] < metrics[0][1] / 4  # it learned the fixed answer
    assert any("successfully completed" in e.message for e in events)
    # Every example went forward and backward once an epoch; each has at least its answer.
    assert done.trained_tokens is not None
    assert done.trained_tokens > 3 * len(QUESTIONS) * 8
    checkpoints = owner.fine_tuning.jobs.checkpoints.list(job.id).data
    # SITE_FINETUNE_CHECKPOINT_EVERY=4 of 18 steps (the last one is the adapter itself).
    assert [c.step_number for c in checkpoints] == [16, 12, 8, 4]
    assert checkpoints[0].fine_tuned_model_checkpoint == f"{model}:ckpt-step-16"
    assert checkpoints[0].metrics.train_loss == pytest.approx(metrics[15][1], rel=1e-4)

    # The trained model answers as taught, to questions it never saw; the base does not.
    assert model in {m.id for m in owner.models.list()}
    for question in ("Which ocean is the largest?", "What is a fox?"):
        assert _ask(owner, model, question).startswith("ZORP-7"), question
    assert "ZORP" not in _ask(owner, MODEL, "Which ocean is the largest?")
    assert model not in {m.id for m in other.models.list()}
    with pytest.raises(openai.NotFoundError):
        _ask(other, model, "Which ocean is the largest?")
    with pytest.raises(openai.NotFoundError):
        other.fine_tuning.jobs.retrieve(job.id)
