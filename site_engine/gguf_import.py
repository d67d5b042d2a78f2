"""Serving a GGUF file: converted once into a transformers model directory, then cached.

transformers reads GGUF files (weights dequantized to float on load, tokenizer and chat template
from the file's metadata), but a GGUF-loaded model refuses `save_pretrained`: it still carries
the GGUF quantization config although its weights are plain tensors by then. Dropping that
config makes it an ordinary model, which saves as safetensors with its tokenizer. The converted
directory is keyed by the file's content digest, so a changed file is converted again and the
same file never twice (loading the 98 MB SmolLM2 GGUF takes ~20-40 s on 2 cores; the cached
directory loads in ~1 s).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"
DEFAULT_CACHE_DIR = Path("var/models")
_DIGEST_CHUNK = 1 << 20
# llama.cpp's quantization names: Q4_1, Q8_0, Q4_K_M, IQ2_XS, F16, BF16, F32 ...
_QUANTIZATION = re.compile(r"(?:I?Q\d[\w]*|B?F(?:16|32))", re.IGNORECASE)


class GgufImportError(RuntimeError):
    """The path is not a GGUF model we can convert; the message says why."""


def model_cache_dir() -> Path:
    return Path(os.environ.get("FEDLLM_MODEL_CACHE") or DEFAULT_CACHE_DIR)


def find_gguf(path: Path) -> Path | None:
    """The GGUF file that `path` names: itself, or the single one in a directory without config.

    A directory that holds a config.json is a transformers directory and wins over any GGUF file
    beside it; a directory with several GGUF files is ambiguous and refused.
    """
    if path.is_file():
        return path if path.suffix.lower() == GGUF_SUFFIX else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    candidates = sorted(p for p in path.iterdir() if p.suffix.lower() == GGUF_SUFFIX)
    if len(candidates) > 1:
        names = ", ".join(p.name for p in candidates)
        raise GgufImportError(f"{path} holds several GGUF files ({names}): name one of them")
    return candidates[0] if candidates else None


def model_name_of(gguf: Path) -> str:
    """`SmolLM2-135M-Instruct.Q4_1.gguf` -> `SmolLM2-135M-Instruct` (drops the quantization)."""
    stem = gguf.name[: -len(GGUF_SUFFIX)]
    base, _, quant = stem.rpartition(".")
    return base if base and _QUANTIZATION.fullmatch(quant) else stem


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_DIGEST_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _check_header(gguf: Path) -> None:
    with gguf.open("rb") as handle:
        magic = handle.read(4)
    if magic != GGUF_MAGIC:
        raise GgufImportError(f"{gguf} is not a GGUF file (its first bytes are {magic!r})")


def convert(gguf: Path, out_dir: Path) -> None:
    """Loads the GGUF through transformers and saves a plain safetensors model + tokenizer."""
    import torch  # the gateway imports this module's lookups without torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_header(gguf)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    except Exception as exc:  # gguf and transformers raise many kinds on a bad file
        raise GgufImportError(f"{gguf} could not be read as a model: {exc}") from exc
    # The weights are already dequantized tensors; without these the model saves like any other.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))


def materialize(gguf: Path, cache_dir: Path | None = None) -> Path:
    """The converted directory for `gguf`, converting it on first use (atomically)."""
    if not gguf.is_file():
        raise GgufImportError(f"{gguf} does not exist")
    _check_header(gguf)
    root = (cache_dir or model_cache_dir()).resolve()
    target = root / f"{model_name_of(gguf)}-{_digest(gguf)[:16]}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    log.info("converting %s into %s (once; later starts reuse it)", gguf, target)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=root))
    try:
        convert(gguf, staging)
        try:
            staging.rename(target)
        except OSError:
            # Another process converted the same file meanwhile; its directory is as good.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
