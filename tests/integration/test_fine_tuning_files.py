"""Training files checked once, in their own processes, when a job is made (issue 67), through
the official openai client against a gateway on PostgreSQL and a real site process (the world of
test_fine_tuning_api.py: its trainer is a test double, its serving the real site's):

- another tenant's chat keeps its pace while two keys' large files are checked: its latency
  then is within 2x of its latency before, both measured here (the files used to be parsed on
  the two tokenize threads that also prepare chat bodies, and a 3 KB chat waited 150 s);
- a key's concurrent creates cannot all pass its bound on checks under way;
- a refused file costs its key: its reading counts against the key's training tokens;
- a line longer than the model's context is refused at the gateway, naming the line;
- a job its gateway left `validating_files` (stopped mid-check) fails in time.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import openai
import pytest

from gateway.stores.fine_tuning_store import NewJob
from tests.integration.test_fine_tuning_api import (
    ADMIN_HEADERS,
    World,
    example,
    gateway,
    jsonl,
    sdk,
    wait_for,
    world,
)
from tests.integration.test_fine_tuning_limits import make_key, refusal

pytestmark = [pytest.mark.postgres, pytest.mark.slow]
__all__ = ["world"]  # the fixture, shared with test_fine_tuning_api.py

# A line longer in bytes than the tiny model's context (1,024 tokens), shorter in tokens: its
# tokens are counted when its file is checked.
LONG_LINE = json.dumps(example("word " * 400)).encode()
# A line of a usual chat example: its tokens need no count.
SHORT_LINE = json.dumps(example("What is the capital of France?")).encode()
BAD_LAST = b'{"messages": [{"role": "tool", "content": "x"}]}\n'


def large_bad_file(mib: int, line: bytes = LONG_LINE) -> tuple[bytes, int]:
    """`mib` MiB of good lines and a bad last one; the bad line's number."""
    count = (mib << 20) // (len(line) + 1)
    return (line + b"\n") * count + BAD_LAST, count + 1


def timed(call: Callable[[], Any]) -> float:
    began = time.perf_counter()
    call()
    return time.perf_counter() - began


def test_another_tenants_chat_keeps_its_pace_while_two_large_files_are_checked(
    world: World,
) -> None:
    # Issue 67's files: 20 MiB of chat examples whose last line is bad.
    content, bad_line = large_bad_file(20, SHORT_LINE)
    with gateway(world) as client:
        makers = [sdk(client, make_key(client, f"ft-maker-{i}")) for i in (1, 2)]
        uploads = [m.files.create(file=("big.jsonl", content), purpose="fine-tune") for m in makers]
        chatter = sdk(client, make_key(client, "ft-chatter"))
        # A body over the 1 KiB the gateway prepares on its event loop: it goes through the
        # tokenize pool, where the files used to be parsed.
        question = "Summarise: " + "the quick brown fox jumps over the lazy dog. " * 70

        def chat() -> float:
            return timed(lambda: chatter.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": question}], max_tokens=4,
            ))  # fmt: skip

        def create(maker: openai.OpenAI, upload: Any) -> Any:
            try:
                maker.fine_tuning.jobs.create(model="tiny", training_file=upload.id)
            except openai.BadRequestError as exc:
                return exc
            return None

        chat()  # warm
        # A check's first file starts the checking process and loads the tokenizer there (once
        # per gateway): out of the measure, with a small bad file of its own.
        warm = makers[0].files.create(file=("w.jsonl", LONG_LINE + b"\n" + BAD_LAST),
                                      purpose="fine-tune")  # fmt: skip
        assert isinstance(create(makers[0], warm), openai.BadRequestError)
        # Three rounds, each the two creates with chats while they run, between chats with
        # nothing else: the host's load from everything else comes and goes, and each side's
        # samples are pooled across the rounds it spans.
        baseline: list[float] = []
        during: list[float] = []
        for _ in range(3):
            baseline += [chat() for _ in range(6)]
            with ThreadPoolExecutor(2) as pool:
                creates: list[Future[Any]] = [
                    pool.submit(create, m, u) for m, u in zip(makers, uploads, strict=True)
                ]
                while not all(c.done() for c in creates):
                    during.append(chat())
            for done in creates:
                error = done.result()
                assert isinstance(error, openai.BadRequestError)
                said = refusal(error)["message"]
                assert f"line {bad_line}: messages[0].role must be one of" in said
        baseline += [chat() for _ in range(6)]
    usual, while_checked = statistics.median(baseline), statistics.median(during)
    assert while_checked <= 2 * usual, (
        f"chat took {while_checked * 1000:.0f} ms (median of {len(during)}) while the files "
        f"were checked, {usual * 1000:.0f} ms (median of {len(baseline)}) otherwise"
    )
    assert len(during) >= 9, during  # the checks lasted long enough to be measured


def test_a_keys_concurrent_creates_cannot_all_pass_its_checks_bound(world: World) -> None:
    content, _ = large_bad_file(2)
    with gateway(world, {"GATEWAY_FINE_TUNING_VALIDATIONS_PER_KEY": "1"}) as client:
        grace = sdk(client, make_key(client, "ft-grace"))
        upload = grace.files.create(file=("big.jsonl", content), purpose="fine-tune")
        barrier = threading.Barrier(3)

        def create() -> str:
            barrier.wait()
            try:
                grace.fine_tuning.jobs.create(model="tiny", training_file=upload.id)
            except openai.APIStatusError as exc:
                return str(refusal(exc).get("code"))
            return "made"

        with ThreadPoolExecutor(3) as pool:
            codes = sorted(pool.map(lambda _: create(), range(3)))
        # One checked (and refused for its last line); the others refused while it was checked.
        assert codes[0] == "fine_tuning_validations_limit_exceeded", codes
        assert codes.count("invalid_training_file") >= 1, codes
        jobs = grace.fine_tuning.jobs.list().data
        assert len(jobs) == codes.count("invalid_training_file")
        assert {job.status for job in jobs} == {"failed"}


def test_a_refused_file_counts_against_its_keys_training_tokens(world: World) -> None:
    content, _ = large_bad_file(1)
    cost = -(-len(content) // 4)  # one reading of it: its bytes / 4
    good_file = (LONG_LINE + b"\n") * 10
    wanted = -(-len(good_file) // 4)  # the good job's estimate, one epoch
    # A day's budget (1,440 minutes) that holds the refused file's reading, or the good job,
    # not both.
    per_minute = (cost + wanted // 2) // 1440
    assert cost <= per_minute * 1440 < cost + wanted
    with gateway(world) as client:
        heidi = sdk(client, make_key(client, "ft-heidi", tokens_per_minute=per_minute))
        bad = heidi.files.create(file=("bad.jsonl", content), purpose="fine-tune")
        good = heidi.files.create(file=("good.jsonl", good_file), purpose="fine-tune")
        one_epoch: Any = {"n_epochs": 1}
        with pytest.raises(openai.BadRequestError):
            heidi.fine_tuning.jobs.create(
                model="tiny", training_file=bad.id, hyperparameters=one_epoch
            )
        with pytest.raises(openai.RateLimitError) as refused:
            heidi.fine_tuning.jobs.create(
                model="tiny", training_file=good.id, hyperparameters=one_epoch
            )
        error = refusal(refused.value)
        assert error["code"] == "training_tokens_limit_exceeded"
        assert f"used {cost}," in error["message"]


def test_a_line_longer_than_the_context_is_refused_naming_it(world: World) -> None:
    too_long = example("word " * 1200)  # about 1,270 tokens: the tiny model's context is 1,024
    content = jsonl([example("fine"), too_long, example("word " * 400), too_long])
    with gateway(world) as client:
        ivan = sdk(client, make_key(client, "ft-ivan"))
        upload = ivan.files.create(file=("long.jsonl", content), purpose="fine-tune")
        with pytest.raises(openai.BadRequestError) as refused:
            ivan.fine_tuning.jobs.create(model="tiny", training_file=upload.id)
        error = refusal(refused.value)
        assert (error["code"], error["param"]) == ("invalid_training_file", "training_file")
        message = error["message"]
        assert "2 of the file's 4 lines" in message
        for line in (2, 4):
            assert f"line {line}: " in message
        assert "longer than the model's context of 1024 tokens" in message
        assert "line 3:" not in message
        [job] = ivan.fine_tuning.jobs.list().data
        assert job.status == "failed"
        assert job.error is not None
        assert job.error.code == "invalid_training_file"


def test_a_job_its_stopped_gateway_left_validating_fails_in_time(world: World) -> None:
    with gateway(world, {"GATEWAY_FINE_TUNING_VALIDATION_TIMEOUT_S": "1"}) as client:
        made = client.post("/admin/api/keys", json={"name": "ft-judy"}, headers=ADMIN_HEADERS)
        key_id, judy = made.json()["id"], sdk(client, made.json()["key"])
        upload = judy.files.create(file=("t.jsonl", jsonl([example("q")])), purpose="fine-tune")
        # As a create writes it, the gateway that would have checked its file then gone.
        left = NewJob("ftjob-left", key_id, "ft-judy", "tiny", upload.id, None, None, 1, 1, 1, 1.0)
        store = client.app.state.assembly.fine_tuning.store
        assert client.blocking_portal.call(store.create, left) is not None
        assert judy.fine_tuning.jobs.retrieve("ftjob-left").status == "validating_files"
        wait_for(lambda: judy.fine_tuning.jobs.retrieve("ftjob-left").status == "failed")
        job = judy.fine_tuning.jobs.retrieve("ftjob-left")
        assert job.error is not None
        assert job.error.code == "validation_timeout"
        assert "GATEWAY_FINE_TUNING_VALIDATION_TIMEOUT_S" in job.error.message
