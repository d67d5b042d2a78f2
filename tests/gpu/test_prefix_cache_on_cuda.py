"""Prefix caching on the GPU against transformers `generate`, token for token, in float32.

The scenario of tests/unit/engine/test_prefix_cache_correctness.py on CUDA: shared prefixes of
every length arriving one per step, a device cache small enough to evict cached blocks and
preempt running ones, cancellations, and a host tier in pinned memory whose copies run on a
side stream; caching off, on, and with the host tier must give the same tokens as `generate`,
with CUDA graphs and without, with steps run one at a time and overlapped (async scheduling,
where a block's last generated token is still on the device when its KV is written).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.unit.engine.test_engine_correctness import CONFIGS
from tests.unit.engine.test_prefix_cache_correctness import (
    check_caching_on_off_host_tier_and_generate_agree,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_prefix_cache_matches_generate_on_cuda(
    arch: str, overlap: bool, graphs: bool, cuda_device: str, tmp_path: Path,
    gpt2_tokenizer_dir: Path,
) -> None:  # fmt: skip
    check_caching_on_off_host_tier_and_generate_agree(
        arch, cuda_device, tmp_path, gpt2_tokenizer_dir, async_scheduling=overlap,
        cuda_graphs=graphs,
    )  # fmt: skip
