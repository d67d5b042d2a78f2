"""How long a site engine and a gateway take to serve after their launch, started with
`python -m` and through the tests' fork servers (devtools/forkserver.py), alternating.

    python -m bench.launch_time [--tokenizer ../shared/tokenizers/gpt2] [--rounds 3]

Each round starts a site on a tiny random Llama (its gRPC port announced) and a gateway in front
of it (SQLite; /readyz reports the site healthy), once per launch mode, the modes alternating so
that a change of the host's speed hits both. Writes bench/results/launch_time/launch_time.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import markdown_table, results_dir, write_one_site_federation, write_results
from devtools.forkserver import FORK_SERVER_ENV
from devtools.launch import (
    GATEWAY_PYTHON_ENV,
    close_fork_servers,
    gateway_python,
    start_gateway,
    start_site,
)
from site_engine.make_model import make_model_dir

ROOT = Path(__file__).resolve().parents[1]
MODES = {"python -m": "0", "fork server": "1"}


def _round(model_dir: Path, work: Path) -> tuple[float, float]:
    """Seconds until the site serves, then until the gateway in front of it is ready."""
    started = time.monotonic()
    site = start_site(model_dir=model_dir, site_name="s", model_name="tiny", log_dir=work)
    site_ready = time.monotonic()
    federation = work / "federation.json"
    write_one_site_federation(federation, model_dir, site.port)
    gateway = None
    try:
        gateway = start_gateway(
            federation_file=federation,
            database_url=f"sqlite+aiosqlite:///{work / 'gateway.db'}",
            log_dir=work,
        )
        gateway_ready = time.monotonic()
    finally:
        if gateway is not None:
            gateway.stop()
        site.stop()
    return site_ready - started, gateway_ready - site_ready


def measure(tokenizer: Path, rounds: int) -> dict[str, dict[str, list[float]]]:
    work = Path(tempfile.mkdtemp(prefix="launch-time-"))
    model_dir = make_model_dir(work / "tiny-llama", "llama", tokenizer)
    seconds: dict[str, dict[str, list[float]]] = {m: {"site": [], "gateway": []} for m in MODES}
    for index in range(rounds):
        order = list(MODES) if index % 2 == 0 else list(reversed(MODES))
        for mode in order:
            os.environ[FORK_SERVER_ENV] = MODES[mode]
            site_s, gateway_s = _round(model_dir, work / f"{index}-{MODES[mode]}")
            seconds[mode]["site"].append(site_s)
            seconds[mode]["gateway"].append(gateway_s)
    close_fork_servers()
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.launch_time")
    parser.add_argument("--tokenizer", type=Path, default=ROOT.parent / "shared/tokenizers/gpt2")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    # The gateway runs as the tests and its image run it: in .venv-gateway where there is one.
    own = ROOT / ".venv-gateway" / "bin" / "python"
    if own.is_file():
        os.environ.setdefault(GATEWAY_PYTHON_ENV, str(own))
    # Fork servers are started lazily; the first forked round includes starting them.
    seconds = measure(args.tokenizer.resolve(), args.rounds)
    rows = [
        [mode, part, statistics.median(values), min(values), max(values)]
        for mode, parts in seconds.items()
        for part, values in parts.items()
    ]
    table = markdown_table(["launch", "process", "median s", "min s", "max s"], rows)
    note = (
        "Seconds from launch until the process serves (a site: its READY line; a gateway: "
        "/readyz with its site healthy). The fork server's first round includes starting the "
        "server itself (its imports), which the test suite pays once per worker and program."
    )
    given = sys.argv[1:] if argv is None else argv
    command = "python -m bench.launch_time " + " ".join(given)
    payload = {"seconds": seconds, "gateway_python": gateway_python()}
    write_results(
        "launch_time", payload, f"{table}\n\n{note}\n", command, results_dir("launch_time")
    )
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
