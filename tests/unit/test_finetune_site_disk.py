"""What a site's fine-tuning jobs leave in SITE_FINETUNE_DIR (the tiny random Llama on the CPU,
real training), issue 75 (LOW-1: the directory kept every cancelled job's files, 4 KB -> 182 MB
over one round, and nothing bounded it):

- an ended job keeps only what says it ended (its spec's description and its result) and, once
  it succeeded, its adapter: its training files and checkpoints go, on cancel, failure and
  success alike, and a site started again still knows each job as it ended;
- the directory is bounded (SITE_FINETUNE_DIR_MAX_BYTES): a start whose files would take it past
  is refused, naming the bound, and registers and writes nothing; an ended job's room is free
  again;
- the bound is validated loudly.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from fedllm_contract.env_settings import SettingsError
from fedllm_contract.fine_tuning import FineTuneHyperparameters, FineTuneSpec, FineTuneState
from site_engine.finetune import FineTuneRefused
from site_engine.finetune.checkpoint import DirectoryRoom
from site_engine.finetune.jobs import FineTuneJobs, FineTuneSettings
from site_engine.model_loading import LoadedModel, load_model
from site_engine.settings import SiteSettings

LINE = (
    b'{"messages": [{"role": "user", "content": "2+2?"}, '
    b'{"role": "assistant", "content": "ANSWER: 4"}]}'
)
BIG = b"\n".join([LINE] * 20_000)  # seconds to read
ENDED = {"spec.json", "result.json"}


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(tiny_llama_dir)


def jobs_in(directory: Path, tiny: LoadedModel, **settings: int) -> FineTuneJobs:
    fine_tune = FineTuneSettings(directory, 1 << 30, max_rank=16, checkpoint_every=1, **settings)
    return FineTuneJobs(fine_tune, tiny.model, tiny.tokenizer, "tiny")


def spec(job_id: str, data: bytes, steps: int = 1, validation: bytes | None = None) -> FineTuneSpec:
    hp = FineTuneHyperparameters(n_epochs=steps, batch_size=1, learning_rate_multiplier=1.0)
    return FineTuneSpec(job_id, "tiny", data, validation, hp, 3)


def names(job_dir: Path) -> set[str]:
    return {path.name for path in job_dir.iterdir()}


def wait_for_file(path: Path) -> None:
    event = threading.Event()
    while not path.is_file():
        event.wait(0.01)


def train_until_final(jobs: FineTuneJobs, job_id: str) -> None:
    for _ in range(2000):
        if jobs.progress(job_id).state.is_final:
            jobs.run_unit()  # the engine thread lets an ended job's trainer go
            return
        jobs.run_unit(alone=True)
    raise AssertionError(f"{job_id} is still {jobs.progress(job_id).state.value}")


def test_an_ended_job_leaves_only_what_says_it_ended(tmp_path: Path, tiny: LoadedModel) -> None:
    jobs = jobs_in(tmp_path, tiny)
    # Cancelled while its file is read.
    jobs.start(spec("read", BIG))
    wait_for_file(tmp_path / "read" / "spec.json")
    jobs.cancel("read")
    jobs.settled("read", timeout_s=120)
    assert names(tmp_path / "read") == ENDED
    # Failed: its file cannot train.
    jobs.start(spec("bad", b'{"messages": 3}'))
    assert jobs.settled("bad", timeout_s=60).state is FineTuneState.FAILED
    assert names(tmp_path / "bad") == ENDED
    # Cancelled while it trains, a checkpoint written.
    jobs.start(spec("mid", LINE, steps=50, validation=LINE))
    jobs.settled("mid", timeout_s=60)
    while not list((tmp_path / "mid").glob("checkpoint-*")):
        jobs.run_unit(alone=True)
    jobs.cancel("mid")
    jobs.run_unit()
    assert names(tmp_path / "mid") == ENDED
    # Succeeded: its adapter stays (the site serves it from there), its checkpoints go.
    jobs.start(spec("done", LINE, steps=3, validation=LINE))
    jobs.settled("done", timeout_s=60)
    train_until_final(jobs, "done")
    done = jobs.progress("done")
    assert done.state is FineTuneState.SUCCEEDED, done.error
    assert names(tmp_path / "done") == ENDED | {"adapter"}
    assert done.adapter_path == str(tmp_path / "done" / "adapter")
    # A site started again knows every job as it ended.
    again = jobs_in(tmp_path, tiny)
    for job_id in ("read", "bad", "mid", "done"):
        assert again.progress(job_id) == jobs.progress(job_id)
    assert again.live() == []


def test_a_job_that_would_take_the_directory_past_its_bound_is_refused(
    tmp_path: Path, tiny: LoadedModel
) -> None:
    data = b"\n".join([LINE] * 100)
    jobs = jobs_in(tmp_path, tiny, max_dir_bytes=2 * len(data) + 4096)
    jobs.start(spec("first", data))
    jobs.start(spec("second", data))
    with pytest.raises(FineTuneRefused) as full:
        jobs.start(spec("third", data))
    assert full.value.code == FineTuneRefused.PRECONDITION
    assert "SITE_FINETUNE_DIR_MAX_BYTES" in str(full.value)
    assert not (tmp_path / "third").exists()
    assert jobs.live() == ["first", "second"]
    # An ended job's files are gone: its room is free again.
    jobs.cancel("first")
    jobs.settled("first", timeout_s=60)
    assert jobs.start(spec("third", data)).state is FineTuneState.QUEUED
    assert jobs.live() == ["second", "third"]


@pytest.mark.parametrize("bound", ["0", "-1", str(32 << 20), "lots"])
def test_the_bound_is_validated_loudly(bound: str) -> None:
    """At least one job's largest files (64 MiB): below, no job of the largest the gateway
    sends could ever start."""
    with pytest.raises(SettingsError, match="SITE_FINETUNE_DIR_MAX_BYTES"):
        SiteSettings.load({"SITE_MODEL_DIR": "m", "SITE_FINETUNE_DIR_MAX_BYTES": bound})
    loaded = SiteSettings.load({"SITE_MODEL_DIR": "m", "SITE_FINETUNE_DIR_MAX_BYTES": "67108864"})
    assert loaded.finetune_dir_max_bytes == 64 << 20
    with pytest.raises(ValueError, match="max_dir_bytes"):
        FineTuneSettings(Path("x"), 1, max_dir_bytes=0)


def test_a_job_being_written_counts_at_its_claim_until_written(tmp_path: Path) -> None:
    """The CI failure of 2026-11-28: a claim counted the directory, then the claims; a job's
    writer finishing in between was counted at its half-written size only, and a third job fit."""
    room = DirectoryRoom(tmp_path, max_bytes=2_500)
    room.claim("first", 1_000)
    (tmp_path / "first").mkdir()
    (tmp_path / "first" / "training.jsonl").write_bytes(b"x" * 10)  # its writer is under way
    room.claim("second", 1_000)
    with pytest.raises(FineTuneRefused):
        room.claim("third", 1_000)  # first counts 1,000, not 10
    (tmp_path / "first" / "training.jsonl").write_bytes(b"x" * 1_000)
    with pytest.raises(FineTuneRefused):
        room.claim("third", 1_000)  # written, not yet told: counted once
    room.written("first")
    room.written("second")  # never written (its job ended): its claim is let go
    room.claim("third", 1_000)
