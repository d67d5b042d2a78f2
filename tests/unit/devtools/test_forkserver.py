"""The fork server launches programs as `python -m` would: own argv, cwd, environment, log and
exit status, and nothing of them outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.forkserver import FORK_SERVER_ENV, ForkServer, ForkServerError

PROGRAM = "tests.support.forked_program"
REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ForkServer]:
    monkeypatch.chdir(REPO_ROOT)  # where `-m tests.support...` resolves
    monkeypatch.setenv("FORKED_PROGRAM_MARK", "server")
    forks = ForkServer(sys.executable, PROGRAM, (PROGRAM,), tmp_path / "server.log")
    yield forks
    forks.close()


def _wait_for(log: Path, text: str) -> str:
    deadline = time.monotonic() + 30
    while text not in (content := log.read_text()):
        assert time.monotonic() < deadline, content
        time.sleep(0.02)
    return content


def test_a_child_runs_as_main_with_its_own_argv_cwd_env_and_exit_status(
    server: ForkServer, tmp_path: Path
) -> None:
    log = tmp_path / "child.log"
    child = server.spawn(["exit", "3"], {**os.environ, "FORKED_PROGRAM_MARK": "child"}, log)
    assert log.exists()  # before the child has run, as Popen's log file would
    assert child.wait(timeout=30) == 3
    output = log.read_text()
    assert f"argv=['exit', '3'] cwd={REPO_ROOT} mark=child" in output
    # Imported once by the server, yet run afresh as __main__ in each child (as `python -m`).
    assert "imported-with-mark=child name=__main__" in output
    assert "Warning" not in output
    assert "atexit ran" in output


def test_signals_reach_the_child_and_its_status_says_how_it_ended(
    server: ForkServer, tmp_path: Path
) -> None:
    log = tmp_path / "child.log"
    serving = server.spawn(["serve"], dict(os.environ), log)
    _wait_for(log, "serving")
    assert serving.poll() is None
    serving.terminate()
    assert serving.wait(timeout=30) == 0
    assert "stopped" in log.read_text()

    killed = server.spawn(["serve"], dict(os.environ), tmp_path / "killed.log")
    _wait_for(tmp_path / "killed.log", "serving")
    killed.kill()
    assert killed.wait(timeout=30) == -signal.SIGKILL
    killed.kill()  # ended: not signalled again


def test_an_uncaught_error_ends_the_child_with_status_1_and_its_traceback(
    server: ForkServer, tmp_path: Path
) -> None:
    log = tmp_path / "child.log"
    assert server.spawn(["raise"], dict(os.environ), log).wait(timeout=30) == 1
    assert "RuntimeError: boom" in log.read_text()


def test_wait_times_out_like_popen(server: ForkServer, tmp_path: Path) -> None:
    child = server.spawn(["serve"], dict(os.environ), tmp_path / "child.log")
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.1)
    child.kill()


def test_closing_the_server_ends_what_it_launched(tmp_path: Path) -> None:
    forks = ForkServer(sys.executable, PROGRAM, (PROGRAM,), tmp_path / "server.log")
    child = forks.spawn(["serve"], dict(os.environ), tmp_path / "child.log")
    _wait_for(tmp_path / "child.log", "serving")
    forks.close()
    with pytest.raises(ProcessLookupError):
        os.kill(child.pid, 0)
    assert not (tmp_path / "server.log").exists()  # an empty log is not kept


def test_a_server_that_cannot_import_its_program_fails_loudly(tmp_path: Path) -> None:
    with pytest.raises(ForkServerError, match="did not start"):
        ForkServer(sys.executable, "no_such_program", ("no_such_program",), tmp_path / "s.log")
    assert "ModuleNotFoundError" in (tmp_path / "s.log").read_text()


def test_a_server_that_died_is_replaced_for_the_next_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from devtools import launch

    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setenv(FORK_SERVER_ENV, "1")
    monkeypatch.setitem(launch._FORKABLE, PROGRAM, (PROGRAM,))
    args = ["-m", PROGRAM, "exit", "0"]
    first = launch._fork_server(sys.executable, args)
    assert first is not None
    assert launch._fork_server(sys.executable, args) is first
    first._popen.kill()
    first._popen.wait()
    second = launch._fork_server(sys.executable, args)
    assert second is not None
    assert second is not first
    assert second.alive
    try:
        process = launch._spawn("forked", args, tmp_path / "child.log")
        assert process.popen.wait(timeout=30) == 0
    finally:  # only this test's server: others of this worker may have children running
        launch._fork_servers.pop((sys.executable, PROGRAM)).close()
