"""The causal-LM loss with the logits never whole: the head run on a slice of positions at a time (docs/design.md §1.4).

A step's largest tensors are its logits (tokens x vocabulary) and their gradient. Here the head runs on a slice of
positions at a time inside the model's forward pass, and each slice's loss and gradients are taken at once, so nothing
of size tokens x vocabulary is kept. `use_sliced_loss` makes a model's forward return this loss, with
``logits=None``, whenever it is training and given labels (as Liger Kernel's and Cut Cross-Entropy's forwards do):
`upscale` turns it on for every SCALE model, so the stock Trainer, TRL and a user's own loop train with it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

IGNORE = -100  # the label transformers' losses ignore

# The loss of one slice's logits: ``(logits of the slice, the slice of positions) -> a scalar``.
SliceLoss = Callable[[torch.Tensor, slice], torch.Tensor]


def at_least_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in fp32 where it is of lower precision (fp64 stays fp64)."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """The label each position predicts (the next one, as transformers' causal LM loss shifts them); the last
    position predicts none (``IGNORE``)."""
    return F.pad(labels, (0, 1), value=IGNORE)[:, 1:]


def slice_positions(batch: int, positions: int, hidden: int, vocab: int) -> int:
    """Positions per slice, so that a slice holds about the hidden states' worth of logits (Liger's rule: the tokens
    over ``ceil(vocab / hidden)``) but at least half the hidden width's rows, each rounded up to a power of two.

    The floor: every slice writes the head's whole weight gradient once, which outweighs the slice's own logits below
    ``hidden / 2`` rows (measurements/README.md)."""
    liger = math.ceil(batch * positions / math.ceil(vocab / hidden))
    rows = 2 ** math.ceil(math.log2(max(1, liger, math.ceil(hidden / 2))))
    return max(1, min(positions, rows // batch))


def chunkable(head: nn.Module) -> bool:
    """Whether ``head``'s output at a position reads that position's hidden state alone (so it can run on slices)."""
    route = getattr(head, "route", None)
    return route is None or not route.active or not route.reads_tokens


def cross_entropy_loss(
    labels: torch.Tensor,
    divisor: float | torch.Tensor,
    extra: Callable[[torch.Tensor, torch.Tensor, slice], torch.Tensor] | None = None,
) -> SliceLoss:
    """The loss of one slice's logits: transformers' causal-LM cross-entropy (labels shifted by one, ``IGNORE``
    ignored, fp32) summed over its positions, plus ``extra(logits, labels, positions)`` where given, over
    ``divisor``."""
    shifted = shifted_labels(labels)

    def loss(logits: torch.Tensor, positions: slice) -> torch.Tensor:
        labels = shifted[:, positions].to(logits.device)
        total = F.cross_entropy(
            at_least_fp32(logits).flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum"
        )
        if extra is not None:
            total = total + extra(logits, labels, positions)
        return total / divisor

    return loss


def _join(readings: list) -> Any:
    """The slices' router readings as one reading of every position (each tensor's last axis is the positions)."""
    if not readings or readings[0] is None:
        return None
    first = readings[0]
    joined = {f.name: torch.cat([getattr(r, f.name) for r in readings], dim=-1) for f in dataclasses.fields(first)}
    return type(first)(**joined)


@dataclass
class _Slices:
    """The head, its trainable weights' names, the positions per slice and the loss of a slice's logits."""

    head: nn.Module
    names: tuple[str, ...]
    positions: int
    loss: SliceLoss

    def run(self, hidden: torch.Tensor, params: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, list]:
        """The loss sum and its gradients (to ``hidden`` where it takes one, then to each of ``params``), a slice
        of positions at a time; a route head's reading is left joined over every position."""
        wants_hidden = hidden.requires_grad
        grads: list[torch.Tensor | None] = [torch.zeros_like(hidden) if wants_hidden else None, *[None] * len(params)]
        total = torch.zeros((), device=hidden.device, dtype=torch.promote_types(hidden.dtype, torch.float32))
        route, readings = getattr(self.head, "route", None), []
        swapped = self.head.__dict__.pop("forward")  # `head_returns_loss`'s: the head's own forward computes a slice
        try:
            for start in range(0, hidden.shape[1], self.positions):
                positions = slice(start, min(hidden.shape[1], start + self.positions))
                with torch.enable_grad():
                    part = hidden[:, positions].detach().requires_grad_(wants_hidden)
                    leaves = [p.detach().requires_grad_() for p in params]
                    weights = dict(zip(self.names, leaves, strict=True))
                    loss = self.loss(functional_call(self.head, weights, (part,), strict=False), positions)
                    wrt = [*([part] if wants_hidden else []), *leaves]
                    with torch.autocast(hidden.device.type, enabled=False):  # a backward pass, as outside the forward
                        got = list(torch.autograd.grad(loss, wrt, allow_unused=True)) if wrt else []
                if wants_hidden:
                    grads[0][:, positions] = got.pop(0)
                for index, grad in enumerate(got, start=1):
                    if grad is not None:
                        grads[index] = grad if grads[index] is None else grads[index].add_(grad)
                total += loss.detach()
                readings.append(None if route is None else route.last)
        finally:
            self.head.forward = swapped
        if route is not None and route.active:
            route.last = _join(readings)
        return total, grads


class _SlicedHeadLoss(torch.autograd.Function):
    """``sum over slices of loss(head(hidden[:, s]), s)``; each slice's gradients computed in the forward pass and
    handed on in the backward pass, times the loss's own gradient."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, slices: _Slices, *params: torch.Tensor) -> torch.Tensor:
        total, ctx.grads = slices.run(hidden, params)
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
        grad_hidden, *grads = [None if g is None else g.mul_(grad_output.to(g.dtype)) for g in ctx.grads]  # ours alone
        ctx.grads = None
        return (grad_hidden, None, *grads)


@contextmanager
def head_returns_loss(head: nn.Module, loss: SliceLoss, batch: int, positions: int | None = None) -> Iterator[None]:
    """Within the block, ``head`` returns ``loss`` summed over slices of positions (a scalar, its gradients taken
    slice by slice) instead of its logits; the head is still called as a module (DDP sees its weights used).
    ``positions``: per slice (default `slice_positions` of the ``batch`` rows)."""
    if not chunkable(head):
        raise ValueError("this head reads other positions (a router reading the token ids): it cannot be sliced")
    params = {name: p for name, p in head.named_parameters() if p.requires_grad}

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        vocab = getattr(head, "out_features", None) or head.weight.shape[0]
        step = positions or slice_positions(batch, hidden.shape[1], hidden.shape[-1], vocab)
        run = _Slices(head, tuple(params), step, loss)
        return _SlicedHeadLoss.apply(hidden, run, *params.values())

    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def _sharded(head: nn.Module) -> bool:
    """Whether ``head``'s weights are sharded (FSDP): it gathers them in its own call, which slices would repeat."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) or getattr(p, "_fsdp_flattened", False) for p in head.parameters())


@dataclass
class SlicedLoss:
    """A model's loss setting (`use_sliced_loss`): ``positions`` per slice (0: `slice_positions`), or None: the
    model's own loss over the whole logits. ``running``: the head swapped by the forward now under way."""

    positions: int | None = 0
    running: AbstractContextManager | None = None

    def before(self, model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
        """The forward pre-hook: a training forward given labels (by name) takes the sliced loss."""
        labels = kwargs.get("labels")
        if self.positions is None or labels is None or not model.training or not torch.is_grad_enabled():
            return None
        if torch.compiler.is_compiling() or kwargs.get("return_dict") is False or "shift_labels" in kwargs:
            return None
        if is_in_torch_dispatch_mode():  # a FLOP count (FlopCounterMode), fake tensors: their trackers cannot
            return None  # follow a gradient taken inside the forward pass
        head = model.get_output_embeddings()
        if head is None or not chunkable(head) or _sharded(head):
            return None
        kwargs = dict(kwargs)
        labels, count = kwargs.pop("labels"), kwargs.pop("num_items_in_batch", None)
        divisor = torch.as_tensor(count if count is not None else (labels[:, 1:] != IGNORE).sum(), device=labels.device)
        self.running = head_returns_loss(head, cross_entropy_loss(labels, divisor), labels.shape[0], self.positions)
        self.running.__enter__()
        return args, kwargs

    def after(self, model: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        """The forward hook (run even when the forward raised): the head back as it was, and the loss the head
        returned in place of the logits handed out as ``loss`` with ``logits=None``."""
        if self.running is None:
            return None
        running, self.running = self.running, None
        running.__exit__(None, None, None)
        if output is None:
            return None
        fields = {key: value for key, value in output.items() if key not in ("loss", "logits")}
        return type(output)(loss=output["logits"], **fields)


def use_sliced_loss(model: nn.Module, positions: int | None = 0) -> None:
    """From now on ``model``'s forward returns the sliced loss (``loss``, ``logits=None``) whenever it is training,
    under gradients and given ``labels=`` (and ``num_items_in_batch=``, the Trainer's divisor); otherwise its own
    forward runs. ``positions`` per slice, 0: `slice_positions`; None: the model's own loss again."""
    setting = model.__dict__.get("sliced_loss")
    if setting is None:
        setting = SlicedLoss()
        model.__dict__["sliced_loss"] = setting
        model.register_forward_pre_hook(setting.before, with_kwargs=True)
        model.register_forward_hook(setting.after, with_kwargs=True, always_call=True)
    setting.positions = positions
