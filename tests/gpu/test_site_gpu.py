"""`python -m site_engine` started as an operator starts it on a GPU, at the documented settings,
for Llama-3.2-1B- and Llama-3.1-8B-shaped random models (128k vocabulary, 131,072 positions):
it must start (no out-of-memory while sizing or capturing), say what it chose, and serve 64
concurrent requests through its OpenAI HTTP face; the 1B site also serves a 32k-token prompt.

Settings: none given (the GPU defaults, vLLM's for the device's memory) and the limits
docs/engine-gpu.md measured best on an H200 (1,024 sequences, 8,192 tokens a step).

The site process needs the site's own packages (grpcio, grpcio-health-checking, protobuf,
litestar, uvicorn), which the bare GPU image lacks: carry them as wheels
(bench/elastic/device_wheels.sh) and put them on PYTHONPATH, or this test fails saying so.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from bench.engine.model_setup import LLAMA_1B_LONG_SHAPE, LLAMA_8B_SHAPE, build_model_dir

pytestmark = pytest.mark.gpu
SHAPES = {"1b": LLAMA_1B_LONG_SHAPE, "8b": LLAMA_8B_SHAPE}
SETTINGS = {
    "defaults": [],
    "documented": ["--max-num-seqs", "1024", "--max-num-batched-tokens", "8192"],
}
WORDS = ("river", "stone", "light", "market", "winter", "engine", "garden", "signal", "paper")


@pytest.fixture(scope="module")
def model_dirs(
    tmp_path_factory: pytest.TempPathFactory, gpt2_tokenizer_dir: Path
) -> Callable[[str], Path]:
    """The model directory of a shape, built on first use (the 8B one takes a minute)."""
    root = tmp_path_factory.mktemp("site-models")
    built: dict[str, Path] = {}

    def get(shape: str) -> Path:
        if shape not in built:
            build_model_dir(root / shape, SHAPES[shape], gpt2_tokenizer_dir, torch.bfloat16, 0,
                            "cuda")  # fmt: skip
            built[shape] = root / shape
        return built[shape]

    return get


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Site:
    """One `python -m site_engine` process, its log in a file."""

    def __init__(self, model: Path, log: Path, extra: list[str]) -> None:
        self.http_port = _free_port()
        self.log_path = log
        command = [
            sys.executable, "-m", "site_engine", "--model", str(model), "--site-name", "gpu",
            "--model-name", "m", "--port", "0", "--http-port", str(self.http_port),
            "--device", "cuda", "--dtype", "bfloat16", *extra,
        ]  # fmt: skip
        self._log = log.open("wb")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while "READY port=" not in self.log():
            if self.process.poll() is not None:
                pytest.fail(f"the site exited ({self.process.returncode}):\n{self.log()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"the site did not start in {timeout_s:.0f} s:\n{self.log()[-4000:]}")
            time.sleep(1.0)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self._log.close()


def _complete(port: int, prompt: str, max_tokens: int) -> dict[str, Any]:
    response = httpx.post(
        f"http://127.0.0.1:{port}/v1/completions",
        json={"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8,
              "top_p": 0.95, "ignore_eos": True},
        timeout=600,
    )  # fmt: skip
    assert response.status_code == 200, response.text[:500]
    return dict(response.json())


def _require_site_packages() -> None:
    import importlib.util

    missing = [name for name in ("grpc", "grpc_health", "litestar", "uvicorn")
               if importlib.util.find_spec(name) is None]  # fmt: skip
    if missing:
        pytest.fail(f"the site needs {missing}: install bench/elastic/device_wheels.sh's "
                    "wheels and put them on PYTHONPATH")  # fmt: skip


@pytest.mark.parametrize("settings", sorted(SETTINGS))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_site_starts_and_serves_64_concurrent_requests(
    shape: str,
    settings: str,
    model_dirs: Callable[[str], Path],
    tmp_path: Path,
    cuda_device: str,
) -> None:
    _require_site_packages()
    site = Site(model_dirs(shape), tmp_path / "site.log", SETTINGS[settings])
    try:
        site.wait_ready(900)
        log = site.log()
        assert "KV cache:" in log, log[-3000:]
        assert "max_model_len 131,072 fit at once" in log, log[-3000:]
        if settings == "defaults":
            assert "batch limits: max_num_seqs=" in log
        rng = random.Random(7)
        prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 400)))
                   for _ in range(64)]  # fmt: skip
        with ThreadPoolExecutor(64) as pool:
            answers = list(pool.map(lambda p: _complete(site.http_port, p, 64), prompts))
        assert all(a["usage"]["completion_tokens"] == 64 for a in answers)
        if shape == "1b" and settings == "defaults":
            long = " ".join(rng.choice(WORDS) for _ in range(32_000))
            answer = _complete(site.http_port, long, 8)
            assert answer["usage"]["prompt_tokens"] >= 32_000
            assert answer["usage"]["completion_tokens"] == 8
        assert "out of memory" not in site.log().lower()
    finally:
        site.stop()
        print(site.log()[-2500:])
