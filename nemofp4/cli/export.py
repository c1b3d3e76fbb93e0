"""``nemofp4-export-hf``: a checkpoint of ours as a transformers NemotronH folder.

    nemofp4-export-hf checkpoint=runs/tiny-ue5m3 out=exports/tiny-ue5m3
    nemofp4-export-hf checkpoint=runs/tiny-ue5m3/checkpoints/step-200 out=exports/x dtype=bfloat16

Writes config.json and model.safetensors (``NemotronHForCausalLM.from_pretrained`` loads it)
plus the run's tokenizer files, and ``nemofp4_export.json`` naming the source checkpoint and
its recipe. The weights are the master weights: the FP4 recipe is not part of the folder, so
transformers runs the model unquantized (as ``nemofp4-eval policy=unquantized`` does). The
reverse import is ``nemofp4.models.nemotron_h.import_hf`` (``nemofp4-eval`` accepts such a
folder directly).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from nemofp4.cli.errors import run_cli
from nemofp4.cli.evaluate import store_primary_config
from nemofp4.evaluation.config import ExportConfig

store_primary_config("export", ExportConfig)
log = logging.getLogger("nemofp4")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def export_checkpoint(cfg: ExportConfig) -> Path:
    """Export ``cfg.checkpoint`` to ``cfg.out``; returns the folder."""
    from nemofp4.data.paths import resolve_path
    from nemofp4.evaluation.checkpoint import load_checkpoint_model, resolve_checkpoint
    from nemofp4.models.nemotron_h import export_hf

    folder = resolve_checkpoint(cfg.checkpoint)
    # bf16: no recipe is applied, the state dict is the same either way and nothing FP4 is needed.
    model, job, state = load_checkpoint_model(folder, precision="bf16")
    out = export_hf(model, cfg.out, dtype=getattr(torch, cfg.dtype))
    copied = []
    tokenizer = cfg.tokenizer or job.data.tokenizer
    if tokenizer != "none":
        source = resolve_path(tokenizer)
        source_dir = source if source.is_dir() else source.parent
        names = TOKENIZER_FILES if source.is_dir() else (source.name, *TOKENIZER_FILES[1:])
        for name in names:
            if (source_dir / name).is_file():
                shutil.copyfile(source_dir / name, out / name)
                copied.append(name)
        if not copied:
            log.warning("no tokenizer files found at %s; the folder has weights and config only", source)
    provenance = {
        "source_checkpoint": str(folder),
        "step": state.get("step"),
        "tokens_seen": state.get("tokens_seen"),
        "trained_recipe": job.precision.name,
        "dtype": cfg.dtype,
        "tokenizer_files": copied,
    }
    (out / "nemofp4_export.json").write_text(json.dumps(provenance, indent=2) + "\n")
    return out


@hydra.main(version_base=None, config_path=None, config_name="export")
def _main(cfg: DictConfig) -> None:
    logging.getLogger("nemofp4").setLevel(logging.INFO)
    out = export_checkpoint(OmegaConf.to_object(cfg))
    print(f"exported to {out}", flush=True)


def main() -> None:
    run_cli(_main, name="nemofp4-export-hf")


if __name__ == "__main__":
    main()
