"""LightningDataModules: scikit-learn digits, image folders, masked-LM and LM text, each also synthetic."""
from mptrain.data.digits import DigitsDataModule
from mptrain.data.imagefolder import ImageFolderDataModule
from mptrain.data.lm import LMTextDataModule
from mptrain.data.mlm import MLMDataModule
from mptrain.data.module import MPTDataModule, SyntheticBatches
from mptrain.data.sampling import ShardedSampler

__all__ = ["DigitsDataModule", "ImageFolderDataModule", "LMTextDataModule", "MLMDataModule", "MPTDataModule",
           "SyntheticBatches", "ShardedSampler"]
