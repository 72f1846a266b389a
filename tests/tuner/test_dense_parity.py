"""Parity of upscaled models with an independent dense reference, all new weights non-zero.

The upscaled model's linears compute ``[[W, W12], [W21, W22]] @ [x; x_up]``, which is exactly one
dense linear of an ordinary HF model of the same class whose config is widened (hidden + u, FFN + f,
u / head_dim new query heads and u / (head_dim * group) new kv heads, appended after the original
ones). The reference here is that plain HF model with hand-assembled dense weights, taken from the
*base* model (original blocks) and the upscaled model's new parameters (looked up by their
documented names only). Norms are the one place where dense is not the same function: SCALE
normalises ``x`` over ``d`` and ``x_up`` over ``u`` separately, so the reference swaps every norm
for `RefSplitNorm`, written here from transformers' own arithmetic rather than imported.

Nothing of scale_cl's internals (layers, route, upscale) is used to build the reference, so a wrong
block layout, a W12 applied where it must not be (or missed where it must), a wrong kv-head order,
a norm that mixes the two parts or a wrong Eq. 5 shows up as a logit mismatch.

Tolerance: the two sides differ only in summation order (one dense matmul against the sum of two
block matmuls), so in fp32 they round differently, by an amount that depends on the CPU's kernels.
No bound is fixed: the upscaled model's logits must be as close to the dense reference's float64
logits as the dense reference's own fp32 logits are (`exactness.assert_exact_to_rounding`), while
every W12 / W21 / W22 / new-norm path moves the logits by more than 1e-2 (checked below by
`test_test_has_teeth`, `test_a_dropped_w12_is_outside_the_bound` and the preserve-vs-adapt gap in
`test_route_parity`).
"""

from __future__ import annotations

import copy
import functools
import re
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from scale_cl import ScaleConfig, set_method, upscale
from tests.conftest import ARCHS, VOCAB, make_model, token_batch
from tests.exactness import assert_exact_to_rounding

pytestmark = pytest.mark.exactness

PRESERVE_LAYERS = 1  # of the 3 tiny decoder layers: layer 0 preserve, layers 1-2 collaborative
FFN_UP = 24
NEW_SCALE = 0.05  # std of the random new blocks: same order as the base weights' 0.02 init, logits stay O(1)
NEW_SUFFIXES = ("w12", "w21", "w22", "bias_up", "weight_up")
BOTH = ("attn", "ffn")


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


class RefSplitNorm(nn.Module):
    """Reference split norm: ``x`` (first ``d``) and ``x_up`` (last ``u``) normalised separately.

    ``rms`` copies transformers' LlamaRMSNorm (float32 statistics, gain applied after the cast back; float64
    statistics for a float64 input, so that the float64 reference is float64 throughout); ``layer`` is LayerNorm
    with bias. Parameter names follow docs/design.md §5 so the upscaled model's
    values load by name.
    """

    def __init__(self, kind: str, d: int, u: int, eps: float) -> None:
        super().__init__()
        self.kind, self.d, self.u, self.eps = kind, d, u, eps
        self.weight = nn.Parameter(torch.ones(d))
        self.weight_up = nn.Parameter(torch.ones(u))
        if kind == "layer":
            self.bias = nn.Parameter(torch.zeros(d))
            self.bias_up = nn.Parameter(torch.zeros(u))

    def _one(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kind == "layer":
            return F.layer_norm(x, (x.shape[-1],), weight, bias, self.eps)
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * x.to(dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x, x_up = hidden[..., : self.d], hidden[..., self.d :]
        assert x_up.shape[-1] == self.u
        bias, bias_up = (self.bias, self.bias_up) if self.kind == "layer" else (None, None)
        return torch.cat((self._one(x, self.weight, bias), self._one(x_up, self.weight_up, bias_up)), dim=-1)


@dataclass
class Case:
    """One architecture: its base model, the upscaled model with random new weights, and sizes."""

    arch: str
    base: nn.Module
    model: nn.Module
    d: int
    u: int
    scale: ScaleConfig


def sizes(config) -> tuple[int, int, int, int]:
    """(hidden d, head_dim h, query heads, kv heads) of a base config."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.hidden_size, head_dim, heads, kv


def randomize_all_new(model: nn.Module, seed: int) -> None:
    """Every new parameter random and non-zero; norm gains around 1 (they multiply, not add)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith(NEW_SUFFIXES):
                continue
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name and name.endswith("weight_up"):
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(NEW_SCALE * noise)


def scale_config(arch: str, base: nn.Module, method: str, collab=BOTH, tau: float = 0.5) -> ScaleConfig:
    _, head_dim, heads, kv = sizes(base.config)
    return ScaleConfig(
        hidden_up=2 * head_dim * (heads // kv),  # two kv-head groups: new kv heads' order matters
        ffn_up=FFN_UP,
        method=method,
        preserve_layers=PRESERVE_LAYERS,
        collab_modules=collab,
        w21_init="zero",  # overwritten below; zero is the cheapest initialiser
        w22_init="zero",
        route_tau=tau,
        seed=0,
    )


@functools.cache
def case(arch: str, collab: tuple[str, ...] = BOTH) -> Case:
    base = make_model(arch, seed=0)
    cfg = scale_config(arch, base, "preserve", collab)
    model = set_method(upscale(copy.deepcopy(base), cfg).eval(), "adapt")  # allocates the W12 blocks adapt uses
    randomize_all_new(model, seed=1)
    set_method(model, "preserve")  # holds them on, unused
    assert sum(name.endswith("w12") for name, _ in model.named_parameters()) > 0
    return Case(arch, base, model, base.config.hidden_size, cfg.hidden_up, cfg)


def collaborative(name: str, preserve_layers: int, collab: tuple[str, ...]) -> bool:
    """Whether the linear ``name`` (a parameter path) uses its W12 on the adapt path, from its path alone."""
    layer = int(re.search(r"\.layers\.(\d+)\.", name).group(1))
    kind = "attn" if (".self_attn." in name or ".attention." in name) else "ffn"
    assert kind == "attn" or ".mlp." in name, name
    return layer >= preserve_layers and kind in collab


@functools.cache
def reference(arch: str, collab: tuple[str, ...], adapt: bool) -> nn.Module:
    """The dense HF model equal to the upscaled one on the preserve (``adapt=False``) or adapt path."""
    c = case(arch, collab)
    model_cls, base_config = ARCHS[arch]
    d, head_dim, heads, kv = sizes(base_config)
    u, f = c.u, c.scale.ffn_up
    config = copy.deepcopy(base_config)
    config.hidden_size = d + u
    config.intermediate_size += f
    config.num_attention_heads = heads + u // head_dim
    if getattr(config, "num_key_value_heads", None):
        config.num_key_value_heads = kv + u // (head_dim * (heads // kv))
    if getattr(config, "head_dim", None):
        config.head_dim = head_dim
    config.tie_word_embeddings = False  # the head's new columns are not the embedding's
    torch.manual_seed(0)
    ref = model_cls(config).eval()
    assert sizes(ref.config)[1] == head_dim

    for name, module in list(ref.named_modules()):
        if isinstance(module, nn.LayerNorm):
            norm = RefSplitNorm("layer", d, u, module.eps)
        elif type(module).__name__.endswith("RMSNorm"):
            norm = RefSplitNorm("rms", d, u, module.variance_epsilon)
        else:
            continue
        parent, _, attr = name.rpartition(".")
        setattr(ref.get_submodule(parent), attr, norm)

    orig = dict(c.base.named_parameters(remove_duplicate=False))
    new = dict(c.model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, param in ref.named_parameters(remove_duplicate=False):
            prefix, _, leaf = name.rpartition(".")
            if f"{prefix}.w21" in new:  # a widened linear: [[W, W12], [W21, W22]], [b; bias_up]
                if leaf == "weight":
                    w12 = new.get(f"{prefix}.w12")  # held only by the linears that use it (or once did)
                    if w12 is None or not (adapt and collaborative(name, PRESERVE_LAYERS, collab)):
                        w12 = orig[name].new_zeros(orig[name].shape[0], new[f"{prefix}.w22"].shape[1])
                    top = torch.cat((orig[name], w12), dim=1)
                    bottom = torch.cat((new[f"{prefix}.w21"], new[f"{prefix}.w22"]), dim=1)
                    dense = torch.cat((top, bottom), dim=0)
                else:
                    dense = torch.cat((orig[name], new[f"{prefix}.bias_up"]))
            elif isinstance(ref.get_submodule(prefix), RefSplitNorm):
                dense = orig[name] if name in orig else new[name]  # weight/bias frozen, *_up new
            else:  # embedding [E, E_up] or LM head [W_out, W_out_up]: both concatenate columns
                dense = torch.cat((orig[name], new[f"{prefix}.weight_up"]), dim=1)
            assert dense.shape == param.shape, f"{name}: assembled {tuple(dense.shape)} != {tuple(param.shape)}"
            param.copy_(dense)
    return ref


@functools.cache
def exact_reference(arch: str, collab: tuple[str, ...], adapt: bool) -> nn.Module:
    """`reference` in float64: the exact logits every comparison measures rounding from."""
    return copy.deepcopy(reference(arch, collab, adapt)).double()


def forward_logits(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def method_logits(c: Case, method: str, ids, mask) -> torch.Tensor:
    return forward_logits(set_method(c.model, method), ids, mask)


def ref_parts(ref: nn.Module, d: int, ids, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(Z, Z_up) of a reference: its final normed hidden state through the head's two column blocks."""
    with torch.no_grad():
        hidden = ref.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
    head = ref.get_output_embeddings().weight
    return hidden[..., :d] @ head[:, :d].T, hidden[..., d:] @ head[:, d:].T


def eq5(arch: str, ids, mask, exact: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two dense references' parts on the batch, ``(Z_p, Z_p_up, Z_a, Z_a_up)``, in float64 if ``exact``."""
    d, build = case(arch).d, exact_reference if exact else reference
    return (*ref_parts(build(arch, BOTH, False), d, ids, mask), *ref_parts(build(arch, BOTH, True), d, ids, mask))


def ref_route(arch: str, ids, mask, tau: float | None = None):
    """Eq. 5 from the two dense references: (logits, routed-to-preserve mask, tau used, the float64 logits).

    With ``tau=None`` the threshold is put in the widest gap between the middle cosines, so both
    branches occur and no token sits close enough to tau for rounding to flip it (the float64
    references route every token alike, checked).
    """
    z_p, z_p_up, z_a, z_a_up = eq5(arch, ids, mask, exact=False)
    assert max_diff(z_p, z_a) > 1e-2, "the two paths must differ for the routing to be tested"
    cos = F.cosine_similarity(z_p, z_a, dim=-1)
    if tau is None:
        values = cos.flatten().sort().values
        lo, hi = len(values) // 4, 3 * len(values) // 4
        gaps = values[lo + 1 : hi + 1] - values[lo:hi]
        at = lo + int(gaps.argmax())
        assert gaps.max() > 1e-5, "cosines too close to split robustly; change the test data"
        tau = (values[at].item() + values[at + 1].item()) / 2
    routed = cos > tau
    logits = torch.where(routed[..., None], (z_p + z_a) / 2 + z_p_up, z_a + z_a_up)
    e_p, e_p_up, e_a, e_a_up = eq5(arch, ids, mask, exact=True)
    assert torch.equal(F.cosine_similarity(e_p, e_a, dim=-1) > tau, routed), "a cosine this close to tau flips"
    exact = torch.where(routed[..., None], (e_p + e_a) / 2 + e_p_up, e_a + e_a_up)
    return logits, routed, tau, exact


def route_model(arch: str, tau: float) -> nn.Module:
    """The case's upscaled model (same weights) built for method route with threshold ``tau``."""
    c = case(arch)
    model = upscale(copy.deepcopy(c.base), scale_config(arch, c.base, "route", tau=tau)).eval()
    model.load_state_dict(c.model.state_dict())
    return model


def batch(padded: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    ids, mask = token_batch(padded, seed=5, rows=3, length=9, pads=(4, 1))
    return ids, (mask if padded else None)


def assert_parity(actual: torch.Tensor, expected: torch.Tensor, exact: torch.Tensor, what: str) -> None:
    """``actual`` (the upscaled model's logits) is the dense reference's to rounding: as close to the float64
    reference ``exact`` as the fp32 reference ``expected`` is."""
    assert actual.shape == expected.shape == (*actual.shape[:2], VOCAB), what
    assert torch.isfinite(expected).all(), f"{what}: reference logits not finite"
    assert_exact_to_rounding(actual, exact, stock=expected, what=what)


def dense_logits(arch: str, collab: tuple[str, ...], adapt: bool, ids, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense reference's logits in fp32 and in float64."""
    return forward_logits(reference(arch, collab, adapt), ids, mask), forward_logits(
        exact_reference(arch, collab, adapt), ids, mask
    )


@pytest.mark.parametrize("method", ["preserve", "adapt"])
def test_path_parity(arch_name, method):
    """Preserve == dense model with W12 = 0 everywhere; adapt == W12 in collaborative linears only."""
    ids, mask = batch(False)
    expected, exact = dense_logits(arch_name, BOTH, method == "adapt", ids, mask)
    assert_parity(method_logits(case(arch_name), method, ids, mask), expected, exact, f"{arch_name} {method}")


def check_route(arch: str, padded: bool) -> None:
    ids, mask = batch(padded)
    expected, routed, tau, exact = ref_route(arch, ids, mask)
    assert routed.any() and not routed.all(), "both branches of Eq. 5 must occur"
    assert_parity(forward_logits(route_model(arch, tau), ids, mask), expected, exact, f"{arch} route tau={tau}")


def test_route_parity(arch_name):
    """Route == Eq. 5 applied per token to the dense preserve-path and adapt-path references."""
    check_route(arch_name, padded=False)


@pytest.mark.parametrize("method", ["preserve", "adapt", "route"])
@pytest.mark.parametrize("arch", ["llama-gqa3-tied", "neox-sequential-rot1.0"])
def test_left_padded_parity(arch, method):
    """Left padding with an attention mask (every position compared, padding included)."""
    if method == "route":
        check_route(arch, padded=True)
        return
    ids, mask = batch(True)
    expected, exact = dense_logits(arch, BOTH, method == "adapt", ids, mask)
    assert_parity(method_logits(case(arch), method, ids, mask), expected, exact, f"{arch} {method} padded")


@pytest.mark.parametrize("collab", [("attn",), ("ffn",)], ids=["attn", "ffn"])
@pytest.mark.parametrize("arch", ["llama-gqa2-tied", "llama-biases", "neox-parallel-rot0.25"])
def test_adapt_collab_modules_parity(arch, collab):
    """With collab_modules restricted, W12 acts only in that module kind of the collaborative layers."""
    ids, mask = batch(False)
    c = case(arch, collab)
    expected, exact = dense_logits(arch, collab, True, ids, mask)
    assert_parity(method_logits(c, "adapt", ids, mask), expected, exact, f"{arch} adapt {collab}")
    # And the restriction matters: the full-collaboration reference is a different function.
    assert max_diff(expected, forward_logits(reference(arch, BOTH, True), ids, mask)) > 1e-3


@pytest.mark.parametrize("block", ["w12", "w21", "w22", "weight_up"])
@pytest.mark.parametrize("arch", ["llama-gqa3-tied", "neox-parallel-rot0.25"])
def test_test_has_teeth(arch, block):
    """A small change to one new block of the last layer is caught: the comparison is not vacuous."""
    ids, mask = batch(False)
    model = copy.deepcopy(case(arch).model)
    names = [n for n, _ in model.named_parameters() if ".layers.2." in n and n.endswith(block)]
    with torch.no_grad():
        model.get_parameter(names[-1]).view(-1)[0] += 0.05
    actual = forward_logits(set_method(model, "adapt"), ids, mask)
    expected, exact = dense_logits(arch, BOTH, True, ids, mask)
    with pytest.raises(AssertionError, match="from the float64 reference"):
        assert_parity(actual, expected, exact, f"mutated: {block} of the last layer perturbed")


@pytest.mark.parametrize("arch", ["llama-biases", "neox-sequential-rot1.0"])
def test_a_dropped_w12_is_outside_the_bound(arch):
    """The mutation: SCALE-Adapt leaving out one collaborative linear's W12 product (the last layer's FFN output
    linear computes ``W x + b`` alone, as a linear whose ``use_w12`` was not set would)."""
    ids, mask = batch(False)
    model = set_method(copy.deepcopy(case(arch).model), "adapt")
    expected, exact = dense_logits(arch, BOTH, True, ids, mask)
    assert_parity(forward_logits(model, ids, mask), expected, exact, f"{arch} adapt")  # the control
    down = model.get_submodule(f"{model.base_model_prefix}.layers.2.mlp")
    linear = down.down_proj if hasattr(down, "down_proj") else down.dense_4h_to_h
    assert linear.use_w12
    linear.use_w12 = False
    with pytest.raises(AssertionError, match="from the float64 reference"):
        assert_parity(forward_logits(model, ids, mask), expected, exact, "mutated: one W12 left out")
