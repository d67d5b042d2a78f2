"""Reading the PEM files that mutual TLS between the gateway and its sites is made of."""

from __future__ import annotations

from pathlib import Path


def read_pem(variable: str, path: Path, marker: str, error: type[ValueError]) -> bytes:
    """The file's bytes, refused loudly (naming the variable) unless it holds a PEM `marker`;
    `error` is the caller's settings error, so a bad file reads like any other bad setting."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise error(f"{variable}: cannot read {path}: {exc}") from exc
    if f"-----BEGIN {marker}".encode() not in data and not (
        marker == "PRIVATE KEY" and b" PRIVATE KEY-----" in data
    ):
        raise error(f"{variable}: {path} is not a PEM file holding a {marker}")
    return data
