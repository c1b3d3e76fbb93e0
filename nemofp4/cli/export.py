"""``nemofp4-export-hf``: a checkpoint of ours as a transformers NemotronH folder.

    nemofp4-export-hf checkpoint=runs/tiny-ue5m3 out=exports/tiny-ue5m3
    nemofp4-export-hf checkpoint=runs/tiny-ue5m3/checkpoints/step-200 out=exports/x dtype=bfloat16

Writes config.json, generation_config.json and model.safetensors
(``NemotronHForCausalLM.from_pretrained`` loads it) plus the run's tokenizer files with the
end-of-document token as eos/bos/pad (``AutoTokenizer`` loads them, and ``generate`` stops at
the end of a document), and ``nemofp4_export.json`` naming the source checkpoint and its recipe. The weights are the master weights: the FP4 recipe is not part of the folder, so
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

from nemofp4.cli.errors import HydraApp, run_cli
from nemofp4.cli.evaluate import store_primary_config
from nemofp4.evaluation.config import ExportConfig

store_primary_config("export", ExportConfig)
log = logging.getLogger("nemofp4")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def export_checkpoint(cfg: ExportConfig) -> Path:
    """Export ``cfg.checkpoint`` to ``cfg.out``; returns the folder."""
    from nemofp4.data import load_tokenizer
    from nemofp4.data.paths import resolve_path
    from nemofp4.evaluation.checkpoint import load_checkpoint_model, resolve_checkpoint
    from nemofp4.evaluation.run_config import read_step_config
    from nemofp4.models.nemotron_h import check_exportable, export_hf

    _prepare_out(Path(cfg.out))
    folder = resolve_checkpoint(cfg.checkpoint)
    check_exportable(read_step_config(folder)[0].model)  # before the weights are read
    # bf16: no recipe is applied, the state dict is the same either way and nothing FP4 is needed.
    model, job, state = load_checkpoint_model(folder, precision="bf16", log_loaded=False)
    tokenizer = cfg.tokenizer or job.data.tokenizer
    loaded = None
    if tokenizer != "none":
        loaded = load_tokenizer(resolve_path(tokenizer), eod_token=job.data.eod_token or None)
        if loaded.vocab_size > job.model.vocab_size:
            raise ValueError(
                f"tokenizer {loaded.path} has {loaded.vocab_size} tokens, more than the model's "
                f"vocab_size={job.model.vocab_size}: it is not the tokenizer this model was trained with"
            )
    out = export_hf(model, cfg.out, dtype=getattr(torch, cfg.dtype), eod_token_id=loaded.eod_id if loaded else None)
    copied = []
    if loaded is not None:
        source = resolve_path(tokenizer)
        source_dir = source if source.is_dir() else source.parent
        names = TOKENIZER_FILES if source.is_dir() else (source.name, *TOKENIZER_FILES[1:])
        for name in names:
            if (source_dir / name).is_file():
                shutil.copyfile(source_dir / name, out / name)
                copied.append(name)
        _write_special_tokens(out / "tokenizer_config.json", loaded.eod_token)
        if "tokenizer_config.json" not in copied:
            copied.append("tokenizer_config.json")
    provenance = {
        "source_checkpoint": str(folder),
        "step": state.get("step"),
        "tokens_seen": state.get("tokens_seen"),
        "trained_recipe": job.precision.name,
        "dtype": cfg.dtype,
        "tokenizer_files": copied,
    }
    (out / "nemofp4_export.json").write_text(json.dumps(provenance, indent=2) + "\n")
    log.info(
        "exported step %s of %s (trained with recipe %s): its master weights, which transformers runs unquantized",
        state.get("step"),
        folder,
        job.precision.name,
    )
    return out


def _prepare_out(out: Path) -> None:
    """Create the output folder before anything is loaded, so a bad `out=` fails first, by name."""
    blocker = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        what = "is an existing file" if blocker == out else f"is inside {str(blocker)!r}, an existing file"
        raise FileExistsError(
            f"out={str(out)!r} {what}; the export writes a folder (config.json, "
            "model.safetensors, tokenizer files): pass a new folder or an existing one"
        )
    out.mkdir(parents=True, exist_ok=True)


def _write_special_tokens(path: Path, eod_token: str) -> None:
    """tokenizer_config.json with the EOD token as eos, bos and pad (kept beside any other settings)."""
    settings = json.loads(path.read_text()) if path.is_file() else {}
    settings.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    settings.update(eos_token=eod_token, bos_token=eod_token, pad_token=eod_token)
    path.write_text(json.dumps(settings, indent=2) + "\n")


@hydra.main(version_base=None, config_path=None, config_name="export")
def _main(cfg: DictConfig) -> None:
    logging.getLogger("nemofp4").setLevel(logging.INFO)
    out = export_checkpoint(OmegaConf.to_object(cfg))
    print(f"exported to {out}", flush=True)


def main() -> None:
    run_cli(_main, name="nemofp4-export-hf", app=HydraApp("export"))


if __name__ == "__main__":
    main()
