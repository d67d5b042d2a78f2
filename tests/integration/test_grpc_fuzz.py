"""Hostile and malformed gRPC traffic against a real site process.

Each RPC gets raw bytes that are mostly not a valid protobuf (sent through a channel with identity
serializers), and hypothesis-built messages that parse but are hostile: huge or zero max_tokens,
empty prompts, out-of-vocabulary ids, NaN/inf/negative/subnormal floats, absurd stop strings,
unknown ids for Cancel, absurd intervals for StreamLoad, duplicate request ids. Every call must
end with a response or a clean status within its deadline; afterwards the site still serves a
normal Generate, its health is SERVING, and it holds no request and no KV block.
FEDLLM_FUZZ_EXAMPLES sets the hypothesis examples per test (default 100).
"""

from __future__ import annotations

import math
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devtools.launch import ManagedProcess, start_site
from fedllm_contract.proto import site_pb2, site_pb2_grpc

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("FEDLLM_FUZZ_EXAMPLES", "100"))
VOCAB = 50257  # the GPT-2 tokenizer of the tiny model
MAX_MODEL_LEN = 1024
SERVICE = "/fedllm.site.v1.SiteEngine/"
UNARY = ("Cancel", "ReleaseQueued", "Info")
STREAMING = ("Generate", "StreamLoad")
# What a malformed or hostile request may end with: refused, or (for bytes that happen to parse)
# a normal answer. UNKNOWN/INTERNAL come from grpc's own deserializer ("Error parsing message"),
# before the servicer runs. Never DEADLINE_EXCEEDED (wedged) or UNAVAILABLE (crashed).
CLEAN_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS}
PARSE_REFUSALS = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
calls: dict[str, int] = {}


@pytest.fixture(scope="module")
def site(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    process = start_site(
        extra_args=["--max-num-seqs", "2"],
        model_dir=tiny_llama_dir,
        site_name="grpc-fuzz",
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


def _count(name: str) -> None:
    calls[name] = calls.get(name, 0) + 1


def _raw_call(channel: grpc.Channel, method: str, payload: bytes) -> grpc.StatusCode:
    """Sends bytes as the request; returns OK or the error status (first message only)."""
    identity: dict[str, Any] = {
        "request_serializer": None,  # bytes go out as they are
        "response_deserializer": None,
    }
    _count(f"raw {method}")
    try:
        if method in UNARY:
            channel.unary_unary(SERVICE + method, **identity)(payload, timeout=30)
        else:
            responses = channel.unary_stream(SERVICE + method, **identity)(payload, timeout=30)
            for _ in responses:  # a Generate that parsed runs to the end; StreamLoad: first one
                if method == "StreamLoad":
                    responses.cancel()
                    break
    except grpc.RpcError as exc:
        code: grpc.StatusCode = exc.code()
        if code is grpc.StatusCode.CANCELLED and method == "StreamLoad":
            return grpc.StatusCode.OK
        return code
    return grpc.StatusCode.OK


@FUZZ
@given(
    method=st.sampled_from(UNARY + STREAMING),
    payload=st.one_of(
        st.binary(max_size=512),
        # Truncated or corrupted field headers: varints that never end, lengths past the end.
        st.builds(lambda b: b"\x0a\xff\xff\xff\xff\x0f" + b, st.binary(max_size=64)),
        st.builds(lambda n, b: bytes([0x12, n]) + b, st.integers(0, 255), st.binary(max_size=8)),
        st.builds(lambda b: b"\xff" * 11 + b, st.binary(max_size=16)),
    ),
)
def test_raw_bytes_get_a_clean_status(channel: grpc.Channel, method: str, payload: bytes) -> None:
    code = _raw_call(channel, method, payload)
    assert code in {grpc.StatusCode.OK} | CLEAN_REFUSALS | PARSE_REFUSALS, (method, payload, code)


def _known_garbage_is_a_parse_error(channel: grpc.Channel) -> None:
    for method in UNARY + STREAMING:
        code = _raw_call(channel, method, b"\x0a\xff\xff\xff\xff\x0f garbage")
        assert code in PARSE_REFUSALS, (method, code)


def test_every_rpc_refuses_a_broken_message(channel: grpc.Channel) -> None:
    _known_garbage_is_a_parse_error(channel)


floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
sampling_params = st.builds(
    site_pb2.SamplingParams,
    # Small, or past the context (always refused: prompts have >= 1 token), never a long run.
    max_tokens=st.one_of(st.integers(0, 6), st.integers(MAX_MODEL_LEN, 2**32 - 1)),
    temperature=st.one_of(st.sampled_from([0.0, 1e-45, 1e-30, 0.7]), floats32),
    top_p=st.one_of(st.sampled_from([0.0, 1e-6, 1.0]), floats32),
    seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    stop=st.lists(st.text(max_size=40), max_size=4),
    ignore_eos=st.booleans(),
)
generate_requests = st.builds(
    site_pb2.GenerateRequest,
    request_id=st.one_of(
        st.just(""), st.text(min_size=1, max_size=140), st.uuids().map(lambda u: u.hex)
    ),
    prompt=st.one_of(st.just(""), st.text(max_size=200), st.just("word " * 1100)),
    prompt_token_ids=st.one_of(
        st.just([]),
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=16),
        st.lists(st.integers(VOCAB - 2, 2**32 - 1), min_size=1, max_size=4),
        st.lists(st.just(0), min_size=MAX_MODEL_LEN, max_size=MAX_MODEL_LEN + 4),
    ),
    sampling=st.one_of(st.none(), sampling_params),
    predicted_tokens=st.one_of(st.integers(0, 10), st.just(2**32 - 1)),
)

# Hostile but servable: every required part valid, the rest extreme (subnormal and huge
# temperatures, NaN/negative top_p read as unset, any seed, odd stop strings, huge predictions).
servable_requests = st.builds(
    site_pb2.GenerateRequest,
    request_id=st.uuids().map(lambda u: u.hex),
    prompt=st.text(min_size=1, max_size=60).filter(str.strip),
    prompt_token_ids=st.one_of(st.just([]), st.lists(st.integers(0, VOCAB - 1), max_size=8)),
    sampling=st.builds(
        site_pb2.SamplingParams,
        max_tokens=st.integers(1, 6),
        temperature=st.floats(0, allow_infinity=False, allow_nan=False, width=32),
        top_p=st.one_of(st.floats(width=32, max_value=1.0), st.just(math.nan)),
        seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
        stop=st.lists(st.text(max_size=8), max_size=4),
        ignore_eos=st.booleans(),
    ),
    predicted_tokens=st.integers(0, 2**32 - 1),
)


def _expected_refusal(request: site_pb2.GenerateRequest) -> str | None:
    """Why the site must refuse this request, if it must (the contract in site.proto)."""
    sampling = request.sampling
    if not request.request_id or len(request.request_id) > 128:
        return "request_id"
    if sampling.max_tokens < 1:
        return "max_tokens"
    if math.isnan(sampling.temperature) or not 0 <= sampling.temperature < math.inf:
        return "temperature"
    if request.prompt_token_ids and max(request.prompt_token_ids) >= VOCAB:
        return "vocabulary"
    if len(request.prompt_token_ids) >= MAX_MODEL_LEN:
        return "max_model_len"
    if sampling.max_tokens >= MAX_MODEL_LEN:
        return "max_model_len"
    return None


@FUZZ
@given(request=st.one_of(generate_requests, servable_requests))
def test_hostile_generate_requests_are_served_or_refused_cleanly(
    stub: site_pb2_grpc.SiteEngineStub, request: site_pb2.GenerateRequest
) -> None:
    _count("hostile Generate")
    must_refuse = _expected_refusal(request)
    refused: tuple[grpc.StatusCode, str] | None
    try:
        chunks = list(stub.Generate(request, timeout=60))
    except grpc.RpcError as exc:
        refused = (exc.code(), exc.details())
    else:
        refused = None
    if refused is not None:
        assert refused[0] in CLEAN_REFUSALS, (refused, request)
        _count(f"hostile Generate refused {refused[0].name}")
        return
    _count("hostile Generate served")
    assert must_refuse is None, f"served a request it must refuse ({must_refuse}): {request}"
    assert chunks[0].accepted
    final = chunks[-1]
    assert final.finish_reason in (site_pb2.FINISH_REASON_STOP, site_pb2.FINISH_REASON_LENGTH)
    produced = [t for chunk in chunks for t in chunk.token_ids]
    assert len(produced) == final.usage.completion_tokens <= request.sampling.max_tokens
    assert all(0 <= t < VOCAB for t in produced)


@FUZZ
@given(request_id=st.text(max_size=200))
def test_cancel_of_unknown_ids_is_a_clean_no(
    stub: site_pb2_grpc.SiteEngineStub, request_id: str
) -> None:
    _count("Cancel unknown")
    response = stub.Cancel(site_pb2.CancelRequest(request_id=f"unknown-{request_id}"), timeout=10)
    assert response.cancelled is False


@FUZZ
@given(interval_ms=st.one_of(st.integers(0, 20), st.integers(10**6, 2**32 - 1)))
def test_stream_load_with_absurd_intervals_answers_and_lets_go(
    stub: site_pb2_grpc.SiteEngineStub, interval_ms: int
) -> None:
    _count("StreamLoad")
    reports = stub.StreamLoad(site_pb2.LoadStreamRequest(interval_ms=interval_ms), timeout=10)
    first = next(reports)  # the first report comes at once, whatever the interval
    assert first.site_name == "grpc-fuzz"
    if interval_ms <= 20:
        assert next(reports).sequence > first.sequence
    reports.cancel()


@FUZZ
@given(max_requests=st.one_of(st.integers(0, 3), st.just(2**32 - 1)))
def test_release_queued_with_nothing_queued_returns_nothing(
    stub: site_pb2_grpc.SiteEngineStub, max_requests: int
) -> None:
    _count("ReleaseQueued")
    response = stub.ReleaseQueued(site_pb2.ReleaseQueuedRequest(max_requests=max_requests))
    assert list(response.released) == []


def _start_long(stub: site_pb2_grpc.SiteEngineStub, request_id: str, sink: list[Any]) -> None:
    request = site_pb2.GenerateRequest(
        request_id=request_id,
        prompt="a long one",
        sampling=site_pb2.SamplingParams(max_tokens=900, ignore_eos=True),
    )
    try:
        sink.extend(stub.Generate(request, timeout=120))
    except grpc.RpcError as exc:
        sink.append(exc)


def test_duplicate_request_ids_are_refused_and_the_first_stays_untouched(
    stub: site_pb2_grpc.SiteEngineStub,
) -> None:
    request_id = f"dup-{uuid.uuid4().hex}"
    first: list[Any] = []
    worker = threading.Thread(target=_start_long, args=(stub, request_id, first))
    worker.start()
    deadline = time.monotonic() + 30
    while not first and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first
    assert first[0].accepted
    for _ in range(5):
        duplicate = site_pb2.GenerateRequest(
            request_id=request_id, prompt="again", sampling=site_pb2.SamplingParams(max_tokens=2)
        )
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(duplicate, timeout=10))
        assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    # The first request is still running (the refusals did not cancel it), and cancels cleanly.
    assert stub.Cancel(site_pb2.CancelRequest(request_id=request_id)).cancelled
    worker.join(timeout=60)
    assert first[-1].finish_reason == site_pb2.FINISH_REASON_CANCELLED


def test_nan_temperature_is_refused(stub: site_pb2_grpc.SiteEngineStub) -> None:
    """Regression: NaN passed `temperature < 0` and sampled token 0 forever."""
    for value in (math.nan, math.inf):
        request = site_pb2.GenerateRequest(
            request_id=uuid.uuid4().hex,
            prompt="hi",
            sampling=site_pb2.SamplingParams(max_tokens=4, temperature=value),
        )
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(request, timeout=10))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "temperature" in caught.value.details()


def test_a_subnormal_temperature_samples_like_greedy(stub: site_pb2_grpc.SiteEngineStub) -> None:
    """Regression: logits / 1e-45 overflowed to inf, softmax gave NaN, and token 0 won always."""

    def run(temperature: float) -> list[int]:
        request = site_pb2.GenerateRequest(
            request_id=uuid.uuid4().hex,
            prompt="The quick brown fox",
            sampling=site_pb2.SamplingParams(
                max_tokens=8, temperature=temperature, seed=7, ignore_eos=True
            ),
        )
        return [t for chunk in stub.Generate(request, timeout=60) for t in chunk.token_ids]

    greedy = run(0.0)
    assert set(greedy) != {0}
    assert run(1e-45) == run(1e-30) == greedy


def test_the_site_serves_normally_after_the_barrage(
    stub: site_pb2_grpc.SiteEngineStub, channel: grpc.Channel
) -> None:
    """Runs last in this module: everything above went to the same site process."""
    _known_garbage_is_a_parse_error(channel)
    request = site_pb2.GenerateRequest(
        request_id=f"after-{uuid.uuid4().hex}",
        prompt="The quick brown fox",
        sampling=site_pb2.SamplingParams(max_tokens=6, ignore_eos=True),
    )
    chunks = list(stub.Generate(request, timeout=60))
    assert chunks[-1].finish_reason == site_pb2.FINISH_REASON_LENGTH
    assert chunks[-1].usage.completion_tokens == 6
    health = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="fedllm.site.v1.SiteEngine"), timeout=5
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert stub.Info(site_pb2.InfoRequest(), timeout=5).site_name == "grpc-fuzz"
    # Nothing leaked: no request left queued or running, every KV block back in the pool.
    deadline = time.monotonic() + 10
    while True:
        reports = stub.StreamLoad(site_pb2.LoadStreamRequest(interval_ms=50), timeout=5)
        report = next(reports)
        reports.cancel()
        idle = (report.running_requests, report.queued_requests, report.kv_blocks_used)
        if idle == (0, 0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle == (0, 0, 0)
    print(f"\ngRPC fuzz calls: {calls} (total {sum(calls.values())})")
