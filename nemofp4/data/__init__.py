"""Data: tokenizer, preprocessing to Megatron ``.bin``/``.idx``, sample index, blending, loader.

Never imports models, quant, recipes or training.
"""

from nemofp4.data.blending import build_blend_index
from nemofp4.data.config import DataConfig, DataSourceConfig
from nemofp4.data.indexed import CorruptDataError, IndexedDataset, IndexedDatasetWriter, write_indexed_dataset
from nemofp4.data.loader import TrainLoader, build_train_loader, build_validation_batches
from nemofp4.data.manifest import TokenSource, open_token_source
from nemofp4.data.preprocessing import PreprocessConfig, preprocess
from nemofp4.data.tokenizer import LoadedTokenizer, load_tokenizer, train_bpe_tokenizer

__all__ = [
    "CorruptDataError",
    "DataConfig",
    "DataSourceConfig",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "LoadedTokenizer",
    "PreprocessConfig",
    "TokenSource",
    "TrainLoader",
    "build_blend_index",
    "build_train_loader",
    "build_validation_batches",
    "load_tokenizer",
    "open_token_source",
    "preprocess",
    "train_bpe_tokenizer",
    "write_indexed_dataset",
]
