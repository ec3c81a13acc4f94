"""Image-classification networks by name: a small CNN for 8x8 digits, torchvision ResNets."""
from __future__ import annotations

from torch import nn


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


def build_image_model(arch: str, num_classes: int) -> nn.Module:
    """``digits_cnn`` or any torchvision classification model name (``resnet50``, ...), randomly
    initialized (no download), the residual branches' last BatchNorm zero-initialized for ResNets."""
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
