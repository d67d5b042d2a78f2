"""Training under limits and training files checked (issue 58), through the official openai
client against a gateway on PostgreSQL and a real site process (the world of
test_fine_tuning_api.py: its trainer is a test double, its serving the real site's):

- a key's unfinished jobs and its training tokens per 24 hours are limited: 429, nothing made;
- a file past GATEWAY_FINE_TUNING_MAX_FILE_BYTES gets 400 naming the limit, at upload and when
  a job would put two files together past it;
- a 60 MiB training file is parsed off the event loop: another request's health check is not
  held while the job is checked, and its bad line is named.
"""

from __future__ import annotations

import gc
import json
import time
from typing import Any

import openai
import pytest
from litestar.testing import TestClient

from tests.integration.test_fine_tuning_api import (
    ADMIN_HEADERS,
    GOOD,
    World,
    example,
    gateway,
    jsonl,
    sdk,
    world,
)
from tests.loop_held import ticking_in
from tests.security.healthz_probe import probing_healthz

pytestmark = [pytest.mark.postgres, pytest.mark.slow]
__all__ = ["world"]  # the fixture, shared with test_fine_tuning_api.py


def make_key(client: TestClient[Any], name: str, **limits: int) -> str:
    response = client.post("/admin/api/keys", json={"name": name, **limits}, headers=ADMIN_HEADERS)
    assert response.status_code == 201, response.text
    key: str = response.json()["key"]
    return key


def refusal(error: openai.APIStatusError) -> dict[str, Any]:
    body = error.body
    assert isinstance(body, dict)
    return body


def test_a_keys_training_limits_give_429_and_make_nothing(world: World) -> None:
    world.trainer.stop_at = 1  # jobs stay running until cancelled
    try:
        with gateway(world, {"GATEWAY_FINE_TUNING_JOBS_PER_KEY": "2"}) as client:
            carol = sdk(client, make_key(client, "ft-carol"))
            upload = carol.files.create(file=("train.jsonl", GOOD), purpose="fine-tune")
            jobs = [carol.fine_tuning.jobs.create(model="tiny", training_file=upload.id)
                    for _ in range(2)]  # fmt: skip
            with pytest.raises(openai.RateLimitError) as refused:
                carol.fine_tuning.jobs.create(model="tiny", training_file=upload.id)
            error = refusal(refused.value)
            assert (error["code"], error["type"]) == ("fine_tuning_jobs_limit_exceeded", "requests")
            assert "2 fine-tuning jobs unfinished, its limit of 2" in error["message"]
            assert len(carol.fine_tuning.jobs.list().data) == 2
            carol.fine_tuning.jobs.cancel(jobs[0].id)
            jobs.append(carol.fine_tuning.jobs.create(model="tiny", training_file=upload.id))
            for job in jobs[1:]:
                carol.fine_tuning.jobs.cancel(job.id)

            # 700 tokens a minute: at most 1,008,000 training tokens a day. ~105k tokens
            # (420 KB / 4) x 50 epochs is 5M; x 5 epochs 525k, and twice that passes the day.
            dave = sdk(client, make_key(client, "ft-dave", tokens_per_minute=700))
            big = jsonl([example(f"{i} " + "word " * 400) for i in range(200)])
            assert 400_000 < len(big) < 440_000
            upload = dave.files.create(file=("big.jsonl", big), purpose="fine-tune")

            def create(epochs: int) -> str:
                return dave.fine_tuning.jobs.create(
                    model="tiny", training_file=upload.id, hyperparameters={"n_epochs": epochs}
                ).id

            with pytest.raises(openai.RateLimitError) as refused:
                create(50)
            error = refusal(refused.value)
            assert (error["code"], error["type"]) == ("training_tokens_limit_exceeded", "tokens")
            assert "1008000: it can never fit" in error["message"]
            first = create(5)
            with pytest.raises(openai.RateLimitError) as refused:
                create(5)
            error = refusal(refused.value)
            assert error["code"] == "training_tokens_limit_exceeded"
            estimate = -(-len(big) // 4) * 5
            assert f"limit 1008000 per 24 hours, used {estimate}," in error["message"]
            assert [job.id for job in dave.fine_tuning.jobs.list().data] == [first]
            # A cancelled job counts what it trained (a step), no longer its estimate.
            dave.fine_tuning.jobs.cancel(first)
            dave.fine_tuning.jobs.cancel(create(5))
    finally:
        world.trainer.stop_at = None


def test_a_file_past_the_limit_gets_400_naming_it(world: World) -> None:
    limit = 1 << 20
    with gateway(world, {"GATEWAY_FINE_TUNING_MAX_FILE_BYTES": str(limit)}) as client:
        erin = sdk(client, make_key(client, "ft-erin"))
        half = jsonl([example(f"{i} " + "word " * 100) for i in range(1200)])
        assert limit // 2 < len(half) < limit
        with pytest.raises(openai.BadRequestError) as refused:
            erin.files.create(file=("big.jsonl", half + half), purpose="fine-tune")
        error = refusal(refused.value)
        assert (error["code"], error["param"]) == ("file_too_large", "file")
        assert str(limit) in error["message"]
        assert erin.files.list().data == []

        # Each file fits; together (one message to the site) they do not.
        training = erin.files.create(file=("t.jsonl", half), purpose="fine-tune")
        validation = erin.files.create(file=("v.jsonl", half), purpose="fine-tune")
        with pytest.raises(openai.BadRequestError) as refused:
            erin.fine_tuning.jobs.create(
                model="tiny", training_file=training.id, validation_file=validation.id
            )
        error = refusal(refused.value)
        assert (error["code"], error["param"]) == ("file_too_large", "validation_file")
        assert str(limit) in error["message"]
        assert erin.fine_tuning.jobs.list().data == []


def test_a_60_mib_training_file_does_not_delay_a_health_check(world: World) -> None:
    # Lines shorter in bytes than the tiny model's context of 1,024 tokens: none needs its
    # tokens counted (fedllm_contract/training_tokens.py), so the check is the JSON's.
    line = json.dumps(example("word " * 150)).encode()
    count = (60 << 20) // (len(line) + 1) + 1
    # The last line is bad: the file is parsed whole, refused, and never sent to the site.
    content = (line + b"\n") * count + b'{"messages": [{"role": "tool", "content": "x"}]}\n'
    assert len(content) > 60 << 20
    with gateway(world) as client:
        frank = sdk(client, make_key(client, "ft-frank"))
        upload = frank.files.create(file=("huge.jsonl", content), purpose="fine-tune")
        client.get("/healthz")  # warm
        # As a gateway runs (gateway/__main__.py): what was imported before serving is out of
        # the collector's sight, else a full collection walks pytest's and torch's heap.
        gc.collect()
        gc.freeze()
        try:
            with (
                ticking_in(client.blocking_portal) as held,
                probing_healthz("", every_s=0.02, client=client) as probe,
            ):
                started = time.monotonic()
                with pytest.raises(openai.BadRequestError) as refused:
                    frank.fine_tuning.jobs.create(model="tiny", training_file=upload.id)
                took_s = time.monotonic() - started
        finally:
            gc.unfreeze()
        error = refusal(refused.value)
        assert error["code"] == "invalid_training_file"
        assert f"line {count + 1}: messages[0].role must be one of" in error["message"]
        assert probe.answers >= 5, (probe, took_s)  # the check took long enough to be probed
        # Issue 58's goal is 100 ms; on this 2-core host shared by 8 workers (load 9 to 19),
        # through the in-process TestClient with torch loaded, it measured 178 to 269 ms (1,400
        # to 3,200 ms with the file split whole, or parsed on the loop): bounded here with room
        # for the load, as tests/security/test_batch_uploads.py bounds its own.
        assert probe.worst_s < 0.5, f"/healthz took {probe.worst_s * 1000:.0f} ms ({took_s:.1f} s)"
        # The goal itself, in what the code decides: the gateway's loop never runs more than
        # 100 ms of CPU at a stretch while the file is read and checked, so a health check
        # waits at most that for the loop (tests/loop_held.py; the wall-clock bound above also
        # holds the host's load). Measured 36 ms; parsed on the loop it was 1.4-3.2 s.
        assert held.turns > 20, held
        assert held.most_s < 0.1, (
            f"the loop ran {held.most_s * 1000:.0f} ms of CPU at a stretch "
            f"(and the kernel {held.system_s * 1000:.0f} ms for it)"
        )
