"""Several gateway processes behind one port (GATEWAY_WORKERS, issue 74).

One gateway process is one event loop: past about a core of streaming work it delivers fewer
tokens than its sites make. With GATEWAY_WORKERS=N, `python -m gateway` becomes a supervisor
that runs the database's migrations once and starts N worker processes, each a whole gateway
(`python -m gateway` with GATEWAY_WORKERS=1) listening on the same address with SO_REUSEPORT, so
the kernel spreads new connections over them (vLLM's `--api-server-count`, gunicorn's workers).

Each worker is what a gateway replica is on PostgreSQL (docs/architecture.md, "Processes"): it
routes on the sites' own load reports and its own requests, and what must be exact across them
is kept where it already is for replicas: key limits, idempotency records, the request log,
files and batches (run under leases) are rows of the one database. On SQLite that state lives
in one process's memory, so several workers need PostgreSQL (a settings error otherwise).

The supervisor forwards SIGTERM/SIGINT to the workers and waits for them; a worker that dies
is started again (at most one start a second); a worker outlives no supervisor (the kernel
ends it with SIGTERM when its parent goes: PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

from gateway.db.migrate import upgrade
from gateway.settings import GatewaySettings

log = logging.getLogger("gateway.workers")
_PR_SET_PDEATHSIG = 1
_STOP_TIMEOUT_S = 30.0
_RESTART_EVERY_S = 1.0


def listening_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A listening TCP socket on host:port (SO_REUSEPORT when several processes share it)."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _die_with_parent() -> None:
    """In the worker, before exec: SIGTERM when the supervisor goes, however it goes."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Supervisor:
    """Starts, watches and stops the worker processes."""

    def __init__(
        self,
        settings: GatewaySettings,
        spawn: Callable[[dict[str, str]], subprocess.Popen[bytes]] | None = None,
    ) -> None:
        self._settings = settings
        self._spawn = spawn or _spawn
        self._workers: list[subprocess.Popen[bytes] | None] = []
        self._stopping = False
        self._env: dict[str, str] = {}

    def run(self) -> int:
        settings = self._settings
        if settings.database.auto_migrate:
            upgrade(settings.database.url)  # once, before any worker opens the database
        # The port first (a port of 0 is chosen here), held without listening so it stays ours.
        holder = socket.socket(socket.AF_INET6 if ":" in settings.server.host else socket.AF_INET)
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind((settings.server.host.strip("[]"), settings.server.port))
        port = holder.getsockname()[1]
        self._env = {
            **os.environ,
            "GATEWAY_WORKERS": "1",
            "GATEWAY_PORT": str(port),
            "GATEWAY_REUSE_PORT": "true",
            "GATEWAY_AUTO_MIGRATE": "false",
        }
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._stop)
        count = settings.server.workers
        self._workers = [self._spawn(self._env) for _ in range(count)]
        log.info("%d gateway workers on %s:%d", count, settings.server.host, port)
        try:
            return self._watch()
        finally:
            holder.close()

    def _watch(self) -> int:
        last_start = 0.0
        while not self._stopping:
            time.sleep(0.2)
            for i, worker in enumerate(self._workers):
                if worker is None or worker.poll() is None or self._stopping:
                    continue
                log.error("gateway worker %d (pid %d) exited with %s; starting it again",
                          i, worker.pid, worker.returncode)  # fmt: skip
                time.sleep(max(0.0, last_start + _RESTART_EVERY_S - time.monotonic()))
                last_start = time.monotonic()
                self._workers[i] = self._spawn(self._env)
        return self._wait()

    def _stop(self, signum: int, _frame: object) -> None:
        self._stopping = True
        for worker in self._workers:
            if worker is not None and worker.poll() is None:
                worker.send_signal(signal.SIGTERM)

    def _wait(self) -> int:
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        code = 0
        for worker in self._workers:
            if worker is None:
                continue
            try:
                worker.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
            code = code or (worker.returncode if worker.returncode > 0 else 0)
        return code


def _spawn(env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "gateway"], env=env, preexec_fn=_die_with_parent)
