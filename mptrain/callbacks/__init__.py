"""mptrain's Lightning callbacks: precision phases, overflow handling, exact resume, layout."""
from mptrain.callbacks.channels_last import ChannelsLast
from mptrain.callbacks.compile_model import CompileModel
from mptrain.callbacks.resume_state import ResumeState

__all__ = ["ChannelsLast", "CompileModel", "ResumeState"]
