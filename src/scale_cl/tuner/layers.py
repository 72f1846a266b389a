"""The widened building blocks: one small module each (docs/design.md §1 and §5).

Every module here reads a hidden vector laid out as ``[x; x_up]`` (original part first) and keeps
the pre-trained tensors under their original names ``weight``/``bias`` (frozen); what it adds is
named ``w12``/``w21``/``w22``/``bias_up`` (linears) or ``weight_up``/``bias_up`` (embedding, head,
norms). The original output never depends on ``x_up`` unless W12 is used, which is what makes
Theorem 3.1 hold exactly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from scale_cl.tuner.config import UP_NORMS
from scale_cl.tuner.merged import merged_product
from scale_cl.tuner.routing.router import HeadPaths, original_logits, router_named
from scale_cl.tuner.routing.rows import constant_half_rows, routed_rows
from scale_cl.tuner.routing.state import RouteState

# The names of what SCALE adds to a module (everything else keeps the base model's names and stays frozen).
NEW_PARAM_NAMES = ("w12", "w21", "w22", "bias_up", "weight_up", "weight_new")


def is_new_parameter(name: str) -> bool:
    """Whether the parameter ``name`` (dotted) is one SCALE added, not the base model's."""
    return name.rsplit(".", 1)[-1] in NEW_PARAM_NAMES


# Where a grown model's norm keeps the earlier stages' norm (frozen): `SplitNorm` ``inner`` (`scale_cl.tuner.stages`).
INNER = "inner"


def is_quantized(module: nn.Module) -> bool:
    """Whether ``module`` is a bitsandbytes quantized linear (without importing bitsandbytes): its product is the
    frozen base's `W x + b` (`scale_cl.tuner.quant`)."""
    return type(module).__module__.startswith("bitsandbytes.") and isinstance(module, nn.Linear)


class SplitInput(nn.Module):
    """A module reading ``[x; x_up]`` whose original part ``x`` may be constant during training.

    ``constant_input`` (set by `set_method`) is true where ``x`` depends on no trainable parameter
    (below the first layer that uses W12): then `original` detaches it, so no gradient is taken
    through the frozen products, which is most of full fine-tuning's backward.

    ``constant_half`` is its route-mode counterpart in the stacked layers: the rows are
    ``[preserve path; adapt path]`` and W12 never reaches the preserve half, so that half's ``x``
    is constant too (the adapt half's is not).
    """

    constant_input: bool = False
    constant_half: bool = False

    def original(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach() if self.constant_input else x


# The forms in which `ScaleLinear` computes Eq. 1, chosen by `ScaleLinear.form` alone (`ScaleMLP` asks it too).
# Each is the same product; the first is the math, the others are faster where the moment allows.
EQ1 = "eq1"  # block by block (`blocks`): training, and any linear without W12
MERGED = "merged"  # inference with W12: the whole block matrix as one dense product (`scale_cl.tuner.merged`)
ROUTED = "routed"  # route's stacked rows: W12 on the adapt half only (`scale_cl.tuner.routing.rows`)
CONSTANT_HALF = "constant_half"  # route's stacked training rows whose preserve half is constant: each half apart


# Copied to export/modeling_scale.py (TwoPathLinear): change both (tests/export/test_export_copies.py).
class ScaleLinear(SplitInput):
    """Eq. 1: ``[[W, W12], [W21, W22]] @ [x; x_up]`` with ``W`` (and its bias) frozen.

    The output is ``[W x + W12 x_up (+ b); W21 x + W22 x_up + bias_up]`` (`blocks`). W12 starts at zero and
    exists only where ``use_w12`` (set by `set_method`) is or was true: a preserve layer neither holds nor computes it.

    `forward` is Eq. 1 (`blocks`) but where `form`, the one place the choice is made, picks a faster form of the same
    product: ``MERGED`` for inference with W12 (`scale_cl.tuner.merged`: one dense product, equal to rounding), and
    on route's stacked rows ``[preserve path; adapt path]`` ``ROUTED`` and, in training, ``CONSTANT_HALF``
    (`scale_cl.tuner.routing.rows`: W12 on the adapt half only).
    """

    merge_for_inference: bool = True

    def __init__(
        self,
        base: nn.Linear,
        in_up: int,
        out_up: int,
        w21: torch.Tensor,
        w22: torch.Tensor,
        collaborative: bool,
        sublayer: str = "attn",
    ) -> None:
        super().__init__()
        self.sublayer = sublayer  # "attn" or "ffn": the sublayer (a collab_modules name) this linear is in
        self.in_features, self.out_features = base.in_features, base.out_features
        self.in_up, self.out_up = in_up, out_up
        self.collaborative = collaborative
        self.use_w12 = False
        self.route: RouteState | None = None  # the model's route state, handed over by `upscale`
        self._merged: tuple | None = None  # the merged inference form's cache (`scale_cl.tuner.merged`)
        if is_quantized(base):  # a quantized frozen base (`scale_cl.tuner.quant`): W x + b is its module's product
            self.quantized_base = base
            self.weight = self.bias = None
            factory = {"device": base.weight.device, "dtype": base.dense_dtype}
        else:
            self.quantized_base = None
            self.weight = base.weight
            self.bias = base.bias
            factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        # W12 is allocated (at zero) by `set_method` where this linear first uses it (`add_w12`): SCALE-Preserve, and
        # the linears below ``preserve_layers``, hold and save none. Registered here so it keeps its place in the
        # parameter order.
        self.register_parameter("w12", None)
        self.w21 = nn.Parameter(w21.to(**factory))
        self.w22 = nn.Parameter(w22.to(**factory))
        self.bias_up = nn.Parameter(torch.zeros(out_up, **factory)) if base.bias is not None else None

    def add_w12(self) -> None:
        """Allocate W12 at zero (Theorem 3.1's start) if this linear has none; a W12 once allocated stays (a switch
        back to SCALE-Preserve keeps what it learned, unused)."""
        if self.w12 is None:
            self.w12 = nn.Parameter(
                torch.zeros(self.out_features, self.in_up, device=self.w21.device, dtype=self.w21.dtype)
            )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.form() == MERGED:  # inference with W12: one dense product
            return merged_product(self, hidden)
        return torch.cat(self.project(*hidden.split((self.in_features, self.in_up), dim=-1)), dim=-1)

    def project(self, x: torch.Tensor, x_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The output's original part and added part, from the input's two parts (`ScaleMLP` keeps them apart)."""
        if torch.is_grad_enabled():
            self._merged = None  # training: drop the inference copy and its memory
        form = self.form(whole=False)
        x = self._as_base_input(self.original(x))
        if form == CONSTANT_HALF:
            return constant_half_rows(self, x, x_up)
        if form == ROUTED:
            return routed_rows(self, x, x_up)
        return self.blocks(x, x_up, self.use_w12)

    def blocks(self, x: torch.Tensor, x_up: torch.Tensor, with_w12: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. 1 block by block: ``(W x + b [+ W12 x_up], W21 x + W22 x_up + bias_up)``."""
        out = self.original_product(x)
        if with_w12:
            out = out + F.linear(x_up, self.w12)
        return out, F.linear(x, self.w21, self.bias_up) + F.linear(x_up, self.w22)

    def form(self, whole: bool = True) -> str:
        """How Eq. 1 is computed now (``EQ1``, ``MERGED``, ``ROUTED`` or ``CONSTANT_HALF``; see the class doc): the one
        place the choice is made. ``whole=False``: for a caller holding the input's two parts, which the merged
        product (over the whole input) does not take."""
        grad = torch.is_grad_enabled()
        # a quantized W stays quantized (merging it would store it dense); under autocast the merged product's wider
        # K is summed in another order by some CPUs' bf16 GEMM (AMD EPYC: one ulp off the base's W x), so not there
        dense = self.weight is not None and not torch.is_autocast_enabled(self.weight.device.type)
        if whole and self.use_w12 and self.merge_for_inference and not grad and dense:
            return MERGED
        if self.constant_half and grad:
            return CONSTANT_HALF
        if self.use_w12 and self.route is not None and self.route.active:
            return ROUTED
        return EQ1

    def original_product(self, x: torch.Tensor) -> torch.Tensor:
        """``W x + b``, the frozen original product (through the quantized module where the base is quantized)."""
        if self.quantized_base is not None:
            return self.quantized_base(x)
        return F.linear(x, self.weight, self.bias)

    def _as_base_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` laid out as the base model's input to W, so ``W x + b`` rounds as it does there.

        A strided slice with a bias takes matmul-then-add instead of the fused addmm the base model's
        contiguous input takes: in bf16/fp16 (or under autocast) that rounds differently (one ulp), so
        the original stream would no longer be bitwise the base model's. On a CPU fp32 rounds the same; on
        CUDA the two paths may pick other GEMM kernels, so there the slice is made contiguous in fp32 too.
        """
        low_precision = x.dtype != torch.float32 or torch.is_autocast_enabled(x.device.type)
        return x.contiguous() if self.bias is not None and (low_precision or x.is_cuda) else x

    def project_half(self, x: torch.Tensor, x_up: torch.Tensor, adapt: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`blocks` on one path's rows of route's stacked training batch whose preserve half is constant (`ScaleMLP`
        runs the halves apart): the preserve path's ``x`` is the constant it is there and never meets W12; the adapt
        path's does."""
        self._merged = None  # training: drop the inference copy and its memory
        x = self._as_base_input(self.original(x) if adapt else x.detach())
        return self.blocks(x, x_up, adapt and self.use_w12)

    def clear_merged(self) -> None:
        """Drop the merged inference form's cached block matrix (`scale_cl.tuner.merged.merged_weights`)."""
        self._merged = None

    def merged_weight(self, with_w12: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block matrix ``[[W, W12], [W21, W22]]`` as one dense weight, and the bias ``[b; bias_up]``.

        ``with_w12`` defaults to whether this linear uses W12 (`use_w12`); False gives the preserve
        path's matrix (W12 taken as zero). A fresh tensor, detached from the parameters.
        """
        with_w12 = self.use_w12 if with_w12 is None else with_w12
        if self.weight is None:
            raise ValueError(
                "this linear's W is quantized (base_quant): it has no dense block matrix to merge (export, growing "
                "again and merged inference need an unquantized base)"
            )
        with torch.no_grad():
            w12 = self.w12 if with_w12 and self.w12 is not None else self.w21.new_zeros(self.out_features, self.in_up)
            weight = torch.cat((torch.cat((self.weight, w12), dim=1), torch.cat((self.w21, self.w22), dim=1)))
            bias = None if self.bias is None else torch.cat((self.bias, self.bias_up))
        return weight, bias

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}+{self.in_up}, out={self.out_features}+{self.out_up}, "
            f"bias={self.bias is not None}, sublayer={self.sublayer}, collaborative={self.collaborative}, "
            f"use_w12={self.use_w12}"
        )


class ScaleMLP(nn.Module):
    """The FFN of a widened layer, applying its activation (and gate) to the original and added
    columns separately.

    The arithmetic is the base MLP's, element for element; keeping the parts apart is what saves
    memory and time. Where the original columns depend on no trainable parameter (`constant_input`
    upstream), autograd then stores nothing for their activation and product and runs no backward
    over them: only the added ``ffn_up`` columns do, instead of all ``ffn + ffn_up``. The children
    keep the base MLP's names (``gate_proj``/``up_proj``/``down_proj``, ``dense_h_to_4h``/...), so
    parameter names and checkpoints are unchanged. ``gate`` is None for an ungated MLP (GPT-NeoX).
    """

    def __init__(self, base: nn.Module, gate: str | None, up: str, down: str, act: str) -> None:
        super().__init__()
        self.names = (gate, up, down, act)
        for name in (gate, up, down, act):
            if name is not None:
                self.add_module(name, base.get_submodule(name))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate_name, up_name, down_name, act_name = self.names
        up, down, act = getattr(self, up_name), getattr(self, down_name), getattr(self, act_name)
        if up.form() == MERGED:  # inference with W12: the stock MLP on the merged weights
            inner = up(hidden)
            inner = act(inner) if gate_name is None else act(getattr(self, gate_name)(hidden)) * inner
            return down(inner)
        return torch.cat(self.project(*hidden.split((up.in_features, up.in_up), dim=-1)), dim=-1)

    def project(self, x: torch.Tensor, x_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP on the input's two parts, its output's two parts (a layer keeping the streams apart,
        `scale_cl.tuner.streams`, never joins them); any form but the merged one."""
        up = getattr(self, self.names[1])
        if up.form(whole=False) == CONSTANT_HALF:  # route's stacked training batch
            half = x.shape[0] // 2
            preserve = self._project(x[:half], x_up[:half], adapt=False)
            adapt = self._project(x[half:], x_up[half:], adapt=True)
            return torch.cat((preserve[0], adapt[0])), torch.cat((preserve[1], adapt[1]))
        return self._project(x, x_up)

    def _project(
        self, x: torch.Tensor, x_up: torch.Tensor, adapt: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP on ``[x; x_up]``; ``adapt`` True/False: on one path's half of route's stacked training batch.

        Route's halves run apart in training: the preserve half's original columns (``ffn`` wide, the widest
        activations) then depend on no trainable parameter, so their activation and gating record no backward,
        and no (2B, T, ffn) tensor is concatenated from halves or zero-filled for a constant half's gradient."""
        gate_name, up_name, down_name, act_name = self.names
        up, down, act = getattr(self, up_name), getattr(self, down_name), getattr(self, act_name)

        def project(linear: ScaleLinear, x: torch.Tensor, x_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return linear.project(x, x_up) if adapt is None else linear.project_half(x, x_up, adapt)

        inner, inner_up = project(up, x, x_up)
        if gate_name is None:
            inner, inner_up = act(inner), act(inner_up)
        else:
            gate, gate_up = project(getattr(self, gate_name), x, x_up)
            inner, inner_up = act(gate) * inner, act(gate_up) * inner_up
        return project(down, inner, inner_up)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Exactly the arithmetic of transformers' LlamaRMSNorm (float32 statistics)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


# Copied to export/modeling_scale.py (SplitRMSNormGroups, SplitLayerNorm, norm_groups): change both
# (tests/export/test_export_copies.py).
class SplitNorm(SplitInput):
    """Normalises ``x`` with the frozen original norm over ``d`` and ``x_up`` with a new one over ``u``.

    A norm over the whole ``d + u`` would let ``x_up`` rescale ``x`` and break preservation, so
    ``x`` never reads ``x_up``'s statistics (docs/design.md §1). ``norm_kind`` is ``"rms"`` (Llama family) or
    ``"layer"`` (LayerNorm with bias, GPT-NeoX). ``up_norm`` (`ScaleConfig.up_norm`): ``"own"`` normalises
    ``x_up`` by its own statistics; ``"original"`` divides it by the original stream's RMS (``rms``) or
    standard deviation (``layer``, not centred), ``"joint"`` by the whole ``[x; x_up]``'s, so a quiet ``x_up``
    stays quiet (docs/design.md §2).

    On a grown model (`scale_cl.tuner.stages`) ``base`` is the earlier stages' `SplitNorm`, kept frozen as ``inner``: it
    normalises the whole earlier width ``x`` (its own groups apart), and this norm adds the next group.
    """

    def __init__(self, base: nn.Module, norm_kind: str, hidden_up: int, eps: float, up_norm: str = "own") -> None:
        super().__init__()
        if norm_kind not in ("rms", "layer"):
            raise ValueError(f"unknown norm kind {norm_kind!r}")
        if up_norm not in UP_NORMS:
            raise ValueError(f"unknown up_norm {up_norm!r}")
        self.norm_kind, self.eps, self.up_norm = norm_kind, eps, up_norm
        if isinstance(base, SplitNorm):  # a grown model's: the earlier stages' norm, frozen, over the whole x
            self.hidden_size, self.hidden_up = base.hidden_size + base.hidden_up, hidden_up
            setattr(self, INNER, base)
            reference = base.weight_up
        else:
            self.hidden_size, self.hidden_up = base.weight.shape[0], hidden_up
            self.weight = base.weight
            reference = base.weight
            if norm_kind == "layer":
                self.bias = base.bias
        factory = {"device": reference.device, "dtype": reference.dtype}
        self.weight_up = nn.Parameter(torch.ones(hidden_up, **factory))
        if norm_kind == "layer":
            self.bias_up = nn.Parameter(torch.zeros(hidden_up, **factory))

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.norm_kind == "rms":
            return rms_norm(x, weight, self.eps)
        return F.layer_norm(x, (x.shape[-1],), weight, bias, self.eps)

    def _by_other(self, reference: torch.Tensor, x_up: torch.Tensor) -> torch.Tensor:
        """``x_up`` over ``reference``'s RMS (rms) or standard deviation (layer), then the new gain (and bias)."""
        ref = reference.to(torch.float32)
        rms = self.norm_kind == "rms"
        stat = ref.pow(2).mean(-1, keepdim=True) if rms else ref.var(-1, unbiased=False, keepdim=True)
        scaled = (x_up.to(torch.float32) * torch.rsqrt(stat + self.eps)).to(x_up.dtype)
        return self.weight_up * scaled if rms else scaled * self.weight_up + self.bias_up

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.project(*hidden.split((self.hidden_size, self.hidden_up), dim=-1), whole=hidden), dim=-1)

    def project(
        self, x: torch.Tensor, x_up: torch.Tensor, whole: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The two parts normalised apart (a layer keeping the streams apart, `scale_cl.tuner.streams`, never joins
        them). ``whole``: ``[x; x_up]`` where the caller holds it (the ``"joint"`` statistic reads it)."""
        if self.up_norm == "joint" and whole is None:
            whole = torch.cat((x, x_up), dim=-1)
        x = self.original(x)
        bias_up = self.bias_up if self.norm_kind == "layer" else None
        if self.up_norm == "own":
            up = self._norm(x_up, self.weight_up, bias_up)
        else:  # over x's statistic ("original") or the whole width's ("joint"); x never reads x_up's
            up = self._by_other(x if self.up_norm == "original" else whole, x_up)
        inner = getattr(self, INNER, None)
        if inner is not None:
            return inner(x), up
        return self._norm(x, self.weight, self.bias if self.norm_kind == "layer" else None), up

    def earlier_stages(self) -> list[nn.Module]:
        """A grown model's earlier norms kept inside this one (frozen; none on a model upscaled once)."""
        inner = getattr(self, INNER, None)
        return [] if inner is None else list(inner.modules())

    @property
    def groups(self) -> tuple[int, ...]:
        """The widths normalised apart, first the original model's: ``(d, u1, u2, ...)`` on a grown model."""
        inner = getattr(self, INNER, None)
        return (*(inner.groups if inner is not None else (self.hidden_size,)), self.hidden_up)

    def extra_repr(self) -> str:
        up = "" if self.up_norm == "own" else f", x_up by the {self.up_norm} statistic"
        return f"{self.norm_kind}, {'+'.join(map(str, self.groups))}, eps={self.eps}{up}"


class ScaleEmbedding(nn.Module):
    """Token -> ``[E[token]; E_up[token]]``; ``E`` frozen (and possibly tied to the LM head).

    With an extended vocabulary (`scale_cl.tuner.vocab`) ``E`` is ``[weight; weight_new]``: the original
    rows frozen, the new tokens' rows ``weight_new`` trainable (taken over from the base model's
    `scale_cl.tuner.vocab.VocabEmbedding`, or added by `scale_cl.tuner.vocab.grow_embeddings`); None otherwise.
    """

    def __init__(self, base: nn.Embedding, weight_up: torch.Tensor) -> None:
        super().__init__()
        self.weight = base.weight
        self.register_parameter("weight_new", getattr(base, "weight_new", None))
        self.padding_idx = base.padding_idx
        self.num_embeddings = base.num_embeddings
        self.embedding_dim = base.embedding_dim + weight_up.shape[1]
        self.weight_up = nn.Parameter(weight_up.to(device=base.weight.device, dtype=base.weight.dtype))

    @staticmethod
    def lookup(input_ids: torch.Tensor, weight: torch.Tensor, new: torch.Tensor | None, padding_idx: int | None):
        """``[weight; new][input_ids]`` without concatenating the tables; an original id reads ``weight`` bitwise."""
        if new is None:
            return F.embedding(input_ids, weight, padding_idx)
        is_new = input_ids >= weight.shape[0]
        old = F.embedding(input_ids.masked_fill(is_new, 0), weight, padding_idx)
        return torch.where(is_new.unsqueeze(-1), F.embedding((input_ids - weight.shape[0]).clamp(min=0), new), old)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.lookup(input_ids, self.weight, self.weight_new, self.padding_idx)
        x_up = F.embedding(input_ids, self.weight_up, self.padding_idx)
        return torch.cat((x, x_up), dim=-1)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.weight.shape[1]}+{self.weight_up.shape[1]}"


class ScaleHead(SplitInput):
    """LM head ``Z + Z_up = W_out x + W_out_up x_up``; ``W_out`` frozen, ``W_out_up`` zero at start.

    ``Z_up`` is weighted by `ScaleConfig.up_logit_scale` (``alpha``, 1 by default), read from the model's
    settings at every forward, as is `ScaleConfig.route_exact`.

    In route mode (``route.active``) the head hands its input on the two paths and its weights to the model's
    router (`scale_cl.tuner.routing`: Eq. 5's cosine router, or the likelihood router), which combines them and
    keeps its reading in ``route.last``.

    With an extended vocabulary (`scale_cl.tuner.vocab`) ``W_out`` is ``[weight; weight_new]`` (the new
    tokens' rows trainable, the embedding's own when tied) and ``W_out_up`` has a row per token, new
    ones included. The original vocabulary's logits are computed as before and the new tokens'
    appended; route decides from the original vocabulary's logits alone, so a token routes as it
    would without the extension.
    """

    def __init__(self, base: nn.Linear, hidden_up: int) -> None:
        super().__init__()
        self.in_features = base.in_features + hidden_up
        self.out_features = base.out_features
        self.hidden_size, self.hidden_up = base.in_features, hidden_up
        self.weight = base.weight
        self.bias = base.bias
        self.register_parameter("weight_new", getattr(base, "weight_new", None))
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.weight_up = nn.Parameter(torch.zeros(base.out_features, hidden_up, **factory))
        self.route: RouteState | None = None  # the model's route state, handed over by `upscale`

    def project(self, x: torch.Tensor, x_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The original-part logits ``Z`` and the added part ``Z_up``, from the input's two parts."""
        z = original_logits(self.original(x), self.weight, self.bias, self.weight_new)
        return z, F.linear(x_up, self.weight_up)

    def setting(self, name: str, default: Any) -> Any:
        """A `ScaleConfig` field as the model holds it now (its `ScaleState`: the one home, saved and exported)."""
        return default if self.route is None else self.route.setting(name)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        route, alpha = self.route, self.setting("up_logit_scale", 1.0)  # Z + alpha Z_up
        if route is None or not route.active:
            x, x_up = hidden.split((self.hidden_size, self.hidden_up), dim=-1)
            z = original_logits(self.original(x), self.weight, self.bias, self.weight_new)
            kept = route is not None and route.capture_base
            if kept:
                route.keep_base(z[..., : self.out_features])  # the base's logits in SCALE-Preserve
            return self._plus_up(z, x_up, alpha, in_place=not kept)
        paths = self._paths(hidden, stacked=route.stacked, alpha=alpha)
        return router_named(route.setting("router")).combine(paths, route)

    def _paths(self, hidden: torch.Tensor, stacked: bool, alpha: float) -> HeadPaths:
        """What a router (or the head itself) computes the logits from; the original part ``x`` taken as constant
        where it is (`SplitInput.original`; route's stacked preserve half: in `route_logits`)."""
        x, x_up = hidden.split((self.hidden_size, self.hidden_up), dim=-1)
        return HeadPaths(
            x if stacked else self.original(x),
            x_up,
            self.weight,
            self.bias,
            self.weight_new,
            self.weight_up,
            alpha,
            stacked,
            self.out_features,
        )

    def _plus_up(self, z: torch.Tensor, x_up: torch.Tensor, alpha: float, in_place: bool) -> torch.Tensor:
        """``Z + alpha W_out_up x_up`` as one product accumulating onto ``Z``: the logits are a step's largest
        tensors (tokens x vocabulary), and ``Z_up`` apart would be one more of them, written and read again.
        ``in_place``: into ``Z``'s own memory (nothing else holds ``Z``; no backward reads it), not a copy of it,
        where the three share a dtype (under autocast only the out-of-place product casts its inputs)."""
        flat, rows, up = z.reshape(-1, z.shape[-1]), x_up.reshape(-1, x_up.shape[-1]), self.weight_up.t()
        if in_place and flat.dtype == rows.dtype == up.dtype:
            return flat.addmm_(rows, up, alpha=alpha).view(z.shape)
        return flat.addmm(rows, up, alpha=alpha).view(z.shape)

    def extra_repr(self) -> str:
        active = self.route is not None and self.route.active
        return f"{self.hidden_size}+{self.hidden_up} -> {self.out_features}, route={active}"
