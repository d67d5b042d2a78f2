"""What a model directory says about an embedding model, as sentence-transformers lays one out:
`modules.json` lists the modules the text goes through (a transformers encoder, a Pooling module
whose `config.json` says how token states become one vector, optionally Normalize: L2), and
`sentence_bert_config.json` the longest input the model was trained to read (all-MiniLM-L6-v2:
mean pooling, normalized, 256 tokens, 384 dimensions). No torch here: the site decides from this
whether it serves an embedding model before it loads anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

PoolingMode = Literal["cls", "mean", "max", "mean_sqrt_len", "lasttoken"]
# sentence-transformers' Pooling config keys, each naming one mode.
_POOLING_KEYS: dict[str, PoolingMode] = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_lasttoken": "lasttoken",
}
_ST = "sentence_transformers.models."
_TRANSFORMER, _POOLING, _NORMALIZE = f"{_ST}Transformer", f"{_ST}Pooling", f"{_ST}Normalize"


class EmbeddingLayoutError(ValueError):
    """The directory describes an embedding model this site cannot serve; the message says
    which part."""


@dataclass(frozen=True, slots=True)
class EmbeddingLayout:
    # Where the transformers encoder (config.json + weights) is.
    encoder_dir: Path
    pooling: PoolingMode
    normalize: bool
    # The longest input, in tokens, special tokens included.
    max_seq_length: int
    dimension: int


def is_embedding_model(model_dir: Path) -> bool:
    """The directory is a sentence-transformers model (its modules.json names a Pooling)."""
    modules = model_dir / "modules.json"
    if not modules.is_file():
        return False
    try:
        listed = json.loads(modules.read_text())
    except ValueError:
        return False
    return isinstance(listed, list) and any(
        isinstance(m, dict) and m.get("type") == _POOLING for m in listed
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise EmbeddingLayoutError(f"cannot read {path}: {exc}") from exc
    if not isinstance(value, dict):
        raise EmbeddingLayoutError(f"{path} is not a JSON object")
    return value


def _pooling(config: dict[str, Any], path: Path) -> PoolingMode:
    chosen = [mode for key, mode in _POOLING_KEYS.items() if config.get(key)]
    others = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v
                    and k not in _POOLING_KEYS)  # fmt: skip
    if others or len(chosen) != 1:
        raise EmbeddingLayoutError(
            f"{path}: this site pools with exactly one of {sorted(_POOLING_KEYS)}; "
            f"the model asks for {sorted(chosen) + others or 'none'}"
        )
    return chosen[0]


def read_layout(model_dir: Path) -> EmbeddingLayout:
    """The model's layout; EmbeddingLayoutError for a module this site does not run (Dense
    projections, other poolings), so it never serves vectors the model would not give."""
    modules = json.loads((model_dir / "modules.json").read_text())
    kinds = [m.get("type") for m in modules]
    unknown = sorted({str(k) for k in kinds if k not in (_TRANSFORMER, _POOLING, _NORMALIZE)})
    if unknown or kinds[:2] != [_TRANSFORMER, _POOLING]:
        raise EmbeddingLayoutError(
            f"{model_dir / 'modules.json'}: this site runs Transformer, Pooling and optionally "
            f"Normalize, in that order; the model lists {kinds}"
            + (f" ({', '.join(unknown)} not supported)" if unknown else "")
        )
    encoder_dir = model_dir / str(modules[0].get("path", ""))
    pooling_path = model_dir / str(modules[1].get("path", "")) / "config.json"
    pooling = _read_json(pooling_path)
    encoder_config = _read_json(encoder_dir / "config.json")
    st_config_path = encoder_dir / "sentence_bert_config.json"
    st_config = _read_json(st_config_path) if st_config_path.is_file() else {}
    positions = int(encoder_config.get("max_position_embeddings", 512))
    max_seq_length = int(st_config.get("max_seq_length") or positions)
    dimension = int(pooling.get("word_embedding_dimension") or encoder_config["hidden_size"])
    return EmbeddingLayout(
        encoder_dir=encoder_dir,
        pooling=_pooling(pooling, pooling_path),
        normalize=_NORMALIZE in kinds,
        max_seq_length=min(max_seq_length, positions),
        dimension=dimension,
    )
