"""mptrain's Lightning callbacks: precision phases, overflow handling, exact resume, layout, fused modules."""
from mptrain.callbacks.auto_fp32_fallback import AutoFp32Fallback
from mptrain.callbacks.channels_last import ChannelsLast
from mptrain.callbacks.compile_model import CompileModel
from mptrain.callbacks.cuda_graphs import CudaGraphs
from mptrain.callbacks.fp32_finetune import Fp32Finetune
from mptrain.callbacks.fuse_modules import FuseModules
from mptrain.callbacks.overflow_monitor import OverflowMonitor
from mptrain.callbacks.resume_state import ResumeState

__all__ = ["AutoFp32Fallback", "ChannelsLast", "CompileModel", "CudaGraphs", "Fp32Finetune", "FuseModules",
           "OverflowMonitor", "ResumeState"]
