"""What the engine reads from a transformers model's configuration, in one place."""

from __future__ import annotations

from typing import Any


def max_model_len(config: Any) -> int:
    """The longest sequence the model's positions allow, whatever the family calls it."""
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"{type(config).__name__} declares no maximum sequence length")


def eos_token_ids(model: Any) -> frozenset[int]:
    """Every EOS id of the generation config and the model config (either may list some)."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(token) for token in value)
        elif value is not None:
            raise TypeError(f"unexpected eos_token_id {value!r}")
    return frozenset(ids)
