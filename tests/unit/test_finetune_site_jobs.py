"""A site's fine-tuning jobs as issue 67 wants them (the tiny random Llama on the CPU, real
training): a start is answered at once and its file read in the background; a cancel during that
read stops it and leaves nothing to train; a job the site knows is never started twice, not even
by two starts at once; a start that reaches the site after its deadline registers nothing; and
tenants take turns, so one tenant's 4-step job does not wait behind another's long one (the
reserve permitting)."""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from fedllm_contract.fine_tuning import FineTuneHyperparameters, FineTuneSpec, FineTuneState
from fedllm_contract.proto import site_pb2, site_pb2_grpc
from fedllm_contract.proto.fine_tuning import spec_to_proto
from fedllm_contract.tokenizer import tokenizer_fingerprint
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.engine_service import EngineService
from site_engine.finetune import FineTuneRefused
from site_engine.finetune.jobs import FineTuneJobs, FineTuneSettings
from site_engine.finetune.memory import TrainingShape, lora_bytes, training_bytes
from site_engine.finetune.turns import TenantTurns
from site_engine.grpc_server import SiteIdentity, SiteServicer, start_server
from site_engine.model_loading import LoadedModel, load_model

LINE = (
    b'{"messages": [{"role": "user", "content": "2+2?"}, '
    b'{"role": "assistant", "content": "ANSWER: 4"}]}'
)
# Thousands of examples: reading them (rendering and tokenizing each) takes seconds.
BIG = b"\n".join([LINE] * 20_000)
# 300,000 examples (30 MB): reading them takes tens of seconds, far longer than a turn.
HUGE = b"\n".join([LINE] * 300_000)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(tiny_llama_dir)


def jobs_in(directory: Path, tiny: LoadedModel, reserve: int = 1 << 30) -> FineTuneJobs:
    return FineTuneJobs(FineTuneSettings(directory, reserve, max_rank=16), tiny.model,
                        tiny.tokenizer, "tiny")  # fmt: skip


def spec(job_id: str, data: bytes, steps: int = 1, tenant: str | None = None) -> FineTuneSpec:
    """A job of `steps` optimizer steps an epoch's example, one example a batch; `tenant`'s."""
    hp = FineTuneHyperparameters(n_epochs=steps, batch_size=1, learning_rate_multiplier=1.0)
    job = FineTuneSpec(job_id, "tiny", data, None, hp, 3)
    return job if tenant is None else replace(job, tenant=tenant)


def wait_for_file(path: Path) -> None:
    event = threading.Event()
    while not path.is_file():
        event.wait(0.01)


def test_a_cancel_while_the_file_is_read_stops_the_read_and_nothing_trains(
    tmp_path: Path, tiny: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    jobs = jobs_in(tmp_path, tiny)
    caplog.set_level(logging.INFO, logger="site_engine.finetune")
    started = jobs.start(spec("orphan", BIG))
    # Answered before its file is read: its steps are not known yet.
    assert (started.state, started.total_steps) == (FineTuneState.QUEUED, 0)
    assert jobs.live() == ["orphan"]
    wait_for_file(tmp_path / "orphan" / "spec.json")  # saved: the reading has begun
    assert jobs.cancel("orphan").state is FineTuneState.CANCELLED
    settled = jobs.settled("orphan", timeout_s=120)
    assert (settled.state, settled.total_steps) == (FineTuneState.CANCELLED, 0)
    assert "the reading of its files stopped" in caplog.text  # stopped, not read to its end
    assert "orphan queued" not in caplog.text
    assert jobs.live() == []
    assert not jobs.has_work()
    jobs.run_unit()  # nothing to train
    after = jobs.progress("orphan")
    assert (after.state, after.step, after.trained_tokens) == (FineTuneState.CANCELLED, 0, 0)
    # The site refuses a second start of the job, and a site started again does not revive it.
    with pytest.raises(FineTuneRefused) as again:
        jobs.start(spec("orphan", LINE))
    assert again.value.code == FineTuneRefused.EXISTS
    restarted = jobs_in(tmp_path, tiny)
    assert restarted.progress("orphan").state is FineTuneState.CANCELLED
    assert restarted.live() == []
    assert not restarted.has_work()


def test_two_starts_of_one_job_at_once_start_it_once(tmp_path: Path, tiny: LoadedModel) -> None:
    jobs = jobs_in(tmp_path, tiny)
    barrier = threading.Barrier(4)
    outcomes: list[str] = []

    def start() -> None:
        barrier.wait()
        try:
            jobs.start(spec("twice", BIG))
            outcomes.append("started")
        except FineTuneRefused as exc:
            outcomes.append(exc.code)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["exists", "exists", "exists", "started"]
    jobs.cancel("twice")


def test_a_start_past_its_deadline_registers_nothing(tmp_path: Path, tiny: LoadedModel) -> None:
    jobs = jobs_in(tmp_path, tiny)
    identity = SiteIdentity("s1", "tiny", tiny.vocab_size, tokenizer_fingerprint(tiny.tokenizer),
                            "cpu", "float32", "test")  # fmt: skip
    # Tens of MB: in transit far longer than the deadline the gateway gave the call.
    late = spec_to_proto(spec("late", b"\n".join([LINE] * 300_000)))

    async def run() -> None:
        engine = PagedEngine(tiny, EngineConfig(max_num_seqs=2, kv_cache_bytes=8 << 20))
        service = EngineService(engine, tiny.tokenizer)
        servicer = SiteServicer(service, identity, jobs)
        server, _, port = await start_server(servicer, "127.0.0.1", 0)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            stub = site_pb2_grpc.SiteEngineStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as expired:
                await stub.StartFineTune(late, timeout=0.001)
            assert expired.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.sleep(1.0)  # the message is in, whatever the server made of it
            listed = await stub.ListFineTunes(site_pb2.ListFineTunesRequest(), timeout=10)
            assert list(listed.job_ids) == []
        finally:
            await channel.close()
            await server.stop(None)
            engine.close()

    asyncio.run(run())
    with pytest.raises(FineTuneRefused):
        jobs.progress("late")


def test_another_tenants_small_job_is_read_while_a_large_one_is(
    tmp_path: Path, tiny: LoadedModel
) -> None:
    """Issue 75 (MED-2): the site read every tenant's job files on one intake thread, first come
    first served, and another key's 8-line job sat queued 150 s behind one 60 MiB job. Tenants'
    readings now take turns, round robin, a slice at a time."""
    jobs = jobs_in(tmp_path, tiny)
    jobs.start(spec("large", HUGE, tenant="a"))
    wait_for_file(tmp_path / "large" / "spec.json")
    jobs.start(spec("small", LINE, tenant="b"))
    small = jobs.settled("small", timeout_s=120)
    assert (small.state, small.total_steps) == (FineTuneState.QUEUED, 1)
    large = jobs.progress("large")
    assert (large.state, large.total_steps) == (FineTuneState.QUEUED, 0)  # still being read
    jobs.cancel("large")
    assert jobs.settled("large", timeout_s=120).total_steps == 0
    assert jobs.live() == ["small"]


def test_tenants_take_turns_round_robin() -> None:
    turns = TenantTurns()
    jobs = [("a", 1), ("a", 2), ("b", 3), ("c", 4)]  # (tenant, job), oldest first
    order = turns.order(jobs, lambda job: job[0])
    assert order == [("a", 1), ("b", 3), ("c", 4)]  # each tenant's oldest
    turns.served("a")
    assert turns.order(jobs, lambda job: job[0]) == [("b", 3), ("c", 4), ("a", 1)]
    turns.served("c")
    assert turns.order(jobs, lambda job: job[0]) == [("a", 1), ("b", 3), ("c", 4)]
    turns.served("gone")  # a tenant whose jobs ended: from the first again
    assert turns.order(jobs, lambda job: job[0])[0] == ("a", 1)


def _train_until(jobs: FineTuneJobs, job_id: str, most_units: int) -> int:
    """Runs units until `job_id` ends; the units it took."""
    for unit in range(most_units):
        if jobs.progress(job_id).state.is_final:
            return unit
        jobs.run_unit(alone=True)
    raise AssertionError(f"{job_id} still {jobs.progress(job_id).state.value}")


def test_a_short_job_of_another_tenant_trains_beside_a_long_one(
    tmp_path: Path, tiny: LoadedModel
) -> None:
    """Issue 67: key B's 4-step job waited behind key A's 2,500-step job."""
    jobs = jobs_in(tmp_path, tiny)
    jobs.start(spec("long", LINE, steps=2500, tenant="a"))
    jobs.settled("long", timeout_s=60)
    for _ in range(400):  # its trainer built, a few of its steps trained (a piece a call)
        if jobs.progress("long").step >= 3:
            break
        jobs.run_unit(alone=True)
    before = jobs.progress("long").step
    jobs.start(spec("short", LINE, steps=4, tenant="b"))
    jobs.settled("short", timeout_s=60)
    _train_until(jobs, "short", 400)
    short = jobs.progress("short")
    assert short.state is FineTuneState.SUCCEEDED, short.error
    long = jobs.progress("long")
    assert long.state is FineTuneState.RUNNING
    # Turn and turn about (a step a unit here): the long job trained about as many steps
    # meanwhile as the short one's 4, no more.
    assert 3 <= long.step - before <= 4 + 1
    assert jobs.cancel("long").state is FineTuneState.CANCELLED


def test_a_job_that_does_not_fit_beside_the_live_one_waits(
    tmp_path: Path, tiny: LoadedModel
) -> None:
    """Turns never take memory the reserve does not hold: with room for one job's trainer and
    unit only, the second tenant's job waits for the first to end."""
    first, second = spec("first", LINE, steps=3, tenant="a"), spec("second", LINE, tenant="b")
    probe = jobs_in(tmp_path / "probe", tiny)
    probe.start(first)
    probe.settled("first", timeout_s=60)
    _, longest = probe.unit_cap("first")
    shape = TrainingShape.of_model(tiny.model)
    hp = first.hyperparameters
    # One trainer with a unit of its longest example, not a second trainer's LoRA state too.
    reserve = training_bytes(shape, hp, longest, longest) + lora_bytes(shape, hp) // 2
    jobs = jobs_in(tmp_path / "tight", tiny, reserve=reserve)
    jobs.start(first)
    jobs.settled("first", timeout_s=60)
    jobs.run_unit(alone=True)  # the first job's trainer
    jobs.start(second)
    jobs.settled("second", timeout_s=60)
    _train_until(jobs, "first", 400)
    assert jobs.progress("first").state is FineTuneState.SUCCEEDED
    assert jobs.progress("second").step == 0  # it waited
    _train_until(jobs, "second", 400)
    assert jobs.progress("second").state is FineTuneState.SUCCEEDED
