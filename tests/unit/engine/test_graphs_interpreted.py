"""The graph runners' staging and static-buffer forward (site_engine/engine/graphs/) on the CPU:
tests/gpu/test_step_graphs.py run under Triton's interpreter (TRITON_INTERPRET=1, set before
triton is imported: a process of its own), so CI checks the decode and flat step graphs' inputs
against the eager path, and a scheduled run's tokens through them, without a GPU.

Skipped where triton is not installed (it is a dev dependency: pyproject.toml's `dev` extra).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[3]


def test_the_graph_runners_match_the_eager_path_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
         "-m", "gpu", "tests/gpu/test_step_graphs.py"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=280, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "4 passed" in done.stdout, done.stdout[-2000:]
