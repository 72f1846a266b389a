"""Perplexity, routing share and representation drift of a causal LM on packed token sequences (paper Fig. 4, 9)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from scale_cl.tuner.routing.state import ROUTE_SHARE_KEY


@dataclass
class PerplexityResult:
    perplexity: float
    loss: float
    tokens: int
    route_preserve_share: float | None = None  # scale_route only: share of tokens routed to preserve
    # with ``new_tokens``: the token-mean of -ln P(next token not in the set), the part of the loss (nats) that is
    # probability mass given to the set; the rest, loss - new_mass_nll, is the ranking among the other tokens
    new_mass_nll: float | None = None


def new_domain_tokens(new: torch.Tensor, old: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A mask over the vocabulary: the tokens that occur in the ``new`` token ids and are relatively more frequent
    there than in ``old`` (add-one smoothed): the new domain's own tokens, for the split of an old-domain loss
    (`perplexity`)."""
    seen = torch.bincount(new.flatten(), minlength=vocab_size)[:vocab_size].double()
    counts_old = torch.bincount(old.flatten(), minlength=vocab_size)[:vocab_size].double() + 1
    counts_new = seen + 1
    return (seen > 0) & (counts_new / counts_new.sum() > counts_old / counts_old.sum())


def _autocast(model: nn.Module, bf16: bool) -> contextlib.AbstractContextManager:
    device = next(model.parameters()).device
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


@torch.no_grad()
def perplexity(
    model: nn.Module,
    sequences: torch.Tensor,
    batch_size: int = 4,
    bf16: bool = False,
    new_tokens: torch.Tensor | None = None,
) -> PerplexityResult:
    """Token-weighted perplexity of ``model`` on ``sequences`` ([n, T] token ids, every position a real token).

    ``new_tokens``: a vocabulary mask (`new_domain_tokens`); the loss is then also split into the mass given to
    those tokens and the ranking among the others (``new_mass_nll``): ``-ln p(y) = -ln p(y | not new) - ln P(not
    new)`` for a token ``y`` outside the set.
    """
    if sequences.ndim != 2 or len(sequences) == 0:
        raise ValueError(f"sequences must be a non-empty [n, T] tensor, got shape {tuple(sequences.shape)}")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total_loss, total_tokens, share_sum, routed, mass_sum = 0.0, 0, 0.0, False, 0.0
    try:
        for start in range(0, len(sequences), batch_size):
            batch = sequences[start : start + batch_size].to(device)
            with _autocast(model, bf16):
                out = model(input_ids=batch, labels=batch)
            tokens = batch.numel() - len(batch)  # the model predicts T-1 tokens per sequence
            total_loss += float(out.loss) * tokens
            total_tokens += tokens
            if new_tokens is not None:
                logp = torch.log_softmax(out.logits[:, :-1].float(), dim=-1)
                mask = new_tokens.to(logp.device)[: logp.shape[-1]]
                on_new = torch.logsumexp(logp[..., : len(mask)][..., mask], dim=-1).exp().clamp(max=1 - 1e-7)
                mass_sum += float(-torch.log1p(-on_new).sum())
            share = out.get(ROUTE_SHARE_KEY) if hasattr(out, "get") else None
            if share is not None:
                share_sum += float(share) * tokens
                routed = True
    finally:
        model.train(was_training)
    loss = total_loss / total_tokens
    return PerplexityResult(
        perplexity=math.exp(min(loss, 700.0)),
        loss=loss,
        tokens=total_tokens,
        route_preserve_share=share_sum / total_tokens if routed else None,
        new_mass_nll=mass_sum / total_tokens if new_tokens is not None else None,
    )


@torch.no_grad()
def final_hidden_original(
    model: nn.Module, input_ids: torch.Tensor, original_width: int, bf16: bool = False
) -> torch.Tensor:
    """The original ``original_width`` features of the last decoder layer's output, [n, T, d], float32 on CPU.

    An upscaled model's hidden state is [original | new]; only the original part is comparable with
    the base model (paper Fig. 4a). Under SCALE-Route the stacked batch holds [preserve; adapt]
    paths; the adapt half is returned (the preserve half equals the base model by construction).
    """
    was_training = model.training
    model.eval()
    try:
        batch = input_ids.to(next(model.parameters()).device)
        with _autocast(model, bf16):
            hidden = model(input_ids=batch, output_hidden_states=True).hidden_states[-1]
    finally:
        model.train(was_training)
    if hidden.shape[0] == 2 * batch.shape[0]:
        hidden = hidden[batch.shape[0] :]
    return hidden[..., :original_width].float().cpu()


def mean_cosine_similarity(reference: torch.Tensor, current: torch.Tensor) -> float:
    """Mean over tokens of the cosine similarity of two [n, T, d] hidden-state tensors."""
    if reference.shape != current.shape:
        raise ValueError(f"hidden states differ in shape: {tuple(reference.shape)} vs {tuple(current.shape)}")
    return float(torch.nn.functional.cosine_similarity(reference, current, dim=-1).mean())
