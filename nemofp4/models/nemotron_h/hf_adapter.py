"""State-dict and config adapter to and from Hugging Face transformers' NemotronH layout.

Ours and HF's module trees match below the top: HF nests the stack under ``backbone.`` in the
released checkpoints (``model.`` in transformers >= 5, which renames ``backbone.`` on load) and
keeps ``lm_head`` at the top. We export the released layout (``backbone.``) so the folder loads
in both, and import either prefix. transformers is not needed to export or import a folder.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from .config import LayerType, NemotronHConfig
from .model import NemotronHModel

HF_PREFIX = "backbone."
_HF_PREFIXES = ("backbone.", "model.")
_OUR_STACK_KEYS = ("embeddings.", "layers.", "norm_f.")

# transformers' names for layer kinds, old ("mamba"/"attention") and new ("linear_attention"/...).
_HF_LAYER_NAMES = {
    "mamba": LayerType.MAMBA,
    "linear_attention": LayerType.MAMBA,
    "attention": LayerType.ATTENTION,
    "full_attention": LayerType.ATTENTION,
    "mlp": LayerType.MLP,
}


# ---------------------------------------------------------------------------- state dict
def to_hf_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our names -> HF's (``layers.3.mixer.in_proj.weight`` -> ``backbone.layers.3.mixer.in_proj.weight``)."""
    out = {}
    for name, tensor in state_dict.items():
        out[HF_PREFIX + name if name.startswith(_OUR_STACK_KEYS) else name] = tensor
    return out


def _our_name(name: str) -> str:
    for prefix in _HF_PREFIXES:
        if name.startswith(prefix) and name[len(prefix) :].startswith(_OUR_STACK_KEYS):
            return name[len(prefix) :]
    return name


def from_hf_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's names (``backbone.`` or ``model.`` prefix) -> ours. Inverse of :func:`to_hf_state_dict`."""
    return {_our_name(name): tensor for name, tensor in state_dict.items()}


# ---------------------------------------------------------------------------- config
def check_exportable(config: NemotronHConfig) -> None:
    """ValueError when transformers' NemotronH cannot run ``config``: its MLP is ``up_proj`` -> activation
    -> ``down_proj`` with no gate, so a SwiGLU model has no HF equivalent."""
    if config.mlp_activation != "relu2":
        raise ValueError(
            f"model.mlp_activation={config.mlp_activation} does not export to Hugging Face: transformers' "
            "NemotronH has only an ungated MLP (up_proj, relu2, down_proj); only model.mlp_activation=relu2 models export"
        )


def to_hf_config(config: NemotronHConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The ``config.json`` dict transformers' NemotronHConfig reads (legacy-compatible keys)."""
    check_exportable(config)
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "hybrid_override_pattern": config.hybrid_layer_pattern,
        "num_hidden_layers": config.num_layers,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "tie_word_embeddings": config.tie_word_embeddings,
        "layer_norm_epsilon": config.norm_eps,
        "intermediate_size": config.ffn_hidden_size,
        "mlp_hidden_act": "relu2",
        "mlp_bias": False,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.attention_head_dim,
        "attention_bias": False,
        "max_position_embeddings": config.max_position_embeddings,
        "mamba_num_heads": config.mamba_num_heads,
        "mamba_head_dim": config.mamba_head_dim,
        "expand": config.mamba_expand,
        "ssm_state_size": config.ssm_state_size,
        "n_groups": config.mamba_num_groups,
        "conv_kernel": config.conv_kernel,
        "use_conv_bias": config.use_conv_bias,
        "chunk_size": config.chunk_size,
        "time_step_min": config.time_step_min,
        "time_step_max": config.time_step_max,
        "time_step_floor": config.time_step_floor,
        "time_step_limit": list(_time_step_limit(config)),
        "mamba_hidden_act": "silu",
        "use_bias": False,
        "mamba_proj_bias": False,
        "residual_in_fp32": False,
        "initializer_range": config.init_std,
        "rescale_prenorm_residual": config.rescale_prenorm_residual,
        "dtype": dtype_name,
    }


def _time_step_limit(config: NemotronHConfig) -> tuple[float, float]:
    """The range our forward clamps softplus(dt + dt_bias) to, as NemotronH's ``time_step_limit``.

    The released checkpoints' (0, inf) means no clamp; transformers >= 5.25 applies the configured
    limit, as the published NemotronH implementation does, so an export behaves there as here."""
    return (config.time_step_min if config.clamp_dt_to_min else 0.0, math.inf)


def _clamps_dt_to_min(hf: dict) -> bool:
    """Inverse of :func:`_time_step_limit`. A config without the key is a released one: (0, inf)."""
    # transformers >= 5.25 writes a non-finite float as {"__float__": "Infinity"} in config.json
    low, high = (
        float(v["__float__"] if isinstance(v, dict) else v) for v in hf.get("time_step_limit") or (0, math.inf)
    )
    time_step_min = float(hf.get("time_step_min", hf.get("mamba_dt_min", 0.001)))
    if high != math.inf or low not in (0.0, time_step_min):
        raise ValueError(
            f"HF config has time_step_limit={[low, high]}; supported: [0.0, inf] (no clamp, the released "
            f"checkpoints) or [time_step_min, inf] = [{time_step_min}, inf]"
        )
    return low > 0.0


def _pattern_from_hf(hf: dict) -> str:
    pattern = hf.get("hybrid_override_pattern")
    if isinstance(pattern, str):
        if "E" in pattern:
            raise ValueError(f"MoE layers ('E' in {pattern!r}) are not supported by this model")
        return pattern
    kinds = hf.get("layers_block_type") or hf.get("layer_types")
    if not isinstance(kinds, list):
        raise ValueError("HF config has neither 'hybrid_override_pattern' nor a 'layers_block_type' list")
    unknown = sorted({k for k in kinds if k not in _HF_LAYER_NAMES})
    if unknown:
        raise ValueError(f"HF layer types {unknown} are not supported; supported: {sorted(_HF_LAYER_NAMES)}")
    return "".join(_HF_LAYER_NAMES[k].value for k in kinds)


def from_hf_config(hf_config) -> NemotronHConfig:
    """Our config from an HF NemotronH config (a ``PretrainedConfig`` or its ``config.json`` dict)."""
    hf = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    if hf.get("model_type", "nemotron_h") != "nemotron_h":
        raise ValueError(f"expected model_type 'nemotron_h', got {hf.get('model_type')!r}")
    for flag in ("attention_bias", "mlp_bias", "use_bias", "mamba_proj_bias"):
        if hf.get(flag, False):
            raise ValueError(f"HF config sets {flag}=True; this model has no linear biases")
    for key, expected in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if hf.get(key, expected) != expected:
            raise ValueError(f"HF config has {key}={hf[key]!r}; only {expected!r} is supported")

    def pick(*names, default=None):
        for name in names:
            if name in hf and hf[name] is not None:
                return hf[name]
        if default is None:
            raise ValueError(f"HF config lacks {names[0]!r}")
        return default

    return NemotronHConfig(
        hybrid_layer_pattern=_pattern_from_hf(hf),
        hidden_size=pick("hidden_size"),
        vocab_size=pick("vocab_size"),
        tie_word_embeddings=bool(pick("tie_word_embeddings", default=False)),
        norm_eps=float(pick("layer_norm_epsilon", "rms_norm_eps", default=1e-5)),
        ffn_hidden_size=pick("intermediate_size"),
        num_attention_heads=pick("num_attention_heads"),
        num_key_value_heads=pick("num_key_value_heads", "num_attention_heads"),
        attention_head_dim=pick("head_dim", "attention_head_dim"),
        max_position_embeddings=pick("max_position_embeddings", default=8192),
        mamba_num_heads=pick("mamba_num_heads"),
        mamba_head_dim=pick("mamba_head_dim"),
        mamba_expand=pick("expand", "mamba_expand", default=2),
        ssm_state_size=pick("ssm_state_size"),
        mamba_num_groups=pick("n_groups", "mamba_n_groups"),
        conv_kernel=pick("conv_kernel", "mamba_d_conv", default=4),
        use_conv_bias=bool(pick("use_conv_bias", "mamba_conv_bias", default=True)),
        chunk_size=pick("chunk_size", "mamba_chunk_size", default=128),
        time_step_min=float(pick("time_step_min", "mamba_dt_min", default=0.001)),
        time_step_max=float(pick("time_step_max", "mamba_dt_max", default=0.1)),
        time_step_floor=float(pick("time_step_floor", "mamba_dt_init_floor", default=1e-4)),
        clamp_dt_to_min=_clamps_dt_to_min(hf),
        init_std=float(pick("initializer_range", default=0.02)),
        rescale_prenorm_residual=bool(pick("rescale_prenorm_residual", default=True)),
    )


INIT_ONLY_FIELDS = (
    "chunk_size",
    "max_position_embeddings",
    "time_step_max",
    "time_step_floor",
    "init_std",
    "rescale_prenorm_residual",
)
"""Config fields that do not change what given weights compute: the SSD chunk (speed and memory; the
numerics only up to rounding), the context length (NoPE: it documents intent) and the fields read only
by random initialization. Weights trained under one value continue under another."""


def config_mismatches(source: NemotronHConfig, target: NemotronHConfig) -> list[str]:
    """``field: source -> target`` for every field outside :data:`INIT_ONLY_FIELDS` on which two configs
    differ: weights of ``source`` would compute something else (or not fit) in a model of ``target``."""
    return [
        f"{f.name}: {getattr(source, f.name)!r} -> {getattr(target, f.name)!r}"
        for f in dataclasses.fields(NemotronHConfig)
        if f.name not in INIT_ONLY_FIELDS and getattr(source, f.name) != getattr(target, f.name)
    ]


# ---------------------------------------------------------------------------- folders
def export_hf(
    model: NemotronHModel, out_dir: str | Path, dtype: torch.dtype | None = None, *, eod_token_id: int | None = None
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` that ``NemotronHForCausalLM.from_pretrained`` loads.

    ``dtype`` casts the weights (default: keep the model's). Tied weights are written twice
    (HF's NemotronH does not tie), so the folder loads with no missing keys.

    ``eod_token_id``: the end-of-document token the model was trained with. It becomes the eos,
    bos and pad id of ``config.json`` and ``generation_config.json``: documents were packed as
    ``text EOD text EOD ...``, so EOD both ends one document and precedes the next, and without
    these keys transformers would assume NemotronH's own ids (bos 1, eos 2, pad 0).
    """
    from safetensors.torch import save_file

    check_exportable(model.config)  # before anything is written
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().to("cpu", dtype=dtype or tensor.dtype)
        state[name] = tensor.contiguous().clone()  # clone: safetensors refuses shared storage
    if "lm_head.weight" not in state:  # tied and deduplicated by state_dict
        state["lm_head.weight"] = state["embeddings.weight"].clone()
    save_dtype = dtype or next(iter(state.values())).dtype
    save_file(to_hf_state_dict(state), str(out / "model.safetensors"), metadata={"format": "pt"})
    hf_config = to_hf_config(model.config, save_dtype)
    if eod_token_id is not None:
        special = {"bos_token_id": eod_token_id, "eos_token_id": eod_token_id, "pad_token_id": eod_token_id}
        hf_config.update(special)
        generation = {**special, "do_sample": False, "_from_model_config": False}
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    return out


def _read_json_object(path: Path) -> dict:
    """The JSON object in ``path``; ValueError naming the file when it is not valid JSON or not an object
    (a truncated download, a hand edit): the decoder's own message names neither."""
    try:
        value = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from err
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def read_hf_config(path: str | Path) -> dict:
    """The ``config.json`` of a transformers model folder."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path / 'config.json'} not found: not a transformers model folder")
    return _read_json_object(path / "config.json")


def hf_weight_files(path: str | Path) -> list[str]:
    """The safetensors files of a model folder: those ``model.safetensors.index.json`` maps to, or
    ``model.safetensors``. Another ``*.safetensors`` beside an index is an error (a reader of the
    whole folder would take its tensors for the model's)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(
                f"{index} has no 'weight_map' object of tensor names to file names (as save_pretrained writes it)"
            )
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names {missing}, which are not in {path}")
        others = sorted(p.name for p in path.glob("*.safetensors") if p.name not in files)
        if others:
            raise ValueError(
                f"{path} holds {others} besides the files of {index.name} ({files}); move them out of the model folder"
            )
        return files
    if (path / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def hf_tensor_headers(path: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype) of every tensor of a model folder, from the files' headers
    alone (no tensor data is read)."""
    from safetensors import safe_open

    out = {}
    for file in hf_weight_files(path):
        with safe_open(str(Path(path) / file), framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                out[name] = (tuple(piece.get_shape()), piece.get_dtype())
    return out


def hf_names(our_names: Iterable[str], config: NemotronHConfig, available: Iterable[str]) -> dict[str, str]:
    """Our parameter name -> the name of the tensor it is read from among ``available`` (an HF folder's
    or module's names, ``backbone.`` or ``model.`` prefix). A tied LM head is read from the embedding
    (HF files may or may not hold a copy of it). Every parameter must be present and no weight left over
    (MTP weights, which transformers ignores too, are skipped); ValueError names the keys otherwise."""
    tied = config.tie_word_embeddings
    in_source = {}
    for name in available:
        ours = _our_name(name)
        if not ours.startswith("mtp."):
            in_source[ours] = name
    wanted = {name: "embeddings.weight" if tied and name == "lm_head.weight" else name for name in our_names}
    missing = sorted(set(wanted.values()) - set(in_source))
    unexpected = sorted(set(in_source) - set(wanted.values()) - ({"lm_head.weight"} if tied else set()))
    if missing or unexpected:
        raise ValueError(f"HF weights do not match the config: missing {missing}, unexpected {unexpected}")
    return {ours: in_source[source] for ours, source in wanted.items()}


def _read_hf_folder(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    hf_config = read_hf_config(path)
    state: dict[str, torch.Tensor] = {}
    for file in hf_weight_files(path):
        state.update(load_file(str(path / file)))
    return hf_config, state


def import_hf(
    source: str | Path | nn.Module, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> NemotronHModel:
    """Our model from a transformers NemotronH folder or an in-memory ``NemotronHForCausalLM``.

    Every parameter must be present and no extra weight may be left over (MTP weights, which
    transformers ignores too, are skipped); a mismatch raises ValueError naming the keys.
    """
    if isinstance(source, nn.Module):
        config = from_hf_config(source.config)
        hf_state = source.state_dict()
    else:
        hf_config, hf_state = _read_hf_folder(Path(source))
        config = from_hf_config(hf_config)

    model = NemotronHModel(config, device="meta", dtype=dtype)
    model.to_empty(device=device)
    names = hf_names(model.state_dict(), config, hf_state)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            source_tensor = hf_state[names[name]]
            if source_tensor.shape != tensor.shape:
                raise ValueError(f"{name}: HF shape {tuple(source_tensor.shape)} != ours {tuple(tensor.shape)}")
            tensor.copy_(source_tensor)
    return model
