"""A PEFT adapter directory as one tar archive: how a site hands a fine-tuned adapter to the
gateway (GetFineTunedAdapter) and takes one to serve (LoadAdapterArchive), so that an adapter
trained on one site is served on every site of its base and outlives the site that trained it.

Only the files an adapter is made of travel, as regular files at the archive's top level: an
archive with anything else (a link, a folder, a path, another name) is refused whole, so no
archive writes outside the directory it is unpacked into.
"""

from __future__ import annotations

import io
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
MAX_ARCHIVE_BYTES = 4 << 30  # a rank-64 adapter of every projection of a 70B model is ~3 GiB
CHUNK_BYTES = 1 << 20  # a gRPC message's data


class ArchiveError(ValueError):
    """The archive is not an adapter's files."""


def pack(directory: Path) -> bytes:
    """The adapter's files in `directory` as an uncompressed tar archive (safetensors do not
    compress)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in ADAPTER_FILES:
            if (directory / name).is_file():
                tar.add(directory / name, arcname=name, recursive=False)
    return buffer.getvalue()


def chunks(data: bytes) -> Iterator[bytes]:
    for start in range(0, len(data), CHUNK_BYTES):
        yield data[start : start + CHUNK_BYTES]


def unpack(data: bytes, into: Path) -> None:
    """Writes the archive's files into the new directory `into`; ArchiveError, nothing
    written, unless the archive holds only adapter files."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            members = tar.getmembers()
            names = [m.name for m in members]
            wrong = [m.name for m in members if not m.isfile() or m.name not in ADAPTER_FILES]
            if wrong or len(set(names)) != len(names) or "adapter_config.json" not in names:
                raise ArchiveError(
                    f"an adapter archive holds {', '.join(ADAPTER_FILES)} as plain files (with "
                    f"adapter_config.json), each once; this one holds {names}"
                )
            contents = {m.name: _read(tar, m) for m in members}
    except tarfile.TarError as exc:
        raise ArchiveError(f"not a tar archive: {exc}") from exc
    into.mkdir(parents=True)
    for name, content in contents.items():
        (into / name).write_bytes(content)


def _read(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    source = tar.extractfile(member)
    if source is None:
        raise ArchiveError(f"{member.name} cannot be read")
    return source.read()


def received_dir(adapter_dir: Path) -> Path:
    """A new directory for an adapter received whole (LoadAdapterArchive): under the site's
    adapter directory, in a dot folder its listing of adapters passes by; the adapter's entry
    there links to it, as it links to any loaded adapter's directory."""
    return adapter_dir / ".received" / str(time.time_ns())
