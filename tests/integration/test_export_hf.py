"""nemofp4-export-hf: a trained checkpoint loads in transformers with the same logits, and imports back exactly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from nemofp4.evaluation import EvaluateConfig, evaluate, is_hf_folder, load_checkpoint_model
from nemofp4.models.nemotron_h import import_hf

from .test_eval_cli import ROOT, train_tiny

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    base = tmp_path_factory.mktemp("export")
    run = base / "ue5m3"
    train_tiny(run, "precision=ue5m3", "train.max_steps=2")
    out = base / "hf"
    proc = subprocess.run(
        [sys.executable, "-m", "nemofp4.cli.export", f"checkpoint={run}", f"out={out}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, out


def test_folder_has_config_weights_tokenizer_and_provenance(exported):
    run, out = exported
    assert is_hf_folder(out)
    assert (out / "tokenizer.json").read_bytes() == (ROOT / "data" / "tokenizer" / "tokenizer.json").read_bytes()
    provenance = json.loads((out / "nemofp4_export.json").read_text())
    assert provenance["step"] == 2 and provenance["trained_recipe"] == "ue5m3"
    assert provenance["source_checkpoint"].endswith("step-2")


def test_transformers_logits_equal_ours_and_import_is_exact(exported):
    run, out = exported
    ours, _, _ = load_checkpoint_model(run, precision="bf16")
    hf = transformers.NemotronHForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    input_ids = torch.randint(0, ours.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(input_ids).logits.float() - ours(input_ids)).abs().max().item()
    assert diff <= 1e-4
    back = import_hf(out)
    state = ours.state_dict()
    assert back.state_dict().keys() == state.keys()
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.decode(tokenizer("It is a truth universally acknowledged").input_ids) == (
        "It is a truth universally acknowledged"
    )


def test_eval_accepts_the_exported_folder(exported):
    run, out = exported
    kwargs = dict(
        policy="unquantized",
        val_data=str(ROOT / "configs" / "data" / "tiny.yaml"),
        seq_len=64,
        val_sequences=8,
        batch_size=4,
        device="cpu",
    )
    from_hf = evaluate(EvaluateConfig(checkpoint=str(out), **kwargs))
    from_run = evaluate(EvaluateConfig(checkpoint=str(run), **{**kwargs, "val_data": "checkpoint"}))
    assert from_hf["val_tokens"] == from_run["val_tokens"]
    assert from_hf["val_loss"] == pytest.approx(from_run["val_loss"], abs=1e-6)


def test_auto_classes_load_offline_and_generate_stops_at_the_end_of_document(exported, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run, out = exported
    eod = 0  # <|endoftext|> in the shipped tokenizer
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    for ids in (config, generation):
        assert (ids["bos_token_id"], ids["eos_token_id"], ids["pad_token_id"]) == (eod, eod, eod)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>" and tokenizer.eos_token_id == eod
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert model.generation_config.eos_token_id == eod and model.generation_config.pad_token_id == eod
    prompt = tokenizer("It is a truth universally acknowledged", return_tensors="pt")
    with torch.no_grad():
        free = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    new = free[0, prompt.input_ids.shape[1] :].tolist()
    assert len(new) == 12 and eod not in new, new  # this 2-step model never ends a document on its own
    # Relabel ids 0 <-> first generated token in a copy: the same model, whose first new token is now EOD.
    first = new[0]
    assert first != eod and not {eod, first} & set(prompt.input_ids[0].tolist())
    swapped = tmp_path / "swapped"
    shutil.copytree(out, swapped)
    weights = load_file(str(out / "model.safetensors"))
    for name in ("backbone.embeddings.weight", "lm_head.weight"):
        weights[name][[eod, first]] = weights[name][[first, eod]]
    save_file(weights, str(swapped / "model.safetensors"), metadata={"format": "pt"})
    relabeled = transformers.AutoModelForCausalLM.from_pretrained(swapped, dtype=torch.float32).eval()
    with torch.no_grad():
        stopped = relabeled.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert stopped[0, prompt.input_ids.shape[1] :].tolist() == [eod]  # stopped at the end-of-document token
