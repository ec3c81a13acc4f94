"""ImageNet-layout image folders (``root/{train,val}/<class>/*.jpg``) with the standard ResNet augmentations."""
from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch
from torch.utils.data import Dataset

from mptrain.data.module import MPTDataModule, require_data_dir
from mptrain.data.sampling import sample_seed


def _torchvision():
    try:
        import torchvision
    except ImportError as e:
        raise ImportError("image folders need torchvision: pip install 'mptrain[vision]'") from e
    return torchvision


def standard_transforms(train: bool, image_size: int = 224):
    """RandomResizedCrop + horizontal flip for training; resize to 8/7 then center crop for
    validation; both normalized with the ImageNet statistics."""
    T = _torchvision().transforms
    norm = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))  # ImageNet's per-channel mean and std
    if train:
        return T.Compose([T.RandomResizedCrop(image_size), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    return T.Compose([T.Resize(int(image_size * 8 / 7)), T.CenterCrop(image_size), T.ToTensor(), norm])


class SeededImageFolder(Dataset):
    """torchvision's ImageFolder whose augmentation of sample ``i`` in epoch ``e`` is drawn from
    a generator seeded by (seed, e, i): the same whichever worker or rank loads it, so a resumed
    run sees the images the uninterrupted run would have seen."""

    def __init__(self, root: str, transform, seed: int = 0):
        if not os.path.isdir(root):
            raise FileNotFoundError(f"image folder {root!r} does not exist (expected ImageNet layout: "
                                    f"{root}/<class>/<image>)")
        self.folder = _torchvision().datasets.ImageFolder(root, transform=transform)
        self.classes: list[str] = self.folder.classes
        self.seed, self.epoch = seed, 0

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, index: int):
        # a worker's RNG is its own: reseed it directly; in the main process leave the training RNG untouched
        in_worker = torch.utils.data.get_worker_info() is not None
        with contextlib.nullcontext() if in_worker else torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_seed(self.seed, self.epoch, index))
            return self.folder[index]


class ImageFolderDataModule(MPTDataModule):
    """Image classification from ``data_dir/train`` and ``data_dir/val``.

    Args:
        data_dir: root holding ``train/`` and ``val/`` (ignored when ``synthetic``).
        image_size: training crop / validation crop size.
        num_classes: classes (read from the folders when ``None``; synthetic mode needs it, 1000 by default).
        (others: see ``MPTDataModule``)
    """

    def __init__(self, data_dir: Optional[str] = None, batch_size: int = 256, num_workers: int = 8,
                 pin_memory: bool = True, seed: int = 0, synthetic: bool = False, synthetic_batches: int = 1000,
                 image_size: int = 224, num_classes: Optional[int] = None, channels_last: bool = True):
        super().__init__(batch_size, num_workers, pin_memory, seed, synthetic, synthetic_batches)
        require_data_dir(data_dir, synthetic)
        self.data_dir, self.image_size, self.channels_last = data_dir, image_size, channels_last
        self._num_classes = num_classes

    @property
    def num_classes(self) -> int:
        if self._num_classes is None and not self.synthetic:
            self.setup("fit")
            self._num_classes = len(self.train_set.classes)
        return 1000 if self._num_classes is None else self._num_classes

    def make_synthetic_batch(self, g, device):
        x = torch.randn(self.batch_size, 3, self.image_size, self.image_size, generator=g, device=device)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, self.num_classes, (self.batch_size,), generator=g, device=device)
        return x, y

    def load(self, stage: str) -> None:
        self.train_set = SeededImageFolder(os.path.join(self.data_dir, "train"),
                                           standard_transforms(True, self.image_size), self.seed)
        self.val_set = SeededImageFolder(os.path.join(self.data_dir, "val"),
                                         standard_transforms(False, self.image_size), self.seed)
        if self.train_set.classes != self.val_set.classes:
            raise ValueError(f"{self.data_dir}: train/ has {len(self.train_set.classes)} classes and val/ has "
                             f"{len(self.val_set.classes)}; they must hold the same class folders")
