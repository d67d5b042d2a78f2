"""The local actuator's warm pool: `pool_size` site-engine processes started ahead of need with
`--pool` (site_engine/pool.py): imports done, weights in host memory, tokenizer and grammar
compiler built, no device touched. A scale-out claims one (one JSON line on its stdin: the
slot's environment and arguments, the site's name), and it serves in about a second instead of a
cold start's tens; the pool starts another in its place.

A pooled process holds host memory (the model's weights once more, the imports' few hundred MiB)
and no GPU. Its output goes to `<log_dir>/<prefix>-pool-<n>.log`, where the site it becomes
keeps writing. Its command line names it `<prefix>-pool-<n>` (the claim's `--site-name`
replaces that for the site), so that what counts a model's processes counts the pool's too.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from fedllm_contract.site_environment import site_environment
from gateway.scaling.config import ActuatorConfig, LocalSlot

log = logging.getLogger(__name__)
POOLED_LINE = b"POOLED pid="


def start_site_process(
    config: ActuatorConfig,
    model: str,
    name: str,
    args: list[str],
    stdin: int,
    env: dict[str, str],
) -> tuple[subprocess.Popen[bytes], Path]:
    """Site `name`'s process, of the actuator's command serving `model` (`args` after its host,
    `--site-name` among them), its output to `<log_dir>/<name>.log`: a site started (local.py)
    and a pooled process alike."""
    command = [*config.command]
    if "--model-name" not in command:
        command += ["--model-name", model]
    command += ["--host", config.host, *args]
    config.log_dir.mkdir(parents=True, exist_ok=True)
    log_path = config.log_dir / f"{name}.log"
    with log_path.open("wb") as out:
        popen = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, stdin=stdin, env=env
        )
    return popen, log_path


@dataclass
class Pooled:
    popen: subprocess.Popen[bytes]
    log_path: Path
    started_at: float

    @property
    def ready(self) -> bool:
        """Prepared and waiting for its claim (it printed its POOLED line and runs)."""
        if self.popen.poll() is not None:
            return False
        try:
            return POOLED_LINE in self.log_path.read_bytes()
        except OSError:
            return False


class LocalPool:
    """Contract: `fill()` starts processes until `size` run (dead ones are replaced);
    `take(slot, name)` claims a ready one for the slot under the site's name (None: none
    ready) and the next `fill()` replaces it; `close()` ends the unclaimed ones (their stdin
    closes: they exit unused)."""

    def __init__(self, config: ActuatorConfig, model: str) -> None:
        self._config = config
        self._model = model
        self._members: list[Pooled] = []
        self._serial = 0

    @property
    def size(self) -> int:
        return self._config.pool_size

    def members(self) -> list[Pooled]:
        return list(self._members)

    def fill(self) -> None:
        for member in [m for m in self._members if m.popen.poll() is not None]:
            log.warning("pooled site process %d exited (%s): replaced; see %s",
                        member.popen.pid, member.popen.returncode, member.log_path)  # fmt: skip
            self._members.remove(member)
        while len(self._members) < self.size:
            self._members.append(self._spawn())

    def _spawn(self) -> Pooled:
        name = f"{self._config.name_prefix}-pool-{self._serial}"
        self._serial += 1
        plans = self._config.log_dir / "kv-plans.json"
        args = ["--site-name", name, "--pool", "--kv-plan-file", str(plans)]
        # What a site needs of the gateway's environment, not its secrets: a pooled process
        # keeps it as the site it becomes (the claim adds the slot's).
        popen, log_path = start_site_process(
            self._config, self._model, name, args, subprocess.PIPE, site_environment(os.environ)
        )
        log.info("pooled site process %s started (pid %d): %s", name, popen.pid, log_path)
        return Pooled(popen, log_path, time.monotonic())

    def take(self, place: LocalSlot, name: str) -> Pooled | None:
        ready = next((m for m in self._members if m.ready), None)
        if ready is None:
            return None
        claim = {"args": ["--port", "0", "--site-name", name, *place.args], "env": dict(place.env)}
        assert ready.popen.stdin is not None
        try:
            ready.popen.stdin.write(json.dumps(claim).encode() + b"\n")
            ready.popen.stdin.flush()
        except OSError:  # it died between the check and the claim: a cold start instead
            return None
        self._members.remove(ready)
        return ready

    def close(self) -> None:
        for member in self._members:
            if member.popen.stdin is not None:
                member.popen.stdin.close()
        for member in self._members:
            try:
                member.popen.wait(timeout=self._config.stop_timeout_s)
            except subprocess.TimeoutExpired:
                member.popen.kill()
                member.popen.wait()
        self._members.clear()
