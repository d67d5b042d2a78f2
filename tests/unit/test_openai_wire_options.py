"""What the gateway sends an OpenAI-compatible engine for the options beyond plain sampling,
in each structured-output dialect, and how it reads choices' index and logprobs back."""

from __future__ import annotations

import json

from fedllm_contract.grammar import ConstraintSpec
from fedllm_contract.request_options import RequestOptions
from gateway.sites.interface import GenerateParams, TokenLogprob
from gateway.sites.openai_wire import capabilities, completion_body, parse_event

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
PARAMS = GenerateParams(
    request_id="r",
    prompt_token_ids=(1, 2),
    max_tokens=5,
    options=RequestOptions(
        temperature=0.5,
        top_p=1.0,
        presence_penalty=0.5,
        logit_bias=((7, -3.0),),
        logprobs=True,
        top_logprobs=2,
        constraint=ConstraintSpec("json_schema", schema=json.dumps(SCHEMA)),
        n=3,
    ),
)


def test_options_travel_in_each_dialect() -> None:
    vllm = completion_body(PARAMS, "m", True, "vllm")
    assert (vllm["n"], vllm["presence_penalty"], vllm["logit_bias"], vllm["logprobs"]) == (
        3,
        0.5,
        {"7": -3.0},
        2,
    )
    assert vllm["structured_outputs"] == {"json": SCHEMA}
    assert "frequency_penalty" not in vllm  # 0: not sent
    sglang = completion_body(PARAMS, "m", True, "sglang")
    assert json.loads(sglang["json_schema"]) == SCHEMA
    assert "structured_outputs" not in sglang
    plain = completion_body(PARAMS, "m", True, "none")
    assert "structured_outputs" not in plain
    assert "json_schema" not in plain
    assert "json_schema" not in capabilities("none")
    assert "tagged_json" not in capabilities("vllm")


def test_a_choice_index_and_its_logprobs_are_read() -> None:
    event = parse_event(
        json.dumps(
            {
                "choices": [
                    {
                        "index": 2,
                        "text": "hi",
                        "logprobs": {
                            "tokens": ["hi"],
                            "token_logprobs": [-0.5],
                            "top_logprobs": [{"token_id:9": -0.5, "ho": -1.5}],
                        },
                    }
                ]
            }
        )
    )
    assert event.index == 2
    assert event.logprobs == (TokenLogprob(-0.5, ((9, None, -0.5), (None, "ho", -1.5))),)
