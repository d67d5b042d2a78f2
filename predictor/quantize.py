"""Optional int8 dynamic quantization of the MiniLM export, kept only when it costs no accuracy.

Dynamic quantization stores the MatMul weights as int8 (a quarter of the bytes) and quantizes
activations on the fly; on a CPU that is memory-bound at small batch sizes it roughly halves
single-prompt latency. It is accepted only if validation accuracy drops by at most
MAX_ACCURACY_DROP (0.5 points); the caller records both sets of metrics either way.
"""

from __future__ import annotations

import logging
from pathlib import Path

MAX_ACCURACY_DROP = 0.005


def quantize_int8(source: Path, target: Path, per_channel: bool = False) -> None:
    """per_channel: one scale per output column of each weight matrix instead of one per matrix,
    so a few large weights do not flatten the rest of the matrix to a handful of levels."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # The quantizer warns on the root logger that the model was not pre-processed (shape
    # inference for static quantization); dynamic quantization does not need it.
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        quantize_dynamic(
            str(source), str(target), per_channel=per_channel, weight_type=QuantType.QInt8
        )
    finally:
        root.setLevel(level)


def accept_quantized(fp32_accuracy: float, int8_accuracy: float) -> bool:
    return int8_accuracy >= fp32_accuracy - MAX_ACCURACY_DROP
