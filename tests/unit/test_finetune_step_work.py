"""Training rows beside serving steps (site_engine/finetune/step_work.py, issue 70) on a small
random Llama: a cancel mid-piece drops the job's unit and trainer at the next step; through
EngineService the reserve lent from the KV cache comes back once the job ends; and a job trained
in rows, a piece a step, follows a plain peft loop over the same batches (the loss curve)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from peft import get_peft_model

from fedllm_contract.fine_tuning import FineTuneHyperparameters, FineTuneSpec, FineTuneState
from site_engine.__main__ import piece_bound_ms, training_work
from site_engine.engine.core.api import EngineStats
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.engine_service import EngineService, OnDemandReserve
from site_engine.finetune.data import Example, encode_file
from site_engine.finetune.jobs import FineTuneJobs, FineTuneSettings
from site_engine.finetune.step_rows import StepRows
from site_engine.finetune.step_work import NextStep, StepRowsWork
from site_engine.finetune.trainer import (
    BASE_LEARNING_RATE,
    _alias,
    batch_of,
    lora_config,
    pad_batch,
)
from site_engine.make_model import make_model_dir
from site_engine.model_loading import LoadedModel, load_model
from site_engine.settings import SettingsError as SiteSettingsError
from site_engine.settings import SiteSettings

HP = FineTuneHyperparameters(n_epochs=1, batch_size=2, learning_rate_multiplier=1.0)
DATA = b"".join(
    b'{"messages": [{"role": "user", "content": "say %d"}, '
    b'{"role": "assistant", "content": "lorem ipsum dolor %d sit amet"}]}\n' % (i, i)
    for i in range(8)
)
BOUND_MS = 5.0
CACHE = 8 << 20
RESERVE = 2 << 20


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, gpt2_tokenizer_dir: Path) -> LoadedModel:
    out = tmp_path_factory.mktemp("models") / "llama"
    return load_model(make_model_dir(out, "llama", gpt2_tokenizer_dir, layers=4))


def busy(running: int = 2, waiting: int = 0) -> EngineStats:
    return EngineStats(num_waiting=waiting, num_running=running, queued_prompt_tokens=0,
                       running_tokens=0, predicted_remaining_tokens=0, kv_blocks_used=0,
                       kv_blocks_total=1, iterations=0)  # fmt: skip


def work_in(directory: Path, model: LoadedModel, stats: list[EngineStats]) -> StepRowsWork:
    settings = FineTuneSettings(directory, 1 << 30, max_step_ms=BOUND_MS)
    jobs = FineTuneJobs(settings, model.model, model.tokenizer, "m")
    next_step = NextStep(token_budget=256, max_num_seqs=8, block_size=16)
    return StepRowsWork(jobs, StepRows(BOUND_MS, min_rows=4), next_step, lambda: stats[-1])


def test_a_request_waiting_for_room_skips_the_rows_and_a_cancel_mid_piece_drops_the_job(
    model: LoadedModel, tmp_path: Path
) -> None:
    stats = [busy()]
    work = work_in(tmp_path, model, stats)
    jobs = work.jobs
    jobs.start(FineTuneSpec("j", "m", DATA, None, HP, 7))
    jobs.settled("j", timeout_s=60)
    work.run_unit(alone=True)  # the trainer's build
    assert jobs.progress("j").state is FineTuneState.RUNNING
    work.run_unit(alone=False)
    assert jobs.unit_budget() is not None  # a unit under way, cut into pieces (4 layers)
    pieces = jobs.pieces_run
    stats.append(busy(waiting=1))  # the next step admits it: it waits for this piece only
    assert work.run_unit(alone=False) > 0.0
    assert jobs.pieces_run == pieces + 1
    stats.append(busy(running=8, waiting=1))  # no sequence free: it waits for room
    assert work.run_unit(alone=False) == 0.0  # no rows this step
    assert jobs.pieces_run == pieces + 1
    jobs.cancel("j")
    stats.append(busy())
    work.run_unit(alone=False)
    assert jobs.progress("j").state is FineTuneState.CANCELLED
    assert jobs.unit_budget() is None
    assert not jobs.has_work()  # trainer and examples let go
    assert work.rows.steps_with_rows >= 1


def _peft_losses(model: LoadedModel, train: list[Example], steps: int) -> list[float]:
    """A plain peft loop over the trainer's batches: mean token loss per step, AdamW, the same
    linear decay."""
    torch.manual_seed(7)
    peft = get_peft_model(_alias(model.model), lora_config(HP))
    params = [p for p in peft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=BASE_LEARNING_RATE)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / steps))
    losses = []
    for step in range(steps):
        batch = [train[i] for i in batch_of(len(train), HP.batch_size, 7, step)]
        ids, mask, labels = pad_batch(batch, model.device)
        loss = peft(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def test_rows_train_as_a_peft_loop_does(model: LoadedModel, tmp_path: Path) -> None:
    stats = [busy()]
    work = work_in(tmp_path, model, stats)
    jobs = work.jobs
    jobs.start(FineTuneSpec("j", "m", DATA, None, HP, 7))
    jobs.settled("j", timeout_s=60)
    train = encode_file(model.tokenizer, DATA, jobs.settings.max_tokens)
    while not jobs.progress("j").state.is_final:
        work.run_unit(alone=False)
    progress = jobs.progress("j")
    assert progress.state is FineTuneState.SUCCEEDED, progress.error
    assert work.rows.steps_with_rows > progress.total_steps  # in pieces, over many steps
    ours = [loss for _, loss in progress.losses]
    peft = _peft_losses(model, train, progress.total_steps)
    assert len(ours) == len(peft) == 4
    # peft's mean over the batch's labelled tokens is the trainer's (one sequence a row here
    # or several: the same sum over the same count), so the curves agree to float error.
    assert ours == pytest.approx(peft, rel=1e-3, abs=1e-4)


def test_a_site_refuses_an_unknown_mode_and_a_bound_of_zero(tmp_path: Path) -> None:
    with pytest.raises(SiteSettingsError, match="SITE_FINETUNE_MODE must be one of"):
        SiteSettings.load({"SITE_FINETUNE_MODE": "between"}, model_dir=tmp_path)
    with pytest.raises(SiteSettingsError, match="SITE_FINETUNE_MAX_TRAINING_DELAY_MS"):
        SiteSettings.load({"SITE_FINETUNE_MAX_TRAINING_DELAY_MS": "0"}, model_dir=tmp_path)


def test_the_reserve_goes_back_to_the_kv_cache_after_the_job(
    model: LoadedModel, tmp_path: Path
) -> None:
    config = EngineConfig(max_num_seqs=2, kv_cache_bytes=CACHE, finetune_reserve_bytes=RESERVE,
                          finetune_reserve_on_demand=True)  # fmt: skip
    engine = PagedEngine(model, config)
    full = engine.runner.kv_cache.num_bytes
    # Built as a site with SITE_FINETUNE_MODE=rows builds it.
    site = SiteSettings.load({}, model_dir=tmp_path, lora_dir=tmp_path, finetune_mode="rows",
                             finetune_max_training_delay_ms=2 * BOUND_MS,
                             finetune_reserve_bytes=RESERVE)  # fmt: skip
    assert piece_bound_ms(site) == BOUND_MS
    settings = FineTuneSettings(tmp_path, 1 << 30, max_step_ms=piece_bound_ms(site))
    jobs = FineTuneJobs(settings, model.model, model.tokenizer, "m")
    work, gate = training_work(site, jobs, engine)
    assert isinstance(work, StepRowsWork)
    assert work.rows.max_training_delay_ms == 2 * BOUND_MS
    lent: list[int] = []

    def note(seconds: float, running: bool) -> None:
        lent.append(engine.runner.kv_cache.num_bytes)

    reserve = OnDemandReserve(engine, RESERVE)
    service = EngineService(engine, model.tokenizer, idle_work=(work, gate),
                            reserve=reserve, on_idle_unit=note)  # fmt: skip
    service.start()
    try:
        jobs.start(FineTuneSpec("j", "m", DATA, None, HP, 7))
        deadline = time.monotonic() + 120
        while not jobs.progress("j").state.is_final:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        while engine.runner.kv_cache.num_bytes != full and time.monotonic() < deadline + 10:
            time.sleep(0.02)
        back = engine.runner.kv_cache.num_bytes
    finally:
        service.stop()
        engine.close()
    assert jobs.progress("j").state is FineTuneState.SUCCEEDED, jobs.progress("j").error
    assert lent
    assert full - max(lent) >= RESERVE  # every piece ran on the smaller cache
    assert back == full
