"""The fine-tuned model: all-MiniLM-L6-v2 (BERT, hidden 384) + mean pooling + a linear head.

Torch lives here and in the training code only; the gateway runs the ONNX export of this model.
The encoder may keep only its first `layers` transformer layers: each dropped layer makes both
training and the gateway's per-prompt cost about 1/6 cheaper (the first layers of a sentence
encoder already carry most of what a length prediction needs).

Optionally the head also reads the prompt's whole length in characters (a third graph input,
`prompt_chars`): the encoder sees at most max_tokens wordpieces, and a mean over tokens says
little of how many there were, yet a long pasted context (summarize this, answer from this)
often means a long answer. That head is a small MLP, so the length can act differently for
different kinds of prompt (a long maths problem is not a long essay request).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from predictor.encoding import PROMPT_CHARS_INPUT, pretrained_dir

ENCODER_LAYERS = 6
INPUT_NAMES = ("input_ids", "attention_mask")
OUTPUT_NAME = "probabilities"
# log1p(characters) / this is about 1 for a 3,000-character prompt: an input scale the head's
# initialisation suits.
_LOG_CHARS_SCALE = 8.0
ONNX_OPSET = 17


class LengthClassifier(nn.Module):
    def __init__(
        self, encoder: nn.Module, hidden: int, n_buckets: int, length_feature: bool = False
    ) -> None:
        super().__init__()
        self.encoder = encoder
        self.length_feature = length_feature
        self.n_buckets = n_buckets
        self.head: nn.Module = (
            nn.Sequential(nn.Linear(hidden + 1, hidden), nn.GELU(), nn.Linear(hidden, n_buckets))
            if length_feature
            else nn.Linear(hidden, n_buckets)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_chars: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits, one row per prompt; padding is left out of the mean over tokens.
        `prompt_chars` (float, one per prompt) is required iff the model has the length feature."""
        logits: torch.Tensor = self.head(self.features(input_ids, attention_mask, prompt_chars))
        return logits

    def features(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_chars: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """What the head reads: the mean of the encoder's token states (+ the scaled prompt
        length with the length feature); a ranking head (predictor.ranking) reads it too."""
        hidden: torch.Tensor = self.encoder(
            input_ids=input_ids, attention_mask=attention_mask
        ).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        if self.length_feature:
            if prompt_chars is None:
                raise ValueError("this model reads prompt_chars: pass each prompt's length")
            scaled = torch.log1p(prompt_chars.to(pooled.dtype)).unsqueeze(-1) / _LOG_CHARS_SCALE
            pooled = torch.cat([pooled, scaled], dim=-1)
        return pooled

    @property
    def feature_width(self) -> int:
        """The width of `features`: the encoder's hidden size (+1 with the length feature)."""
        hidden = int(cast(Any, self.encoder).config.hidden_size)
        return hidden + 1 if self.length_feature else hidden

    def word_embeddings(self) -> nn.Parameter:
        """The wordpiece embedding table (the largest single tensor of the encoder)."""
        weight: nn.Parameter = cast(Any, self.encoder).get_input_embeddings().weight
        return weight


class _Probabilities(nn.Module):
    """The exported graph ends in a softmax, so the gateway needs no post-processing."""

    def __init__(self, classifier: LengthClassifier) -> None:
        super().__init__()
        self.classifier = classifier

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.classifier(*inputs), dim=-1)


def _linear(weight: torch.Tensor, bias: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0])
    layer.weight.data, layer.bias.data = weight.detach().clone(), bias.detach().clone()
    return layer


def narrow_layer(layer: nn.Module, ffn_width: int | None, heads: int | None) -> None:
    """Keeps the `ffn_width` feed-forward neurons and the `heads` attention heads of one BERT
    layer that weigh most in it (a unit's weight: the norm of what it reads times the norm of
    what it writes), in their order. None keeps them all. Fine-tuning then adapts what is left;
    the gateway streams fewer weight bytes per prediction."""
    module = cast(Any, layer)
    with torch.no_grad():
        if ffn_width is not None:
            _narrow_feed_forward(module, ffn_width)
        if heads is not None:
            _narrow_attention(module.attention, heads)


def _narrow_feed_forward(module: Any, width: int) -> None:
    read, write = module.intermediate.dense, module.output.dense
    if not 1 <= width <= read.out_features:
        raise ValueError(f"ffn_width must be within 1..{read.out_features}, got {width}")
    weight = read.weight.norm(dim=1) * write.weight.norm(dim=0)
    keep = weight.topk(width).indices.sort().values
    module.intermediate.dense = _linear(read.weight[keep], read.bias[keep])
    module.output.dense = _linear(write.weight[:, keep], write.bias)


def _narrow_attention(attention: Any, heads: int) -> None:
    own, out = attention.self, attention.output.dense
    size = own.attention_head_size
    count = own.query.out_features // size
    if not 1 <= heads <= count:
        raise ValueError(f"heads must be within 1..{count}, got {heads}")
    projections = (own.query, own.key, own.value)
    reads = sum(m.weight.view(count, size, -1).flatten(1).norm(dim=1) for m in projections)
    writes = out.weight.view(out.out_features, count, size).transpose(0, 1).flatten(1).norm(dim=1)
    kept = (reads * writes).topk(heads).indices.sort().values
    rows = (kept[:, None] * size + torch.arange(size)).flatten()
    for name in ("query", "key", "value"):
        projection = getattr(own, name)
        setattr(own, name, _linear(projection.weight[rows], projection.bias[rows]))
    attention.output.dense = _linear(out.weight[:, rows], out.bias)
    # The forward pass infers the head count from the projections' width; these keep the
    # module's description true.
    own.num_attention_heads, own.all_head_size = heads, heads * size


def build_classifier(
    n_buckets: int,
    layers: int = ENCODER_LAYERS,
    seed: int = 0,
    length_feature: bool = False,
    ffn_width: int | None = None,
    heads: int | None = None,
) -> LengthClassifier:
    """The pretrained encoder (first `layers` layers, each narrowed to `ffn_width` feed-forward
    neurons and `heads` attention heads when given) with a freshly initialised head."""
    if not 1 <= layers <= ENCODER_LAYERS:
        raise ValueError(f"layers must be within 1..{ENCODER_LAYERS}, got {layers}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model hub is never reachable here
    from transformers import AutoModel, logging

    # The loading report and its progress bar are noise in a training log.
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    torch.manual_seed(seed)
    # Eager attention exports to plain ONNX ops that onnxruntime runs on any version.
    encoder = AutoModel.from_pretrained(
        str(pretrained_dir()), attn_implementation="eager", dtype=torch.float32
    )
    encoder.encoder.layer = encoder.encoder.layer[:layers]
    encoder.config.num_hidden_layers = layers
    hidden = int(encoder.config.hidden_size)
    classifier = LengthClassifier(encoder, hidden, n_buckets, length_feature)
    narrow(classifier, ffn_width, heads)
    return classifier


def narrow(model: LengthClassifier, ffn_width: int | None, heads: int | None) -> None:
    """narrow_layer on every encoder layer of `model`."""
    for layer in cast(Any, model.encoder).encoder.layer:
        narrow_layer(layer, ffn_width, heads)


def export_onnx(model: LengthClassifier, path: Path) -> None:
    """ONNX graph with dynamic batch and sequence axes, (input_ids, attention_mask
    [, prompt_chars]) -> probabilities."""
    export_graph(_Probabilities(model), model.length_feature, path, [OUTPUT_NAME])


def export_graph(
    module: nn.Module, length_feature: bool, path: Path, outputs: Sequence[str]
) -> None:
    """Exports `module` (the classifier's inputs -> `outputs`, each with a batch axis) with
    dynamic batch and sequence axes."""
    module.eval()
    # A padded row in the example keeps the tracer from dropping the mask as all-ones.
    mask = torch.ones((2, 8), dtype=torch.long)
    mask[1, 5:] = 0
    example: tuple[torch.Tensor, ...] = (torch.full((2, 8), 1000, dtype=torch.long), mask)
    names = list(INPUT_NAMES)
    axes: dict[str, dict[int, str]] = {name: {0: "batch", 1: "sequence"} for name in names}
    if length_feature:
        example += (torch.tensor([40.0, 3000.0]),)
        names.append(PROMPT_CHARS_INPUT)
        axes[PROMPT_CHARS_INPUT] = {0: "batch"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about python control flow in BERT
        torch.onnx.export(
            module,
            example,
            str(path),
            input_names=names,
            output_names=list(outputs),
            dynamic_axes={**axes, **{name: {0: "batch"} for name in outputs}},
            opset_version=ONNX_OPSET,
            dynamo=False,
        )
