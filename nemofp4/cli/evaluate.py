"""``nemofp4-eval``: held-out NLL and multiple-choice accuracy of a checkpoint under an inference policy.

    nemofp4-eval checkpoint=runs/tiny-ue5m3 policy=current tasks='[data/tasks/austen_cloze.jsonl]' out=eval.json
    nemofp4-eval checkpoint=runs/tiny-ue5m3/checkpoints/step-200 policy=delayed delay=50
    nemofp4-eval checkpoint=hf_out/ val_data=configs/data/tiny.yaml        # a transformers folder

The settings are the fields of :class:`nemofp4.evaluation.EvaluateConfig` (configs/evaluate.yaml).
Results go to ``out`` as JSON with a markdown table beside it, and are printed.
"""

from __future__ import annotations

import json
import logging

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from nemofp4.cli.errors import HydraApp, run_cli
from nemofp4.data.paths import CONFIG_DIR
from nemofp4.evaluation.config import EvaluateConfig

log = logging.getLogger("nemofp4")


def store_primary_config(name: str, schema: type) -> None:
    """Register ``configs/<name>.yaml`` (over its typed schema) as a primary config in Hydra's
    ConfigStore, and run the app without a config search path.

    Why: ``configs/`` has a ``checkpoint`` group (the trainer's), so with it on the search path
    Hydra would read ``checkpoint=<path>`` as a group choice rather than this app's field.
    """
    store = ConfigStore.instance()
    store.store(name=f"{name}_schema", node=schema)
    store.store(name=name, node=OmegaConf.load(CONFIG_DIR / f"{name}.yaml"))


store_primary_config("evaluate", EvaluateConfig)


@hydra.main(version_base=None, config_path=None, config_name="evaluate")
def _main(cfg: DictConfig) -> None:
    from nemofp4.evaluation.runner import evaluate, format_markdown, write_results

    logging.getLogger("nemofp4").setLevel(logging.INFO)
    config: EvaluateConfig = OmegaConf.to_object(cfg)
    results = evaluate(config)
    print(format_markdown(results), flush=True)
    if config.out:
        json_path, md_path = write_results(results, config.out)
        log.info("results: %s, %s", json_path, md_path)
    else:
        print(json.dumps(results, indent=2, sort_keys=True))


def main() -> None:
    run_cli(_main, name="nemofp4-eval", app=HydraApp("evaluate"))


if __name__ == "__main__":
    main()
