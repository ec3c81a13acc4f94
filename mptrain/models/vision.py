"""Image-classification networks by name: a small CNN for 8x8 digits, torchvision ResNets."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mptrain.compat import torch as compat
from mptrain.nn import fuse_modules
from mptrain.nn.retype import retype


class ChannelPaddedConv2d(nn.Conv2d):
    """nn.Conv2d (same parameters and state_dict) whose fp16 CUDA input is zero-padded to 4 channels,
    with the weight to match, when it has 3: cuDNN's channels_last fp16 kernels for a 3-channel image
    are slower than for 4 (ResNet-50's stem, batch 256 on the H200: forward + weight gradient 1.18 ->
    0.93 ms; docs/kernels/pool.md, "The stem convolution, padded").  The zero channels add exactly zero
    to every output and receive no gradient.  bf16 and fp32 input run unpadded (padding did not pay there)."""

    PAD_TO = 4

    @classmethod
    def from_conv(cls, conv: nn.Conv2d) -> "ChannelPaddedConv2d":
        """``conv`` itself, its class changed (parameters, hooks and settings stay as they are)."""
        return retype(conv, nn.Conv2d, cls, "ChannelPaddedConv2d.from_conv")

    def pads(self, x: torch.Tensor) -> bool:
        return x.shape[1] == 3 and self.groups == 1 and x.dtype == torch.float16 and x.is_cuda

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.pads(x):
            return super().forward(x)
        pad = (0, 0, 0, 0, 0, self.PAD_TO - 3)
        return compat.conv2d_forward(self, F.pad(x, pad), F.pad(self.weight, pad), self.bias)


def digits_cnn(num_classes: int = 10, width: int = 16, hidden: int = 64) -> nn.Module:
    """Two 3x3 conv layers, one pooling, two linear layers: ~98% on scikit-learn digits in seconds."""
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * width * 16, hidden), nn.ReLU(inplace=True), nn.Dropout(0.25),
        nn.Linear(hidden, num_classes),
    )


def build_image_model(arch: str, num_classes: int, fused: bool = False) -> nn.Module:
    """``digits_cnn`` or any torchvision classification model name (``resnet50``, ...), randomly
    initialized (no download), the residual branches' last BatchNorm zero-initialized for ResNets.
    ``fused``: mptrain's drop-ins where they apply (``fuse_modules``: the max-pools; a 3-channel stem
    conv as :class:`ChannelPaddedConv2d`); same parameters, state_dict and results."""
    model = _build(arch, num_classes)
    if fused:
        model = fuse_modules(model)
        stem = getattr(model, "conv1", None)
        if type(stem) is nn.Conv2d and stem.in_channels == 3:
            model.conv1 = ChannelPaddedConv2d.from_conv(stem)
    return model


def _build(arch: str, num_classes: int) -> nn.Module:
    if arch == "digits_cnn":
        return digits_cnn(num_classes)
    try:
        import torchvision
    except ImportError as e:
        raise ImportError(f"model.arch={arch!r} needs torchvision: pip install 'mptrain[vision]'") from e
    names = torchvision.models.list_models(module=torchvision.models)
    if arch not in names:
        raise ValueError(f"model.arch={arch!r} is not a model; choose 'digits_cnn' or a torchvision model: "
                         f"{', '.join(n for n in names if n.startswith(('resnet', 'wide_resnet', 'resnext')))}, ...")
    kwargs = {"zero_init_residual": True} if "resn" in arch else {}
    return torchvision.models.get_model(arch, weights=None, num_classes=num_classes, **kwargs)
