"""``nemofp4-preprocess``: tokenize text into Megatron ``.bin``/``.idx`` shards plus a manifest.

    nemofp4-preprocess input='corpus/*.jsonl' tokenizer=path/to/tokenizer output_prefix=out/web workers=8
    nemofp4-preprocess input=data/corpus/austen_train.jsonl.gz tokenizer=train output_prefix=/tmp/austen

The settings are the fields of :class:`nemofp4.data.preprocessing.PreprocessConfig`
(``configs/preprocess.yaml``); a misspelled override fails at start.
"""

from __future__ import annotations

import logging

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from nemofp4.cli.errors import HydraApp, run_cli
from nemofp4.data.paths import CONFIG_DIR as _CONFIG_DIR
from nemofp4.data.preprocessing import PreprocessConfig, preprocess

CONFIG_DIR = str(_CONFIG_DIR)
ConfigStore.instance().store(name="preprocess_schema", node=PreprocessConfig)
log = logging.getLogger("nemofp4.preprocess")


@hydra.main(version_base=None, config_path=CONFIG_DIR, config_name="preprocess")
def _main(cfg: DictConfig) -> None:
    manifest = preprocess(OmegaConf.to_object(cfg))
    log.info(
        "%s: %d documents, %d tokens (%s) in %d shard(s)",
        cfg.output_prefix,
        manifest["documents"],
        manifest["tokens"],
        manifest["dtype"],
        len(manifest["shards"]),
    )


def main() -> None:
    run_cli(_main, name="nemofp4-preprocess", app=HydraApp("preprocess", CONFIG_DIR))


if __name__ == "__main__":
    main()
