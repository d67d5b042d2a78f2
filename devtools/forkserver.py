"""A parent that has imported a program's modules once and forks a ready copy per launch.

`python -m site_engine` spends ~4 s of CPU importing torch and transformers before it reads its
first argument, and `python -m gateway` ~3 s importing litestar, SQLAlchemy and transformers'
tokenizers. The test suite starts about a hundred sites and eighty gateways: those imports were
~40% of its CPU. A fork server imports them once; each launch is a fork that runs the program's
`__main__` exactly as `python -m` would (runpy, its own argv, environment, working directory and
log file), so a test still talks to a separate process that parses its own arguments, loads its
own model and exits with its own status.

What differs from a fresh interpreter, and why it does not matter for the processes launched here:
the modules were imported under the server's environment (the programs read theirs at start-up,
in main, not at import), and native libraries loaded by the server keep state chosen at load
(OpenBLAS's thread pools, which re-create themselves after a fork). Nothing launched this way is
what an operator runs: `devtools.launch` forks only where FEDLLM_LAUNCH_FORKSERVER=1 (the test
suite sets it) and never for a launch that wraps the interpreter (strace).

Protocol, one JSON object per line on the server's stdin / stdout:
  {"op": "spawn", "args": [...], "env": {...}, "cwd": "...", "log": "..."} -> {"pid": N}
  {"op": "poll", "pid": N} -> {"returncode": null | int}   (negative: killed by that signal)
End of input: the server kills what it launched and exits.

Run as `python -m devtools.forkserver MODULE [PRELOAD ...]` (PRELOAD: the modules to import once,
e.g. `site_engine.__main__`, which imports what the program needs). It imports only the standard
library itself, so it runs in any environment that has MODULE (the gateway's, without torch).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Any


def _child(module: str, request: dict[str, Any], control: tuple[int, int]) -> None:
    """Becomes `python -m module args...` with the request's environment and log; never returns."""
    code = 1
    try:
        for fd in control:
            os.close(fd)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND)  # made by the client
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [module, *request["args"]]
        # The program's own module runs afresh, as under `python -m` (its imports stay loaded).
        sys.modules.pop(module, None)
        sys.modules.pop(f"{module}.__main__", None)
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except BaseException:  # an uncaught error ends the program as the interpreter would
        traceback.print_exc()
    # What the interpreter does at exit: join non-daemon threads, run atexit hooks, flush.
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


class _Server:
    def __init__(self, module: str, control_in: int, control_out: int) -> None:
        self.module = module
        self.control = (control_in, control_out)
        self.exited: dict[int, int] = {}
        self.running: set[int] = set()

    def reap(self) -> None:
        while self.running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.running.discard(pid)
            self.exited[pid] = os.waitstatus_to_exitcode(status)

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        if request["op"] == "spawn":
            sys.stdout.flush()  # nothing buffered here may reach the child's log
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(self.module, request, self.control)
            self.running.add(pid)
            return {"pid": pid}
        if request["op"] == "poll":
            self.reap()
            return {"returncode": self.exited.get(request["pid"])}
        return {"error": f"unknown op {request['op']!r}"}

    def serve(self) -> None:
        reader = os.fdopen(self.control[0], "r", encoding="utf-8", closefd=False)
        while True:
            ready, _, _ = select.select([reader], [], [], 0.2)
            self.reap()
            if not ready:
                continue
            line = reader.readline()
            if not line:
                break
            reply = json.dumps(self.answer(json.loads(line))) + "\n"
            os.write(self.control[1], reply.encode())
        for pid in self.running:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def main() -> None:
    module, *preload = sys.argv[1:]
    for name in preload:
        importlib.import_module(name)
    # Forking copies only the calling thread: refuse if the imports left a Python thread running
    # (native pools such as OpenBLAS's re-create themselves in the child).
    if threading.active_count() != 1:
        sys.exit(f"forkserver: importing {module} started threads; forking would be unsafe")
    # The control pipe moves off fds 0 and 1 (each child replaces those with its own).
    control = (os.dup(0), os.dup(1))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)  # stray prints must not reach the control pipe
    os.write(control[1], b'{"ready": true}\n')
    _Server(module, control[0], control[1]).serve()


# The client side: what devtools.launch uses in the test process.
# "1": devtools.launch starts sites and gateways through fork servers (the test suite sets it);
# unset, each starts with `python -m`, as an operator's do.
FORK_SERVER_ENV = "FEDLLM_LAUNCH_FORKSERVER"
READY_TIMEOUT_S = 120.0
POLL_INTERVAL_S = 0.02


class ForkServerError(RuntimeError):
    """The fork server did not start or stopped answering; the message says where its log is."""


class ForkServer:
    """One running server for `module`, started with `python`; thread-safe."""

    def __init__(self, python: str, module: str, preload: tuple[str, ...], log_path: Path) -> None:
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as log:
            self._popen = subprocess.Popen(
                [python, "-m", "devtools.forkserver", module, *preload],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
            )
        assert self._popen.stdin is not None
        assert self._popen.stdout is not None
        self._requests: IO[bytes] = self._popen.stdin
        self._replies: IO[bytes] = self._popen.stdout
        self._lock = threading.Lock()
        ready, _, _ = select.select([self._replies], [], [], READY_TIMEOUT_S)
        if not ready or not self._replies.readline():
            self.close()
            raise ForkServerError(f"the fork server for {module} did not start: see {log_path}")

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            try:
                self._requests.write(json.dumps(request).encode() + b"\n")
                self._requests.flush()
                line = self._replies.readline()
            except OSError as error:
                raise ForkServerError(f"the fork server is gone: see {self.log_path}") from error
        if not line:
            raise ForkServerError(f"the fork server is gone: see {self.log_path}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def spawn(self, args: list[str], env: dict[str, str], log_path: Path) -> ForkedChild:
        """A child running the module with `args` (what follows `-m module`), its output in
        `log_path` (made empty here, so that it exists when this returns, as with Popen)."""
        log_path.write_bytes(b"")
        request = {"op": "spawn", "args": args, "env": env, "log": str(log_path)}
        request["cwd"] = os.getcwd()
        return ForkedChild(self, int(self._ask(request)["pid"]), args)

    @property
    def alive(self) -> bool:
        return self._popen.poll() is None

    def returncode(self, pid: int) -> int | None:
        code = self._ask({"op": "poll", "pid": pid})["returncode"]
        return None if code is None else int(code)

    def close(self) -> None:
        """Ends the server and every child it launched that still runs."""
        self._requests.close()
        try:
            self._popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._popen.kill()
            self._popen.wait()
        self._replies.close()
        if self._popen.returncode == 0 and self.log_path.stat().st_size == 0:
            self.log_path.unlink()  # kept only when it holds something to read


class ForkedChild:
    """A launched child, with the parts of subprocess.Popen that devtools.launch uses."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._server = server

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.returncode(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(POLL_INTERVAL_S)
        return code

    def send_signal(self, sig: int) -> None:
        # A child that ended is not signalled: its pid may belong to another process by now.
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    main()
