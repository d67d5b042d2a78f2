"""What an adapter load reads, bounded (issue 58): a FIFO or device in place of an adapter's
files is refused at once instead of holding the site's loader thread for ever, a config past
its size limit is not read whole, and a non-finite weight (or one past the serving dtype's
range) is refused before the adapter is kept. A tiny random Llama's shapes."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from site_engine.engine.lora.adapter import (
    CONFIG_FILE,
    MAX_CONFIG_BYTES,
    WEIGHTS_FILE,
    AdapterError,
    BaseShapes,
    read_adapter,
)
from site_engine.engine.lora.registry import AdapterRegistry, LoraSettings
from site_engine.model_loading import LoadedModel, load_model
from tests.unit.engine.test_lora_adapters import write_adapter


@pytest.fixture(scope="module")
def base(tiny_llama_dir: Path) -> BaseShapes:
    loaded: LoadedModel = load_model(tiny_llama_dir)
    return BaseShapes.of_model(loaded.model)


def _read_in_thread(path: Path, base: BaseShapes) -> BaseException | None:
    """read_adapter on a thread, as the site runs a load; fails the test if it hangs."""
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            read_adapter(path, "x", base, 16, torch.float32)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=read, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the read hangs on a FIFO"
    assert time.monotonic() - started < 5
    return outcome[0]


@pytest.mark.parametrize("which", [CONFIG_FILE, WEIGHTS_FILE])
def test_a_fifo_in_place_of_a_file_is_refused_at_once(
    tmp_path: Path, base: BaseShapes, which: str
) -> None:
    path = write_adapter(tmp_path / "fifo", base)
    (path / which).unlink()
    os.mkfifo(path / which)
    error = _read_in_thread(path, base)
    assert isinstance(error, AdapterError)
    assert f"{which} is not a regular file" in str(error)


def test_a_device_in_place_of_the_config_is_refused(tmp_path: Path, base: BaseShapes) -> None:
    path = write_adapter(tmp_path / "dev", base)
    (path / CONFIG_FILE).unlink()
    (path / CONFIG_FILE).symlink_to("/dev/zero")  # would never end if read whole
    error = _read_in_thread(path, base)
    assert isinstance(error, AdapterError)
    assert "not a regular file" in str(error)


def test_a_config_past_its_size_limit_is_refused(tmp_path: Path, base: BaseShapes) -> None:
    path = write_adapter(tmp_path / "big", base)
    config = (path / CONFIG_FILE).read_text()
    (path / CONFIG_FILE).write_text(config[:-1] + ', "pad": "' + "x" * MAX_CONFIG_BYTES + '"}')
    with pytest.raises(AdapterError, match=f"over {MAX_CONFIG_BYTES} bytes"):
        read_adapter(path, "big", base, 16, torch.float32)


@pytest.mark.parametrize(
    ("value", "dtype"),
    [(float("nan"), torch.float32), (float("inf"), torch.float32), (1e6, torch.float16)],
)
def test_a_non_finite_weight_is_refused_and_nothing_is_registered(
    tmp_path: Path, base: BaseShapes, value: float, dtype: torch.dtype
) -> None:
    """1e6 is finite in float32 but past float16's range (65504): served in float16 it is inf."""
    path = write_adapter(tmp_path / "uploads" / "bad", base)
    tensors = load_file(str(path / WEIGHTS_FILE))
    name = sorted(name for name in tensors if name.endswith("lora_B.weight"))[-1]
    tensors[name][0, 0] = value
    save_file(tensors, str(path / WEIGHTS_FILE))
    lora_dir = tmp_path / "lora"
    lora_dir.mkdir()
    registry = AdapterRegistry(LoraSettings(lora_dir), base, dtype, torch.device("cpu"))
    with pytest.raises(AdapterError, match=r"lora_B holds (NaN or infinite values|values up to)"):
        registry.register("bad", path)
    assert registry.served() == ()
    registry.close()
    fine = write_adapter(tmp_path / "uploads" / "fine", base)
    assert read_adapter(fine, "fine", base, 16, dtype).rank == 4  # the same shapes, finite
