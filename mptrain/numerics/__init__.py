"""Numerics toolkit: where does low precision hurt, layer by layer?

* :func:`compare_layerwise` -- fp32 shadow comparison of every module (forward and backward);
* :class:`OverflowMonitor` -- the Lightning callback counting inf/NaN, near-max values and
  fp16-underflowing gradients per module (it lives in :mod:`mptrain.callbacks`, re-exported here);
* :func:`evaluate_precisions` -- metric and latency of a trained model per precision,
  int8 dynamic quantization included (:mod:`mptrain.numerics.quant`);
* :func:`doctor_report` -- what the hardware and the toolchain can do.
"""
from mptrain.callbacks.overflow_monitor import OverflowMonitor
from mptrain.numerics.evaluate import PrecisionTable, evaluate_precisions
from mptrain.numerics.hardware import doctor_report, format_doctor
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
    "doctor_report", "format_doctor",
    "QuantConfig", "QuantReport", "Int8DynamicLinear", "quantize", "dequantize", "quantize_weight",
    "quantize_activation", "quantize_dynamic", "int8_matmul", "int8_matmul_reference", "quantization_report",
]

