"""Each method's training FLOP floor per token: what its definition needs computed, counted by formula.

`scale_cl.eval.cost` counts what a training step runs; this module says what it must run, from the shapes alone, so
the two can be set side by side (`scale-cl bench`) and tested equal (tests/bench/test_bench.py): any product the code
computes that the method does not need shows up as the difference. The conventions are the counter's (2 FLOPs a
multiply-add; attention dense over the sequence, its backward the 5 products torch counts), so the floor of full
fine-tuning is exactly what it runs.

What the floor leaves out, by definition (docs/design.md §1.3, §1.4):

* a frozen weight's gradient; the input gradient of a product whose input depends on no trainable parameter: the
  original stream below the first W12 that is used (everywhere in SCALE-Preserve), what reads that stream in the
  first layer that uses one, and route's preserve path (W12 taken as zero);
* the backward of the attention of original heads whose queries, keys and values are constant;
* W12 products where W12 is not used.

What it keeps: the forward of every block (W21 reads the original stream; Eq. 5 needs both paths' logits and their
cosine), and the new stream's backward down to the new embedding rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scale_cl.methods import method_spec
from scale_cl.tuner.arch import ArchSpec, spec_for_config
from scale_cl.tuner.arch.spec import LinearSpec
from scale_cl.tuner.config import ScaleConfig
from scale_cl.tuner.widths import Dims, base_dims, growth, resolve


@dataclass(frozen=True)
class Floor:
    """FLOPs per token of one training step that a method cannot do without."""

    forward: float
    backward: float

    @property
    def train(self) -> float:
        return self.forward + self.backward

    def __add__(self, other: Floor) -> Floor:
        return Floor(self.forward + other.forward, self.backward + other.backward)

    def __mul__(self, times: int) -> Floor:
        return Floor(self.forward * times, self.backward * times)


NOTHING = Floor(0, 0)


@dataclass(frozen=True)
class _Block:
    """One linear of a decoder layer: its original sizes and the sizes SCALE adds."""

    spec: LinearSpec
    inputs: int
    outputs: int
    inputs_up: int
    outputs_up: int

    def floor(self, w12: bool, input_grad: bool) -> Floor:
        """``[[W, W12], [W21, W22]] [x; x_up]`` on one path: W12 used or not, the input ``x`` needing gradient or not.
        ``x_up`` always needs it (the new embedding trains)."""
        i, o, iu, ou = self.inputs, self.outputs, self.inputs_up, self.outputs_up
        forward = 2 * (o * i + ou * (i + iu) + (o * iu if w12 else 0))
        backward = 2 * ou * (i + iu) + 2 * ou * iu  # W21's and W22's gradients; x_up's through W22
        backward += 4 * o * iu if w12 else 0  # W12's gradient; x_up's through W12
        backward += 2 * (o + ou) * i if input_grad else 0  # x's through W and W21
        return Floor(forward, backward)


def _sizes(dims: Dims, unit: str) -> int:
    return {
        "hidden": dims.hidden,
        "q": dims.heads * dims.head_dim,
        "kv": dims.kv_heads * dims.head_dim,
        "qkv": 3 * dims.heads * dims.head_dim,
        "ffn": dims.ffn,
    }[unit]


def _attention(heads: int, head_dim: int, tokens: int, backward: bool) -> Floor:
    """Attention of ``heads`` query heads over ``tokens`` keys, per token: forward ``q k^T`` and ``p v``; backward
    the five products torch's counter counts (`scale_cl.eval.cost.attention_backward_flops`)."""
    forward = 4 * tokens * head_dim * heads
    return Floor(forward, 10 * tokens * head_dim * heads if backward else 0)


def _layer(
    blocks: list[_Block],
    dims: Dims,
    new_heads: int,
    tokens: int,
    *,
    w12: set[str],
    input_grad: bool,
    parallel: bool,
) -> tuple[Floor, bool]:
    """One decoder layer on one path: (its floor, whether its output needs gradient). ``w12``: the modules ("attn",
    "ffn") whose W12 this path uses here; ``input_grad``: whether the layer's input ``x`` needs gradient.

    Where a gradient is needed follows the data: attention reads the layer's input, the FFN reads attention's output
    (or, with a parallel residual, the layer's input), and a W12 makes what it feeds depend on a trainable weight."""
    attention_grad = input_grad or "attn" in w12  # the original heads' q/k/v, and so attention's output
    ffn_input_grad = input_grad if parallel else attention_grad
    floor = NOTHING
    for block in blocks:
        reads_input = block.spec.grow_in == "hidden"
        if block.spec.module == "attn":
            grad = input_grad if reads_input else attention_grad
        else:
            grad = ffn_input_grad if reads_input else ffn_input_grad or "ffn" in w12
        floor += block.floor(block.spec.module in w12, grad)
    floor += _attention(dims.heads, dims.head_dim, tokens, backward=attention_grad)
    floor += _attention(new_heads, dims.head_dim, tokens, backward=True)
    return floor, input_grad or bool(w12)


def scale_floor(config: Any, scale: ScaleConfig, tokens: int) -> Floor:
    """The training floor per token of a SCALE method (``scale.method``) on a base model of ``config`` (its
    transformers config, not upscaled), for sequences of ``tokens`` tokens, with Eq. 5's cosine router."""
    spec = spec_for_config(config)
    dims = base_dims(config, spec)
    scale = resolve(scale, dims)
    grow = growth(scale, dims)
    blocks = [
        _Block(lin, _sizes(dims, lin.grow_in), _sizes(dims, lin.grow_out), grow[lin.grow_in], grow[lin.grow_out])
        for lin in spec.linears
    ]
    parallel = bool(getattr(config, spec.parallel_residual or "", False))
    new_heads, vocab, d, u = scale.hidden_up // dims.head_dim, config.vocab_size, dims.hidden, scale.hidden_up
    collaborative = set(scale.collab_modules)
    method, first = scale.method, scale.preserve_layers

    def path(uses_w12: bool, layers: range, input_grad: bool) -> tuple[Floor, bool]:
        floor = NOTHING
        for index in layers:
            w12 = collaborative if uses_w12 and index >= first else set()
            layer, input_grad = _layer(
                blocks, dims, new_heads, tokens, w12=w12, input_grad=input_grad, parallel=parallel
            )
            floor += layer
        return floor, input_grad

    head_up = Floor(2 * vocab * u, 4 * vocab * u)  # W_out_up x_up: its gradient and x_up's
    if method != "route" or first >= dims.layers:  # one path (route without a collaborative layer: both agree)
        floor, top_grad = path(method != "preserve", range(dims.layers), False)
        floor += Floor(2 * vocab * d, 2 * vocab * d if top_grad else 0) + head_up
        return floor + (Floor(2 * vocab, 0) if method == "route" else NOTHING)  # Eq. 5's cosine of Z with itself
    below, _ = path(False, range(first), False)
    preserve, _ = path(False, range(first, dims.layers), False)
    adapt, top_grad = path(True, range(first, dims.layers), False)
    # the head: both paths' Z (Z_a takes gradient), Z_up on one row per token (the routed path's x_up), the cosine
    head = Floor(2 * 2 * vocab * d, 2 * vocab * d if top_grad else 0) + head_up + Floor(2 * vocab, 0)
    return below + preserve + adapt + head


def fft_floor(config: Any, tokens: int) -> Floor:
    """Full fine-tuning's floor per token: every product forward, every weight's and input's gradient backward."""
    spec: ArchSpec = spec_for_config(config)
    dims = base_dims(config, spec)
    weights = sum(_sizes(dims, lin.grow_in) * _sizes(dims, lin.grow_out) for lin in spec.linears) * dims.layers
    weights += config.vocab_size * dims.hidden  # the LM head
    return Floor(2 * weights, 4 * weights) + _attention(dims.heads, dims.head_dim, tokens, True) * dims.layers


def method_floor(method: str, config: Any, scale: ScaleConfig | None, tokens: int) -> Floor | None:
    """The floor of a `scale_cl.prepare` method name (``scale`` for the SCALE ones), or None for the baselines that
    have none here (LoRA, Freeze, LLaMA Pro: their libraries' own autograd decides what they run)."""
    spec = method_spec(method)
    if spec.trains_everything:
        return fft_floor(config, tokens)
    if spec.is_scale and scale is not None:
        return scale_floor(config, scale, tokens)
    return None
