"""What a fine-tuning job's training holds in memory, so it fits the site's explicit reserve.

The base weights are the served model's own (shared, site_engine/finetune/trainer.py), so a job
adds only: the LoRA weights with their gradients and AdamW's two moments (fp32, 16 bytes a
weight), and the activations of one unit. The activations are counted from what autograd keeps
for a Llama-style block with LoRA on some projections, per token (e: the base's element size;
peft runs the adapters in fp32, so over a half-precision base every adapted projection keeps
its own fp32 copy of its input):
- each RMSNorm (two a layer): its input in fp32 and the 1/rms (4h + 4);
- attention (SDPA): query, key, value and output at the query width (HF repeats the kv heads
  to the query heads when a padding mask is given, so kv at the query width is the bound) and
  the log-sum-exp (4 a head); eager attention also keeps the probabilities, fp32 and in e
  (heads x sequence length a token);
- the MLP: the gate projection's output, its SiLU and the up projection's output (3 x I x e);
- each adapted projection: its input for the LoRA A gradient (fp32 copies over a half base; an
  fp32 base shares them: q/k/v one input, gate/up another, o's is attention's output) and A's
  output (rank x 4).
Once a unit: the rotary cos and sin, the padding mask attention keeps (a row of the longest
sequence's width a token, in e), the final norm, and the loss: the labelled rows of the
hidden states with their gradient, and one chunk of LOSS_CHUNK_TOKENS' logits (the head's
output in e, fp32 logits, log-softmax kept for the backward and their gradients: 12 + 2e bytes
per vocabulary entry). The backward of a layer holds gradients about the size of what the
layer kept, so one layer more is counted for it. tests/unit/test_finetune_units.py checks the
kept part against the tensors autograd actually saves on a small model.

The unit's tokens are capped so the sum stays under SITE_FINETUNE_RESERVE_BYTES; the KV cache
was sized without that reserve (memory_plan.plan_kv_cache), so training never takes memory the
cache counted on.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from fedllm_contract.fine_tuning import FineTuneHyperparameters
from site_engine.engine.lora.adapter import BaseShapes
from site_engine.finetune.trainer import LOSS_CHUNK_TOKENS

_WEIGHT_BYTES = 16  # fp32 weight + gradient + AdamW's two moments
_LORA_BYTES = 4  # peft keeps the adapters, and runs them, in fp32
_QKV, _GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")


@dataclass(frozen=True, slots=True)
class TrainingShape:
    base: BaseShapes
    hidden: int
    heads: int
    vocab: int
    element_bytes: int
    eager_attention: bool = False

    @classmethod
    def of_model(cls, model: nn.Module) -> TrainingShape:
        config = getattr(model, "config")  # noqa: B009 (a transformers model's)
        weight = next(model.parameters())
        return cls(
            BaseShapes.of_model(model),
            int(config.hidden_size),
            int(config.num_attention_heads),
            int(config.vocab_size),
            weight.element_size(),
            getattr(config, "_attn_implementation", None) == "eager",
        )

    @property
    def intermediate(self) -> int:
        return self.base.features["gate_proj"][1]

    @property
    def query_width(self) -> int:
        return self.base.features["q_proj"][1]


def lora_bytes(shape: TrainingShape, hp: FineTuneHyperparameters) -> int:
    """The LoRA weights, gradients and optimizer state of a job."""
    per_layer = sum(
        hp.lora_rank * (shape.base.features[m][0] + shape.base.features[m][1])
        for m in hp.target_modules
        if m in shape.base.features
    )
    return per_layer * shape.base.num_layers * _WEIGHT_BYTES


def _lora_inputs(shape: TrainingShape, targets: frozenset[str]) -> int:
    """Bytes a token of one layer keeps for the adapters' A gradients (their inputs)."""
    if shape.element_bytes < _LORA_BYTES:  # each adapter casts its input to fp32: a copy each
        return sum(shape.base.features[m][0] * _LORA_BYTES for m in targets)
    shared = shape.hidden * shape.element_bytes
    return (
        shared * bool(targets & set(_QKV))
        + shared * bool(targets & set(_GATE_UP))
        + shape.intermediate * shape.element_bytes * ("down_proj" in targets)
    )  # o_proj's input is attention's output, kept already


def layer_bytes_per_token(shape: TrainingShape, hp: FineTuneHyperparameters, longest: int) -> int:
    """What autograd keeps per token for one decoder layer (sequences up to `longest`)."""
    e, h = shape.element_bytes, shape.hidden
    targets = frozenset(hp.target_modules) & set(shape.base.features)
    norms = 2 * (4 * h + 4)
    attention = 4 * shape.query_width * e + 4 * shape.heads
    if shape.eager_attention:
        attention += shape.heads * longest * (4 + e)
    mlp = 3 * shape.intermediate * e
    lora = _lora_inputs(shape, targets) + len(targets) * hp.lora_rank * _LORA_BYTES
    return norms + attention + mlp + lora


def kept_bytes(shape: TrainingShape, hp: FineTuneHyperparameters, tokens: int, longest: int) -> int:
    """What autograd keeps at the end of a unit's forward (the decoder and the rows the loss
    reads), for `tokens` padded tokens in sequences up to `longest`."""
    e, h = shape.element_bytes, shape.hidden
    head_dim = shape.query_width // shape.heads
    per_token = (
        shape.base.num_layers * layer_bytes_per_token(shape, hp, longest)
        + 2 * head_dim * e  # rotary cos and sin
        + longest * e  # the padding mask, row x column, that attention keeps
        + 4 * h
        + 4  # the final norm
        + 1  # the mask of labelled positions
    )
    return per_token * tokens


def activation_bytes(
    shape: TrainingShape, hp: FineTuneHyperparameters, tokens: int, longest: int
) -> int:
    """The peak a unit of `tokens` padded tokens (sequences up to `longest`) adds."""
    e = shape.element_bytes
    backward = layer_bytes_per_token(shape, hp, longest) * tokens  # one layer's gradients
    rows = 2 * shape.hidden * e * tokens  # the labelled rows and their gradient, at most
    logits = min(tokens, LOSS_CHUNK_TOKENS) * shape.vocab * (12 + 2 * e)
    return kept_bytes(shape, hp, tokens, longest) + backward + rows + logits


def training_bytes(
    shape: TrainingShape, hp: FineTuneHyperparameters, tokens: int, longest: int
) -> int:
    return lora_bytes(shape, hp) + activation_bytes(shape, hp, tokens, longest)


def largest_unit_tokens(
    shape: TrainingShape, hp: FineTuneHyperparameters, longest: int, reserve_bytes: int
) -> int:
    """The most padded tokens one unit may take within the reserve, for sequences up to
    `longest`; 0 if not even one such sequence fits."""

    def fits(tokens: int) -> bool:
        return training_bytes(shape, hp, tokens, longest) <= reserve_bytes

    if not fits(longest):
        return 0
    # Every token costs at least what it keeps, so `high` cannot fit; bytes grow with tokens.
    low, high = longest, longest + reserve_bytes // kept_bytes(shape, hp, 1, longest) + 1
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def longest_example_tokens(
    shape: TrainingShape, hp: FineTuneHyperparameters, reserve_bytes: int, max_tokens: int
) -> int:
    """The most tokens one example may have (at most `max_tokens`, where examples are cut) for
    its unit of one to fit the reserve; 0 if not even a one-token example fits. What the site
    tells the gateway, which refuses a longer example when the job is made (issue 75)."""

    def fits(tokens: int) -> bool:
        return training_bytes(shape, hp, tokens, tokens) <= reserve_bytes

    if not fits(1):
        return 0
    # A unit of one longer example keeps more: bytes grow with its tokens.
    low, high = 1, max_tokens + 1
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low
