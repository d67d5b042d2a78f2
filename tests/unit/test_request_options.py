"""One request-options type from HTTP to the engine (fedllm_contract/request_options.py): every
field crosses every boundary, each boundary's mapper keeps defaults as defaults, and a field
that a layer does not carry fails here rather than being dropped silently."""

from __future__ import annotations

import json
from dataclasses import fields, replace
from typing import Any

import msgspec
import pytest

from fedllm_contract.grammar import ConstraintSpec
from fedllm_contract.proto import site_pb2
from fedllm_contract.proto.options import options_from_proto, options_to_proto
from fedllm_contract.request_options import OPTION_NAMES, Priority, RequestOptions
from gateway.chat.request import ChatCompletionRequest
from gateway.completions.request import CompletionRequest
from gateway.completions.sampling_options import check_options, options_from_wire
from gateway.errors import GatewayError
from gateway.sites.grpc_client import _to_proto
from gateway.sites.interface import GenerateParams
from gateway.sites.openai_wire import completion_body, option_fields
from site_engine.engine.core.types import SamplingParams
from site_engine.grpc_server import InvalidRequest, _check_options
from site_engine.openai_wire import BadRequest as FaceBadRequest
from site_engine.openai_wire import _sampling as face_sampling
from site_engine.request_options import NOT_SAMPLING, SAMPLING_OPTIONS, engine_request

TAGGED = ConstraintSpec("tagged_json", schema='{"type": "object"}', begin="<a>", end="</a>",
                        separator=",", min_items=1, max_items=3)  # fmt: skip
# A value other than the default for every option, each exact in float32 (the wire's floats).
# A new option must add one: test_every_option_has_a_sample_value fails until it does.
NON_DEFAULT: dict[str, Any] = {
    "temperature": 0.5,
    "top_p": 0.25,
    "seed": 2**62 + 1,
    "stop": ("\n", "END"),
    "ignore_eos": True,
    "presence_penalty": 0.5,
    "frequency_penalty": -1.5,
    "logit_bias": ((3, -100.0), (7, 2.5)),
    "logprobs": True,
    "top_logprobs": 5,
    "constraint": TAGGED,
    "repetition_penalty": 1.25,
    "n": 3,
    "adapter": "tenant-a",
    "priority": Priority.BATCH,
}
EVERYTHING = RequestOptions(**NON_DEFAULT)
_PROTO_HOLDERS = (site_pb2.SamplingParams.DESCRIPTOR, site_pb2.GenerateRequest.DESCRIPTOR)


def test_every_option_has_a_sample_value() -> None:
    assert set(NON_DEFAULT) == OPTION_NAMES
    for field in fields(RequestOptions):
        assert NON_DEFAULT[field.name] != field.default, field.name


def test_every_option_is_a_field_of_the_proto() -> None:
    """The codec writes each option into the proto field of its name: one that site.proto does
    not declare (in SamplingParams or GenerateRequest, not both) would not cross the wire."""
    for name in OPTION_NAMES:
        holders = [d.name for d in _PROTO_HOLDERS if name in d.fields_by_name]
        assert len(holders) == 1, f"option {name!r} is declared in {holders or 'no message'}"


@pytest.mark.parametrize("name", sorted(OPTION_NAMES))
def test_each_option_crosses_grpc_alone(name: str) -> None:
    options = replace(RequestOptions(), **{name: NON_DEFAULT[name]})
    request = site_pb2.GenerateRequest()
    options_to_proto(options, request)
    assert options_from_proto(request) == options


def test_all_options_and_the_defaults_cross_grpc() -> None:
    for options in (EVERYTHING, RequestOptions()):
        request = site_pb2.GenerateRequest()
        options_to_proto(options, request)
        assert options_from_proto(request) == options
    # A message from a sender that set nothing reads as the defaults (0 is no valid top_p, n
    # or repetition penalty: those read as unset).
    assert options_from_proto(site_pb2.GenerateRequest()) == replace(
        RequestOptions(), temperature=0.0
    )


def test_what_a_site_cannot_read_is_refused() -> None:
    request = site_pb2.GenerateRequest(priority=7)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="priority 7"):
        options_from_proto(request)
    request = site_pb2.GenerateRequest()
    request.sampling.constraint.SetInParent()  # a constraint of no kind
    with pytest.raises(ValueError, match="no kind"):
        options_from_proto(request)


def test_the_gateways_grpc_adapter_sends_the_options_and_the_call() -> None:
    params = GenerateParams("r1", (5, 6), 9, EVERYTHING, predicted_tokens=4,
                            generated_before=2, cache_salt="s")  # fmt: skip
    message = _to_proto(params)
    assert options_from_proto(message) == EVERYTHING
    assert (message.sampling.max_tokens, message.sampling.generated_before) == (9, 2)
    assert (message.predicted_tokens, message.cache_salt) == (4, "s")
    assert message.adapter == "tenant-a"
    assert message.priority == site_pb2.PRIORITY_BATCH


def test_the_engine_gets_every_option() -> None:
    assert SAMPLING_OPTIONS | NOT_SAMPLING == OPTION_NAMES, (
        "an option is neither a field of the engine's SamplingParams nor one the serving layer "
        "takes itself"
    )
    request = engine_request("r1", (5, 6), EVERYTHING, 9, generated_before=2, cache_salt="s")
    sampling = request.sampling
    for name in SAMPLING_OPTIONS:
        assert getattr(sampling, name) == NON_DEFAULT[name], name
    assert (sampling.max_tokens, sampling.generated_before) == (9, 2)
    assert (request.adapter, request.priority) == ("tenant-a", Priority.BATCH)
    assert request.cache_salt == "s"
    plain = engine_request("r2", (5,), RequestOptions(), 4)
    assert plain.sampling == SamplingParams(max_tokens=4)
    assert (plain.adapter, plain.priority) == (None, Priority.INTERACTIVE)
    assert engine_request("r3", (5,), replace(RequestOptions(), adapter=""), 4).adapter is None


def test_a_site_refuses_an_adapter_it_does_not_serve() -> None:
    with pytest.raises(InvalidRequest, match="adapter 'tenant-a' is not served by this site"):
        _check_options(EVERYTHING, 50257, frozenset())
    _check_options(EVERYTHING, 50257, frozenset({"tenant-a"}))
    _check_options(RequestOptions(), 50257, frozenset())


def test_an_openai_site_gets_each_option_under_its_name() -> None:
    body = option_fields(EVERYTHING, "vllm")
    assert body == {
        "temperature": 0.5,
        "top_p": 0.25,
        "seed": 2**62 + 1,
        "stop": ["\n", "END"],
        "ignore_eos": True,
        "presence_penalty": 0.5,
        "frequency_penalty": -1.5,
        "logit_bias": {"3": -100.0, "7": 2.5},
        "logprobs": 5,
        "structured_outputs": {"json": {"type": "object"}},
        "repetition_penalty": 1.25,
        "n": 3,
        "model": "tenant-a",  # vLLM serves an adapter as a model of its name
    }
    assert option_fields(RequestOptions(), "vllm") == {"temperature": 1.0, "top_p": 1.0}
    plain = completion_body(GenerateParams("r", (1,), 4), "base", False)
    assert plain["model"] == "base"


def _chat(**body: object) -> ChatCompletionRequest:
    raw = json.dumps({"model": "m", "messages": [], **body})
    return msgspec.json.decode(raw, type=ChatCompletionRequest)


def _completion(**body: object) -> CompletionRequest:
    raw = json.dumps({"model": "m", "prompt": "hi", **body})
    return msgspec.json.decode(raw, type=CompletionRequest)


WIRE = {"temperature": 0.5, "top_p": 0.25, "seed": 7, "stop": "\n", "ignore_eos": True,
        "presence_penalty": 0.5, "frequency_penalty": -1.5, "logit_bias": {"7": 2.5, "3": -1},
        "n": 2}  # fmt: skip
FROM_WIRE = RequestOptions(temperature=0.5, top_p=0.25, seed=7, stop=("\n",), ignore_eos=True,
                           presence_penalty=0.5, frequency_penalty=-1.5,
                           logit_bias=((3, -1.0), (7, 2.5)), n=2)  # fmt: skip


def test_each_api_maps_the_options_it_names_alike() -> None:
    assert options_from_wire(_chat(**WIRE)) == FROM_WIRE
    assert options_from_wire(_completion(**WIRE)) == FROM_WIRE
    # Absent (or null) fields are the defaults, whatever the API's own field defaults.
    assert options_from_wire(_chat()) == RequestOptions()
    assert options_from_wire(_completion()) == RequestOptions()
    given = options_from_wire(_chat(), priority=Priority.FLEX, logprobs=True, top_logprobs=2)
    assert given == RequestOptions(priority=Priority.FLEX, logprobs=True, top_logprobs=2)


@pytest.mark.parametrize(
    ("options", "param"),
    [
        (RequestOptions(n=0), "n"),
        (RequestOptions(top_logprobs=21), "top_logprobs"),
        (RequestOptions(presence_penalty=2.5), "presence_penalty"),
        (RequestOptions(frequency_penalty=float("nan")), "frequency_penalty"),
        (RequestOptions(logit_bias=((50257, 1.0),)), "logit_bias"),
        (RequestOptions(logit_bias=((1, 101.0),)), "logit_bias"),
        (RequestOptions(stop=("a",) * 5), "stop"),
        (RequestOptions(stop=("",)), "stop"),
        (RequestOptions(seed=2**63), "seed"),
    ],
)
def test_options_out_of_range_are_400s_naming_the_parameter(options, param) -> None:
    with pytest.raises(GatewayError) as caught:
        check_options(options, vocab=50257, max_choices=8)
    assert caught.value.param == param


def test_checked_options_are_the_options() -> None:
    assert check_options(FROM_WIRE, vocab=50257, max_choices=8) == FROM_WIRE
    assert check_options(RequestOptions(), vocab=50257, max_choices=8) == RequestOptions()


def test_the_sites_openai_face_reads_every_sampling_option() -> None:
    body = {**WIRE, "top_logprobs": 2, "repetition_penalty": 1.25, "max_tokens": 9,
            "generated_before": 2, "response_format": {"type": "json_object"}}  # fmt: skip
    sampling = face_sampling(body, chat=False)
    expected = replace(FROM_WIRE, repetition_penalty=1.25, constraint=ConstraintSpec("json_object"))
    for name in SAMPLING_OPTIONS - {"logprobs", "top_logprobs", "logit_bias"}:
        assert getattr(sampling, name) == getattr(expected, name), name
    assert sorted(sampling.logit_bias) == list(expected.logit_bias)  # in the body's order
    assert (sampling.max_tokens, sampling.generated_before) == (9, 2)
    chat = face_sampling({"logprobs": True, "top_logprobs": 2}, chat=True)
    assert (chat.logprobs, chat.top_logprobs) == (True, 2)
    with pytest.raises(FaceBadRequest, match="presence_penalty"):
        face_sampling({"presence_penalty": "high"})
    with pytest.raises(FaceBadRequest, match="temperature"):
        face_sampling({"temperature": -1.0})
