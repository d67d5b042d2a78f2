"""The whole engine on the GPU against transformers `generate`, token for token, in float32.

The scenario of tests/unit/engine/test_engine_correctness.py (requests arriving while others
run, cancellations, a cache small enough to force recompute preemption, a 24-token budget that
splits prompts into chunks) on CUDA: most steps mix decode rows with prefill chunks, many of
which continue cached positions. With CUDA graphs the decode rows replay the graphs and the
prefill chunks go through the varlen paged kernel in the same step; without them every row of a
mixed step, decode rows included, goes through the varlen kernel.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.engine.test_engine_correctness import CONFIGS, check_engine_matches_generate

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_engine_matches_generate_on_cuda(
    arch: str, overlap: bool, graphs: bool, cuda_device: str, tmp_path: Path,
    gpt2_tokenizer_dir: Path,
) -> None:  # fmt: skip
    check_engine_matches_generate(
        arch, cuda_device, tmp_path, gpt2_tokenizer_dir, async_scheduling=overlap,
        cuda_graphs=graphs,
    )  # fmt: skip
