"""The demo says how far its requests are while they run (issue 75: `make demo` printed nothing
for the ~4 minutes its 24 requests took on a loaded machine): a line every few seconds, "n of
24 answered", here against a stand-in gateway that answers a request only once a progress line
has been printed since the one before."""

from __future__ import annotations

import asyncio
import io
import json

import httpx

from devtools.demo_send import send_all
from predictor.datasets import PromptRecord

WORKLOAD = [PromptRecord("builtin", i, f"question {i}", "") for i in range(3)]


class Lines(io.StringIO):
    """The demo's output: each line written wakes the stand-in gateway."""

    def __init__(self) -> None:
        super().__init__()
        self.printed = asyncio.Event()

    def write(self, text: str) -> int:
        if text.endswith("\n"):
            self.printed.set()
        return super().write(text)


def answer(request: httpx.Request, index: int) -> httpx.Response:
    body = json.loads(request.content)
    if body["stream"]:
        delta = {"delta": {"content": "ok"}, "finish_reason": "stop"}
        usage = {"completion_tokens": 1}
        chunks = [{"id": f"c{index}", "choices": [delta]},
                  {"id": f"c{index}", "choices": [], "usage": usage}]  # fmt: skip
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text)
    return httpx.Response(200, json={"id": f"c{index}", "usage": {"completion_tokens": 1},
                                     "choices": [{"message": {"content": "ok"},
                                                  "finish_reason": "stop"}]})  # fmt: skip


def test_the_demo_prints_how_many_requests_are_answered_while_they_run() -> None:
    async def scenario() -> str:
        out = Lines()
        served = 0

        async def gateway(request: httpx.Request) -> httpx.Response:
            nonlocal served
            out.printed.clear()
            await out.printed.wait()  # a progress line since the last answer
            served += 1
            return answer(request, served)

        answers = await send_all(
            "http://demo.test", WORKLOAD, 16, concurrency=1, progress_every_s=0.01, out=out,
            transport=httpx.MockTransport(gateway),
        )  # fmt: skip
        assert [a.ok for a in answers] == [True] * 3
        return out.getvalue()

    lines = asyncio.run(asyncio.wait_for(scenario(), 60)).splitlines()
    said = [line.split(" answered")[0].strip() for line in lines]
    for answered in ("0 of 3", "1 of 3", "2 of 3"):
        assert answered in said, lines  # said while requests ran, before they all were answered
    assert said.index("0 of 3") < said.index("1 of 3") < said.index("2 of 3")
    assert lines[-1].strip().startswith("3 of 3 answered"), lines
