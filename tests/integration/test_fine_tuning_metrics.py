"""A job's metrics events as the gateway records them from a real site trainer (the tiny random
Llama on the CPU) into its database (SQLite), polled after every piece the site runs, as the
runner polls a busy site: the closest a poll can come to a unit's end.

Issue 75: with a validation file, no metrics event carried `valid_loss`. The site published a
step's training loss at the end of its optimizer step and computed that epoch's validation loss
in the units after it; the gateway writes each step's event once, so the event was written
before its validation loss existed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fedllm_contract.fine_tuning import FineTuneHyperparameters, FineTuneSpec
from gateway.db.session import create_engine, create_sessionmaker
from gateway.stores.file_store import FileStore, NewFile
from gateway.stores.fine_tuning_store import FineTuningStore, NewJob
from site_engine.finetune.jobs import FineTuneJobs, FineTuneSettings
from site_engine.model_loading import load_model
from tests.support.migrated import run_migrated

LINE = (
    b'{"messages": [{"role": "user", "content": "2+2?"}, '
    b'{"role": "assistant", "content": "ANSWER: 4"}]}'
)
TRAINING = b"\n".join([LINE] * 4)
VALIDATION = b"\n".join([LINE] * 2)


def _file(file_id: str) -> NewFile:
    return NewFile(file_id, None, "fine-tune", f"{file_id}.jsonl", expires_at=None)


async def _recorded(url: str, jobs: FineTuneJobs, epochs: int) -> list[dict[str, Any]]:
    """Trains a job of two steps an epoch on the site, recording its progress after every
    piece; the data of its metrics events, by step."""
    engine = create_engine(url)
    try:
        sessions = create_sessionmaker(engine)
        files, store = FileStore(sessions), FineTuningStore(sessions)
        await files.create(_file("file-train"), TRAINING, quota=None)
        await files.create(_file("file-valid"), VALIDATION, quota=None)
        new = NewJob("ftjob-v", None, None, "tiny", "file-train", "file-valid", None, 5,
                     epochs, 2, 1.0)  # fmt: skip
        assert await store.create(new) is not None
        assert await store.validated(new.id, 2, 4) is not None
        assert await store.assign(new.id, "site-1")
        hp = FineTuneHyperparameters(n_epochs=epochs, batch_size=2, learning_rate_multiplier=1.0)
        jobs.start(FineTuneSpec(new.id, "tiny", TRAINING, VALIDATION, hp, 5))
        jobs.settled(new.id, timeout_s=60)
        for _ in range(2000):
            progress = jobs.progress(new.id)
            await store.record(progress)
            if progress.state.is_final:
                break
            jobs.run_unit()
        assert progress.state.value == "succeeded", progress.error
        assert [s for s, _ in progress.validation_losses] == [2 * e for e in range(1, epochs + 1)]
        events = (await store.events(new.id, None, 100)).data
        return sorted(
            (e.data for e in events if e.type == "metrics" and e.data is not None),
            key=lambda data: int(data["step"]),
        )
    finally:
        await engine.dispose()


@pytest.mark.parametrize("epochs", [1, 2])
def test_the_step_that_ends_an_epoch_carries_its_validation_loss(
    epochs: int, tiny_llama_dir: Path, tmp_path: Path, sqlite_url: str
) -> None:
    tiny = load_model(tiny_llama_dir)
    jobs = FineTuneJobs(
        FineTuneSettings(tmp_path / "site", 1 << 30), tiny.model, tiny.tokenizer, "tiny"
    )
    found: list[list[dict[str, Any]]] = []

    async def exercise(url: str) -> None:
        found.append(await _recorded(url, jobs, epochs))

    run_migrated(sqlite_url, exercise)
    (metrics,) = found
    assert [data["step"] for data in metrics] == list(range(1, 2 * epochs + 1))
    with_validation = [data["step"] for data in metrics if "valid_loss" in data]
    assert with_validation == [2 * e for e in range(1, epochs + 1)], metrics
    assert all(data["valid_loss"] > 0 for data in metrics if "valid_loss" in data)
