"""Loads a transformers causal LM directory (safetensors weights + config) for serving."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from fedllm_contract.tokenizer import load_tokenizer
from site_engine.engine.model_config import eos_token_ids, max_model_len
from site_engine.gguf_import import GgufImportError, find_gguf, materialize

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(RuntimeError):
    """The directory does not hold a model we can serve; the message says why."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    max_model_len: int
    eos_token_ids: frozenset[int]
    device: torch.device
    dtype: torch.dtype

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)


def _max_model_len(config: object) -> int:
    try:
        return max_model_len(config)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc


def resolve_model_dir(path: Path) -> Path:
    """A transformers directory as is; a GGUF file (or a directory holding one) converted once."""
    if not path.exists():
        raise ModelLoadError(f"{path} does not exist: expected a model directory or a GGUF file")
    try:
        gguf = find_gguf(path)
        return materialize(gguf) if gguf is not None else path
    except GgufImportError as exc:
        raise ModelLoadError(str(exc)) from exc


def load_model(
    model_dir: Path,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    tokenizer_dir: Path | None = None,
) -> LoadedModel:
    """Loads weights through transformers' own loading path (config.json + *.safetensors).

    `model_dir` may also be a GGUF file or a directory holding one (see gguf_import).
    """
    model_dir = resolve_model_dir(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"{model_dir} has no config.json: not a transformers model directory")
    if dtype not in TORCH_DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; choose one of {sorted(TORCH_DTYPES)}")
    torch_device = torch.device(device)
    config = AutoConfig.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), config=config, dtype=TORCH_DTYPES[dtype]
    )
    model.to(torch_device)
    model.eval()
    tokenizer = load_tokenizer(tokenizer_dir or model_dir)
    if len(tokenizer) > config.vocab_size:
        raise ModelLoadError(
            f"tokenizer has {len(tokenizer)} tokens but the model's vocabulary is "
            f"{config.vocab_size}: they do not belong together"
        )
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        max_model_len=_max_model_len(config),
        # The tokenizer's EOS counts too: some configs leave it out.
        eos_token_ids=eos_token_ids(model)
        | ({int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()),
        device=torch_device,
        dtype=TORCH_DTYPES[dtype],
    )
