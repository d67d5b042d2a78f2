"""Starting site engines and the gateway as real processes on this machine.

Used by the demo and by the end-to-end tests, so both run the programs an operator runs. The
demo starts each with `python -m`; the tests (FORK_SERVER_ENV=1) start them as forks of a parent
that imported the program once (devtools/forkserver.py), the same program's main with its own
arguments, environment and log, without its seconds of imports.
"""

from __future__ import annotations

import atexit
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from devtools.forkserver import FORK_SERVER_ENV, ForkedChild, ForkServer
from fedllm_contract.site_environment import site_environment

# Not anchored at the line's end (another thread's log line can land right after the number), but
# the number must be followed by something, so a half-written line is not read as a shorter port.
_READY = re.compile(r"^READY port=(\d+)(?=\D)", re.MULTILINE)
# The interpreter `python -m gateway` runs with, where it is not this one: an environment with the
# gateway's own dependencies and no torch, as its container image has (`make setup` builds one in
# .venv-gateway and `make test` names it here). Unset: this interpreter.
GATEWAY_PYTHON_ENV = "FEDLLM_GATEWAY_PYTHON"
# The programs a fork server can launch, with what it imports for them once: the __main__ module
# (which imports the program) and what the program imports later, while it starts.
_FORKABLE: dict[str, tuple[str, ...]] = {
    "site_engine": ("site_engine.__main__",),
    "gateway": (
        "gateway.__main__",
        "uvloop",
        "uvicorn.protocols.http.httptools_impl",
        "onnxruntime",
    ),
}
_fork_servers: dict[tuple[str, str], ForkServer] = {}
# The admin token of each gateway started here, by its port: readiness() of a URL sends it.
_admin_tokens: dict[int, str] = {}
_fork_servers_lock = threading.Lock()


class LaunchError(RuntimeError):
    """A process did not come up; the message includes the end of its log."""


# Ports handed out for a process to bind later come from below Linux's ephemeral range
# (32768-60999), where no port-0 bind lands, and from a slice of their own per pytest-xdist
# worker: a port picked here and bound seconds later by a starting process can then be taken
# meanwhile neither by another process's port-0 bind nor by another worker's pick (CI saw a
# test's site and a bench's site on one port, each picked by a port-0 bind).
_PICKED_PORTS = range(20000, 32000)
_port_cursor: list[int] = []


def _port_slice() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "") or 1)
    index = int(worker[2:]) if worker[:2] == "gw" and worker[2:].isdigit() else 0
    width = len(_PICKED_PORTS) // max(count, 1)
    start = _PICKED_PORTS.start + (index % max(count, 1)) * width
    return range(start, start + width)


def free_port() -> int:
    """A port free now on 127.0.0.1, for a process to bind (see _PICKED_PORTS)."""
    ports = _port_slice()
    if not _port_cursor:  # each process starts at its own place in the slice
        _port_cursor.append(secrets.randbelow(len(ports)))
    for _ in range(len(ports)):
        port = ports[_port_cursor[0] % len(ports)]
        _port_cursor[0] += 1
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {ports.start}-{ports.stop - 1}")


@dataclass
class ManagedProcess:
    name: str
    popen: subprocess.Popen[bytes] | ForkedChild
    log_path: Path
    port: int = 0
    extra: dict[str, str] = field(default_factory=dict)
    # A gateway's GATEWAY_ADMIN_TOKEN: its readiness report is for operators only (readiness()).
    admin_token: str | None = field(default=None, repr=False)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float = 10.0) -> None:
        if not self.alive():
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=timeout_s)

    def terminate(self) -> None:
        """Asks the process to stop (SIGTERM) without waiting; `stop` waits."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.alive():
            self.popen.kill()
            self.popen.wait(timeout=10)


class StopSignal(SystemExit):
    """A stop asked by a signal within stopping_on_signals (its code: 128 + the signal's
    number, what a shell reports for a process the signal ended)."""


@contextmanager
def stopping_on_signals(signals: Sequence[int] = (signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise StopSignal (a SystemExit, as Ctrl-C raises
    KeyboardInterrupt), so that the block's `finally` stops the processes it started when the
    program is asked to stop (`kill`, a closed terminal, a CI timeout) instead of leaving them
    running. A second signal while they stop is ignored."""

    def exit_now(signum: int, _frame: object) -> None:
        for each in signals:
            signal.signal(each, signal.SIG_IGN)
        raise StopSignal(128 + signum)

    previous = {each: signal.signal(each, exit_now) for each in signals}
    try:
        yield
    finally:
        for each, handler in previous.items():
            signal.signal(each, handler)


def stop_all(processes: Sequence[ManagedProcess], timeout_s: float = 10.0) -> None:
    """Stops every process at once (each shuts down while the others do), in the order given."""
    for process in processes:
        process.terminate()
    for process in processes:
        process.stop(timeout_s)


def gateway_python() -> str:
    """The interpreter the gateway runs with (GATEWAY_PYTHON_ENV, else this one)."""
    return os.environ.get(GATEWAY_PYTHON_ENV) or sys.executable


def _spawn(
    name: str,
    args: Sequence[str],
    log_path: Path,
    env: Mapping[str, str] | None = None,
    wrapper: Sequence[str] = (),
    python: str | None = None,
    inherited: Mapping[str, str] | None = None,
) -> ManagedProcess:
    """`wrapper` runs before the interpreter (a tracer such as `strace -f -o FILE`); `python`
    names another interpreter than this one; `inherited`: what of this process's environment
    the child gets (None: all of it), `env` on top."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**(os.environ if inherited is None else inherited), **(env or {})}
    server = None if wrapper else _fork_server(python or sys.executable, args)
    if server is not None:
        return ManagedProcess(name, server.spawn(list(args[2:]), full_env, log_path), log_path)
    with log_path.open("wb") as log_file:
        popen = subprocess.Popen(
            [*wrapper, python or sys.executable, *args],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
        )
    return ManagedProcess(name, popen, log_path)


def _fork_server(python: str, args: Sequence[str]) -> ForkServer | None:
    """The fork server that launches `python -m MODULE` (started on first use), or None where
    launches are not forked (FORK_SERVER_ENV unset, or a program it does not know)."""
    if os.environ.get(FORK_SERVER_ENV) != "1" or len(args) < 2 or args[0] != "-m":
        return None
    module = args[1]
    if module not in _FORKABLE:
        return None
    with _fork_servers_lock:
        server = _fork_servers.get((python, module))
        # One that died (its log says why) is replaced; what it launched fails on its own.
        if server is None or not server.alive:
            log_fd, log_name = tempfile.mkstemp(prefix=f"fedllm-fork-{module}-", suffix=".log")
            os.close(log_fd)
            server = ForkServer(python, module, _FORKABLE[module], Path(log_name))
            _fork_servers[(python, module)] = server
    return server


def close_fork_servers() -> None:
    """Ends every fork server this process started, and whatever they launched that still runs."""
    with _fork_servers_lock:
        for server in _fork_servers.values():
            server.close()
        _fork_servers.clear()


atexit.register(close_fork_servers)


def _wait_for_ready_line(process: ManagedProcess, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = _READY.search(process.log_path.read_text(errors="replace"))
        if match:
            return int(match.group(1))
        if not process.alive():
            raise LaunchError(f"{process.name} exited:\n{process.log_tail()}")
        time.sleep(0.1)
    process.kill()
    raise LaunchError(f"{process.name} not ready after {timeout_s:.0f}s:\n{process.log_tail()}")


def spawn_site(
    *,
    model_dir: Path,
    site_name: str,
    model_name: str,
    log_dir: Path,
    port: int = 0,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    wrapper: Sequence[str] = (),
    module: str = "site_engine",
) -> ManagedProcess:
    """Starts `python -m site_engine` without waiting; see wait_until_serving. `env` adds to
    what a site inherits of this process's environment (fedllm_contract/site_environment.py: a
    demo run with GATEWAY_ADMIN_TOKEN set keeps it from the sites), e.g. SITE_TLS_* for a site
    with mutual TLS, SITE_LOG_LEVEL. `module`: another program that takes the site's arguments
    and starts it its own way (bench.serving_path.site: a synthetic engine's)."""
    args = [
        "-m",
        module,
        "--model",
        str(model_dir),
        "--site-name",
        site_name,
        "--model-name",
        model_name,
        "--port",
        str(port),
        *extra_args,
    ]
    log_path = log_dir / f"site-{site_name}.log"
    return _spawn(site_name, args, log_path, env, wrapper, inherited=site_environment(os.environ))


def wait_until_serving(process: ManagedProcess, timeout_s: float = 120.0) -> ManagedProcess:
    process.port = _wait_for_ready_line(process, timeout_s)
    return process


def start_site(
    *,
    model_dir: Path,
    site_name: str,
    model_name: str,
    log_dir: Path,
    port: int = 0,
    extra_args: Sequence[str] = (),
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
) -> ManagedProcess:
    """Starts `python -m site_engine` and waits until it serves gRPC."""
    process = spawn_site(
        model_dir=model_dir,
        site_name=site_name,
        model_name=model_name,
        log_dir=log_dir,
        port=port,
        extra_args=extra_args,
        env=env,
    )
    return wait_until_serving(process, timeout_s)


def start_gateway(
    *,
    federation_file: Path,
    database_url: str,
    log_dir: Path,
    port: int | None = None,
    env: Mapping[str, str] | None = None,
    expect_healthy_sites: int = 1,
    timeout_s: float = 120.0,
    wrapper: Sequence[str] = (),
    python: str | None = None,
) -> ManagedProcess:
    """Starts `python -m gateway` and waits until its readiness report shows enough healthy
    sites. `python`: the interpreter (default: gateway_python(); a gateway that runs retrain
    jobs needs one with the training extras, as the trainer image has). Without a
    GATEWAY_ADMIN_TOKEN in `env` it gets a random one, kept in the process (readiness() reads
    the readiness report with it)."""
    port = port or free_port()
    gateway_env = {
        "GATEWAY_FEDERATION_FILE": str(federation_file),
        "GATEWAY_DATABASE_URL": database_url,
        "GATEWAY_PORT": str(port),
        "GATEWAY_HEALTH_INTERVAL_S": "0.5",
        "GATEWAY_ADMIN_TOKEN": secrets.token_urlsafe(24),
        **(env or {}),
    }
    process = _spawn(
        "gateway",
        ["-m", "gateway"],
        log_dir / "gateway.log",
        gateway_env,
        wrapper,
        python or gateway_python(),
    )
    process.port = port
    process.admin_token = _admin_tokens[port] = gateway_env["GATEWAY_ADMIN_TOKEN"]
    _wait_for_gateway(process, expect_healthy_sites, timeout_s)
    return process


def readiness(gateway: ManagedProcess | str, timeout_s: float = 10.0) -> dict[str, Any]:
    """The gateway's readiness report (database, sites, drains, request log, predictors):
    /admin/api/readiness, with the admin token start_gateway() gave it (/readyz tells anyone
    only whether it is ready). `gateway`: the process, or its base URL (http://127.0.0.1:PORT)
    if start_gateway() started it here."""
    if isinstance(gateway, ManagedProcess):
        base, token = f"http://127.0.0.1:{gateway.port}", gateway.admin_token
    else:
        base = gateway.rstrip("/")
        token = _admin_tokens.get(urlsplit(base).port or 0)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    answer = httpx.get(f"{base}/admin/api/readiness", headers=headers, timeout=timeout_s)
    body: dict[str, Any] = answer.json()
    return body


def _wait_for_gateway(process: ManagedProcess, healthy_sites: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not process.alive():
            raise LaunchError(f"gateway exited:\n{process.log_tail()}")
        try:
            body = readiness(process, timeout_s=2)
        except (httpx.HTTPError, ValueError):
            time.sleep(0.2)
            continue
        if sum(bool(v) for v in body.get("sites", {}).values()) >= healthy_sites:
            return
        time.sleep(0.2)
    process.kill()
    raise LaunchError(f"gateway not ready after {timeout_s:.0f}s:\n{process.log_tail()}")
