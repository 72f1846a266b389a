"""The measurements themselves: interleaved training and inference timing, FLOP counting, state size.

Timing interleaves the methods (one method after the other, round after round) so that drift of a
shared, noisy machine hits all of them alike; medians make a single stalled step harmless.
FLOPs are counted by `scale_cl.eval.cost` on a real pass of the model as run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable

import torch
from torch import nn
from tqdm.auto import tqdm

from scale_cl.tuner.sliced_loss import use_sliced_loss


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (each once; a tied weight is one parameter)."""
    params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
    return torch.optim.AdamW(params, lr=lr)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor, sliced: bool = True) -> None:
    """One optimizer step of the causal-LM loss on ``ids``; ``sliced``: the logits a slice at a time, as training
    computes it (`scale_cl.train.chunked_loss`), else transformers' loss over the whole logits."""
    use_sliced_loss(model, 0 if sliced else None)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def state_bytes(model: nn.Module) -> int:
    """Parameters + gradients + AdamW's two moments of the trainable ones: the training state, no activations."""
    params = list({id(p): p for p in model.parameters()}.values())
    total = sum(p.numel() * p.element_size() for p in params)
    return total + 3 * sum(p.numel() * p.element_size() for p in params if p.requires_grad)


def interleaved_training(
    models: dict[str, nn.Module],
    ids: torch.Tensor,
    *,
    lr: float,
    warmup: int,
    steps: int,
    rounds: int,
    compile_mode: str = "none",
    sliced: bool = True,
    progress: bool = True,
) -> dict[str, list[float]]:
    """Seconds per optimizer step, per method: ``warmup`` untimed steps, then ``rounds`` x ``steps`` timed.

    Every round runs ``steps`` consecutive steps of each method in turn. ``compile_mode`` other than ``"none"``
    times ``torch.compile(model, mode=compile_mode)`` (compiled during the warm-up steps; keep at least one), with
    the whole loss. ``sliced``: the loss a slice of positions at a time (`train_step`).
    """
    device = ids.device
    optimizers = {name: make_optimizer(model, lr) for name, model in models.items()}
    for model in models.values():
        model.train()
    if compile_mode != "none":
        models = {name: torch.compile(model, mode=compile_mode) for name, model in models.items()}
        sliced = False
    times: dict[str, list[float]] = {name: [] for name in models}
    total = len(models) * (warmup + rounds * steps)
    with tqdm(total=total, desc="train steps", disable=not progress, leave=False) as bar:
        for _ in range(warmup):
            for name, model in models.items():
                train_step(model, optimizers[name], ids, sliced)
                bar.update()
        synchronize(device)
        for _ in range(rounds):
            for name, model in models.items():
                for _ in range(steps):
                    start = time.perf_counter()
                    train_step(model, optimizers[name], ids, sliced)
                    synchronize(device)
                    times[name].append(time.perf_counter() - start)
                    bar.update()
    for optimizer in optimizers.values():
        optimizer.state.clear()
    return times


def _generate(model: nn.Module, prompt: torch.Tensor, new_tokens: int) -> None:
    # min_new_tokens = max_new_tokens: random weights must not stop early at an EOS token
    model.generate(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )


def interleaved_inference(
    models: dict[str, nn.Module],
    ids: torch.Tensor,
    prompt: torch.Tensor,
    *,
    new_tokens: int,
    rounds: int,
    progress: bool = True,
) -> dict[str, dict[str, list[float]]]:
    """Seconds per forward pass on ``ids`` and per ``generate()`` of ``new_tokens`` after ``prompt``.

    One untimed round warms up, then ``rounds`` timed rounds, each running every method in turn.
    ``new_tokens=0`` skips generation.
    """
    device = ids.device
    times: dict[str, dict[str, list[float]]] = {name: {"forward": [], "generate": []} for name in models}
    for model in models.values():
        model.eval()
    bar = tqdm(total=len(models) * (rounds + 1), desc="inference", disable=not progress, leave=False)
    with torch.no_grad(), bar:
        for round_ in range(rounds + 1):
            for name, model in models.items():
                start = time.perf_counter()
                model(input_ids=ids)
                synchronize(device)
                middle = time.perf_counter()
                if new_tokens:
                    _generate(model, prompt, new_tokens)
                    synchronize(device)
                end = time.perf_counter()
                if round_:
                    times[name]["forward"].append(middle - start)
                    if new_tokens:
                        times[name]["generate"].append(end - middle)
                bar.update()
    return times


def median(values: Iterable[float]) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None
