"""What a fine-tuning job's training holds in memory, so it fits the site's explicit reserve.

The base weights are the served model's own (shared, site_engine/finetune/trainer.py), so a job
adds only: the LoRA weights with their gradients and AdamW's two moments (fp32, 16 bytes a
weight), and the activations of one micro-batch. Activations are estimated after Korthikanti et
al. ("Reducing Activation Recomputation in Large Transformer Models"): about 34 * hidden bytes
per token and layer at 2-byte precision (scaled for the base's element size), plus the logits
in fp32 with their gradient (12 bytes per token and vocabulary entry). The micro-batch is the
largest that keeps the sum under SITE_FINETUNE_RESERVE_BYTES at the job's longest example; the
KV cache was sized without that reserve (memory_plan.plan_kv_cache), so training never takes
memory the cache counted on.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from fedllm_contract.fine_tuning import FineTuneHyperparameters
from site_engine.engine.lora.adapter import BaseShapes

_ACTIVATION_BYTES_PER_HIDDEN = 34  # per token, layer and hidden unit, at 2-byte precision
_LOGIT_BYTES = 12  # fp32 logits, their log-softmax and gradient
_WEIGHT_BYTES = 16  # fp32 weight + gradient + AdamW's two moments


@dataclass(frozen=True, slots=True)
class TrainingShape:
    base: BaseShapes
    hidden: int
    vocab: int
    element_bytes: int

    @classmethod
    def of_model(cls, model: nn.Module) -> TrainingShape:
        config = getattr(model, "config")  # noqa: B009 (a transformers model's)
        weight = next(model.parameters())
        return cls(
            BaseShapes.of_model(model),
            int(config.hidden_size),
            int(config.vocab_size),
            weight.element_size(),
        )


def lora_bytes(shape: TrainingShape, hp: FineTuneHyperparameters) -> int:
    """The LoRA weights, gradients and optimizer state of a job."""
    per_layer = sum(
        hp.lora_rank * (shape.base.features[m][0] + shape.base.features[m][1])
        for m in hp.target_modules
        if m in shape.base.features
    )
    return per_layer * shape.base.num_layers * _WEIGHT_BYTES


def activation_bytes(shape: TrainingShape, tokens: int) -> int:
    per_token = (
        _ACTIVATION_BYTES_PER_HIDDEN * shape.hidden * shape.base.num_layers * shape.element_bytes
    ) // 2 + _LOGIT_BYTES * shape.vocab
    return per_token * tokens


def training_bytes(
    shape: TrainingShape, hp: FineTuneHyperparameters, micro_batch: int, longest: int
) -> int:
    return lora_bytes(shape, hp) + activation_bytes(shape, micro_batch * longest)


def largest_micro_batch(
    shape: TrainingShape, hp: FineTuneHyperparameters, longest: int, reserve_bytes: int
) -> int:
    """The most examples (<= batch_size) one unit may run within the reserve; 0 if none fits."""
    fits = 0
    for micro in range(1, hp.batch_size + 1):
        if training_bytes(shape, hp, micro, longest) > reserve_bytes:
            break
        fits = micro
    return fits
