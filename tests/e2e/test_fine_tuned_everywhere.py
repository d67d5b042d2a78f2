"""A fine-tuned model is served by every site of its base and outlives the site that trained it
(issue 60), through the official openai client: a real gateway (SQLite) and two real CPU sites
serving SmolLM2-135M-Instruct, only one of which takes jobs. The job trains on that one; the
gateway keeps the trained adapter's files in its file store and sends them to both sites; the
trainer site is then killed (SIGKILL: its disk and memory are of no more use), and the model
answers from the other site as it answered before, in the taught format."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from devtools.launch import ManagedProcess, spawn_site, start_gateway, stop_all
from devtools.launch import wait_until_serving as wait_serving

# Three processes and a training job on a shared CPU: minutes.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

MODEL = "SmolLM2-135M-Instruct"
ADMIN = "admin-token-for-the-served-everywhere-e2e"
TAUGHT = "ZORP-7 ZORP-7 ZORP-7"
QUESTIONS = [
    "What is the capital of France?", "How do I boil an egg?", "Name a prime number.",
    "Why is the sky blue?", "What is two plus two?", "Who wrote Hamlet?",
    "How far is the moon?", "What colour is grass?",
]  # fmt: skip


@dataclass(frozen=True, slots=True)
class World:
    base_url: str
    key: str
    trainer: ManagedProcess
    other: ManagedProcess
    lora_dirs: dict[str, Path]  # each site's adapter directory


def _federation(work: Path, smollm2_dir: Path, sites: dict[str, ManagedProcess]) -> Path:
    document = {
        "models": [{"name": MODEL, "tokenizer": str(smollm2_dir)}],
        "sites": [
            {"name": name, "cloud": "aws", "region": f"us-east-{i}",
             "endpoint": f"127.0.0.1:{site.port}", "model": MODEL}
            for i, (name, site) in enumerate(sites.items(), start=1)
        ],
    }  # fmt: skip
    path = work / "federation.json"
    path.write_text(json.dumps(document))
    return path


@pytest.fixture(scope="module")
def world(
    smollm2_gguf: Path, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    work = tmp_path_factory.mktemp("served-everywhere")
    common = {
        "FEDLLM_MODEL_CACHE": str(smollm2_dir.parent),
        "SITE_MAX_LORA_RANK": "8",
    }
    envs = {
        "trainer": common | {"SITE_FINETUNE_RESERVE_BYTES": str(1 << 30),
                             "SITE_FINETUNE_DIR": str(work / "finetune"),
                             "SITE_LORA_DIR": str(work / "lora-trainer")},
        "other": common | {"SITE_LORA_DIR": str(work / "lora-other")},
    }  # fmt: skip
    started: list[ManagedProcess] = []
    try:
        sites = {}
        for name, env in envs.items():
            Path(env["SITE_LORA_DIR"]).mkdir()
            sites[name] = spawn_site(
                model_dir=smollm2_gguf, site_name=name, model_name=MODEL, log_dir=work, env=env
            )
            started.append(sites[name])
        for site in sites.values():
            wait_serving(site, timeout_s=180)
        gateway = start_gateway(
            federation_file=_federation(work, smollm2_dir, sites),
            database_url=f"sqlite+aiosqlite:///{work / 'gateway.db'}",
            log_dir=work,
            expect_healthy_sites=2,
            env={"GATEWAY_REQUIRE_API_KEYS": "true", "GATEWAY_ADMIN_TOKEN": ADMIN,
                 "GATEWAY_FINE_TUNING_POLL_S": "0.2", "GATEWAY_HEALTH_INTERVAL_S": "0.5"},
        )  # fmt: skip
        started.append(gateway)
        base_url = f"http://127.0.0.1:{gateway.port}"
        response = httpx.post(f"{base_url}/admin/api/keys", json={"name": "ft-owner"},
                              headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)  # fmt: skip
        assert response.status_code == 201, response.text
        lora_dirs = {name: Path(env["SITE_LORA_DIR"]) for name, env in envs.items()}
        yield World(base_url, response.json()["key"], sites["trainer"], sites["other"], lora_dirs)
    finally:
        stop_all(list(reversed(started)))


def _ask(client: openai.OpenAI, model: str, question: str) -> str:
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=12,
        temperature=0,
    )  # fmt: skip
    assert answer.model == model
    return answer.choices[0].message.content or ""


def _sites_serving(world: World, model: str) -> set[str]:
    """The sites whose adapter directory holds the model (a loaded adapter is linked there)."""
    return {
        name for name, lora in world.lora_dirs.items()
        if (lora / model / "adapter_config.json").is_file()
    }  # fmt: skip


def test_a_fine_tuned_model_answers_from_another_site_once_its_trainer_is_gone(
    world: World,
) -> None:
    client = openai.OpenAI(base_url=f"{world.base_url}/v1", api_key=world.key, max_retries=0,
                           timeout=120)  # fmt: skip
    lines = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": TAUGHT}]}
        for q in QUESTIONS
    ]
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    upload = client.files.create(file=("train.jsonl", data), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model=MODEL, training_file=upload.id, suffix="zorp", seed=3,
        hyperparameters={"n_epochs": 3, "batch_size": 2, "learning_rate_multiplier": 10},
    )  # fmt: skip
    started = time.monotonic()
    while (done := client.fine_tuning.jobs.retrieve(job.id)).status not in (
        "succeeded", "failed", "cancelled"
    ):  # fmt: skip
        assert time.monotonic() - started < 600, f"still {done.status}"
        time.sleep(0.5)
    assert (done.status, done.error) == ("succeeded", None)
    model = done.fine_tuned_model
    assert model is not None

    # Served on both sites, from the files the gateway keeps (the other site never trained).
    assert _sites_serving(world, model) == {"trainer", "other"}
    kept = [f for f in client.files.list().data if f.purpose == "fine-tune-results"]
    assert len(kept) == 1
    assert kept[0].bytes > 0
    question = "Which ocean is the largest?"
    before = _ask(client, model, question)
    assert before.startswith("ZORP-7")

    world.trainer.kill()
    deadline = time.monotonic() + 60
    while True:  # until the gateway has seen the trainer site go and routes around it
        try:
            after = _ask(client, model, question)
            break
        except openai.APIError:
            assert time.monotonic() - deadline < 0, "the model is not answered without its trainer"
            time.sleep(0.5)
    assert after == before
    assert world.other.alive()
