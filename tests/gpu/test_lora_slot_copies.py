"""An adapter written into its slot while steps run answers as one written with nothing running
(site_engine/engine/lora/slot_copies.py: the writes go on a stream of their own, after the last
step that reads the slot they overwrite, and before the step that reads them).

One slot for four adapters, async scheduling: each switch of adapter overwrites the slot while
the previous adapter's last step may still run on the device. The same requests, arriving the
same way, run again with the device idle around every slot write (synchronized before and
after it): the same schedule, so the tokens must be the same, request by request. A missing
wait would let a running step read the half-written slot of the next adapter, or the next step
read it before its copy ended. A race shows only when the timing lets it, so a pass says the
order held on these runs; the test also checks that some write did start while a step ran.

The model is tiny: its steps end on the device before the host has planned the next one, so no
write would ever meet a running step (the H100 of 2026-11-27: 0 of the writes did). In the busy
run every step therefore starts with a few milliseconds of device-side spinning
(`torch.cuda._sleep`), queued on the compute stream before the step's reads: a step is still
running when the host writes the next adapter's slot, as with a large model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from site_engine.engine.lora.adapter import LoraAdapter
from site_engine.engine.lora.registry import LoraSettings
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.model_loading import load_model
from tests.gpu.test_lora_kernels import _adapter_dir, _model_dir, _requests, _run

pytestmark = pytest.mark.gpu

# ~5 ms of a step's device time at the H100's and H200's ~1.8-2 GHz.
_SPIN_CYCLES = 10_000_000


@pytest.mark.parametrize("graphs", [False, True])
def test_a_slot_written_while_steps_run_answers_as_one_written_with_none_running(
    cuda_device: str,
    tmp_path: Path,
    gpt2_tokenizer_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    graphs: bool,
) -> None:
    model_dir = _model_dir(tmp_path, gpt2_tokenizer_dir)
    root = _adapter_dir(tmp_path, model_dir)
    answers: dict[bool, dict[str, list[int]]] = {}
    busy_at_write: list[bool] = []
    for idle in (True, False):
        loaded = load_model(model_dir, device=cuda_device)
        lora = LoraSettings(root, max_loras=1, max_cpu_loras=4, max_rank=16, copy_stream=True)
        config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, block_size=8,
                              kv_cache_bytes=8 << 20, cuda_graphs=graphs, lora=lora,
                              async_scheduling=True)  # fmt: skip
        engine = PagedEngine(loaded, config)
        assert engine.adapters is not None
        slots = engine.adapters.slots
        write = slots._write

        def written(
            slot: int,
            adapter: LoraAdapter,
            write: Callable[[int, LoraAdapter], None] = write,
            idle: bool = idle,
        ) -> None:
            if idle:
                torch.cuda.synchronize()
            else:
                busy_at_write.append(not torch.cuda.current_stream().query())
            write(slot, adapter)
            if idle:
                torch.cuda.synchronize()

        monkeypatch.setattr(slots, "_write", written)
        if not idle:
            launch = engine.runner.launch_logits

            def slow_step(*args: Any, launch: Callable[..., Any] = launch) -> Any:
                torch.cuda._sleep(_SPIN_CYCLES)  # type: ignore[no-untyped-call]
                return launch(*args)

            monkeypatch.setattr(engine.runner, "launch_logits", slow_step)
        answers[idle] = _run(engine, _requests())
        engine.close()
    assert len(busy_at_write) >= 4, "the slot was not rewritten: the case tests nothing"
    assert any(busy_at_write), "no slot write started while a step ran"
    assert answers[False] == answers[True]
    probes = {rid: t for rid, t in answers[False].items() if rid.startswith("probe-")}
    assert len({tuple(t) for t in probes.values()}) == len(probes), probes
