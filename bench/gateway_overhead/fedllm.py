"""One gwbench run of fedllm's gateway (../shared/gwbench/bench.sh): a fake gRPC site, the
gateway on one core, the paired direct/gateway matrix.

The kit's own `run_fedllm.sh` writes a federation file without a chat template (the gateway no
longer guesses one, so every /v1/chat/completions request would be a 400): this run writes the
same federation with the contract's ChatML template, imports the gateway from the checkout being
measured (PYTHONPATH: the shared virtualenv's editable install points at another checkout) and,
on PostgreSQL, creates a database of its own and sums the CPU of its server backends.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from fedllm_contract.tokenizer import CHATML_TEMPLATE

POSTGRES_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"
SITE_PORT = 50151
GW_PORT = 8100
_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Kit:
    """Where the kit and its inputs are."""

    gwbench: Path
    tokenizer: Path
    predictor: Path | None  # None: the gateway runs in fallback mode (no predictor)
    routing: str = "mico"


def _federation(work: Path, kit: Kit) -> Path:
    (work / "chatml.jinja").write_text(CHATML_TEMPLATE)
    model = {"name": "fake-model", "tokenizer": str(kit.tokenizer), "chat_template": "chatml.jinja"}
    site = {
        "name": "fake-site",
        "cloud": "local",
        "region": "loopback",
        "endpoint": f"127.0.0.1:{SITE_PORT}",
        "model": "fake-model",
        "capacity_weight": 1.0,
    }
    path = work / "federation.json"
    path.write_text(json.dumps({"models": [model], "sites": [site]}))
    return path


def checkout_gateway_python(checkout: Path) -> Path:
    """The gateway as its image runs it (`make setup`'s .venv-gateway: no torch, which
    transformers would otherwise import, growing the heap every full collection walks), else
    the development environment."""
    own = checkout / ".venv-gateway" / "bin" / "python"
    return own if own.exists() else checkout / ".venv" / "bin" / "python"


def gateway_command(
    checkout: Path,
    work: Path,
    kit: Kit,
    database_url: str | None,
    port: int = GW_PORT,
    extra_env: dict[str, str] | None = None,
) -> str:
    """The shell command that starts the gateway in `work`; `extra_env` adds or overrides
    environment variables (GATEWAY_* settings)."""
    env = {
        "PYTHONPATH": str(checkout),
        "GATEWAY_FEDERATION_FILE": str(_federation(work, kit)),
        "GATEWAY_HOST": "127.0.0.1",
        "GATEWAY_PORT": str(port),
        "GATEWAY_ROUTING_POLICY": kit.routing,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "DO_NOT_TRACK": "1",
    }
    if kit.predictor is not None:
        env["GATEWAY_PREDICTOR_DIR"] = str(kit.predictor)
    if database_url is not None:
        env["GATEWAY_DATABASE_URL"] = database_url
    env |= extra_env or {}
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    python = checkout_gateway_python(checkout)
    unset = "-u GATEWAY_DATABASE_URL -u GATEWAY_PREDICTOR_DIR"
    return f"cd {shlex.quote(str(work))} && exec env {unset} {assignments} {python} -m gateway"


def site_command(checkout: Path, kit: Kit) -> str:
    python = checkout / ".venv" / "bin" / "python"
    return (
        f"exec {python} {kit.gwbench / 'fake_site.py'} --checkout {checkout} --port {SITE_PORT} "
        f"--model-name fake-model --tokenizer {kit.tokenizer} "
        "--stubs-module fedllm_contract.proto --tokenizer-module fedllm_contract.tokenizer"
    )


def start_site(
    checkout: Path, kit: Kit, output: Any = subprocess.DEVNULL
) -> subprocess.Popen[bytes]:
    """The kit's fake site on cpu 0, returned once its port takes connections (it imports grpc
    and loads its tokenizer first); stopped again if it exits or is not up within a minute."""
    # taskset and bash exec what they run: the pid is the Python process itself.
    command = ["taskset", "-c", "0", "bash", "-c", site_command(checkout, kit)]
    site = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while site.poll() is None and time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", SITE_PORT), timeout=1).close()
            return site
        except OSError:
            time.sleep(0.2)
    site.kill()
    site.wait()
    raise RuntimeError(f"the fake site did not open 127.0.0.1:{SITE_PORT} (exit {site.returncode})")


def run_bench(name: str, out: Path, gw_cmd: str, aux_cmd: str, kit: Kit) -> None:
    """bench.sh with the matrix knobs already in the environment."""
    args = [
        str(kit.gwbench / "bench.sh"),
        "--name",
        name,
        "--out",
        str(out),
        "--gw-url",
        f"http://127.0.0.1:{GW_PORT}",
        "--gw-model",
        "fake-model",
        "--gw-start-cmd",
        gw_cmd,
        "--aux-backend-cmd",
        aux_cmd,
        "--aux-ready-port",
        str(SITE_PORT),
        "--gw-ready-url",
        f"http://127.0.0.1:{GW_PORT}/readyz",
    ]
    subprocess.run(args, check=True, stdout=(out / "bench.out").open("w"), stderr=subprocess.STDOUT)


class BackendCpu:
    """Sums the CPU (/proc utime + stime) of the PostgreSQL backends serving `database`,
    sampled every `every_s` (a backend that ends between two samples loses its last slice)."""

    def __init__(self, database: str, every_s: float = 0.5) -> None:
        self._tag = f" {database} "
        self._every_s = every_s
        self._seen: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> BackendCpu:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    @property
    def cpu_s(self) -> float:
        return sum(self._seen.values()) / _TICKS

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            self._sample()

    def _sample(self) -> None:
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                title = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                if not title.startswith("postgres:") or self._tag not in title:
                    continue
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            ticks = int(fields[11]) + int(fields[12])  # utime, stime
            self._seen[int(proc.name)] = max(ticks, self._seen.get(int(proc.name), 0))


@contextmanager
def postgres_database() -> Iterator[str]:
    """A fresh database on the local server, dropped afterwards; yields its name."""
    name = f"gwbench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(POSTGRES_SERVER, autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{name}"')
    try:
        yield name
    finally:
        with psycopg.connect(POSTGRES_SERVER, autocommit=True) as connection:
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _count_requests(database: str) -> int:
    url = POSTGRES_SERVER.rsplit("/", 1)[0] + f"/{database}"
    with psycopg.connect(url) as connection:
        row = connection.execute("SELECT count(*) FROM requests").fetchone()
    return int(row[0]) if row else 0


def run_fedllm(checkout: Path, out: Path, kit: Kit, database: str) -> dict[str, Any]:
    """One matrix of fedllm's gateway on `database` ("sqlite" or "postgres"); what it adds to
    the kit's summary (the server's CPU per request on PostgreSQL)."""
    out.mkdir(parents=True, exist_ok=True)
    work = Path(f"/tmp/gwbench/fedllm-work/{out.name}-{int(time.time())}")
    (work / "var").mkdir(parents=True, exist_ok=True)
    site = site_command(checkout, kit)
    rev = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    extra: dict[str, Any] = {"database": database, "rev": rev, "checkout": str(checkout)}
    if database == "sqlite":
        run_bench(
            f"fedllm-{rev}-sqlite", out, gateway_command(checkout, work, kit, None), site, kit
        )
        return extra
    with postgres_database() as name:
        url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
        with BackendCpu(name) as server:
            run_bench(
                f"fedllm-{rev}-postgres", out, gateway_command(checkout, work, kit, url), site, kit
            )
        requests = _count_requests(name)
    extra |= {
        "postgres_backend_cpu_s": round(server.cpu_s, 2),
        "postgres_requests": requests,
        "postgres_cpu_ms_per_req": round(1000 * server.cpu_s / requests, 3) if requests else None,
    }
    return extra
