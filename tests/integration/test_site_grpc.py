"""A real site process over real gRPC on loopback: the whole contract, good input and bad."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoModelForCausalLM

from devtools.launch import ManagedProcess, start_site
from fedllm_contract.proto import site_pb2, site_pb2_grpc
from fedllm_contract.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def site(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    # Two sequences at a time, so that a third and fourth request have to queue.
    process = start_site(
        extra_args=["--max-num-seqs", "2"],
        model_dir=tiny_llama_dir,
        site_name="grpc-test",
        model_name="tiny",
        log_dir=tmp_path_factory.mktemp("logs"),
    )
    yield process
    process.stop()


@pytest.fixture(scope="module")
def channel(site: ManagedProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{site.port}") as channel:
        yield channel


@pytest.fixture
def stub(channel: grpc.Channel) -> site_pb2_grpc.SiteEngineStub:
    return site_pb2_grpc.SiteEngineStub(channel)


def generate(stub, request_id: str, prompt: str = "Hello there", **sampling) -> list:
    sampling.setdefault("max_tokens", 8)
    request = site_pb2.GenerateRequest(
        request_id=request_id, prompt=prompt, sampling=site_pb2.SamplingParams(**sampling)
    )
    return list(stub.Generate(request, timeout=60))


def tokens(chunks) -> list[int]:
    return [t for chunk in chunks for t in chunk.token_ids]


def test_info_and_health(stub, channel) -> None:
    info = stub.Info(site_pb2.InfoRequest())
    assert (info.site_name, info.model, info.max_model_len) == ("grpc-test", "tiny", 1024)
    assert info.vocab_size == 50257
    assert len(info.tokenizer_fingerprint) == 64
    health = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="fedllm.site.v1.SiteEngine")
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_a_generative_site_says_so_and_refuses_embed(stub) -> None:
    assert stub.Info(site_pb2.InfoRequest()).task == site_pb2.MODEL_TASK_GENERATE
    request = site_pb2.EmbedRequest(
        request_id="embed-1", inputs=[site_pb2.EmbedInput(token_ids=[1, 2])]
    )
    with pytest.raises(grpc.RpcError) as refused:
        stub.Embed(request, timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "serves generative model tiny" in refused.value.details()


def test_greedy_stream_matches_transformers_generate(stub, tiny_llama_dir: Path) -> None:
    chunks = generate(stub, "greedy-1", prompt="The quick brown fox", max_tokens=12)
    assert chunks[0].accepted
    assert not chunks[0].token_ids
    final = chunks[-1]
    assert final.finish_reason == site_pb2.FINISH_REASON_LENGTH
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (4, 12)

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    tokenizer = load_tokenizer(tiny_llama_dir)
    prompt_ids = torch.tensor([tokenizer.encode("The quick brown fox")])
    expected = model.generate(
        prompt_ids,
        max_new_tokens=12,
        do_sample=False,
        min_new_tokens=12,
        attention_mask=torch.ones_like(prompt_ids),
    )
    assert tokens(chunks) == expected[0, 4:].tolist()
    assert "".join(c.text for c in chunks) == tokenizer.decode(expected[0, 4:])


def test_seeded_sampling_is_reproducible(stub) -> None:
    first = tokens(generate(stub, "seed-1", temperature=1.0, seed=42, max_tokens=10))
    second = tokens(generate(stub, "seed-2", temperature=1.0, seed=42, max_tokens=10))
    other = tokens(generate(stub, "seed-3", temperature=1.0, seed=43, max_tokens=10))
    assert first == second != other


def test_stop_string_ends_the_stream(stub) -> None:
    free = generate(stub, "nostop", prompt="Once upon a time", max_tokens=20)
    text = "".join(c.text for c in free)
    stop = text[5:8]
    chunks = generate(stub, "stop", prompt="Once upon a time", max_tokens=20, stop=[stop])
    assert chunks[-1].finish_reason == site_pb2.FINISH_REASON_STOP
    assert "".join(c.text for c in chunks) == text[: text.index(stop)]


def test_cancel_stops_a_running_request(stub) -> None:
    results: list = []
    worker = threading.Thread(
        target=lambda: results.extend(generate(stub, "long", max_tokens=900, ignore_eos=True))
    )
    worker.start()
    time.sleep(0.5)
    assert stub.Cancel(site_pb2.CancelRequest(request_id="long")).cancelled
    worker.join(timeout=30)
    assert results[-1].finish_reason == site_pb2.FINISH_REASON_CANCELLED
    assert len(tokens(results)) < 900
    assert not stub.Cancel(site_pb2.CancelRequest(request_id="long")).cancelled


def test_cancel_of_an_unknown_request_is_a_clean_no(stub) -> None:
    assert stub.Cancel(site_pb2.CancelRequest(request_id="never-seen")).cancelled is False


def test_release_queued_hands_back_requests_that_have_not_started(stub) -> None:
    streams: dict[str, list] = {}

    def run(request_id: str) -> None:
        streams[request_id] = generate(stub, request_id, max_tokens=300, ignore_eos=True)

    workers = [threading.Thread(target=run, args=(f"q{i}",)) for i in range(4)]
    for worker in workers:
        worker.start()
    wait_for_load(stub, running=2, queued=2)
    released = stub.ReleaseQueued(site_pb2.ReleaseQueuedRequest(max_requests=5)).released
    released_ids = {r.request_id for r in released}
    assert len(released_ids) == 2  # the two that were queued, whichever arrived last
    assert all(r.prompt_tokens == 2 for r in released)
    for worker in workers:
        worker.join(timeout=60)
    for request_id, chunks in streams.items():
        if request_id in released_ids:
            assert chunks[-1].finish_reason == site_pb2.FINISH_REASON_RELEASED
            assert tokens(chunks) == []
        else:
            assert chunks[-1].finish_reason == site_pb2.FINISH_REASON_LENGTH
            assert len(tokens(chunks)) == 300


def wait_for_load(stub, *, running: int, queued: int, timeout_s: float = 30) -> None:
    """Blocks until the site reports exactly this many running and queued requests."""
    deadline = time.monotonic() + timeout_s
    reports = stub.StreamLoad(site_pb2.LoadStreamRequest(interval_ms=20), timeout=timeout_s)
    try:
        for report in reports:
            if (report.running_requests, report.queued_requests) == (running, queued):
                return
            assert time.monotonic() < deadline, f"load never reached {running}/{queued}"
    finally:
        reports.cancel()


def test_load_reports_stream(stub) -> None:
    reports = stub.StreamLoad(site_pb2.LoadStreamRequest(interval_ms=50), timeout=5)
    first, second = next(reports), next(reports)
    reports.cancel()
    assert first.site_name == "grpc-test"
    assert second.sequence > first.sequence
    assert first.kv_blocks_total > 0
    assert second.timestamp_ms >= first.timestamp_ms


@pytest.mark.parametrize(
    ("request_kwargs", "code", "message"),
    [
        (
            {"prompt": "x " * 2000, "sampling": {"max_tokens": 8}},
            grpc.StatusCode.INVALID_ARGUMENT,
            "more than max_model_len",
        ),
        (
            {"prompt": "hi", "sampling": {"max_tokens": 1024}},
            grpc.StatusCode.INVALID_ARGUMENT,
            "exceeds max_model_len",
        ),
        (
            {"prompt": "hi", "sampling": {"max_tokens": 0}},
            grpc.StatusCode.INVALID_ARGUMENT,
            "max_tokens",
        ),
        ({"prompt": "", "sampling": {"max_tokens": 4}}, grpc.StatusCode.INVALID_ARGUMENT, "empty"),
        (
            {"prompt_token_ids": [1, 60000], "sampling": {"max_tokens": 4}},
            grpc.StatusCode.INVALID_ARGUMENT,
            "vocabulary",
        ),
        (
            {"prompt": "hi", "sampling": {"max_tokens": 4, "temperature": -1}},
            grpc.StatusCode.INVALID_ARGUMENT,
            "temperature",
        ),
        # The site serves no LoRA adapter yet: any adapter named is refused.
        (
            {"prompt": "hi", "adapter": "x", "sampling": {"max_tokens": 4}},
            grpc.StatusCode.INVALID_ARGUMENT,
            "adapter 'x' is not served by this site",
        ),
        (
            {"prompt": "hi", "priority": 7, "sampling": {"max_tokens": 4}},
            grpc.StatusCode.INVALID_ARGUMENT,
            "priority 7",
        ),
    ],
)
def test_bad_requests_get_clear_errors_and_the_site_keeps_serving(
    stub, request_kwargs, code, message
) -> None:
    fields = dict(request_kwargs)
    sampling = site_pb2.SamplingParams(**fields.pop("sampling"))
    request = site_pb2.GenerateRequest(request_id=uuid.uuid4().hex, sampling=sampling, **fields)
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(request, timeout=10))
    assert caught.value.code() == code
    assert message in caught.value.details()
    assert tokens(generate(stub, f"after-bad-{uuid.uuid4().hex}", max_tokens=2))  # still serving


def test_every_priority_class_is_served_and_no_adapter_is_the_base(stub) -> None:
    for priority in (site_pb2.PRIORITY_FLEX, site_pb2.PRIORITY_BATCH):
        request = site_pb2.GenerateRequest(
            request_id=uuid.uuid4().hex,
            prompt="Hello there",
            sampling=site_pb2.SamplingParams(max_tokens=2, temperature=0),
            priority=priority,
            adapter="",  # an empty name is the base model
        )
        assert tokens(list(stub.Generate(request, timeout=60)))


def test_malformed_message_is_refused_and_the_site_keeps_serving(channel, stub) -> None:
    raw = channel.unary_stream(
        "/fedllm.site.v1.SiteEngine/Generate",
        request_serializer=lambda payload: payload,
        response_deserializer=lambda payload: payload,
    )
    with pytest.raises(grpc.RpcError) as caught:
        list(raw(b"\x0a\xff\xff\xff\xff\x0f garbage", timeout=10))
    # grpc's own deserializer refuses it before our code runs; it reports UNKNOWN with a reason.
    assert caught.value.code() in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
    assert "Error parsing message" in caught.value.details()
    assert tokens(generate(stub, "after-garbage", max_tokens=2))


def test_busy_engine_reports_load_and_still_answers_control_calls_promptly(stub) -> None:
    """Two running, two queued: the load report shows it, and Info stays fast meanwhile."""
    ids = [f"busy-{uuid.uuid4().hex[:8]}-{i}" for i in range(4)]
    workers = [
        threading.Thread(
            target=generate, args=(stub, rid), kwargs={"max_tokens": 400, "ignore_eos": True}
        )
        for rid in ids
    ]
    for worker in workers:
        worker.start()
    wait_for_load(stub, running=2, queued=2)
    report = next(iter(stub.StreamLoad(site_pb2.LoadStreamRequest(interval_ms=50), timeout=5)))
    assert (report.running_requests, report.queued_requests) == (2, 2)
    assert report.queued_prompt_tokens == 4  # two queued prompts of 2 tokens
    assert report.kv_blocks_used > 0
    assert report.running_tokens > 0
    assert report.predicted_remaining_tokens > 2 * 400  # queued ones count their max_tokens
    # All of it is interactive (no priority named), and the per-class entries say so.
    interactive, flex, batch = report.by_class
    assert interactive.priority == site_pb2.PRIORITY_INTERACTIVE
    assert (interactive.running_requests, interactive.queued_requests) == (2, 2)
    assert interactive.queued_prompt_tokens == 4
    assert interactive.running_tokens == report.running_tokens
    assert interactive.predicted_remaining_tokens == report.predicted_remaining_tokens
    assert (flex.priority, batch.priority) == (site_pb2.PRIORITY_FLEX, site_pb2.PRIORITY_BATCH)
    assert flex.running_requests + flex.queued_requests + batch.running_requests == 0
    latencies = []
    for _ in range(20):
        started = time.perf_counter()
        stub.Info(site_pb2.InfoRequest(), timeout=5)
        latencies.append(time.perf_counter() - started)
    assert sorted(latencies)[-2] < 0.25, latencies  # the engine thread does not hold gRPC up
    for rid in ids:
        stub.Cancel(site_pb2.CancelRequest(request_id=rid))
    for worker in workers:
        worker.join(timeout=30)
    time.sleep(0.3)
    idle = next(iter(stub.StreamLoad(site_pb2.LoadStreamRequest(interval_ms=50), timeout=5)))
    assert (idle.running_requests, idle.queued_requests, idle.kv_blocks_used) == (0, 0, 0)
