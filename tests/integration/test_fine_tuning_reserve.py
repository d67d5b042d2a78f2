"""A job whose example the training site's memory reserve cannot hold is refused when it is made,
in tokens (issue 75: an 840-token example got 200 `queued`, then `failed` at the site with the
reserve given in bytes). A real site process (the tiny Llama on the CPU) with a reserve that
holds examples of about 200 tokens says so in its SiteInfo; the gateway (in this process, on
SQLite) checks every line against it, through the official openai client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from litestar.testing import TestClient

from devtools.launch import stop_all
from fedllm_contract.fine_tuning import FineTuneHyperparameters
from gateway.app import create_app
from gateway.settings import GatewaySettings
from site_engine.finetune.memory import TrainingShape, training_bytes
from site_engine.model_loading import load_model
from tests.integration.test_fine_tuning_api import BASE, example, jsonl, wait_for
from tests.integration.test_fine_tuning_limits import refusal
from tests.support.training_site import start_training_site

pytestmark = pytest.mark.slow

# The longest example the site's reserve is sized to hold, in tokens.
HELD = 200


@pytest.fixture(scope="module")
def site(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    work = tmp_path_factory.mktemp("reserve")
    shape = TrainingShape.of_model(load_model(tiny_llama_dir).model)
    hp = FineTuneHyperparameters(n_epochs=1, batch_size=1, learning_rate_multiplier=1.0)
    process = start_training_site(tiny_llama_dir, work, training_bytes(shape, hp, HELD, HELD))
    try:
        yield work
    finally:
        stop_all([process])


@pytest.fixture
def client(site: Path, tmp_path: Path) -> Iterator[openai.OpenAI]:
    settings = GatewaySettings.from_env({
        "GATEWAY_FEDERATION_FILE": str(site / "federation.json"),
        "GATEWAY_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}",
        "GATEWAY_HEALTH_INTERVAL_S": "0.5",
    })  # fmt: skip
    with TestClient(create_app(settings), base_url=BASE, timeout=60) as http:
        runner = http.app.state.assembly.fine_tuning.runner
        wait_for(lambda: bool(runner.training_sites("tiny")))
        yield openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused",
                            http_client=http, max_retries=0)  # type: ignore[arg-type]  # fmt: skip


def test_an_example_the_reserve_cannot_hold_is_refused_at_create_in_tokens(
    client: openai.OpenAI,
) -> None:
    # About 400 tokens: within the model's context (1,024), twice what the reserve holds.
    long = example("word " * 380)
    content = jsonl([example("fine"), long, example("also fine")])
    upload = client.files.create(file=("long.jsonl", content), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError) as refused:
        client.fine_tuning.jobs.create(model="tiny", training_file=upload.id)
    error = refusal(refused.value)
    assert (error["code"], error["param"]) == ("invalid_training_file", "training_file")
    message = error["message"]
    assert "1 of the file's 3 lines" in message
    assert "line 2: " in message
    assert "tokens an example may have in the fine-tuning memory reserve" in message
    assert "bytes" not in message
    held = int(message.split(" tokens an example may have")[0].rsplit(" ", 1)[1])
    assert HELD - 2 <= held <= HELD  # the site's own count of what its reserve holds
    # The examples it holds pass: the job is made and queued.
    fits = client.files.create(file=("fits.jsonl", jsonl([example("fine")] * 3)),
                               purpose="fine-tune")  # fmt: skip
    job = client.fine_tuning.jobs.create(model="tiny", training_file=fits.id)
    assert job.status == "queued"
    client.fine_tuning.jobs.cancel(job.id)


def test_the_validation_file_is_held_to_the_reserve_too(client: openai.OpenAI) -> None:
    train = client.files.create(file=("t.jsonl", jsonl([example("fine")])), purpose="fine-tune")
    valid = client.files.create(
        file=("v.jsonl", json.dumps(example("word " * 380)).encode()), purpose="fine-tune"
    )
    with pytest.raises(openai.BadRequestError) as refused:
        client.fine_tuning.jobs.create(
            model="tiny", training_file=train.id, validation_file=valid.id
        )
    error = refusal(refused.value)
    assert (error["code"], error["param"]) == ("invalid_training_file", "validation_file")
    assert "fine-tuning memory reserve" in error["message"]
