"""Numerics toolkit: where low precision hurts, layer by layer (:func:`compare_layerwise`), what a
trained model's metric and latency become per precision, int8 included (:func:`evaluate_precisions`),
what fp8-master's casts do to each linear layer (:func:`fp8_report`); :class:`OverflowMonitor` is the
callbacks' one.  The command-line front ends (``mptrain numerics``, ``mptrain doctor``) live in mptrain.cli."""
from mptrain.callbacks.overflow_monitor import OverflowMonitor
from mptrain.numerics.evaluate import PrecisionTable, evaluate_precisions
from mptrain.numerics.fp8 import Fp8Report, fp8_report
from mptrain.numerics.layerwise import ROW_KEYS, LayerwiseReport, compare_layerwise
from mptrain.numerics.quant import (
    Int8DynamicLinear,
    QuantConfig,
    QuantReport,
    dequantize,
    int8_matmul,
    int8_matmul_reference,
    quantization_report,
    quantize,
    quantize_activation,
    quantize_dynamic,
    quantize_weight,
)

__all__ = [
    "compare_layerwise", "LayerwiseReport", "ROW_KEYS", "OverflowMonitor",
    "evaluate_precisions", "PrecisionTable",
    "fp8_report", "Fp8Report",
    "QuantConfig", "QuantReport", "Int8DynamicLinear", "quantize", "dequantize", "quantize_weight",
    "quantize_activation", "quantize_dynamic", "int8_matmul", "int8_matmul_reference", "quantization_report",
]

