"""Data modules: synthetic (made on the device), scikit-learn digits, image folders, masked-LM
and language-model text.  Each is a ``LightningDataModule``; heavy imports happen on use."""
from mptrain.data.digits import DigitsDataModule
from mptrain.data.imagefolder import ImageFolderDataModule
from mptrain.data.lm import LMTextDataModule
from mptrain.data.mlm import MLMDataModule
from mptrain.data.module import MPTDataModule, SyntheticBatches
from mptrain.data.sampling import ShardedSampler

__all__ = ["DigitsDataModule", "ImageFolderDataModule", "LMTextDataModule", "MLMDataModule", "MPTDataModule",
           "SyntheticBatches", "ShardedSampler"]
