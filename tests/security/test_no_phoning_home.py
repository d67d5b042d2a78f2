"""Finding 11: the gateway phoned home. With a length predictor loaded, ONNX Runtime resolved
its telemetry collector (mobile.events.data.microsoft.com) from inside the gateway process.

A site and a gateway (with a real ONNX predictor artifact) run under `strace -f`, serve
completions, and stop; every connect() and sendto() to an internet address they made is read
back from the trace. The only destinations allowed are the ones the operator configured: the
sites' endpoints (the database is SQLite here). Anything else, a DNS query included, fails the
test with the destination named. Run in Python alone, an audit hook would miss the native
library's own sockets, which is why the trace is taken by the kernel's side.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest

from devtools.launch import (
    ManagedProcess,
    readiness,
    spawn_site,
    start_gateway,
    wait_until_serving,
)
from tests.e2e.conftest import write_federation
from tests.support.predictor_artifact import small_artifact

pytestmark = pytest.mark.slow

# connect(7, {sa_family=AF_INET, sin_port=htons(53), sin_addr=inet_addr("10.0.0.2")}, 16)
# connect(9, {sa_family=AF_INET6, sin6_port=htons(443), inet_pton(AF_INET6, "::1", ...
_DESTINATION = re.compile(
    r"(connect|sendto)\(.*?sa_family=AF_INET6?, sin6?_port=htons\((\d+)\).*?"
    r"(?:inet_addr\(\"([^\"]+)\"\)|inet_pton\(AF_INET6, \"([^\"]+)\")"
)
# What would silence ONNX Runtime's telemetry from outside the gateway: left out of the traced
# processes, so the gateway alone must do it (CI runners set CI=true).
_OUTSIDE_SWITCHES = ("ORT_DISABLE_TELEMETRY", "ORT_RUNNING_UNIT_TESTS", "CI")
TELEMETRY_WAIT_S = 15.0


def destinations(trace: Path) -> set[tuple[str, int]]:
    found = set()
    for line in trace.read_text(errors="replace").splitlines():
        match = _DESTINATION.search(line)
        if match:
            address = (match.group(3) or match.group(4)).removeprefix("::ffff:")
            found.add((address, int(match.group(2))))
    return found


def tracer(output: Path) -> list[str]:
    strace = shutil.which("strace")
    if strace is None:
        pytest.fail("this test traces the processes' sockets with strace: install strace")
    return [strace, "-f", "-qq", "--seccomp-bpf", "-e", "trace=connect,sendto", "-o", str(output)]


def stop_traced(process: ManagedProcess) -> None:
    """SIGTERM to the traced program (strace's child), then strace ends with it."""
    children = Path(f"/proc/{process.popen.pid}/task/{process.popen.pid}/children")
    for pid in children.read_text().split() if children.exists() else ():
        os.kill(int(pid), signal.SIGTERM)
    process.popen.wait(timeout=30)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_artifact(tmp_path_factory.mktemp("predictor") / "base")


def test_gateway_and_site_connect_only_to_configured_destinations(
    tiny_llama_dir: Path, artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in _OUTSIDE_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    site = spawn_site(
        model_dir=tiny_llama_dir,
        site_name="aws-use1",
        model_name="tiny",
        log_dir=tmp_path,
        wrapper=tracer(tmp_path / "site.trace"),
    )
    started = [site]
    try:
        wait_until_serving(site)
        endpoint = f"127.0.0.1:{site.port}"
        gateway = start_gateway(
            federation_file=write_federation(
                tmp_path / "federation.json", tiny_llama_dir, {"aws-use1": endpoint}
            ),
            database_url=f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}",
            log_dir=tmp_path,
            env={"GATEWAY_PREDICTOR_DIR": str(artifact)},
            wrapper=tracer(tmp_path / "gateway.trace"),
        )
        started.append(gateway)
        ready_at = time.monotonic()
        ready = readiness(gateway)
        assert ready["predictor"]["mode"] == "active"
        for prompt in ("Hello there", "Name three rivers"):
            response = httpx.post(
                f"http://127.0.0.1:{gateway.port}/v1/completions",
                json={"model": "tiny", "prompt": prompt, "max_tokens": 4},
                timeout=60,
            )
            assert response.status_code == 200, response.text
        # ONNX Runtime's telemetry thread first sends about 9 s after the predictor's session
        # is made (measured with strace on 1.31.1): stay up well past that.
        time.sleep(max(0.0, ready_at + TELEMETRY_WAIT_S - time.monotonic()))
    finally:
        for process in reversed(started):
            stop_traced(process)
    allowed = {("127.0.0.1", site.port)}
    for name in ("site", "gateway"):
        unexpected = destinations(tmp_path / f"{name}.trace") - allowed
        assert not unexpected, (
            f"the {name} connected to destinations nobody configured: {unexpected}"
        )
