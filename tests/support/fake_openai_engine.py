"""A stand-in for an external engine (vLLM, SGLang): speaks the OpenAI completions API with
streaming, serves /v1/models, and publishes its load under the metric names and shapes the
engines document (vLLM: `vllm:num_requests_running{model_name=...}`, `vllm:kv_cache_usage_perc`,
`vllm:generation_tokens_total`, `vllm:cache_config_info{block_size,num_gpu_blocks}`; SGLang:
`sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`,
`sglang:max_total_num_tokens`, `sglang:gen_throughput`). It runs on a real loopback port (uvicorn
in a thread), so the gateway reaches it as it would reach a real engine, from this process or
from a gateway process.

Its answer to a prompt is `n` words " w0 w1 ..." (one per SSE event); `behaviour` makes it
misbehave the ways engines do: an HTTP error status, a malformed event, a dropped connection,
an "abort" finish reason, a slow stream.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from litestar import Litestar, MediaType, Request, Response, get, post
from litestar.response import Stream

from devtools.launch import free_port


@dataclass
class EngineState:
    model: str = "served-model"
    dialect: str = "vllm"
    max_model_len: int = 2048
    # ok | status:<code> | malformed | drop | abort
    behaviour: str = "ok"
    token_delay_s: float = 0.0
    # Gauges the metrics page publishes, as the engine would see its own load.
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    kv_blocks: int = 1000
    block_size: int = 16
    generated_total: float = 0.0
    gen_throughput: float = 0.0
    metrics_status: int = 200
    requests: list[dict[str, Any]] = field(default_factory=list)
    disconnected: int = 0
    finished: int = 0
    # LoRA adapters it serves over its model, listed as vLLM lists them (`parent`: the base).
    adapters: tuple[str, ...] = ()


_TEXT = MediaType.TEXT


def _error(status: int, message: str, code: str | None = None) -> Response[Any]:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": code}}
    return Response(body, status_code=status)


def vllm_metrics(s: EngineState) -> str:
    labels = f'model_name="{s.model}"'
    return "\n".join([
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{labels}}} {float(s.running)}",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{labels}}} {float(s.waiting)}",
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{labels}}} {s.kv_usage}",
        "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
        "# TYPE vllm:generation_tokens_total counter",
        f"vllm:generation_tokens_total{{{labels}}} {s.generated_total}",
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
        f'vllm:cache_config_info{{block_size="{s.block_size}",cache_dtype="auto",'
        f'num_gpu_blocks="{s.kv_blocks}"}} 1.0',
        "",
    ])  # fmt: skip


def sglang_metrics(s: EngineState) -> str:
    labels = f'model_name="{s.model}",tp_rank="0"'
    gauges = {
        "sglang:num_running_reqs": s.running,
        "sglang:num_queue_reqs": s.waiting,
        "sglang:token_usage": s.kv_usage,
        "sglang:max_total_num_tokens": s.kv_blocks * s.block_size,
        "sglang:gen_throughput": s.gen_throughput,
    }
    lines = []
    for name, value in gauges.items():
        lines += [f"# HELP {name} {name}", f"# TYPE {name} gauge", f"{name}{{{labels}}} {value}"]
    lines += [
        "# TYPE sglang:generation_tokens_total counter",
        f"sglang:generation_tokens_total{{{labels}}} {s.generated_total}",
        "",
    ]
    return "\n".join(lines)


def build_app(s: EngineState) -> Litestar:
    @get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": s.model, "object": "model", "owned_by": "test",
                "max_model_len": s.max_model_len}  # fmt: skip
        loras = [{"id": name, "object": "model", "owned_by": "test", "root": f"/loras/{name}",
                  "parent": s.model} for name in s.adapters]  # fmt: skip
        return {"object": "list", "data": [card, *loras]}

    @get("/metrics", media_type=MediaType.TEXT)
    async def metrics() -> Response[str]:
        text = vllm_metrics(s) if s.dialect == "vllm" else sglang_metrics(s)
        return Response(text, status_code=s.metrics_status, media_type=MediaType.TEXT)

    @post("/v1/completions", status_code=200)
    async def completions(request: Request[Any, Any, Any]) -> Response[Any] | Stream:
        body = await request.json()
        s.requests.append(body)
        if body.get("model") not in (s.model, *s.adapters):
            message = f"The model `{body.get('model')}` does not exist."
            return _error(404, message, "model_not_found")
        if s.behaviour.startswith("status:"):
            return _error(int(s.behaviour.split(":")[1]), "the engine says no")
        return Stream(_events(s, body), media_type="text/event-stream")

    @post("/v1/load_lora_adapter", status_code=200)
    async def load_lora(request: Request[Any, Any, Any]) -> Response[Any]:
        """vLLM's run-time LoRA loading (its messages, its 400s)."""
        body = await request.json()
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return _error(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name in s.adapters:
            return _error(400, f"The lora adapter '{name}' has already been loaded.")
        s.adapters = (*s.adapters, name)
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type=_TEXT)

    @post("/v1/unload_lora_adapter", status_code=200)
    async def unload_lora(request: Request[Any, Any, Any]) -> Response[Any]:
        name = (await request.json()).get("lora_name")
        if name not in s.adapters:
            return _error(404, f"The lora adapter '{name}' cannot be found.")
        s.adapters = tuple(a for a in s.adapters if a != name)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type=_TEXT)

    return Litestar([models, metrics, completions, load_lora, unload_lora])


async def _events(s: EngineState, body: dict[str, Any]) -> AsyncIterator[str]:
    count = int(body["max_tokens"])
    prompt_len = len(body["prompt"]) if isinstance(body["prompt"], list) else 1
    try:
        for i in range(count):
            if s.behaviour == "malformed" and i == 2:
                yield "data: {not json\n\n"
                return
            if s.behaviour == "drop" and i == 2:
                raise ConnectionResetError("the engine went away")  # the server drops the stream
            last = i == count - 1
            reason = ("abort" if s.behaviour == "abort" else "length") if last else None
            choice = {"index": 0, "text": f" w{i}", "finish_reason": reason}
            event = {"id": "cmpl-1", "object": "text_completion", "model": s.model,
                     "choices": [choice]}  # fmt: skip
            s.generated_total += 1
            yield f"data: {json.dumps(event)}\n\n"
            if s.token_delay_s:
                await asyncio.sleep(s.token_delay_s)
        usage = {"prompt_tokens": prompt_len, "completion_tokens": count,
                 "total_tokens": prompt_len + count}  # fmt: skip
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"
        s.finished += 1
    except (asyncio.CancelledError, GeneratorExit):
        s.disconnected += 1
        raise


@dataclass
class RunningEngine:
    state: EngineState
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"


@contextmanager
def running_engine(state: EngineState | None = None) -> Iterator[RunningEngine]:
    """Serves a fake engine on a free loopback port for the duration of the block."""
    state = state or EngineState()
    port = free_port()
    config = uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake engine did not start"
        time.sleep(0.02)
    try:
        yield RunningEngine(state, port)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
