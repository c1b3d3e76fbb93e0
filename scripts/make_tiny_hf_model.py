"""A small random Nemotron-H saved by transformers, as a stand-in for a downloaded released folder.

    python scripts/make_tiny_hf_model.py hf/tiny-nemotron-h
    python scripts/make_tiny_hf_model.py hf/small --preset small --max-shard-size 50MB

transformers' own ``NemotronHForCausalLM`` builds the model (its own initialization, then every weight
moved off it by a seeded perturbation, so that a model that was not loaded computes another loss) and
``save_pretrained`` writes it: ``config.json``, ``generation_config.json``, safetensors (one file, or
shards with ``model.safetensors.index.json`` when ``--max-shard-size`` is given). The shipped
tokenizer (8,192 tokens, EOD ``<|endoftext|>``) is copied beside it with a ``tokenizer_config.json``
that ``AutoTokenizer`` reads, so the folder has the layout of the released ones and the shipped token
files match its tokenizer. Offline: nothing is
downloaded. Tests and docs/training.md ("Continue from a released model") use it.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_TOKENIZER = ROOT / "data" / "tokenizer"
EOD = "<|endoftext|>"


def make_tiny_hf_model(
    out: str | Path,
    *,
    preset: str = "tiny",
    dtype: str = "bfloat16",
    seed: int = 0,
    max_shard_size: str | None = None,
    perturbation: float = 0.05,
    **overrides,
) -> Path:
    """Write the folder ``out``; ``overrides`` change fields of the nemofp4 preset the architecture comes from."""
    import transformers

    from nemofp4.models import get_model_config
    from nemofp4.models.nemotron_h import to_hf_config

    out = Path(out)
    config = get_model_config(preset, **overrides)
    hf_config = transformers.NemotronHConfig(
        **{**to_hf_config(config), "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    )
    torch.manual_seed(seed)
    model = transformers.NemotronHForCausalLM(hf_config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * (perturbation * 6 if p.dim() == 1 else perturbation))
    model.to(getattr(torch, dtype))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, **kwargs)
    # the shipped tokenizer as it is (re-saving it through transformers would rewrite tokenizer.json, and the
    # shipped token files record the hash of this one), with transformers' settings beside it
    shutil.copyfile(SHIPPED_TOKENIZER / "tokenizer.json", out / "tokenizer.json")
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOD, "bos_token": EOD, "pad_token": EOD}
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="folder to write (replaced if it exists)")
    parser.add_argument("--preset", default="tiny", help="nemofp4 model preset of the architecture (default tiny)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-size", default=None, help="e.g. 1MB: shards with an index, as released models")
    parser.add_argument("--pattern", default=None, help="override the preset's hybrid_layer_pattern")
    args = parser.parse_args()
    overrides = {"hybrid_layer_pattern": args.pattern} if args.pattern else {}
    out = make_tiny_hf_model(
        args.out, preset=args.preset, dtype=args.dtype, seed=args.seed, max_shard_size=args.max_shard_size, **overrides
    )
    print(f"wrote {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")


if __name__ == "__main__":
    main()
