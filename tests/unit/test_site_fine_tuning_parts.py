"""The parts of a site's fine-tuning jobs that need no real training: the data's loss mask, the
refusals (in FineTuneJobs and through gRPC to the gateway's client), the protobuf codec, and the
idle gate in a real engine loop: with requests waiting, no unit of training runs."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from fedllm_contract.fine_tuning import (
    FineTuneCheckpoint,
    FineTuneHyperparameters,
    FineTuneProgress,
    FineTuneSpec,
    FineTuneState,
)
from fedllm_contract.proto.fine_tuning import (
    progress_from_proto,
    progress_to_proto,
    spec_from_proto,
    spec_to_proto,
)
from fedllm_contract.tokenizer import tokenizer_fingerprint
from gateway.errors import GatewayError
from gateway.fine_tuning.file_check import check_training_file
from gateway.sites.grpc_client import GrpcSiteClient
from gateway.sites.interface import FineTuneCallRefused
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import SamplingParams
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.engine_service import EngineService
from site_engine.finetune import FineTuneRefused
from site_engine.finetune.data import IGNORE, TrainingDataError, encode, parse_chat_jsonl
from site_engine.finetune.jobs import FineTuneJobs, FineTuneSettings
from site_engine.finetune.memory import TrainingShape, largest_unit_tokens, training_bytes
from site_engine.grpc_server import (
    MAX_RECEIVE_MESSAGE_BYTES,
    SiteIdentity,
    SiteServicer,
    start_server,
)
from site_engine.idle_work import IdleGate
from site_engine.model_loading import LoadedModel, load_model

HP = FineTuneHyperparameters(n_epochs=1, batch_size=2, learning_rate_multiplier=1.0)
LINE = (
    b'{"messages": [{"role": "user", "content": "2+2?"}, '
    b'{"role": "assistant", "content": "ANSWER: 4"}]}'
)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(tiny_llama_dir)


def spec(job_id: str = "job-1", base: str = "tiny", data: bytes = LINE * 1) -> FineTuneSpec:
    return FineTuneSpec(job_id, base, data + b"\n" + data, None, HP, 3)


def jobs_in(directory: Path, tiny: LoadedModel, reserve: int = 1 << 30) -> FineTuneJobs:
    settings = FineTuneSettings(directory, reserve, max_rank=16)
    return FineTuneJobs(settings, tiny.model, tiny.tokenizer, "tiny")


def test_the_loss_is_on_the_assistant_turn_and_its_end_only(smollm2_dir: Path) -> None:
    tokenizer = load_model(smollm2_dir).tokenizer
    example = encode(tokenizer, parse_chat_jsonl(LINE)[0], 512)
    learned = [
        t for t, label in zip(example.input_ids, example.labels, strict=True) if label != IGNORE
    ]
    assert tokenizer.decode(learned) == "ANSWER: 4<|im_end|>"
    assert example.labels[: len(example.labels) - len(learned) - 1].count(IGNORE) > 10


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (LINE + b"\nnot json", "line 2: not JSON"),
        (b'{"messages": []}', "line 1: 'messages' must be a non-empty list"),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', "line 1: no assistant message"),
        (b'{"messages": [{"role": "robot", "content": "hi"}]}', "line 1: messages.0..role"),
        (b'{"messages": [{"role": "tool", "content": "4"}]}', "line 1: messages.0..role"),
        (b"\n\n", "line 1: an empty line"),
        (b"", "no training example"),
    ],
)
def test_a_bad_file_is_refused_naming_its_line(data: bytes, says: str) -> None:
    with pytest.raises(TrainingDataError, match=says):
        parse_chat_jsonl(data)


@pytest.mark.parametrize(
    "line",
    [
        b'{"messages": [{"role": "tool", "content": "4"}, {"role": "assistant", "content": "y"}]}',
        b'{"messages": [{"role": "assistant", "content": "a\xe2\x80\xa8b"}]}',  # raw U+2028
        b'{"messages": [{"role": "assistant", "content": "\xff"}]}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"messages": [{"role": "assistant", "content": "y"}], "tools": []}',
        b"",
    ],
)
def test_the_site_refuses_exactly_the_lines_the_gateway_refuses(line: bytes) -> None:
    """Issue 58: a `tool` message or a raw U+2028 passed the gateway's check and then failed
    the job at the site. Both now run fedllm_contract/training_data.py; this holds them to
    it."""
    data = LINE + b"\n" + line + b"\n" + LINE + b"\n"
    try:
        check_training_file(data, "training_file")
        gateway_refuses = None
    except GatewayError as exc:
        gateway_refuses = exc.message
    try:
        parse_chat_jsonl(data)
        site_refuses = None
    except TrainingDataError as exc:
        site_refuses = str(exc)
    assert site_refuses == gateway_refuses


def test_refusals_leave_nothing_behind(tmp_path: Path, tiny: LoadedModel) -> None:
    jobs = jobs_in(tmp_path, tiny)
    cases = [
        (spec(base="other"), FineTuneRefused.INVALID, "not the job's base 'other'"),
        (spec(job_id="../x"), FineTuneRefused.INVALID, "bad job id"),
    ]
    bad_targets = FineTuneHyperparameters(1, 1, 1.0, target_modules=("lm_head",))
    cases.append((FineTuneSpec("j", "tiny", LINE, None, bad_targets, 1), "invalid", "lm_head"))
    high_rank = FineTuneHyperparameters(1, 1, 1.0, lora_rank=64)
    cases.append((FineTuneSpec("j", "tiny", LINE, None, high_rank, 1), "invalid", "rank 64"))
    for bad, code, says in cases:
        with pytest.raises(FineTuneRefused, match=says) as caught:
            jobs.start(bad)
        assert caught.value.code == code
    assert list(tmp_path.iterdir()) == []
    # Files are read after the start is answered: a file that cannot train, or whose example
    # the reserve cannot hold, fails the job (and its second start is refused all the same).
    assert jobs.start(spec("bad", data=b'{"messages": 3}')).state is FineTuneState.QUEUED
    failed = jobs.settled("bad", timeout_s=60)
    assert failed.state is FineTuneState.FAILED
    assert "line 1" in (failed.error or "")
    small = jobs_in(tmp_path / "small", tiny, reserve=1000)
    small.start(spec())
    tight = small.settled("job-1", timeout_s=60)
    assert tight.state is FineTuneState.FAILED
    assert "SITE_FINETUNE_RESERVE_BYTES" in (tight.error or "")
    assert f"the {small.longest_example} tokens an example may have" in (tight.error or "")
    started = jobs.start(spec())
    assert (started.state, started.total_steps) == (FineTuneState.QUEUED, 0)
    assert jobs.settled("job-1", timeout_s=60).total_steps == 1
    for known in ("job-1", "bad"):
        with pytest.raises(FineTuneRefused) as twice:
            jobs.start(spec(known))
        assert twice.value.code == FineTuneRefused.EXISTS
    assert jobs.live() == ["job-1"]
    with pytest.raises(FineTuneRefused) as unknown:
        jobs.progress("nope")
    assert unknown.value.code == FineTuneRefused.NOT_FOUND


def test_the_longest_example_the_site_says_its_reserve_holds_is_the_longest_it_trains(
    tmp_path: Path, tiny: LoadedModel
) -> None:
    """SiteInfo's fine_tuning_max_example_tokens (issue 75): what the gateway refuses longer
    examples by when a job is made, the boundary of what the site's reserve trains."""
    shape = TrainingShape.of_model(tiny.model)
    gateways = FineTuneHyperparameters(n_epochs=3, batch_size=4, learning_rate_multiplier=2.0)
    for held in (1, 100, 333):
        reserve = training_bytes(shape, gateways, held, held)
        jobs = jobs_in(tmp_path / str(held), tiny, reserve=reserve)
        assert jobs.longest_example == held
        assert largest_unit_tokens(shape, gateways, held, reserve) >= 1
        assert largest_unit_tokens(shape, gateways, held + 1, reserve) == 0
    assert jobs_in(tmp_path / "none", tiny, reserve=1).longest_example == 0
    # Examples are cut to the context: a reserve that holds one that long says the context.
    assert jobs_in(tmp_path / "all", tiny).longest_example == 1024


def test_the_codec_round_trips() -> None:
    job = FineTuneSpec("j", "tiny", LINE, b"", HP, 2**40)
    assert spec_from_proto(spec_to_proto(job)) == job
    assert spec_from_proto(spec_to_proto(spec())).validation_jsonl is None
    progress = FineTuneProgress(
        "j", FineTuneState.SUCCEEDED, 4, 4, 99, ((1, 2.5), (4, 0.25)), ((4, 0.5),),
        (FineTuneCheckpoint(4, "/x/checkpoint-4", 0.25),), adapter_path="/x/adapter",
    )  # fmt: skip
    assert progress_from_proto(progress_to_proto(progress)) == progress


class RecordingWork:
    """Idle work that records the engine's queue each time a unit runs (the gate is real)."""

    def __init__(self, engine: PagedEngine) -> None:
        self.engine = engine
        self.waiting_at_units: list[int] = []
        self.lock = threading.Lock()

    def has_work(self) -> bool:
        return True

    def next_unit_s(self) -> float:
        return 0.002

    def run_unit(self, alone: bool) -> float:
        with self.lock:
            self.waiting_at_units.append(self.engine.stats().num_waiting)
        time.sleep(0.002)
        return 0.002


def serve_all(service: EngineService, requests: int, max_tokens: int) -> None:
    """`requests` greedy requests sent at once, each streamed to its end."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    async def one(i: int) -> None:
        async for _ in service.generate(EngineRequest(f"r{i}", (1, 2, 3, 4), sampling)):
            pass

    async def all_of_them() -> None:
        await asyncio.gather(*(one(i) for i in range(requests)))

    asyncio.run(all_of_them())


def test_no_unit_runs_while_requests_wait(tiny: LoadedModel) -> None:
    engine = PagedEngine(tiny, EngineConfig(max_num_seqs=2, kv_cache_bytes=8 << 20))
    work = RecordingWork(engine)
    service = EngineService(engine, tiny.tokenizer, idle_work=(work, IdleGate(1.0)))
    service.start()
    try:
        serve_all(service, requests=8, max_tokens=16)  # 6 of 8 wait at first
        time.sleep(0.05)
    finally:
        service.stop()
        engine.close()
    assert work.waiting_at_units, "no unit ran once the queue was empty"
    assert set(work.waiting_at_units) == {0}


def test_the_grpc_contract_through_the_gateways_client(tmp_path: Path, tiny: LoadedModel) -> None:
    identity = SiteIdentity("s1", "tiny", tiny.vocab_size, tokenizer_fingerprint(tiny.tokenizer),
                            "cpu", "float32", "test")  # fmt: skip

    async def run(jobs: FineTuneJobs | None) -> None:
        engine = PagedEngine(tiny, EngineConfig(max_num_seqs=2, kv_cache_bytes=8 << 20))
        service = EngineService(engine, tiny.tokenizer)
        server, _, port = await start_server(SiteServicer(service, identity, jobs), "127.0.0.1", 0)
        client = GrpcSiteClient("s1", f"127.0.0.1:{port}", 5.0)
        try:
            assert (await client.info()).accepts_fine_tuning is (jobs is not None)
            if jobs is None:
                with pytest.raises(FineTuneCallRefused, match="RESERVE_BYTES is 0") as off:
                    await client.start_fine_tune(spec())
                assert off.value.reason == "precondition"
                return
            with pytest.raises(FineTuneCallRefused, match="not the job's base") as other:
                await client.start_fine_tune(spec(base="other"))
            assert other.value.reason == "invalid"
            # Past the site's message limit: refused for good, never sent again (issue 58).
            huge = spec(data=b" " * MAX_RECEIVE_MESSAGE_BYTES)
            with pytest.raises(FineTuneCallRefused) as too_large:
                await client.start_fine_tune(huge)
            assert too_large.value.reason == "too_large"
            with pytest.raises(FineTuneCallRefused) as unknown:
                await client.fine_tune_progress("nope")
            assert unknown.value.reason == "not_found"
            started = await client.start_fine_tune(spec())
            assert started.state is FineTuneState.QUEUED
            assert jobs.settled("job-1", timeout_s=60).total_steps == 1
            read = await client.fine_tune_progress("job-1")
            assert (read.state, read.total_steps) == (FineTuneState.QUEUED, 1)
            # A second start is refused at the site; the client answers the job it has.
            assert await client.start_fine_tune(spec()) == read
            assert await client.live_fine_tunes() == ["job-1"]
            cancelled = await client.cancel_fine_tune("job-1")
            assert cancelled.state is FineTuneState.CANCELLED
            assert await client.live_fine_tunes() == []
        finally:
            await client.close()
            await server.stop(None)
            engine.close()

    asyncio.run(run(None))
    asyncio.run(run(jobs_in(tmp_path, tiny)))


def test_validation_loss_per_epoch_and_the_files_a_job_leaves(
    tmp_path: Path, tiny: LoadedModel
) -> None:
    hp = FineTuneHyperparameters(n_epochs=2, batch_size=1, learning_rate_multiplier=1.0)
    jobs = FineTuneJobs(
        FineTuneSettings(tmp_path, 1 << 30, checkpoint_every=3), tiny.model, tiny.tokenizer, "tiny"
    )
    jobs.start(FineTuneSpec("v", "tiny", LINE + b"\n" + LINE, LINE, hp, 5))
    jobs.settled("v", timeout_s=60)
    while not jobs.progress("v").state.is_final:
        jobs.run_unit()
    done = jobs.progress("v")
    assert done.state is FineTuneState.SUCCEEDED, done.error
    assert [s for s, _ in done.validation_losses] == [2, 4]
    assert [c.step for c in done.checkpoints] == [3]
    assert done.adapter_path == str(tmp_path / "v" / "adapter")
    assert {p.name for p in (tmp_path / "v" / "adapter").iterdir()} >= {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    assert not list((tmp_path / "v").glob(".tmp-*"))
    # A site started again answers the finished job from disk, unchanged.
    again = FineTuneJobs(FineTuneSettings(tmp_path, 1 << 30), tiny.model, tiny.tokenizer, "tiny")
    assert again.progress("v") == done
    assert not again.has_work()


def test_a_job_cancelled_mid_way_stops_and_lets_its_trainer_go(
    tmp_path: Path, tiny: LoadedModel
) -> None:
    jobs = jobs_in(tmp_path, tiny)
    hp = FineTuneHyperparameters(n_epochs=3, batch_size=1, learning_rate_multiplier=1.0)
    jobs.start(FineTuneSpec("c", "tiny", LINE, None, hp, 5))
    jobs.settled("c", timeout_s=60)
    jobs.run_unit()  # builds the trainer
    assert jobs.progress("c").state is FineTuneState.RUNNING
    while jobs.progress("c").step < 1:  # the first step, a piece at a time
        jobs.run_unit()
    assert jobs.cancel("c").state is FineTuneState.CANCELLED
    assert jobs.has_work()  # its trainer is still held until the engine thread's next unit
    jobs.run_unit()
    assert not jobs.has_work()
    final = jobs.progress("c")
    assert (final.state, final.step) == (FineTuneState.CANCELLED, 1)
    assert jobs.cancel("c") == final  # a final job's progress, unchanged
    again = jobs_in(tmp_path, tiny)  # a restart does not resume it
    assert again.progress("c").state is FineTuneState.CANCELLED
    assert not again.has_work()


def test_idle_units_are_metered_beside_requests_and_alone(tiny: LoadedModel) -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from site_engine.metrics import SiteMetrics

    metrics = SiteMetrics("s1")
    engine = PagedEngine(tiny, EngineConfig(max_num_seqs=2, kv_cache_bytes=8 << 20))
    work = RecordingWork(engine)
    service = EngineService(
        engine,
        tiny.tokenizer,
        idle_work=(work, IdleGate(1.0)),
        on_idle_unit=metrics.observe_idle_unit,
    )
    service.start()
    try:
        serve_all(service, requests=2, max_tokens=24)  # both run at once: no one waits
        time.sleep(0.05)  # idle: units alone
    finally:
        service.stop()
        engine.close()
    counts = {
        sample.labels["beside_requests"]: sample.value
        for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        if family.name == "fedllm_site_idle_work_unit_seconds"
        for sample in family.samples
        if sample.name.endswith("_count")
    }
    assert counts["true"] >= 1  # units between the two requests' steps
    assert counts["false"] >= 1
    assert counts["true"] + counts["false"] == len(work.waiting_at_units)
