"""The GPU tests: `make test-gpu` (python3 -m pytest -m gpu tests/gpu) on the GPU machine.

Everything a GPU test needs is here or in tests/conftest.py, so that collecting tests/gpu on a
bare GPU machine (torch, transformers, triton and pytest, none of the gateway's dependencies)
imports nothing else.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.gpu.kernel_device import interpreted

# Modules that import the Triton kernels at import time cannot even be collected without triton
# (the project's CPU environment has none), and deselecting by marker happens after collection.
if importlib.util.find_spec("triton") is None:
    collect_ignore = ["test_step_graphs.py"]
# Constrained decoding needs the grammar engine, which the GPU image does not carry: carry its
# wheel (llguidance, docs/openai-api.md) to run test_structured_output_cuda.py.
if importlib.util.find_spec("llguidance") is None:
    collect_ignore = [*globals().get("collect_ignore", []), "test_structured_output_cuda.py"]


if interpreted():
    # Triton 3.6's interpreter with numpy 2.4 (devtools/triton_interpreter.py); only on a CPU
    # run, which has the whole repository.
    from devtools.triton_interpreter import fix_scalar_index

    fix_scalar_index()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Every test under tests/gpu is a GPU test, marked or not: `make test` (-m "not gpu") never
    # runs one on a machine without CUDA.
    for item in items:
        if "tests/gpu/" in item.nodeid.replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(scope="session")
def kernel_device(request: pytest.FixtureRequest) -> str:
    """ "cuda", or "cpu" under TRITON_INTERPRET=1 (see tests/gpu/kernel_device.py)."""
    if interpreted():
        return "cpu"
    return str(request.getfixturevalue("cuda_device"))
