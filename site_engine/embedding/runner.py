"""The embedding model runner: the transformers encoder of an embedding model, and the pooling
its layout names, on one padded batch of token-id sequences at a time.

The vectors are those sentence-transformers computes for the same tokens: the encoder's last
hidden states under the padding mask, pooled (mean over the real tokens for all-MiniLM-L6-v2),
then L2-normalized when the model lists Normalize. Padding is on the right, so padded rows read
exactly their own tokens (the mask keeps padding out of attention and out of the pooling).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional
from transformers import AutoModel, PreTrainedModel, PreTrainedTokenizerBase

from fedllm_contract.tokenizer import load_tokenizer
from site_engine.embedding.layout import EmbeddingLayout, EmbeddingLayoutError, read_layout
from site_engine.model_loading import TORCH_DTYPES, ModelLoadError


def pool(hidden: torch.Tensor, mask: torch.Tensor, layout: EmbeddingLayout) -> torch.Tensor:
    """(batch, tokens, hidden) states and their (batch, tokens) 0/1 mask -> (batch, dimension)
    float32 vectors, as sentence-transformers' Pooling and Normalize compute them."""
    hidden = hidden.float()
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    lengths = weights.sum(dim=1)
    if layout.pooling == "cls":
        pooled = hidden[:, 0]
    elif layout.pooling == "lasttoken":
        last = mask.sum(dim=1).long() - 1
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    elif layout.pooling == "max":
        pooled = hidden.masked_fill(weights == 0, -1e9).max(dim=1).values
    else:
        summed = (hidden * weights).sum(dim=1)
        if layout.pooling == "mean":
            pooled = summed / lengths.clamp(min=1e-9)
        else:  # mean_sqrt_len
            pooled = summed / lengths.clamp(min=1e-9).sqrt()
    return functional.normalize(pooled, p=2, dim=1) if layout.normalize else pooled


@dataclass(frozen=True, slots=True)
class EmbeddingRunner:
    encoder: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    layout: EmbeddingLayout
    device: torch.device
    pad_token_id: int

    @property
    def vocab_size(self) -> int:
        return int(self.encoder.config.vocab_size)

    @torch.inference_mode()
    def embed(self, inputs: Sequence[Sequence[int]]) -> list[bytes]:
        """One forward pass over the inputs (each at most max_seq_length ids); one vector per
        input, as float32 little-endian bytes."""
        longest = max(len(ids) for ids in inputs)
        batch = torch.full((len(inputs), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(inputs), longest), dtype=torch.long)
        for row, ids in enumerate(inputs):
            batch[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[row, : len(ids)] = 1
        batch, mask = batch.to(self.device), mask.to(self.device)
        hidden = self.encoder(input_ids=batch, attention_mask=mask).last_hidden_state
        vectors = pool(hidden, mask, self.layout).cpu().numpy().astype("<f4")
        return [row.tobytes() for row in vectors]


def load_embedding_runner(
    model_dir: Path,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    tokenizer_dir: Path | None = None,
) -> EmbeddingRunner:
    """The encoder and its tokenizer from a sentence-transformers directory; ModelLoadError
    saying why for one this site cannot serve."""
    try:
        layout = read_layout(model_dir)
    except EmbeddingLayoutError as exc:
        raise ModelLoadError(str(exc)) from exc
    if dtype not in TORCH_DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; choose one of {sorted(TORCH_DTYPES)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything it reads is in the directory
    torch_device = torch.device(device)
    encoder = AutoModel.from_pretrained(str(layout.encoder_dir), dtype=TORCH_DTYPES[dtype])
    encoder.to(torch_device)
    encoder.eval()
    tokenizer = load_tokenizer(tokenizer_dir or model_dir)
    vocab = int(encoder.config.vocab_size)
    if len(tokenizer) > vocab:
        raise ModelLoadError(
            f"tokenizer has {len(tokenizer)} tokens but the model's vocabulary is {vocab}: "
            "they do not belong together"
        )
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = getattr(encoder.config, "pad_token_id", None) or 0
    hidden = int(encoder.config.hidden_size)
    if layout.dimension != hidden:
        raise ModelLoadError(
            f"the pooling config says {layout.dimension} dimensions, the encoder has {hidden}"
        )
    return EmbeddingRunner(encoder, tokenizer, layout, torch_device, int(pad))
