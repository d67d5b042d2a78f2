"""The batch file formats and their limits, as pure functions: input lines parsed or refused
naming the line, output and error lines in OpenAI's shape, completion windows, the slices items
are validated in, and the cap on uploads in flight."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from gateway.batches.items import Entry, slices
from gateway.batches.output import line_id, render
from gateway.batches.records import FinalItem
from gateway.batches.request import window_hours
from gateway.db.models import BatchItemStatus
from gateway.errors import GatewayError, Overloaded
from gateway.files.batch_input import parse_lines
from gateway.files.uploads import UploadGate


def line(custom_id: str = "a", **extra: object) -> dict[str, object]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": {}} | extra


def jsonl(*lines: object) -> bytes:
    return b"".join(
        (json.dumps(x).encode() if not isinstance(x, bytes) else x) + b"\n" for x in lines
    )


def test_good_lines_are_kept_raw_in_order() -> None:
    content = jsonl(line("a"), b"   ", line("b", url="/v1/chat/completions", body={"x": [1]}))
    parsed = parse_lines(content, max_lines=10, max_line_bytes=1000)
    assert [(p.number, p.custom_id, p.url) for p in parsed] == [
        (1, "a", "/v1/completions"),
        (3, "b", "/v1/chat/completions"),
    ]
    assert msgspec.json.decode(parsed[1].body) == {"x": [1]}


@pytest.mark.parametrize(
    ("content", "message", "code"),
    [
        (jsonl(line(), b"{nope"), "line 2 of the file: not valid JSON", None),
        (jsonl(line(method="PUT")), "line 1 of the file: method must be POST", None),
        (jsonl(line(url="/v1/embeddings")), "url '/v1/embeddings' is not an endpoint", None),
        (
            jsonl(line(), line()),
            "line 2 of the file: custom_id 'a' is also the custom_id of line 1",
            None,
        ),
        (jsonl(line(body=[1])), "line 1 of the file: body must be a JSON object", None),
        (jsonl(line(custom_id="")), "length >= 1", None),
        (jsonl(line(extra=1)), "unknown field `extra`", None),
        (
            jsonl(line(body={"p": "x" * 200})),
            "a request takes at most 150 bytes",
            "request_too_large",
        ),
        (jsonl(*(line(str(i)) for i in range(4))), "more than 3 requests", "batch_too_large"),
        (b"", "holds no request", None),
        (b"\xc3\x28", "not UTF-8", None),
    ],
)
def test_malformed_files_name_the_line(content: bytes, message: str, code: str | None) -> None:
    with pytest.raises(GatewayError) as refused:
        parse_lines(content, max_lines=3, max_line_bytes=150, param="input_file_id")
    assert message in refused.value.message
    assert (refused.value.param, refused.value.code) == ("input_file_id", code)


def final(status: BatchItemStatus, **fields: object) -> FinalItem:
    base: dict[str, object] = {
        "index": 4,
        "custom_id": "q",
        "status": status,
        "request_id": "cmpl-1",
        "completion": None,
        "error": None,
        "status_code": None,
    }
    return FinalItem(**(base | fields))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("item", "kind", "response", "error"),
    [
        (
            final(BatchItemStatus.COMPLETED, completion={"id": "cmpl-1"}),
            "output",
            {"status_code": 200, "request_id": "cmpl-1", "body": {"id": "cmpl-1"}},
            None,
        ),
        (
            final(BatchItemStatus.FAILED, error={"message": "m", "type": "t"}, status_code=502),
            "error",
            {
                "status_code": 502,
                "request_id": "cmpl-1",
                "body": {"error": {"message": "m", "type": "t"}},
            },
            None,
        ),
        (
            final(
                BatchItemStatus.CANCELLED,
                request_id=None,
                error={"message": "x", "code": "batch_expired"},
            ),
            "error",
            None,
            {"code": "batch_expired", "message": "x"},
        ),
    ],
)
def test_result_lines(item: FinalItem, kind: str, response: object, error: object) -> None:
    written_kind, written = render("batch_1", item)
    assert written.endswith(b"\n")
    assert written_kind == kind
    assert json.loads(written) == {
        "id": line_id("batch_1", 4),
        "custom_id": "q",
        "response": response,
        "error": error,
    }
    assert line_id("batch_1", 4) == line_id("batch_1", 4) != line_id("batch_1", 5)


@pytest.mark.parametrize(
    ("window", "hours"),
    [(None, None), ("24h", 24), ("1h", 1), ("168h", 168)],
)
def test_completion_window(window: str | None, hours: int | None) -> None:
    assert window_hours(window) == hours


@pytest.mark.parametrize("window", ["24", "0h", "169h", "1d", "h", "-1h", "01h"])
def test_bad_completion_window(window: str) -> None:
    with pytest.raises(GatewayError, match="completion_window"):
        window_hours(window)


def test_slices_are_bounded_in_bytes_and_items() -> None:
    def entry(size: int) -> Entry:
        return Entry("w", "c", b"{}", size)

    sizes = [100 << 10, 100 << 10, 100 << 10, 300 << 10, 1]
    assert [len(s) for s in slices([entry(n) for n in sizes])] == [2, 1, 1, 1]
    assert [len(s) for s in slices([entry(1)] * 600)] == [256, 256, 88]
    assert slices([]) == []


def test_uploads_under_way_are_capped_per_key_only() -> None:
    gate = UploadGate(limit=1, per_key=2)
    with gate.admit(1), gate.admit(1):
        with pytest.raises(Overloaded, match="this key has 2 batch upload"):
            gate.admit(1).__enter__()
        # Other keys are not refused for key 1's uploads, however many keys, whatever the limit.
        with gate.admit(2), gate.admit(None), gate.admit(3), gate.admit(3):
            assert gate.in_flight == 6
    assert gate.in_flight == 0
    with gate.admit(1), gate.admit(1):  # given back: the key's share is whole again
        pass
    assert UploadGate(limit=4).per_key == 1  # the default: one upload per key at a time


def test_received_uploads_are_validated_limit_at_a_time_in_turn() -> None:
    async def run() -> None:
        gate = UploadGate(limit=2, per_key=1)
        started: list[int] = []
        most = 0
        release = asyncio.Event()

        async def upload(key: int) -> None:
            nonlocal most
            with gate.admit(key):
                async with gate.validating():
                    started.append(key)
                    most = max(most, gate.validating_now)
                    await release.wait()

        tasks = [asyncio.create_task(upload(key)) for key in range(5)]
        for _ in range(5):  # every task runs to where it waits
            await asyncio.sleep(0)
        assert (started, gate.in_flight, gate.validating_now) == ([0, 1], 5, 2)
        release.set()
        await asyncio.gather(*tasks)
        assert (started, most, gate.in_flight, gate.validating_now) == ([0, 1, 2, 3, 4], 2, 0, 0)

    asyncio.run(run())
