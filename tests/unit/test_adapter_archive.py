"""An adapter's files as one tar archive (site_engine/adapter_archive.py): what a site hands the
gateway of a fine-tuned adapter and takes back to serve. Only an adapter's own files, as plain
files at the top, are unpacked; anything else is refused with nothing written."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from site_engine.adapter_archive import ArchiveError, chunks, pack, unpack


def _adapter(directory: Path) -> Path:
    directory.mkdir()
    (directory / "adapter_config.json").write_text('{"r": 8}')
    (directory / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 5000)
    (directory / "README.md").write_text("not sent")
    return directory


def test_an_adapter_travels_whole_and_only_its_files(tmp_path: Path) -> None:
    archive = pack(_adapter(tmp_path / "trained"))
    assert b"".join(chunks(archive)) == archive
    assert len(list(chunks(archive))) == 2  # 1.28 MB in 1 MiB messages
    unpack(archive, tmp_path / "received")
    assert sorted(p.name for p in (tmp_path / "received").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (tmp_path / "received" / name).read_bytes() == (
            tmp_path / "trained" / name
        ).read_bytes()


def _tar(entries: list[tarfile.TarInfo]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for info in entries:
            tar.addfile(info, io.BytesIO(b"x" * info.size) if info.isfile() else None)
    return buffer.getvalue()


def _file(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = 1
    return info


def _link(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
    return info


@pytest.mark.parametrize(
    "archive",
    [
        b"not a tar archive at all",
        _tar([_file("adapter_config.json"), _file("../escape")]),
        _tar([_file("adapter_config.json"), _file("sub/adapter_model.safetensors")]),
        _tar([_file("adapter_config.json"), _link("adapter_model.safetensors")]),
        _tar([_file("adapter_model.safetensors")]),  # no config
        _tar([_file("adapter_config.json"), _file("adapter_config.json")]),
    ],
)
def test_anything_but_an_adapters_files_is_refused_and_nothing_written(
    tmp_path: Path, archive: bytes
) -> None:
    with pytest.raises(ArchiveError):
        unpack(archive, tmp_path / "received")
    assert not (tmp_path / "received").exists()
    assert not (tmp_path / "escape").exists()
