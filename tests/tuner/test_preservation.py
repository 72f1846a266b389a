"""Theorem 3.1 in real models: the original stream and the logits are the base model's.

Covers every tiny architecture of conftest (`arch_name`), every method, with and without left
padding, before and after training, plus the honesty of the widened config and the head layout.

"Equal" is to rounding (docs/design.md §1.2): the upscaled model's original stream and logits must be as close to the
base model's float64 values as the base model's own fp32 computation is (`exactness.assert_exact_to_rounding`), on
whatever CPU kernels run them.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any, NamedTuple

import pytest
import torch

from scale_cl import ScaleConfig, set_method, upscale
from scale_cl.tuner.layers import ScaleLinear
from tests.conftest import VOCAB, hidden_up_for, make_model, token_batch, upscaled_copy
from tests.exactness import assert_exact_to_rounding

pytestmark = pytest.mark.exactness

METHODS = ("preserve", "adapt", "route")


def batch(padded: bool, seed: int = 0, rows: int = 3, length: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(padded, seed, rows, length, pads=(4, 1))


def labels_for(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ids.masked_fill(mask == 0, -100)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def assert_equal_within(actual: torch.Tensor, stock: torch.Tensor, exact: torch.Tensor, what: str) -> None:
    """``actual`` is the base model's value to rounding: as close to its float64 value ``exact`` as the base
    model's fp32 value ``stock`` is."""
    assert actual.shape == stock.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(stock.shape)}"
    assert torch.isfinite(stock).all(), f"{what}: the base values are not finite"
    assert_exact_to_rounding(actual, exact, stock=stock, what=what)


def upscaled(base, method: str = "preserve", **fields):
    """Random W21/W22, so the new stream is busy and any leak into the original one shows."""
    return upscaled_copy(base, method, **{"w21_init": "random", "w22_init": "random", **fields})


def run(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, output_hidden_states=True, **kwargs)


class BaseRun(NamedTuple):
    """The base model's outputs on one batch, in fp32 (``stock``) and float64 (``exact``)."""

    stock: Any
    exact: Any


def run_base(base, ids, mask) -> BaseRun:
    return BaseRun(run(base, ids, mask), run(copy.deepcopy(base).double(), ids, mask))


def assert_logits_base(logits: torch.Tensor, base_run: BaseRun, what: str) -> None:
    assert_equal_within(logits, base_run.stock.logits, base_run.exact.logits, what)


def assert_original_stream_equal(
    base_run: BaseRun,
    up_out,
    d: int,
    rows: int,
    layers: Iterable[int] | None = None,
    start: int = 0,
    what: str = "original part",
) -> None:
    """``hs[start : start + rows, ..., :d]`` of the upscaled model equals the base model's hidden states.

    Route stacks the batch as [preserve path; adapt path] from its first collaborative layer, so its
    hidden states there have 2B rows; the first B rows are the preserve path (``start`` B: the adapt path).
    """
    stock, exact = base_run.stock.hidden_states, base_run.exact.hidden_states
    assert len(up_out.hidden_states) == len(stock)
    for i in layers if layers is not None else range(len(stock)):
        hs_up = up_out.hidden_states[i]
        assert hs_up.shape[-1] > d, f"hidden state {i} is not widened: {tuple(hs_up.shape)}"
        got = hs_up[start : start + rows, ..., :d]
        assert_equal_within(got, stock[i], exact[i], f"{what} of hidden state {i}")


def head_input_recorder(model):
    """Records the input of the LM head (the final normalised hidden state) on every forward."""
    seen: list[torch.Tensor] = []
    handle = model.get_output_embeddings().register_forward_hook(lambda mod, args, out: seen.append(args[0].detach()))
    return seen, handle


def train(model, ids, mask, steps: int = 5, lr: float = 1e-2) -> list[float]:
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask)).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return losses


# --------------------------------------------------------------------------------------------
# At initialisation (any W21/W22, W12 = 0, head's new columns zero): logits and original stream.


@pytest.mark.parametrize("padded", [False, True], ids=["no-pad", "left-pad"])
@pytest.mark.parametrize("method", METHODS)
def test_logits_equal_base_at_init(arch_name, method, padded):
    base = make_model(arch_name)
    model = upscaled(base, method, preserve_layers=1 if method == "route" else 0)
    ids, mask = batch(padded)
    out = run(model, ids, mask)
    assert_logits_base(out.logits, run_base(base, ids, mask), f"{arch_name}/{method} logits")
    if method == "route":
        # at init both paths agree (cos = 1 > tau): every real token goes to the preserve path
        assert out["route_preserve_share"].item() == 1.0


@pytest.mark.parametrize("method", METHODS)
def test_logits_equal_base_with_svd_init(arch_name, method):
    base = make_model(arch_name, seed=1)
    model = upscaled(base, method, preserve_layers=1, w21_init="svd", w22_init="svd")
    ids, mask = batch(padded=True, seed=1)
    assert_logits_base(run(model, ids, mask).logits, run_base(base, ids, mask), f"{arch_name}/{method} svd")


@pytest.mark.parametrize("preserve_layers", [0, 3], ids=["all-collaborative", "none-collaborative"])
def test_route_logits_equal_base_any_preserve_layers(arch_name, preserve_layers):
    """Route stacks from layer 0 (preserve_layers=0) or never (preserve_layers = all 3 layers)."""
    base = make_model(arch_name)
    model = upscaled(base, "route", preserve_layers=preserve_layers)
    ids, mask = batch(padded=True)
    base_out, out = run_base(base, ids, mask), run(model, ids, mask)
    assert_logits_base(out.logits, base_out, f"route, preserve_layers={preserve_layers}")
    rows = ids.shape[0]
    stacked_rows = 2 * rows if preserve_layers == 0 else rows
    assert out.hidden_states[1].shape[0] == stacked_rows
    assert_original_stream_equal(base_out, out, base.config.hidden_size, rows)


@pytest.mark.parametrize("padded", [False, True], ids=["no-pad", "left-pad"])
@pytest.mark.parametrize("method", METHODS)
def test_original_stream_equals_base_every_layer(arch_name, method, padded):
    base = make_model(arch_name)
    d = base.config.hidden_size
    model = upscaled(base, method, preserve_layers=1)
    ids, mask = batch(padded)
    base_out, up_out = run_base(base, ids, mask), run(model, ids, mask)
    rows = ids.shape[0]
    assert_original_stream_equal(base_out, up_out, d, rows)
    # The new stream is really there (random W21/W22, random E_up): not a copy of nothing.
    assert up_out.hidden_states[1][..., d:].abs().max() > 1e-3
    if method == "route":
        # From the first collaborative layer on, the batch is stacked; with W12 = 0 at init the
        # adapt path (second half) equals the base model too.
        stacked = [i for i, hs in enumerate(up_out.hidden_states) if hs.shape[0] == 2 * rows]
        assert stacked, "route never stacked the two paths"
        assert stacked[0] >= 2, "route stacked before the first collaborative layer (preserve_layers=1)"
        assert_original_stream_equal(
            base_out, up_out, d, rows, layers=stacked, start=rows, what="the adapt path's original part"
        )


# --------------------------------------------------------------------------------------------
# After training: what must stay the base model's still does, and training did change something.


def test_preserve_training_keeps_original_stream(arch_name):
    base = make_model(arch_name)
    d = base.config.hidden_size
    model = upscaled(base, "preserve")
    ids, mask = batch(padded=True)
    losses = train(model, ids, mask)
    assert all(torch.isfinite(torch.tensor(losses)))

    head = model.get_output_embeddings()
    assert head.weight_up.abs().max() > 1e-3, "the LM head's new columns did not train"

    base_out = run_base(base, ids, mask)
    seen, handle = head_input_recorder(model)
    up_out = run(model, ids, mask)
    handle.remove()

    assert_original_stream_equal(base_out, up_out, d, ids.shape[0])
    # The full logits moved (training did something) ...
    assert max_diff(up_out.logits, base_out.stock.logits) > 1e-3, "logits still equal base after training"
    # ... but the original-part logits Z are still exactly the base model's.
    z, z_up = head.project(*seen[-1].split((head.hidden_size, head.hidden_up), dim=-1))
    assert_logits_base(z, base_out, "original-part logits Z after preserve training")
    # And the logits are Z + Z_up (the head sums them in one product): as exact as Z + Z_up summed apart.
    exact = run(copy.deepcopy(model).double(), ids, mask).logits
    assert_exact_to_rounding(up_out.logits, exact, stock=z + z_up, what="logits = Z + Z_up")


def test_adapt_training_honours_preserve_layers(arch_name):
    base = make_model(arch_name)
    d = base.config.hidden_size
    model = upscaled(base, "adapt", preserve_layers=1)
    ids, mask = batch(padded=True)
    train(model, ids, mask)

    for index, layer in enumerate(model.base_model.layers):
        for name, module in layer.named_modules():
            if isinstance(module, ScaleLinear):
                if index < 1:
                    assert module.w12 is None, f"layer {index} {name}: W12 held in a preserve layer"
                else:
                    assert module.w12.abs().max() > 1e-3, f"layer {index} {name}: W12 did not train"

    base_out, up_out = run_base(base, ids, mask), run(model, ids, mask)
    # hidden_states[0] is the embedding output, [1] the output of layer 0 (a preserve layer).
    assert_original_stream_equal(base_out, up_out, d, ids.shape[0], layers=range(2))
    later = [max_diff(up_out.hidden_states[i][..., :d], base_out.stock.hidden_states[i]) for i in range(2, 4)]
    assert max(later) > 1e-3, f"no collaborative layer's original stream changed: {later}"


def test_route_training_keeps_preserve_path(arch_name):
    """Route trains W12 through the adapt path only; the preserve path (first B rows) stays the base model."""
    base = make_model(arch_name)
    d = base.config.hidden_size
    model = upscaled(base, "route", preserve_layers=1)
    ids, mask = batch(padded=True)
    train(model, ids, mask)
    rows = ids.shape[0]

    base_out, up_out = run_base(base, ids, mask), run(model, ids, mask)
    assert_original_stream_equal(base_out, up_out, d, rows)
    adapt_diff = max_diff(up_out.hidden_states[-1][rows:, ..., :d], base_out.stock.hidden_states[-1])
    assert adapt_diff > 1e-3, "the adapt path's original stream did not change after route training"


# --------------------------------------------------------------------------------------------
# The widened config states the truth.


def test_config_and_shapes_are_honest(arch_name):
    base = make_model(arch_name)
    cfg = base.config
    d, ffn, heads = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or d // heads
    is_neox = cfg.model_type == "gpt_neox"
    kv = heads if is_neox else cfg.num_key_value_heads
    group = heads // kv
    u, f = hidden_up_for(base, 2), 24
    model = upscale(copy.deepcopy(base), ScaleConfig(hidden_up=u, ffn_up=f))

    new = model.config
    assert new.hidden_size == d + u
    assert new.intermediate_size == ffn + f
    assert new.num_attention_heads == heads + u // head_dim
    assert new.hidden_size // new.num_attention_heads == head_dim
    if not is_neox:
        assert new.num_key_value_heads == kv + u // (head_dim * group)
        assert new.head_dim == head_dim

    expected = (
        {
            "attention.query_key_value": (u, 3 * u),
            "attention.dense": (u, u),
            "mlp.dense_h_to_4h": (u, f),
            "mlp.dense_4h_to_h": (f, u),
        }
        if is_neox
        else {
            "self_attn.q_proj": (u, u),
            "self_attn.k_proj": (u, u // group),
            "self_attn.v_proj": (u, u // group),
            "self_attn.o_proj": (u, u),
            "mlp.gate_proj": (u, f),
            "mlp.up_proj": (u, f),
            "mlp.down_proj": (f, u),
        }
    )
    # An HF model built from the widened config has exactly the widened linears' full shapes.
    torch.manual_seed(0)
    fresh = type(base)(copy.deepcopy(base.config.__class__.from_dict(new.to_dict())))
    for index, layer in enumerate(model.base_model.layers):
        linears = {name: m for name, m in layer.named_modules() if isinstance(m, ScaleLinear)}
        assert set(linears) == set(expected), f"layer {index}: widened linears {sorted(linears)}"
        fresh_layer = fresh.base_model.layers[index]
        for name, (in_up, out_up) in expected.items():
            lin = linears[name]
            assert (lin.in_up, lin.out_up) == (in_up, out_up), f"{name}: (in_up, out_up)"
            assert lin.w12 is None, f"{name}: SCALE-Preserve holds no W12"
            lin.add_w12()  # what SCALE-Adapt allocates
            assert lin.w12.shape == (lin.out_features, in_up) and not lin.w12.any()
            assert lin.w21.shape == (out_up, lin.in_features)
            assert lin.w22.shape == (out_up, in_up)
            full = fresh_layer.get_submodule(name).weight.shape
            assert full == (lin.out_features + out_up, lin.in_features + in_up), f"{name}: config vs module"
    assert model.get_input_embeddings().weight_up.shape == (VOCAB, u)
    assert model.get_output_embeddings().weight_up.shape == (VOCAB, u)


# --------------------------------------------------------------------------------------------
# New heads have their own q/k/v rows, paired with the right key/value head.


def _attn_input_recorder(model, path: str):
    seen: list[torch.Tensor] = []
    module = model.base_model.layers[0].get_submodule(path)
    handle = module.register_forward_hook(lambda mod, args, out: seen.append(args[0].detach()))
    return seen, handle


def _causal_mean(v: torch.Tensor) -> torch.Tensor:
    """Uniform causal attention (all scores equal): position t averages v[0..t]. v: (B, T, h)."""
    counts = torch.arange(1, v.shape[1] + 1, dtype=v.dtype)[None, :, None]
    return v.cumsum(dim=1) / counts


@pytest.mark.parametrize("target", [0, 1], ids=["first-new-kv-head", "second-new-kv-head"])
@pytest.mark.parametrize("arch", ["neox-parallel-rot0.25", "neox-sequential-rot1.0", "llama-gqa2-tied"])
def test_new_head_owns_its_value_rows(arch, target):
    """Only the V rows of ONE new (key/value) head are non-zero in layer 0's W21; all new q/k rows are zero.

    Then every query head reading that kv head attends uniformly (zero scores) and outputs the causal
    mean of its values, every other new head outputs zero, and the original heads equal the base model.
    For GPT-NeoX this pins the fused per-head [q; k; v] layout, for Llama the repeat_kv pairing.
    """
    base = make_model(arch)
    cfg = base.config
    is_neox = cfg.model_type == "gpt_neox"
    heads = cfg.num_attention_heads
    h = cfg.hidden_size // heads
    group = 1 if is_neox else heads // cfg.num_key_value_heads
    u = hidden_up_for(base, 2)  # two new kv heads (2 * group new query heads)
    model = upscale(copy.deepcopy(base), ScaleConfig(hidden_up=u, ffn_up=0, w21_init="zero", w22_init="zero"))
    attn = model.base_model.layers[0].get_submodule("attention" if is_neox else "self_attn")
    torch.manual_seed(3)
    with torch.no_grad():
        if is_neox:
            v_rows = attn.query_key_value.w21[target * 3 * h + 2 * h : (target + 1) * 3 * h]
        else:
            v_rows = attn.v_proj.w21[target * h : (target + 1) * h]
        v_rows.copy_(torch.randn_like(v_rows))
        v_rows = v_rows.detach().clone()
    out_path = "attention.dense" if is_neox else "self_attn.o_proj"
    in_path = "attention.query_key_value" if is_neox else "self_attn.v_proj"

    ids, mask = batch(padded=False)
    base_seen, h1 = _attn_input_recorder(base, out_path)
    run(base, ids, mask)
    h1.remove()
    base64 = copy.deepcopy(base).double()
    base_exact, h0 = _attn_input_recorder(base64, out_path)
    run(base64, ids, mask)
    h0.remove()
    seen, h2 = _attn_input_recorder(model, out_path)
    normed, h3 = _attn_input_recorder(model, in_path)
    run(model, ids, mask)
    h2.remove()
    h3.remove()

    attn_out = seen[-1]  # (B, T, (heads + new) * h): per-head outputs, heads in order
    d = heads * h
    assert_equal_within(attn_out[..., :d], base_seen[-1], base_exact[-1], "original heads' attention output")
    x = normed[-1][..., : cfg.hidden_size]  # the normalised original stream the projections read
    expected_v = _causal_mean(x @ v_rows.T)
    exact_v = _causal_mean(x.double() @ v_rows.double().T)  # the same formula on the same values, in float64
    new_heads = u // h
    for j in range(new_heads):
        got = attn_out[..., d + j * h : d + (j + 1) * h]
        if j // group == target:
            assert_exact_to_rounding(got, exact_v, stock=expected_v, what=f"new head {j}: the causal mean of v")
            assert got.abs().max() > 1e-2
        else:  # zero q, k and v rows (and biases): zero scores, uniform weights over zero values, exactly 0
            assert torch.count_nonzero(got) == 0, f"new head {j} reads the wrong key/value rows"


def test_set_method_then_logits_still_base_at_init(arch_name):
    """Switching method on a fresh upscaled model keeps the base logits (W12 = 0 everywhere)."""
    base = make_model(arch_name)
    model = upscaled(base, "preserve", preserve_layers=1)
    ids, mask = batch(padded=True)
    expected = run_base(base, ids, mask)
    for method in ("route", "adapt", "preserve"):
        set_method(model, method)
        assert_logits_base(run(model, ids, mask).logits, expected, f"after set_method({method!r})")


def test_a_leak_of_the_new_stream_is_outside_the_bound():
    """The mutation the bound must see: SCALE-Preserve computing one linear's W12 (a flag left on by a method switch)
    after a few training steps gave it values of ~1e-3, so ``x_up`` leaks into the original stream of one layer."""
    base = make_model("llama-gqa2-tied")
    model = upscaled(base, "preserve")
    linear = model.base_model.layers[1].self_attn.o_proj
    linear.add_w12()  # as a model switched back to Preserve after training W12 holds it
    with torch.no_grad():
        linear.w12.copy_(1e-3 * torch.randn(linear.w12.shape, generator=torch.Generator().manual_seed(0)))
    ids, mask = batch(padded=True)
    expected = run_base(base, ids, mask)
    assert_logits_base(run(model, ids, mask).logits, expected, "W12 held but not computed")  # the control
    linear.use_w12 = True
    with pytest.raises(AssertionError, match="from the float64 reference"):
        assert_logits_base(run(model, ids, mask).logits, expected, "mutated: one W12 computed under SCALE-Preserve")
