"""Drop-in LSTM modules backed by the fused LSTM kernels (mptrain.ops.lstm).

``FusedLSTMCell`` / ``FusedLSTM`` subclass ``torch.nn.LSTMCell`` / ``torch.nn.LSTM``: same arguments,
parameter names, state_dict keys and initialisation, so checkpoints move freely between them.

``FusedLSTM(impl=)``: ``"cudnn"`` hands the call to torch's own LSTM (cuDNN on CUDA, native kernels
elsewhere); ``"fused"`` is mptrain's path (per layer one GEMM for all steps' input projections, then
the recurrent loop in C++; the reference on the CPU or without the extension); ``"auto"`` (default)
takes cuDNN whenever nn.LSTM would (so it is never slower there), the fused path on CUDA when cuDNN is
off, torch's path otherwise (CPU, PackedSequence).

torch.compile: ``FusedLSTMCell`` compiles fullgraph (one ``mptrain::lstm_cell`` per step). Dynamo
refuses every ``nn.LSTM`` instance unless ``torch._dynamo.config.allow_rnn = True``; with it,
``FusedLSTM(impl="fused")`` compiles fullgraph to one ``mptrain::lstm_layer`` per layer.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from mptrain import ops
from mptrain.compat import torch as compat
from mptrain.ops.dispatch import check_fused, use_op

IMPLS = ("auto", "cudnn", "fused")


class FusedLSTMCell(nn.LSTMCell):
    """torch.nn.LSTMCell with the fused gate kernel on CUDA; ``fused``: "auto" (the kernel on CUDA when
    the extension loads, else the reference), True (require the kernel), False (always the reference)."""

    def __init__(self, input_size, hidden_size, bias=True, device=None, dtype=None, *, fused="auto"):
        super().__init__(input_size, hidden_size, bias, device=device, dtype=dtype)
        self.fused = check_fused("FusedLSTMCell", fused)

    @classmethod
    def from_module(cls, cell: nn.LSTMCell, **kwargs) -> "FusedLSTMCell":
        """A FusedLSTMCell sharing ``cell``'s Parameter objects (optimizers keep working)."""
        new = cls(cell.input_size, cell.hidden_size, cell.bias, device="meta", **kwargs)
        for name, _ in new.named_parameters(recurse=False):
            setattr(new, name, getattr(cell, name))
        return new.train(cell.training)

    def forward(self, input, hx=None):
        # A step is host-bound: the common case (batched, hx given) goes straight to the op, which checks
        # every tensor itself, with the parameters read from their dict (self.weight_ih would cost a
        # Module.__getattr__ call each); parametrized or replaced weights take the attributes.
        if hx is not None and input.dim() == 2:
            h, c = hx
            if h.dim() == 2 and c.dim() == 2:
                p = compat.own_parameters(self)
                try:
                    w_ih, w_hh, b_ih, b_hh = p["weight_ih"], p["weight_hh"], p["bias_ih"], p["bias_hh"]
                except KeyError:
                    w_ih, w_hh, b_ih, b_hh = self.weight_ih, self.weight_hh, self.bias_ih, self.bias_hh
                return ops.lstm_cell(input, h, c, w_ih, w_hh, b_ih, b_hh, fused=self.fused)
        if input.dim() not in (1, 2):
            raise ValueError(f"FusedLSTMCell: expected input to be 1-D or 2-D, got {input.dim()}-D")
        if hx is None:
            hx = (input.new_zeros(*input.shape[:-1], self.hidden_size),) * 2
        for i, t in enumerate(hx):
            if t.dim() != input.dim():
                raise ValueError(f"FusedLSTMCell: hx[{i}] must be {input.dim()}-D like the input, got {t.dim()}-D")
        weights = (self.weight_ih, self.weight_hh, self.bias_ih, self.bias_hh)
        if input.dim() == 2:
            return ops.lstm_cell(input, hx[0], hx[1], *weights, fused=self.fused)
        h, c = ops.lstm_cell(input[None], hx[0][None], hx[1][None], *weights, fused=self.fused)  # a batch of one
        return h[0], c[0]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fused={self.fused!r}"


class FusedLSTM(nn.LSTM):
    """torch.nn.LSTM (unidirectional, no projections) with an explicit sequence policy: nn.LSTM's
    arguments and parameter names plus ``impl`` ("auto" | "cudnn" | "fused", see the module docstring)."""

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False, dropout=0.0,
                 bidirectional=False, proj_size=0, device=None, dtype=None, *, impl="auto"):
        if bidirectional:
            raise ValueError("FusedLSTM is unidirectional; use torch.nn.LSTM for bidirectional=True")
        if proj_size:
            raise ValueError(f"FusedLSTM has no projections (proj_size={proj_size}); use torch.nn.LSTM")
        if impl not in IMPLS:
            raise ValueError(f"FusedLSTM: impl={impl!r}, expected one of {IMPLS}")
        super().__init__(input_size, hidden_size, num_layers=num_layers, bias=bias, batch_first=batch_first,
                         dropout=dropout, device=device, dtype=dtype)
        self.impl = impl

    @classmethod
    def from_module(cls, lstm: nn.LSTM, **kwargs) -> "FusedLSTM":
        """A FusedLSTM sharing ``lstm``'s Parameter objects (optimizers keep working)."""
        new = cls(lstm.input_size, lstm.hidden_size, num_layers=lstm.num_layers, bias=lstm.bias,
                  batch_first=lstm.batch_first, dropout=lstm.dropout, bidirectional=lstm.bidirectional,
                  proj_size=lstm.proj_size, device="meta", **kwargs)
        for name in compat.rnn_flat_weight_names(new):
            setattr(new, name, getattr(lstm, name))
        compat.rnn_refresh_flat_weights(new)
        return new.train(lstm.training)

    def flatten_parameters(self) -> None:
        """nn.LSTM's, plus bfloat16, which torch skips (cuDNN would then copy the scattered weights into
        one buffer at every call, with the "not part of single contiguous chunk of memory" warning)."""
        super().flatten_parameters()
        weights = compat.rnn_flat_weights(self)
        if (len(weights) != len(compat.rnn_flat_weight_names(self)) or not weights
                or not all(isinstance(w, torch.Tensor) and w.is_cuda and w.dtype == torch.bfloat16 for w in weights)
                or len({w.data_ptr() for w in weights}) != len(weights)
                or not (torch.backends.cudnn.enabled and torch.backends.cudnn.is_available())
                or not compat.use_cudnn_rnn_flatten_weight()):
            return
        from torch.backends.cudnn import rnn as cudnn_rnn

        try:
            with torch.cuda.device_of(weights[0]), torch.no_grad():
                compat.cudnn_rnn_flatten_weight(
                    weights, 4 if self.bias else 2, self.input_size, cudnn_rnn.get_cudnn_mode(self.mode),
                    self.hidden_size, self.proj_size, self.num_layers, self.batch_first, bool(self.bidirectional),
                )
        except RuntimeError:
            pass  # a cuDNN without bf16 RNNs: keep torch's behaviour (copy per call)

    def resolved_impl(self, input) -> str:
        """"cudnn" or "fused": what forward(input) runs under this module's policy."""
        if self.impl != "auto":
            return self.impl
        if isinstance(input, PackedSequence) or not input.is_cuda:
            return "cudnn"  # torch's own path (native kernels on the CPU)
        if torch.backends.cudnn.enabled and torch.backends.cudnn.is_available():
            return "cudnn"
        return "fused" if use_op("lstm_layer", input, "auto") else "cudnn"

    def forward(self, input, hx=None):
        if self.resolved_impl(input) == "cudnn":
            return super().forward(input, hx)
        if isinstance(input, PackedSequence):
            raise TypeError("FusedLSTM(impl='fused') does not take a PackedSequence; use impl='cudnn'")
        return self._forward_fused(input, hx)

    def _forward_fused(self, input, hx):
        if input.dim() not in (2, 3):
            raise ValueError(f"FusedLSTM: expected input to be 2-D or 3-D, got {input.dim()}-D")
        batched = input.dim() == 3
        x = (input.transpose(0, 1) if self.batch_first else input) if batched else input.unsqueeze(1)  # (T, B, I)
        if x.size(-1) != self.input_size:
            raise ValueError(f"FusedLSTM: input.size(-1) must be input_size={self.input_size}, got {x.size(-1)}")
        shape = (self.num_layers, x.size(1), self.hidden_size)
        if hx is None:
            h0 = c0 = torch.zeros(shape, dtype=x.dtype, device=x.device)
        else:
            h0, c0 = hx if batched else (hx[0].unsqueeze(1), hx[1].unsqueeze(1))
            for name, t in (("h_0", h0), ("c_0", c0)):
                if tuple(t.shape) != shape:
                    got = tuple(t.shape) if batched else tuple(t.squeeze(1).shape)
                    want = shape if batched else shape[::2]
                    raise ValueError(f"FusedLSTM: expected {name} of shape {want}, got {got}")
        states = []
        for k in range(self.num_layers):
            weights = [getattr(self, name) for name in compat.rnn_layer_weight_names(self)[k]]
            if not self.bias:
                weights += [None, None]
            x, h, c = ops.lstm_layer(x, h0[k], c0[k], *weights)
            states.append((h, c))
            if self.dropout and self.training and k < self.num_layers - 1:
                x = nn.functional.dropout(x, self.dropout, training=True)
        h_n, c_n = (torch.stack(s) for s in zip(*states))
        if not batched:
            return x.squeeze(1), (h_n.squeeze(1), c_n.squeeze(1))
        return (x.transpose(0, 1) if self.batch_first else x), (h_n, c_n)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", impl={self.impl!r}"
