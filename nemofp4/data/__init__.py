"""Data: tokenizer, preprocessing to Megatron ``.bin``/``.idx``, sample index, blending, loader.

Never imports models, quant, recipes or training. Names are imported on first use, so
``import nemofp4.data`` (e.g. in tokenizer worker processes) does not pull in torch.
"""

from importlib import import_module

_EXPORTS = {
    "build_blend_index": "blending",
    "DataConfig": "config",
    "DataSourceConfig": "config",
    "CorruptDataError": "indexed",
    "IndexedDataset": "indexed",
    "IndexedDatasetWriter": "indexed",
    "write_indexed_dataset": "indexed",
    "TrainLoader": "loader",
    "build_train_loader": "loader",
    "build_validation_batches": "loader",
    "check_model_vocab": "loader",
    "TokenSource": "manifest",
    "open_token_source": "manifest",
    "PreprocessConfig": "preprocessing",
    "preprocess": "preprocessing",
    "LoadedTokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "train_bpe_tokenizer": "tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'nemofp4.data' has no attribute {name!r}")
    value = getattr(import_module(f"nemofp4.data.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
