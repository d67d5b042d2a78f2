"""A CPU profile of fedllm's gateway under gwbench load: where its time per request goes.

    python -m bench.gateway_overhead.profile [--checkout DIR] [--predictor DIR] [--database URL]
        [--routing mico] [--concurrency 32] [--requests 3000] [--stream]
        [--out DIR]

Starts the fake gRPC site (cpu 0) and the gateway (cpu 1) as the overhead benchmark does, warms
the gateway up, then samples it with py-spy (`record --format raw`, every thread, idle samples
included so that pyspy_summary.py can drop them) while the kit's load generator (cpu 0) sends
the requests; writes the raw profile and the kit's summary of it.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench.common import results_dir
from bench.gateway_overhead.fedllm import (
    GW_PORT,
    SITE_PORT,
    Kit,
    gateway_command,
    start_site,
)

ROOT = Path(__file__).resolve().parents[2]
LOAD_PY = "/tmp/gwbench/venv/bin/python"


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout_s: float = 180) -> None:
    """Returns once `url` answers 200; raises if `process` exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the process behind {url} exited ({process.returncode})")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url} not ready after {timeout_s}s")


def load_command(
    kit: Kit,
    concurrency: int,
    requests: int,
    stream: bool,
    port: int = GW_PORT,
    sut_pid: int | None = None,
) -> list[str]:
    """The kit's load generator (cpu 0) against the gateway on `port`; `sut_pid` makes it
    report that process's CPU per request."""
    args = [LOAD_PY, str(kit.gwbench / "load.py"), "--url", f"http://127.0.0.1:{port}/v1"]
    args += ["--model", "fake-model", "-c", str(concurrency), "-n", str(requests)]
    args += ["--duration", "120", "--cpu", "0"]
    args += ["--sut-pid", str(sut_pid)] if sut_pid is not None else []
    return [*args, "--stream"] if stream else args


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _refuse_taken_ports() -> None:
    for port in (GW_PORT, SITE_PORT):
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                raise SystemExit(f"127.0.0.1:{port} is taken: another gateway or site is running")


def profile(args: argparse.Namespace, kit: Kit) -> Path:
    _refuse_taken_ports()
    out: Path = args.out
    work = Path(f"/tmp/gwbench/fedllm-work/profile-{int(time.time())}")
    (work / "var").mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    logs = (out / "site.log").open("w"), (out / "gateway.log").open("w")
    site = start_site(args.checkout, kit, logs[0])
    gateway: subprocess.Popen[bytes] | None = None
    try:
        gw_cmd = gateway_command(args.checkout, work, kit, args.database)
        gateway = subprocess.Popen(
            ["taskset", "-c", "1", "bash", "-c", gw_cmd], stdout=logs[1], stderr=subprocess.STDOUT
        )
        wait_ready(f"http://127.0.0.1:{GW_PORT}/readyz", gateway)
        subprocess.run(load_command(kit, 8, 300, args.stream), check=True, capture_output=True)
        raw = out / "profile.txt"
        spy = subprocess.Popen(
            [
                shutil.which("py-spy") or str(ROOT / ".venv/bin/py-spy"),
                "record",
                "--pid",
                str(gateway.pid),
                "--rate",
                "250",
                "--format",
                "raw",
                "--threads",
                "--idle",
                "--nonblocking",
                "-o",
                str(raw),
            ],
            stdout=subprocess.DEVNULL,
            stderr=(out / "py-spy.log").open("w"),
        )
        time.sleep(1)
        load = load_command(kit, args.concurrency, args.requests, args.stream)
        result = subprocess.run(load, check=True, capture_output=True, text=True)
        (out / "load.json").write_text(result.stdout)
        spy.send_signal(2)  # SIGINT: py-spy writes the profile and exits
        spy.wait(60)
    finally:
        if gateway is not None:
            _stop(gateway)
        _stop(site)
    summary = subprocess.run(
        [sys.executable, str(kit.gwbench / "pyspy_summary.py"), str(raw), "--top", "30"],
        check=True,
        capture_output=True,
        text=True,
    )
    (out / "summary.txt").write_text(summary.stdout)
    return out / "summary.txt"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway_overhead.profile")
    parser.add_argument("--checkout", type=Path, default=ROOT)
    parser.add_argument("--gwbench", type=Path, default=ROOT.parent / "shared" / "gwbench")
    parser.add_argument("--tokenizer", type=Path, default=ROOT.parent / "shared/tokenizers/gpt2")
    parser.add_argument("--predictor", type=Path, default=ROOT / "var" / "predictor" / "default")
    parser.add_argument("--no-predictor", action="store_true")
    parser.add_argument("--routing", default="mico", help="GATEWAY_ROUTING_POLICY")
    parser.add_argument("--database", help="GATEWAY_DATABASE_URL (default: SQLite)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument(
        "--out", type=Path, default=results_dir("gateway_overhead") / "gateway_profile"
    )
    args = parser.parse_args(argv)
    args.checkout = args.checkout.resolve()
    predictor = None if args.no_predictor else args.predictor.resolve()
    kit = Kit(args.gwbench.resolve(), args.tokenizer.resolve(), predictor, routing=args.routing)
    print(profile(args, kit).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
