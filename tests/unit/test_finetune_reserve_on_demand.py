"""The fine-tuning reserve taken from the KV cache only while a job trains (issue 60, "memory
that follows the job"): the engine runs at its full cache, a job's units run only once the
reserve's top blocks are lent to it (the cache really shrinks), and when no job is left the
cache grows back to its full size."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fedllm_contract.fine_tuning import FineTuneHyperparameters, FineTuneSpec, FineTuneState
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.engine_service import EngineService, OnDemandReserve
from site_engine.finetune.jobs import FineTuneJobs, FineTuneSettings
from site_engine.idle_work import IdleGate
from site_engine.make_model import make_model_dir
from site_engine.model_loading import LoadedModel, load_model

HP = FineTuneHyperparameters(n_epochs=1, batch_size=2, learning_rate_multiplier=1.0)
DATA = b"".join(
    b'{"messages": [{"role": "user", "content": "say %d"}, '
    b'{"role": "assistant", "content": "lorem ipsum %d"}]}\n' % (i, i)
    for i in range(4)
)
CACHE = 8 << 20
RESERVE = 2 << 20


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, gpt2_tokenizer_dir: Path) -> LoadedModel:
    out = tmp_path_factory.mktemp("models") / "llama"
    return load_model(make_model_dir(out, "llama", gpt2_tokenizer_dir))


class Watch:
    """The site's jobs as idle work, noting the engine's cache size at every unit."""

    def __init__(self, jobs: FineTuneJobs, engine: PagedEngine) -> None:
        self.jobs, self.engine = jobs, engine
        self.blocks: list[int] = []  # the cache's bytes at each unit

    def has_work(self) -> bool:
        return self.jobs.has_work()

    def next_unit_s(self) -> float:
        return self.jobs.next_unit_s()

    def run_unit(self, alone: bool) -> float:
        self.blocks.append(self.engine.runner.kv_cache.num_bytes)
        return self.jobs.run_unit(alone)


def wait_for(condition: object, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_reserve_is_the_cache_s_except_while_a_job_trains(
    model: LoadedModel, tmp_path: Path
) -> None:
    config = EngineConfig(max_num_seqs=2, kv_cache_bytes=CACHE, finetune_reserve_bytes=RESERVE,
                          finetune_reserve_on_demand=True)  # fmt: skip
    engine = PagedEngine(model, config)
    full = engine.limits.kv_blocks_total
    full_bytes = engine.runner.kv_cache.num_bytes
    jobs = FineTuneJobs(FineTuneSettings(tmp_path, 1 << 30), model.model, model.tokenizer, "m")
    watch = Watch(jobs, engine)
    service = EngineService(engine, model.tokenizer, idle_work=(watch, IdleGate(1000.0)),
                            reserve=OnDemandReserve(engine, RESERVE))  # fmt: skip
    service.start()
    try:
        time.sleep(0.2)
        assert engine.limits.kv_blocks_total == full  # no job: the whole cache serves
        jobs.start(FineTuneSpec("j", "m", DATA, None, HP, 7))
        wait_for(lambda: jobs.progress("j").state.is_final)
        assert jobs.progress("j").state is FineTuneState.SUCCEEDED, jobs.progress("j").error
        wait_for(lambda: engine.limits.kv_blocks_total == full, 10.0)
        back_bytes = engine.runner.kv_cache.num_bytes
    finally:
        service.stop()
        engine.close()
    # Every unit ran on the smaller cache (its memory given up: at least the reserve), and the
    # cache came back whole.
    assert watch.blocks
    assert len(set(watch.blocks)) == 1
    assert full_bytes - watch.blocks[0] >= RESERVE
    assert back_bytes == full_bytes


def test_a_neighbour_cannot_borrow_while_the_trainer_holds_or_drains_the_reserve(
    model: LoadedModel,
) -> None:
    config = EngineConfig(max_num_seqs=2, kv_cache_bytes=CACHE, finetune_reserve_bytes=RESERVE,
                          finetune_reserve_on_demand=True)  # fmt: skip
    engine = PagedEngine(model, config)
    try:
        assert engine.reserve_kv(RESERVE)
        assert engine.kv_room() == 0
        with pytest.raises(ValueError, match="already lends"):
            engine.lend_kv(RESERVE)
        assert engine.return_kv() == 0  # a neighbour's return does not take the trainer's
        assert engine.release_kv_reserve() >= RESERVE
        assert engine.kv_room() > 0
    finally:
        engine.close()
