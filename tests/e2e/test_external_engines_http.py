"""A federation of both kinds of site through the public API: one gRPC site engine and one site
of kind `openai` (another site engine reached through its OpenAI-compatible HTTP face), real
processes on loopback. Both serve completions and chat; an answer whose site dies mid-stream
continues on the site of the other kind, token for token. And the metrics path: fake engines
publishing vLLM- and SGLang-named metrics show their load on the gateway's dashboard API."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from devtools.launch import ManagedProcess, free_port, spawn_site, start_gateway, wait_until_serving
from tests.support.fake_openai_engine import EngineState, running_engine

pytestmark = pytest.mark.slow
ADMIN = "external-engines-admin-token-0123"
# The gateway must not notice a killed site by itself: continuation is what is under test.
DEAF = {"GATEWAY_HEALTH_INTERVAL_S": "300", "GATEWAY_LOAD_REPORT_STALE_S": "300"}
LONG = {"model": "tiny", "prompt": "a long answer", "max_tokens": 500, "ignore_eos": True,
        "temperature": 0}  # fmt: skip


def grpc_site(name: str, endpoint: str) -> dict[str, object]:
    return {"name": name, "cloud": "aws", "region": "us-east-1", "endpoint": endpoint,
            "model": "tiny"}  # fmt: skip


def openai_site(name: str, base: str, metrics: str, dialect: str, engine_model: str):
    return {"name": name, "cloud": "gcp", "region": "europe-west4", "model": "tiny",
            "kind": "openai", "base_url": base, "engine_model": engine_model,
            "metrics_url": metrics, "metrics_dialect": dialect,
            "metrics_interval_ms": 200}  # fmt: skip


@pytest.fixture
def mixed(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[Callable[..., tuple]]:
    started: list[ManagedProcess] = []

    def start(env: dict[str, str] | None = None) -> tuple[ManagedProcess, dict]:
        http_port = free_port()
        sites = {
            "grpc-a": spawn_site(model_dir=tiny_llama_dir, site_name="grpc-a", model_name="tiny",
                                 log_dir=tmp_path),
            "openai-b": spawn_site(model_dir=tiny_llama_dir, site_name="openai-b",
                                   model_name="tiny", log_dir=tmp_path,
                                   extra_args=["--http-port", str(http_port)]),
        }  # fmt: skip
        started.extend(sites.values())
        for process in sites.values():
            wait_until_serving(process)
        base = f"http://127.0.0.1:{http_port}"
        federation = {
            "models": [{"name": "tiny", "tokenizer": str(tiny_llama_dir)}],
            "sites": [
                grpc_site("grpc-a", f"127.0.0.1:{sites['grpc-a'].port}"),
                openai_site("openai-b", f"{base}/v1", f"{base}/metrics", "vllm", "tiny"),
            ],
        }
        path = tmp_path / "federation.json"
        path.write_text(json.dumps(federation))
        gateway = start_gateway(
            federation_file=path,
            database_url=f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}",
            log_dir=tmp_path,
            expect_healthy_sites=2,
            env={"GATEWAY_ADMIN_TOKEN": ADMIN, **(env or {})},
        )
        started.append(gateway)
        return gateway, sites

    yield start
    for process in reversed(started):
        process.stop()


def stream_on(url: str, site: str, body: dict[str, object]) -> Iterator[dict]:
    """Opens streams until round robin puts one on `site`; yields its events."""
    for _ in range(4):
        with httpx.stream("POST", url, json=body, timeout=120) as response:
            assert response.status_code == 200, response.read()
            if response.headers["x-fedllm-site"] != site:
                response.read()
                continue
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield json.loads(line[6:])
            return
    raise AssertionError(f"no request was routed to {site}")


def continue_after_kill(gateway: ManagedProcess, victim: ManagedProcess, name: str) -> None:
    url = f"http://127.0.0.1:{gateway.port}/v1/completions"
    reference = httpx.post(url, json=LONG, timeout=120).json()["choices"][0]["text"]
    body = {**LONG, "stream": True, "stream_options": {"include_usage": True}}
    texts, usage = [], None
    for event in stream_on(url, name, body):
        assert "error" not in event, event
        if event["choices"]:
            texts.append(event["choices"][0]["text"])
            if len(texts) == 5 and victim.alive():
                os.kill(victim.popen.pid, signal.SIGSTOP)  # nothing more from it, then gone
                victim.kill()
        else:
            usage = event["usage"]
    assert not victim.alive()
    assert "".join(texts) == reference  # one answer, token for token, across the two kinds
    assert usage is not None
    assert usage["completion_tokens"] == 500


def admin_rows(sql_db: Path) -> list[dict[str, object]]:
    import sqlite3

    with sqlite3.connect(sql_db) as db:
        db.row_factory = sqlite3.Row
        query = ("SELECT r.attempts, r.continuations, s.name AS site FROM requests r "
                 "JOIN sites s ON s.id = r.site_id WHERE r.stream = 1")  # fmt: skip
        return [dict(row) for row in db.execute(query)]


def continued_row(sql_db: Path) -> dict[str, object]:
    """The one request that continued on another site, once the gateway has written it (its
    request log is written behind the answers)."""
    deadline = time.monotonic() + 15
    while True:
        moved = [r for r in admin_rows(sql_db) if r["continuations"]]
        if moved or time.monotonic() > deadline:
            (row,) = moved
            return row
        time.sleep(0.1)


def test_both_kinds_serve_and_a_grpc_site_killed_mid_stream_continues_on_the_openai_one(
    mixed, tmp_path: Path
) -> None:
    gateway, sites = mixed(env=DEAF)
    base = f"http://127.0.0.1:{gateway.port}"
    served = set()
    for _ in range(2):
        response = httpx.post(f"{base}/v1/completions", json={**LONG, "max_tokens": 8}, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 8
        served.add(response.headers["x-fedllm-site"])
        messages = [{"role": "user", "content": "hi"}]
        chat_body = {"model": "tiny", "messages": messages, "max_tokens": 4}
        chat = httpx.post(f"{base}/v1/chat/completions", timeout=60, json=chat_body)
        assert chat.status_code == 200, chat.text
        served.add(chat.headers["x-fedllm-site"])
    assert served == {"grpc-a", "openai-b"}
    continue_after_kill(gateway, sites["grpc-a"], "grpc-a")
    moved = continued_row(tmp_path / "gateway.db")
    (hop,) = json.loads(str(moved["continuations"]))
    assert (hop["from"], hop["to"], moved["site"]) == ("grpc-a", "openai-b", "openai-b")
    assert 0 < hop["after_tokens"] < 500


def test_an_openai_site_killed_mid_stream_continues_on_the_grpc_one(mixed, tmp_path) -> None:
    gateway, sites = mixed(env=DEAF)
    continue_after_kill(gateway, sites["openai-b"], "openai-b")
    moved = continued_row(tmp_path / "gateway.db")
    (hop,) = json.loads(str(moved["continuations"]))
    assert (hop["from"], hop["to"]) == ("openai-b", "grpc-a")


def overview_sites(base: str) -> dict[str, dict[str, object]]:
    ov = httpx.get(f"{base}/admin/api/overview", timeout=10,
                   headers={"Authorization": f"Bearer {ADMIN}"}).json()  # fmt: skip
    return {s["name"]: s for s in ov["sites"]}


def test_engine_metrics_in_vllm_and_sglang_names_reach_the_dashboard(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    vllm = EngineState(model="org/tiny", dialect="vllm", running=2, waiting=7, kv_usage=0.5)
    sglang = EngineState(model="tiny-sg", dialect="sglang", running=4, waiting=3, kv_usage=0.25)
    with running_engine(vllm) as v, running_engine(sglang) as s:
        federation = {
            "models": [{"name": "tiny", "tokenizer": str(tiny_llama_dir)}],
            "sites": [
                openai_site("vllm-x", v.base_url, v.metrics_url, "vllm", "org/tiny"),
                openai_site("sglang-y", s.base_url, s.metrics_url, "sglang", "tiny-sg"),
            ],
        }
        path = tmp_path / "federation.json"
        path.write_text(json.dumps(federation))
        gateway = start_gateway(
            federation_file=path,
            database_url=f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}",
            log_dir=tmp_path,
            expect_healthy_sites=2,
            env={"GATEWAY_ADMIN_TOKEN": ADMIN},
        )
        try:
            base = f"http://127.0.0.1:{gateway.port}"
            deadline = time.monotonic() + 20
            while True:
                rows = overview_sites(base)
                seen = {n: (r["queued_requests"], r["running_requests"]) for n, r in rows.items()}
                if seen == {"vllm-x": (7, 2), "sglang-y": (3, 4)} or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert seen == {"vllm-x": (7, 2), "sglang-y": (3, 4)}
            # KV: vLLM 50% of 1000 blocks x 16; SGLang 25% of its 16000-token pool.
            assert rows["vllm-x"]["running_tokens"] == 8000
            assert rows["sglang-y"]["running_tokens"] == 4000
            assert rows["vllm-x"]["kind"] == "openai"
            assert rows["vllm-x"]["can_release_queued"] is False
            # Served through the public API by the engine itself (its words, our accounting).
            answer = httpx.post(f"{base}/v1/completions", timeout=30,
                                json={"model": "tiny", "prompt": "x", "max_tokens": 3})  # fmt: skip
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == " w0 w1 w2"
            metrics = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
            assert 'site="vllm-x"' in metrics.text
            # An engine that stops knowing the model: the gateway says so, and stays up.
            vllm.model = sglang.model = "renamed"
            small = {"model": "tiny", "prompt": "x", "max_tokens": 3}
            refused = httpx.post(f"{base}/v1/completions", timeout=30, json=small)
            assert refused.status_code == 503, refused.text
            # The engine refuses it, or, once a health poll has seen the engines' model lists, the
            # router already knows no site serves it: either way the client is told which model.
            message = refused.json()["error"]["message"]
            assert "does not serve model" in message or "no site can serve model 'tiny'" in message
            assert httpx.get(f"{base}/healthz").status_code == 200
        finally:
            gateway.stop()


FLAG = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


def test_parameters_travel_to_both_site_kinds(mixed) -> None:
    """n, logprobs, penalties, logit_bias and a JSON schema reach the gRPC site and the openai
    site alike (round robin alternates them); a required tool call, which an OpenAI-compatible
    engine cannot be asked to enforce, goes only to the gRPC site."""
    gateway, _ = mixed()
    url = f"http://127.0.0.1:{gateway.port}/v1/chat/completions"
    fmt = {"type": "json_schema", "json_schema": {"name": "flag", "schema": FLAG}}
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "ok?"}],
        "response_format": fmt,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 2,
        "presence_penalty": 0.5,
        "logit_bias": {"11": -5},
        "max_tokens": 200,
        "seed": 3,
    }
    sites = set()
    for _ in range(4):
        response = httpx.post(url, json=body, timeout=120)
        assert response.status_code == 200, response.text
        sites.add(response.headers["x-fedllm-site"])
        answer = response.json()
        assert [c["index"] for c in answer["choices"]] == [0, 1]
        for choice in answer["choices"]:
            assert set(json.loads(choice["message"]["content"])) == {"ok"}
            content = choice["logprobs"]["content"]
            assert content
            assert all(len(token["top_logprobs"]) == 2 for token in content)
    assert sites == {"grpc-a", "openai-b"}
    tool = {"type": "function", "function": {"name": "f", "parameters": FLAG}}
    call = {"model": "tiny", "messages": [{"role": "user", "content": "call f"}],
            "tools": [tool], "tool_choice": "required", "parallel_tool_calls": False,
            "max_tokens": 200}  # fmt: skip
    for _ in range(3):
        response = httpx.post(url, json=call, timeout=120)
        assert response.status_code == 200, response.text
        assert response.headers["x-fedllm-site"] == "grpc-a"
        (called,) = response.json()["choices"][0]["message"]["tool_calls"]
        assert set(json.loads(called["function"]["arguments"])) == {"ok"}
