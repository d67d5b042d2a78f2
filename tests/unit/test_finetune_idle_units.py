"""Idle-sized units of fine-tuning (issue 60): with no request waiting or running, a unit takes
up to SITE_FINETUNE_IDLE_UNIT_TOKENS (a whole batch here) instead of what the time bound allows,
and trains exactly as bounded units do; a request arriving during such a unit gets its step
after the piece under way, not after the unit (judged by pieces and engine steps, not by the
clock)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from fedllm_contract.fine_tuning import FineTuneHyperparameters, FineTuneSpec, FineTuneState
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import SamplingParams
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.engine_service import EngineService
from site_engine.finetune.data import encode_file
from site_engine.finetune.jobs import FineTuneJobs, FineTuneSettings
from site_engine.idle_work import IdleGate
from site_engine.make_model import make_model_dir
from site_engine.model_loading import LoadedModel, load_model

LAYERS = 6  # a unit is 2 x 6 + 1 pieces of one boundary each: long next to one piece
# Far below any unit's time: bounded units are one example each and pieces one boundary each,
# whatever the machine's speed.
TINY_BOUND_MS = 0.001
HP = FineTuneHyperparameters(n_epochs=1, batch_size=4, learning_rate_multiplier=1.0)


def chat(i: int) -> bytes:
    words = " ".join(["lorem ipsum"] * (3 + 2 * i))
    return (
        f'{{"messages": [{{"role": "user", "content": "say {i}"}}, '
        f'{{"role": "assistant", "content": "{words}"}}]}}'
    ).encode()


DATA = b"\n".join(chat(i) for i in range(8)) + b"\n"


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory, gpt2_tokenizer_dir: Path) -> LoadedModel:
    out = tmp_path_factory.mktemp("models") / "deep-llama"
    return load_model(make_model_dir(out, "llama", gpt2_tokenizer_dir, layers=LAYERS))


def lengths(model: LoadedModel) -> list[int]:
    """The job's examples' tokens, shortest first."""
    return sorted(len(e.input_ids) for e in encode_file(model.tokenizer, DATA, 1024))


def jobs_in(directory: Path, model: LoadedModel, idle_unit_tokens: int = 4096) -> FineTuneJobs:
    settings = FineTuneSettings(
        directory, 1 << 30, max_step_ms=TINY_BOUND_MS, idle_unit_tokens=idle_unit_tokens
    )
    return FineTuneJobs(settings, model.model, model.tokenizer, "deep")


def run_job(jobs: FineTuneJobs, alone: bool) -> None:
    jobs.start(FineTuneSpec("j", "deep", DATA, None, HP, 7))
    jobs.settled("j", timeout_s=60)
    while jobs.progress("j").state is not FineTuneState.SUCCEEDED:
        jobs.run_unit(alone=alone)
        assert jobs.progress("j").state is not FineTuneState.FAILED, jobs.progress("j").error


def test_alone_a_unit_is_idle_sized_and_trains_as_bounded_units_do(
    deep: LoadedModel, tmp_path: Path
) -> None:
    tokens = lengths(deep)
    bounded, idle = jobs_in(tmp_path / "b", deep), jobs_in(tmp_path / "i", deep)
    run_job(bounded, alone=False)
    run_job(idle, alone=True)
    # Bounded by a bound no unit meets: one example a unit, the longest at most.
    assert bounded.largest_unit_run == tokens[-1]
    # Alone: a whole batch of 4 a unit (4 x its longest), more than any one example.
    assert idle.largest_unit_run >= 4 * tokens[3] > tokens[-1]
    assert idle.pieces_run < bounded.pieces_run  # fewer, larger units: fewer pieces
    a, b = bounded.progress("j"), idle.progress("j")
    assert (a.step, a.trained_tokens) == (b.step, b.trained_tokens) == (2, sum(tokens))
    # The same accumulated gradient: the same losses (float sums in another order).
    assert [s for s, _ in a.losses] == [s for s, _ in b.losses]
    assert [loss for _, loss in b.losses] == pytest.approx([loss for _, loss in a.losses], 1e-4)


def test_the_idle_unit_size_caps_an_idle_unit(deep: LoadedModel, tmp_path: Path) -> None:
    jobs = jobs_in(tmp_path, deep, idle_unit_tokens=1)  # one example a unit, alone or not
    run_job(jobs, alone=True)
    assert jobs.largest_unit_run == lengths(deep)[-1]
    with pytest.raises(ValueError, match="idle_unit_tokens must be >= 1"):
        FineTuneSettings(tmp_path, 1 << 30, idle_unit_tokens=0)


class Recorder:
    """The site's jobs as the engine's idle work, recording each call: (pieces run so far, the
    engine's step count when it ran, whether the engine was empty). After the second piece it
    holds the engine's thread until the test has sent a request: the request arrives during
    that piece, whatever the machine's load."""

    def __init__(self, jobs: FineTuneJobs, engine: PagedEngine) -> None:
        self.jobs, self.engine = jobs, engine
        self.calls: list[tuple[int, int, bool]] = []
        self.mid_unit, self.sent = threading.Event(), threading.Event()
        self.budget_mid_unit: int | None = None
        self.lock = threading.Lock()

    def has_work(self) -> bool:
        return self.jobs.has_work()

    def next_unit_s(self) -> float:
        return self.jobs.next_unit_s()

    def run_unit(self, alone: bool) -> float:
        steps = self.engine.stats().iterations
        took = self.jobs.run_unit(alone)
        with self.lock:
            self.calls.append((self.jobs.pieces_run, steps, alone))
        if self.jobs.pieces_run == 2 and not self.mid_unit.is_set():
            self.budget_mid_unit = self.jobs.unit_budget()
            self.mid_unit.set()
            self.sent.wait(timeout=60)
        return took

    def snapshot(self) -> list[tuple[int, int, bool]]:
        with self.lock:
            return list(self.calls)


def test_a_request_arriving_during_an_idle_unit_waits_a_piece_not_the_unit(
    deep: LoadedModel, tmp_path: Path
) -> None:
    jobs = jobs_in(tmp_path, deep)
    jobs.start(FineTuneSpec("j", "deep", DATA, None, HP, 7))
    jobs.settled("j", timeout_s=60)
    engine = PagedEngine(deep, EngineConfig(max_num_seqs=2, kv_cache_bytes=8 << 20))
    work = Recorder(jobs, engine)
    service = EngineService(engine, deep.tokenizer, idle_work=(work, IdleGate(TINY_BOUND_MS)))
    tokens = 0

    async def ask() -> None:
        nonlocal tokens
        sampling = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        stream = service.generate(EngineRequest("r", (1, 2, 3, 4), sampling))
        accepted = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)  # the stream's first step queues the request (no await before)
        work.sent.set()
        await accepted
        async for event in stream:
            tokens = event.completion_tokens

    service.start()
    try:
        assert work.mid_unit.wait(timeout=60), "no unit ran"
        sent_after = len(work.snapshot())  # the engine's thread is held: nothing runs meanwhile
        asyncio.run(ask())
    finally:
        work.sent.set()
        service.stop()
        engine.close()
        jobs.cancel("j")
    assert tokens == 4
    calls = work.snapshot()
    assert calls[sent_after - 1][2]  # the engine was empty: the unit under way is idle-sized
    assert work.budget_mid_unit == 4096  # the idle size, not the bound's one token
    base_steps, pieces_then = calls[sent_after - 1][1], calls[sent_after - 1][0]
    # Pieces run after the request came and before the engine's step with it: none (the loop
    # takes the request before its next piece), one allowed. The idle unit had 2 x LAYERS - 1
    # pieces left.
    before_its_step = max(c[0] for c in calls if c[1] == base_steps) - pieces_then
    assert before_its_step <= 1, (sent_after, calls[: sent_after + 4])
