"""How long a large batch takes to create through the gateway, and how long the gateway's event
loop is held meanwhile and while the batch is cancelled (issue 58: "a 90,000-item batch takes
117 s to create, and cancelling it stalls the gateway ~1 s").

    python -m bench.batch_scale [--items 90000] [--database postgresql://postgres@127.0.0.1:5432/postgres]

A real gateway process on PostgreSQL (a fresh database) in front of one site on a tiny random
Llama. The batch (short chat requests; `--endpoint /v1/completions` for prompts) is uploaded as
OpenAI's JSONL file (`POST /v1/files`, purpose batch) and
created from it (`POST /v1/batches`); then cancelled at once (`POST /v1/batches/{id}/cancel`)
and followed until it is `cancelled` (its error file written). A thread asks `/healthz` every
20 ms throughout: the slowest answer in each phase is how long the loop was held. Writes
bench/results/batch_scale/batch_scale.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg

from bench.common import (
    command_line,
    markdown_table,
    results_dir,
    write_one_site_federation,
    write_results,
)
from devtools.launch import GATEWAY_PYTHON_ENV, start_gateway, start_site
from site_engine.make_model import make_model_dir

ROOT = Path(__file__).resolve().parents[1]
SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@dataclass
class Phase:
    """The /healthz answers while one step ran."""

    name: str
    seconds: float = 0.0
    answers: list[float] = field(default_factory=list)

    def row(self) -> list[object]:
        worst = max(self.answers, default=0.0)
        slow = sum(1 for a in self.answers if a > 0.1)
        return [self.name, self.seconds, len(self.answers), worst * 1000, slow]


@contextmanager
def probing(base_url: str, phase_of: list[Phase]) -> Iterator[None]:
    """Asks /healthz every 20 ms, each answer's time counted in the phase current at its end."""
    done = threading.Event()

    def ask() -> None:
        with httpx.Client(base_url=base_url, timeout=60) as client:
            while not done.is_set():
                started = time.monotonic()
                client.get("/healthz").raise_for_status()
                phase_of[-1].answers.append(time.monotonic() - started)
                time.sleep(0.02)

    prober = threading.Thread(target=ask, daemon=True)
    prober.start()
    try:
        yield
    finally:
        done.set()
        prober.join()


@contextmanager
def fresh_database(server: str) -> Iterator[str]:
    name = f"fedllm_bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        url = server.rsplit("/", 1)[0] + f"/{name}"
        yield url.replace("postgresql://", "postgresql+psycopg://", 1)
    finally:
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def body(endpoint: str, index: int) -> dict[str, Any]:
    """A short request of the endpoint (chat: a system and a user message, as batches of chat
    requests mostly are)."""
    if endpoint == CHAT:
        messages = [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": f"Item {index}: say hello"},
        ]
        return {"model": "tiny", "messages": messages, "max_tokens": 4}
    return {"model": "tiny", "prompt": f"Item {index}: say hello", "max_tokens": 4}


def batch_file(items: int, endpoint: str) -> bytes:
    lines = (
        json.dumps(
            {"custom_id": f"r{i}", "method": "POST", "url": endpoint, "body": body(endpoint, i)}
        )
        for i in range(items)
    )
    return ("\n".join(lines) + "\n").encode()


def run_batch(base_url: str, items: int, endpoint: str) -> tuple[list[Phase], dict[str, Any]]:
    phases = [Phase("warm-up")]
    content = batch_file(items, endpoint)
    with httpx.Client(base_url=base_url, timeout=900) as client, probing(base_url, phases):
        time.sleep(0.5)

        def step(name: str) -> Phase:
            phases.append(Phase(name))
            return phases[-1]

        upload = step("upload the file")
        started = time.monotonic()
        answer = client.post(
            "/v1/files",
            files={"file": ("batch.jsonl", content)},
            data={"purpose": "batch"},
        )
        answer.raise_for_status()
        upload.seconds = time.monotonic() - started

        create = step("create the batch")
        started = time.monotonic()
        answer = client.post(
            "/v1/batches",
            json={
                "input_file_id": answer.json()["id"],
                "endpoint": endpoint,
                "completion_window": "24h",
            },
        )
        answer.raise_for_status()
        create.seconds = time.monotonic() - started
        batch = answer.json()

        cancel = step("cancel (the answer)")
        started = time.monotonic()
        answer = client.post(f"/v1/batches/{batch['id']}/cancel")
        answer.raise_for_status()
        cancel.seconds = time.monotonic() - started

        settle = step("cancelling -> cancelled")
        started = time.monotonic()
        while (status := client.get(f"/v1/batches/{batch['id']}").json())["status"] != "cancelled":
            time.sleep(0.1)
        settle.seconds = time.monotonic() - started
        time.sleep(0.5)
    return phases, {"file_bytes": len(content), "counts": status["request_counts"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.batch_scale")
    parser.add_argument("--items", type=int, default=90_000)
    parser.add_argument("--endpoint", choices=(CHAT, COMPLETIONS), default=CHAT)
    parser.add_argument("--database", default=SERVER, help="a PostgreSQL server (psycopg URL)")
    parser.add_argument("--tokenizer", type=Path, default=ROOT.parent / "shared/tokenizers/gpt2")
    parser.add_argument("--out", type=Path, default=results_dir("batch_scale"))
    parser.add_argument("--name", default="batch_scale")
    args = parser.parse_args(argv)
    own = ROOT / ".venv-gateway" / "bin" / "python"
    if own.is_file():
        os.environ.setdefault(GATEWAY_PYTHON_ENV, str(own))
    work = Path(tempfile.mkdtemp(prefix="batch-scale-"))
    model_dir = make_model_dir(work / "tiny-llama", "llama", args.tokenizer.resolve())
    site = start_site(model_dir=model_dir, site_name="s", model_name="tiny", log_dir=work)
    federation = work / "federation.json"
    write_one_site_federation(federation, model_dir, site.port)
    gateway = None
    try:
        with fresh_database(args.database) as url:
            gateway = start_gateway(
                federation_file=federation,
                database_url=url,
                log_dir=work,
                env={"GATEWAY_MAX_BODY_BYTES": str(64 << 20)},
            )
            phases, facts = run_batch(f"http://127.0.0.1:{gateway.port}", args.items, args.endpoint)
            gateway.stop()
            gateway = None
    finally:
        if gateway is not None:
            gateway.stop()
        site.stop()
    rows = [phase.row() for phase in phases[1:]]
    header = ["step", "seconds", "/healthz answers", "slowest ms", "answers > 100 ms"]
    table = markdown_table(header, rows)
    note = (
        f"{args.items} items of {args.endpoint} ({facts['file_bytes']} bytes of JSONL), "
        f"gateway on PostgreSQL, one tiny site; final counts {facts['counts']}. `/healthz` "
        "asked every 20 ms from another thread: its slowest answer in a step is how long the "
        "gateway's event loop was held."
    )
    payload = {
        "items": args.items,
        "endpoint": args.endpoint,
        **facts,
        "phases": [
            {"step": p.name, "seconds": p.seconds, "answers_s": p.answers} for p in phases[1:]
        ],
    }
    command = command_line("bench.batch_scale", argv)
    write_results(args.name, payload, f"{note}\n\n{table}", command, args.out)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
