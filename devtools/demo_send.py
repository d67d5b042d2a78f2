"""The demo's requests: its prompts sent to the gateway's chat API (a third of them streamed),
`concurrency` at a time, each answer read back as the client got it, and a line every
PROGRESS_S while they run saying how many are answered (issue 75: the demo printed nothing for
the ~4 minutes its 24 requests took on a loaded machine, and a newcomer could not tell it from a
hang)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

import httpx

from devtools.demo_report import DemoAnswer
from predictor.datasets import PromptRecord

MODEL_NAME = "SmolLM2-135M-Instruct"
# How often the demo says how far its requests are.
PROGRESS_S = 5.0


@dataclass(slots=True)
class Progress:
    total: int
    answered: int = 0
    failed: int = 0
    started: float = field(default_factory=time.perf_counter)

    def line(self) -> str:
        failed = f", {self.failed} failed" if self.failed else ""
        took = time.perf_counter() - self.started
        return f"  {self.answered} of {self.total} answered{failed}, {took:.0f} s"

    async def report_every(self, seconds: float, out: TextIO) -> None:
        """Prints a line every `seconds` until cancelled."""
        while True:
            await asyncio.sleep(seconds)
            print(self.line(), file=out, flush=True)


def _chat_body(record: PromptRecord, max_tokens: int, stream: bool) -> dict[str, object]:
    body: dict[str, object] = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": record.prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _read_stream(payload: bytes) -> tuple[str, str, int, str]:
    text, finish, tokens, request_id = [], "", 0, ""
    for line in payload.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: ") :])
        request_id = chunk.get("id") or request_id
        for choice in chunk.get("choices") or []:
            text.append(choice.get("delta", {}).get("content") or "")
            finish = choice.get("finish_reason") or finish
        if chunk.get("usage"):
            tokens = int(chunk["usage"]["completion_tokens"])
    return "".join(text), finish, tokens, request_id


def _read_body(payload: bytes) -> tuple[str, str, int, str]:
    body = json.loads(payload)
    choice = body["choices"][0]
    tokens = body["usage"]["completion_tokens"]
    return choice["message"]["content"], choice["finish_reason"], tokens, body["id"]


async def _ask(
    client: httpx.AsyncClient, record: PromptRecord, max_tokens: int, stream: bool
) -> DemoAnswer:
    body = _chat_body(record, max_tokens, stream)
    started = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            payload = await response.aread()
    except httpx.HTTPError as exc:
        elapsed = time.perf_counter() - started
        return DemoAnswer(False, "-", stream, elapsed, record.prompt, detail=str(exc))
    elapsed = time.perf_counter() - started
    site = response.headers.get("x-fedllm-site", "-")
    if response.status_code != 200 or b'"error"' in payload:
        detail = payload.decode(errors="replace")[:200]
        return DemoAnswer(False, site, stream, elapsed, record.prompt, detail=detail)
    answer, finish, tokens, request_id = (_read_stream if stream else _read_body)(payload)
    return DemoAnswer(
        True, site, stream, elapsed, record.prompt, answer, finish, tokens,
        request_id=request_id,
    )  # fmt: skip


async def send_all(
    base_url: str,
    workload: list[PromptRecord],
    max_tokens: int,
    concurrency: int,
    progress_every_s: float = PROGRESS_S,
    out: TextIO = sys.stdout,
    transport: httpx.AsyncBaseTransport | None = None,
) -> list[DemoAnswer]:
    """Every prompt's answer, in order; a progress line on `out` every `progress_every_s`
    while they run, and one at the end. `transport`: a stand-in for the gateway (the tests')."""
    limit = asyncio.Semaphore(concurrency)
    progress = Progress(len(workload))

    async def one(client: httpx.AsyncClient, index: int, record: PromptRecord) -> DemoAnswer:
        async with limit:
            answer = await _ask(client, record, max_tokens, stream=index % 3 == 0)
        progress.answered += 1
        progress.failed += not answer.ok
        return answer

    async with httpx.AsyncClient(base_url=base_url, timeout=600, transport=transport) as client:
        reporting = asyncio.ensure_future(progress.report_every(progress_every_s, out))
        try:
            answers = await asyncio.gather(*(one(client, i, r) for i, r in enumerate(workload)))
        finally:
            reporting.cancel()
    print(progress.line(), file=out, flush=True)
    return list(answers)
