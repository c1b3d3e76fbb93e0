"""The hybrid model: module contract, forward, init, causality at every level, swappable linears."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nemofp4.models import build_model, get_model_config, param_groups
from nemofp4.models.nemotron_h.model import (
    MLP,
    Attention,
    GatedRMSNorm,
    Mamba2Mixer,
    NemotronHModel,
    SwiGLUMLP,
    causal_depthwise_conv1d,
)

LINEAR_NAMES = {
    "mamba": ("in_proj", "out_proj"),
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("up_proj", "down_proj"),
}
SWIGLU_LINEAR_NAMES = {**LINEAR_NAMES, "mlp": ("gate_up_proj", "down_proj")}


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = get_model_config("tiny")
    return build_model(cfg, device="cpu").eval()


@pytest.fixture(scope="module")
def tiny_swiglu():
    torch.manual_seed(0)
    return build_model(get_model_config("tiny", mlp_activation="swiglu"), device="cpu").eval()


def randomize_(model: nn.Module, seed: int = 0) -> None:
    """Move every parameter away from its init (norms off 1, D off 1, larger weights) so that a
    wrong wiring anywhere changes the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() == 1 else 0.02))


def test_module_names_and_types(tiny):
    cfg = tiny.config
    assert isinstance(tiny.embeddings, nn.Embedding) and isinstance(tiny.lm_head, nn.Linear)
    assert isinstance(tiny.layers, nn.ModuleList) and len(tiny.layers) == cfg.num_layers
    names = dict(tiny.named_modules())
    for i, (block, symbol) in enumerate(zip(tiny.layers, cfg.hybrid_layer_pattern)):
        assert block.layer_idx == i
        assert block.block_type == {"M": "mamba", "*": "attention", "-": "mlp"}[symbol]
        assert f"layers.{i}.norm" in names
        for linear in LINEAR_NAMES[block.block_type]:
            assert type(names[f"layers.{i}.mixer.{linear}"]) is nn.Linear
    assert "norm_f" in names and tiny.config is cfg
    # No biases on any linear (Nemotron-H has none).
    assert all(m.bias is None for m in tiny.modules() if isinstance(m, nn.Linear))


def test_swiglu_mlp_is_a_fused_gate_up_linear_and_a_down_linear(tiny_swiglu):
    cfg = tiny_swiglu.config
    d, f = cfg.hidden_size, cfg.ffn_hidden_size
    linears = {n: m for n, m in tiny_swiglu.named_modules() if isinstance(m, nn.Linear)}
    for i, block in enumerate(tiny_swiglu.layers):
        names = sorted(n.rsplit(".", 1)[1] for n in linears if n.startswith(f"layers.{i}."))
        assert names == sorted(SWIGLU_LINEAR_NAMES[block.block_type])
        if block.block_type == "mlp":
            assert isinstance(block.mixer, SwiGLUMLP)
            assert block.mixer.gate_up_proj.weight.shape == (2 * f, d)  # [gate | up]: two GEMMs in one
            assert block.mixer.down_proj.weight.shape == (d, f)
    assert all(m.bias is None for m in linears.values())


def test_swiglu_forward_equals_the_reference_from_the_fused_weights_halves(tiny_swiglu):
    torch.manual_seed(0)
    mixer = next(b.mixer for b in tiny_swiglu.layers if b.block_type == "mlp")
    f = tiny_swiglu.config.ffn_hidden_size
    x = torch.randn(2, 7, tiny_swiglu.config.hidden_size, dtype=torch.float64)
    w = mixer.gate_up_proj.weight.double()
    w_gate, w_up, w_down = w[:f], w[f:], mixer.down_proj.weight.double()

    def reference(gate, up):  # down(silu(x W_g^T) * (x W_u^T)), in float64
        return (F.silu(x @ gate.T) * (x @ up.T)) @ w_down.T

    with torch.no_grad():
        out = mixer.double()(x)
        mixer.float()
    torch.testing.assert_close(out, reference(w_gate, w_up), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(out, reference(w_up, w_gate), atol=1e-6)  # the first half is the gate


def test_forward_shapes_and_return_hidden(tiny):
    ids = torch.randint(0, tiny.config.vocab_size, (2, 19))
    logits = tiny(ids)
    assert logits.shape == (2, 19, tiny.config.vocab_size) and logits.dtype == torch.float32
    hidden = tiny(ids, return_hidden=True)
    assert hidden.shape == (2, 19, tiny.config.hidden_size)
    assert torch.equal(tiny.lm_head(hidden), logits)
    with pytest.raises(ValueError, match="batch, seq"):
        tiny(ids[0])


def test_tied_embeddings_share_one_parameter():
    model = build_model(get_model_config("tiny", tie_word_embeddings=True))
    assert model.lm_head.weight is model.embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == model.config.num_parameters()


def test_init_is_deterministic_and_meta_path_matches_cpu_path():
    cfg = get_model_config("tiny")
    torch.manual_seed(123)
    cpu = build_model(cfg, device="cpu")
    meta = build_model(cfg, device="meta")
    meta.to_empty(device="cpu")
    torch.manual_seed(123)
    meta.init_weights()
    for (name, a), (_, b) in zip(cpu.state_dict().items(), meta.state_dict().items()):
        assert torch.equal(a, b), name
    other = build_model(cfg, device="meta").to_empty(device="cpu")
    other.init_weights(generator=torch.Generator().manual_seed(7))
    assert not torch.equal(other.embeddings.weight, cpu.embeddings.weight)


def test_init_follows_nemotron_h_conventions():
    cfg = get_model_config("tiny")
    model = build_model(cfg, device="meta").to_empty(device="cpu")
    for p in model.parameters():
        p.data.fill_(float("nan"))  # every parameter must be written
    torch.manual_seed(0)
    model.init_weights()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    mixer = model.layers[0].mixer
    assert isinstance(mixer, Mamba2Mixer)
    assert torch.equal(mixer.A_log, torch.log(torch.arange(1, cfg.mamba_num_heads + 1, dtype=torch.float32)))
    assert torch.equal(mixer.D, torch.ones(cfg.mamba_num_heads))
    dt = F.softplus(mixer.dt_bias)
    assert dt.min() >= cfg.time_step_min * (1 - 1e-5) and dt.max() <= cfg.time_step_max * (1 + 1e-5)
    assert torch.equal(mixer.conv1d.bias, torch.zeros_like(mixer.conv1d.bias))
    bound = 1 / math.sqrt(cfg.mamba_intermediate_size) / math.sqrt(cfg.num_layers)
    assert mixer.out_proj.weight.abs().max() <= bound
    assert mixer.out_proj.weight.abs().max() > 0.9 * bound  # uniform, rescaled
    assert abs(mixer.in_proj.weight.std().item() - cfg.init_std) < 1e-3
    assert abs(model.layers[1].mixer.down_proj.weight.std().item() - cfg.init_std) < 1e-3  # MLP: not rescaled
    assert abs(model.embeddings.weight.std().item() - cfg.init_std) < 1e-3
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or name == "norm_f.weight":
            assert torch.equal(p, torch.ones_like(p)), name
    plain = build_model(get_model_config("tiny", rescale_prenorm_residual=False))
    assert abs(plain.layers[0].mixer.out_proj.weight.std().item() - cfg.init_std) < 1e-3
    swiglu = build_model(get_model_config("tiny", mlp_activation="swiglu")).layers[1].mixer
    for linear in (swiglu.gate_up_proj, swiglu.down_proj):  # the MLP's scheme: N(0, init_std), both halves
        assert abs(linear.weight.std().item() - cfg.init_std) < 1e-3
    halves = swiglu.gate_up_proj.weight.chunk(2)
    assert abs(halves[0].std().item() - halves[1].std().item()) < 1e-3


def test_param_groups_exclude_ssm_params_norms_and_biases(tiny):
    decay, no_decay = param_groups(tiny, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in tiny.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    decay_names = {names[id(p)] for p in decay["params"]}
    assert len(no_decay_names) + len(decay_names) == len(names)
    for name in no_decay_names:
        assert name.rsplit(".", 1)[-1] in ("A_log", "D", "dt_bias", "bias") or "norm" in name, name
    for name in (
        "layers.0.mixer.A_log",
        "layers.0.mixer.D",
        "layers.0.mixer.dt_bias",
        "layers.0.mixer.norm.weight",
        "layers.0.norm.weight",
        "norm_f.weight",
        "layers.0.mixer.conv1d.bias",
    ):
        assert name in no_decay_names
    assert "embeddings.weight" in decay_names and "layers.0.mixer.in_proj.weight" in decay_names
    tied = build_model(get_model_config("tiny", tie_word_embeddings=True))
    groups = param_groups(tied, 0.1)
    assert sum(len(g["params"]) for g in groups) == len(list(tied.parameters()))


def test_gated_norm_is_grouped_and_gates_before_norm():
    norm = GatedRMSNorm(8, group_size=4, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(1.0, 9.0))
    x = torch.randn(3, 8, dtype=torch.float32)
    z = torch.randn(3, 8)
    gated = (x.double() * F.silu(z.double())).view(3, 2, 4)
    expected = gated / torch.sqrt(gated.pow(2).mean(-1, keepdim=True) + 1e-6)
    expected = expected.view(3, 8) * torch.arange(1.0, 9.0, dtype=torch.float64)
    torch.testing.assert_close(norm(x, z).double(), expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- causality
def assert_causal(fn, x, t):
    """Changing positions >= t must leave outputs before t bit-identical (and change some after)."""
    x2 = x.clone()
    x2[:, t:] = torch.randn_like(x2[:, t:]) * 3
    y, y2 = fn(x), fn(x2)
    assert torch.equal(y[:, :t], y2[:, :t])
    assert not torch.equal(y[:, t:], y2[:, t:])


@pytest.mark.parametrize("t", [1, 3, 64, 70])
def test_conv_is_causal(t):
    weight, bias = torch.randn(6, 4), torch.randn(6)
    assert_causal(lambda x: causal_depthwise_conv1d(x, weight, bias), torch.randn(2, 80, 6), t)


def test_conv_matches_direct_sum():
    x, weight, bias = torch.randn(1, 10, 3, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64), None
    out = causal_depthwise_conv1d(x, weight, bias)
    padded = F.pad(x, (0, 0, 3, 0))
    expected = F.silu(sum(padded[:, k : k + 10] * weight[:, k] for k in range(4)))
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("t", [1, 64, 70])  # tiny's chunk is 64
def test_mixers_are_causal(tiny, tiny_swiglu, t):
    torch.manual_seed(0)
    randomize_(tiny)
    randomize_(tiny_swiglu)
    with torch.no_grad():
        for model, mixer_type in ((tiny, Mamba2Mixer), (tiny, Attention), (tiny, MLP), (tiny_swiglu, SwiGLUMLP)):
            mixer = next(b.mixer for b in model.layers if isinstance(b.mixer, mixer_type))
            assert_causal(mixer, torch.randn(2, 100, model.config.hidden_size), t)


@pytest.mark.parametrize("t,mlp_activation", [(1, "relu2"), (70, "relu2"), (70, "swiglu")])
def test_model_is_causal(t, mlp_activation):
    model = build_model(get_model_config("tiny", mlp_activation=mlp_activation))
    randomize_(model, seed=1)
    ids = torch.randint(0, model.config.vocab_size, (2, 100))
    ids2 = ids.clone()
    ids2[:, t:] = torch.randint(0, model.config.vocab_size, ids2[:, t:].shape)
    with torch.no_grad():
        y, y2 = model(ids), model(ids2)
    assert torch.equal(y[:, :t], y2[:, :t])
    assert not torch.equal(y[:, t:], y2[:, t:])


# ---------------------------------------------------------------------------- swappable linears
class ScaledLinear(nn.Module):
    """Stand-in for a precision recipe's replacement: same weight, output scaled."""

    def __init__(self, linear: nn.Linear, scale: float):
        super().__init__()
        self.linear, self.scale = linear, scale

    def forward(self, x):
        return self.linear(x) * self.scale


@pytest.mark.parametrize(
    "block_type,linear,mlp_activation",
    [(bt, n, "relu2") for bt, names in LINEAR_NAMES.items() for n in names]
    + [("mlp", n, "swiglu") for n in SWIGLU_LINEAR_NAMES["mlp"]],
)
def test_swapped_linear_changes_the_output(block_type, linear, mlp_activation):
    torch.manual_seed(0)
    model = build_model(get_model_config("tiny", mlp_activation=mlp_activation)).eval()
    randomize_(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 40))
    with torch.no_grad():
        before = model(ids)
        mixer = next(b.mixer for b in model.layers if b.block_type == block_type)
        original = getattr(mixer, linear)
        setattr(mixer, linear, ScaledLinear(original, 1.5))
        after = model(ids)
        setattr(mixer, linear, ScaledLinear(original, 1.0))
        restored = model(ids)
    assert not torch.allclose(before, after, atol=1e-4)
    assert torch.equal(before, restored)


def test_swapped_lm_head_changes_the_output(tiny):
    model = NemotronHModel(tiny.config)
    model.load_state_dict(tiny.state_dict())
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    with torch.no_grad():
        before = model(ids)
        model.lm_head = ScaledLinear(model.lm_head, 2.0)
        torch.testing.assert_close(model(ids), 2 * before)


@pytest.mark.parametrize("mlp_activation", ["relu2", "swiglu"])
def test_tiny_trains_a_step(mlp_activation):
    torch.manual_seed(0)
    model = build_model(get_model_config("tiny", mlp_activation=mlp_activation))
    ids = torch.randint(0, model.config.vocab_size, (4, 64))
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3)
    losses = []
    for _ in range(3):
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
