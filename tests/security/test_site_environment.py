"""Issue 67: pooled and elastic site processes inherited the gateway's admin token, metrics
token and database URL (readable in /proc/<pid>/environ by the site's user and anything the
site runs). The local actuator's sites, cold or pooled, and devtools' sites now get only what a
site needs (fedllm_contract/site_environment.py), plus their slot's own environment."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from devtools.launch import spawn_site
from fedllm_contract.site_environment import site_environment
from gateway.scaling.config import ActuatorConfig, LocalSlot
from gateway.scaling.local import LocalProcesses

pytestmark = pytest.mark.slow
GATEWAY_SECRETS = {
    "GATEWAY_ADMIN_TOKEN": "admin-token-the-sites-must-not-see",
    "GATEWAY_ADMIN_METRICS_TOKEN": "metrics-token-the-sites-must-not-see",
    "GATEWAY_DATABASE_URL": "postgresql+psycopg://fedllm:db-password@db/fedllm",
    "HF_TOKEN": "hf_the_sites_never_download",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-the-sites-must-not-see",
}


def environ(pid: int) -> dict[str, str]:
    """The environment the process was started with. Read again while it comes back empty:
    just after its exec the kernel may not have it in place yet (seen here, about 1 read in 5)."""
    deadline = time.monotonic() + 10.0
    while not (raw := Path(f"/proc/{pid}/environ").read_bytes()):
        assert time.monotonic() < deadline, f"process {pid} shows no environment"
        time.sleep(0.01)
    pairs = (entry.decode().partition("=") for entry in raw.split(b"\0") if entry)
    return {name: value for name, _, value in pairs}


def _no_secrets(env: dict[str, str]) -> None:
    leaked = {name for name in env if name in GATEWAY_SECRETS}
    leaked |= {name for name, value in env.items() if value in GATEWAY_SECRETS.values()}
    assert not leaked, leaked


def test_what_a_site_inherits() -> None:
    parent = {
        **GATEWAY_SECRETS,
        "PATH": "/usr/bin",
        "HOME": "/home/fedllm",
        "PYTHONPATH": "/srv/fedllm",
        "SITE_TORCH_THREADS": "2",
        "SITE_TLS_KEY": "/etc/fedllm/tls/key.pem",  # a site's own setting: the key's path
        "HF_HOME": "/cache/hf",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "LC_ALL": "C.UTF-8",
        "FEDLLM_SHARED_DIR": "/shared",
        "GATEWAY_FEDERATION_FILE": "/etc/fedllm/federation.json",
        "DATABASE_URL": "postgresql://x",
        "FEDLLM_TLS_KEY_PEM": "-----BEGIN PRIVATE KEY-----",
    }
    env = site_environment(parent, {"CUDA_VISIBLE_DEVICES": "1", "FEDLLM_TEST_SLOT": "1"})
    assert env == {
        "PATH": "/usr/bin",
        "HOME": "/home/fedllm",
        "PYTHONPATH": "/srv/fedllm",
        "SITE_TORCH_THREADS": "2",
        "SITE_TLS_KEY": "/etc/fedllm/tls/key.pem",
        "HF_HOME": "/cache/hf",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "LC_ALL": "C.UTF-8",
        "FEDLLM_SHARED_DIR": "/shared",
        "CUDA_VISIBLE_DEVICES": "1",  # the slot's own pass whole
        "FEDLLM_TEST_SLOT": "1",
    }


def test_pooled_and_elastic_sites_get_none_of_the_gateways_secrets(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in GATEWAY_SECRETS.items():
        monkeypatch.setenv(name, value)  # the gateway's process environment

    async def failed(model: str, reason: str) -> None:
        return

    async def run() -> None:
        command = (sys.executable, "-m", "site_engine", "--model", str(tiny_llama_dir))
        slot = LocalSlot((("FEDLLM_TEST_SLOT", "0"),), ())
        config = ActuatorConfig(kind="local", name_prefix="el", command=command, slots=(slot,),
                                log_dir=tmp_path, stop_timeout_s=5.0, pool_size=1)  # fmt: skip
        actuator = LocalProcesses("tiny", config, None, failed)  # type: ignore[arg-type]
        try:
            await actuator.tick([])  # the pool fills on the controller's ticks
            (pooled,) = actuator.pooled()
            pooled_env = environ(pooled.popen.pid)
            assert pooled_env["PATH"] == os.environ["PATH"]
            _no_secrets(pooled_env)
            # A cold start (no pooled process is ready yet): the slot's environment, none of
            # the gateway's.
            assert await actuator.start(1) == 1
            cold_env = environ(actuator._children["el-0"].popen.pid)
            assert cold_env["FEDLLM_TEST_SLOT"] == "0"
            _no_secrets(cold_env)
        finally:
            await actuator.close()

    asyncio.run(run())


def test_devtools_sites_get_none_of_the_starters_secrets(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`make demo` run by an operator with GATEWAY_ADMIN_TOKEN exported: its sites do not
    inherit it (its gateway is given it)."""
    for name, value in GATEWAY_SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("FEDLLM_LAUNCH_FORKSERVER", "0")  # `python -m`, as the demo starts them
    site = spawn_site(model_dir=tiny_llama_dir, site_name="demo-site", model_name="tiny",
                      log_dir=tmp_path, env={"SITE_LOG_LEVEL": "INFO"})  # fmt: skip
    try:
        env = environ(site.popen.pid)
        assert env["SITE_LOG_LEVEL"] == "INFO"
        _no_secrets(env)
    finally:
        site.stop(5.0)
