"""A safetensors file read without the `safetensors` package: its header first, its data mapped.

Why not `safetensors.torch.load_file`: it opens and maps the file while holding the GIL, so a
slow disk read on a loader thread stalls the engine's step loop and every other loader (a
loader blocked opening a file stopped the whole process in a test). Here the open and header
read are Python I/O (the GIL is released in the syscalls), the data is an mmap of the file whose
pages are read by the torch copies that lay the adapter out (which release the GIL too), and
everything is checked on the header before any data is touched: a refused adapter costs no read.

Format (https://github.com/huggingface/safetensors): 8 bytes little-endian header length N, N
bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__"?: {...}},
then the data, offsets relative to its start.
"""

from __future__ import annotations

import json
import mmap
import os
import stat
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

# The dtypes LoRA weights come in (the engine converts to its serving dtype).
DTYPES: Mapping[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}
_MAX_HEADER = 100 << 20  # safetensors' own bound


class WeightsFileError(ValueError):
    """The file is not a safetensors file of float tensors; the message says why."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # bytes from the start of the file
    end: int


def open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading when it is a regular file (links followed); WeightsFileError
    for a FIFO, a device or a directory: a FIFO's read waits for a writer for ever (and a plain
    open of one, too), holding the site's loader thread, and a device may never end."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # returns at once, even for a FIFO
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise WeightsFileError(f"{path.name} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_small(path: Path, limit: int) -> bytes:
    """A regular file's bytes, WeightsFileError past `limit` (read no further than that)."""
    with open_regular(path) as file:
        data = file.read(limit + 1)
    if len(data) > limit:
        raise WeightsFileError(f"{path.name} is over {limit} bytes")
    return data


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors a safetensors file holds, checked against its size; OSError if unreadable,
    WeightsFileError if malformed or not a regular file. Reads the header only."""
    with open_regular(path) as file:
        size = os.fstat(file.fileno()).st_size
        prefix = file.read(8)
        length = int.from_bytes(prefix, "little")
        if len(prefix) < 8 or not 2 <= length <= min(_MAX_HEADER, size - 8):
            raise WeightsFileError(f"{path.name}: not a safetensors file (header length)")
        try:
            header = json.loads(file.read(length))
        except ValueError as exc:
            raise WeightsFileError(f"{path.name}: header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise WeightsFileError(f"{path.name}: header is not a JSON object")
    header.pop("__metadata__", None)
    return {name: _entry(name, info, 8 + length, size) for name, info in header.items()}


def _entry(name: str, info: object, data_start: int, size: int) -> TensorEntry:
    fields = info if isinstance(info, dict) else {}
    dtype_name, shape, offsets = (fields.get(k) for k in ("dtype", "shape", "data_offsets"))
    if not (
        isinstance(shape, list)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(n, int) and n >= 0 for n in (*shape, *offsets))
    ):
        raise WeightsFileError(f"tensor {name!r}: malformed header entry {info!r}")
    dtype = DTYPES.get(str(dtype_name))
    if dtype is None:
        raise WeightsFileError(f"tensor {name!r}: dtype {dtype_name} is not a float type")
    begin, end = offsets
    numel = 1
    for dim in shape:
        numel *= dim
    if end - begin != numel * dtype.itemsize or data_start + end > size:
        raise WeightsFileError(f"tensor {name!r}: data offsets {begin}..{end} do not fit")
    return TensorEntry(dtype, tuple(shape), data_start + begin, data_start + end)


def map_file(path: Path) -> torch.Tensor:
    """The file's bytes as a [size] uint8 tensor over a private read-only mapping (pages are
    read when a copy touches them; the mapping goes when the last view does)."""
    with open_regular(path) as file:
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    with warnings.catch_warnings():  # frombuffer warns on any buffer it cannot prove writable
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapped, dtype=torch.uint8)


def map_tensors(path: Path, entries: Mapping[str, TensorEntry]) -> dict[str, torch.Tensor]:
    """Views of the file's tensors over a private read-only mapping (pages are read when a
    copy touches them; the mapping goes when the last view does). Callers copy what they keep:
    a view would break if the file were truncated in place."""
    raw = map_file(path)
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in entries.items():
        data = raw[entry.begin : entry.end]
        if entry.begin % entry.dtype.itemsize:  # an unaligned tensor (old writers): copied
            data = data.clone()
        tensors[name] = data.view(entry.dtype).view(entry.shape)
    return tensors
