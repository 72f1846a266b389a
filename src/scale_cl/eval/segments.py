"""Mixed documents: a passage of one domain inside a document of the other, at a known position, and
the loss read per segment. A router that decides from the document so far sees the host first: whether it turns to
the passage's model when the passage starts, and back when the host resumes, shows in the passage's loss and in the
host's loss after it, which a per-document perplexity averages away.

A mixed sequence is ``host[:before] + guest[:passage] + host[before:]`` cut to the evaluation length, built from the
token ids of the packed evaluation blocks with their EOS tokens dropped (an EOS resets the routers: the sequence is
one document). Cuts fall on token boundaries, not sentence ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from scale_cl.eval.route_separation import base_weight_of, mixes_experts

SEGMENTS = ("before", "passage", "after")  # the host before the passage, the passage, the host after it


@dataclass
class MixedSet:
    """Mixed sequences ([n, T] token ids) and each position's segment ([n, T], an index into `SEGMENTS`)."""

    input_ids: torch.Tensor
    segment: torch.Tensor


def mixed_documents(host: torch.Tensor, guest: torch.Tensor, eos_ids: tuple[int, ...], count: int) -> MixedSet:
    """``count`` sequences as long as ``host``'s blocks ([n, T]): a quarter of each is a run of ``guest``'s tokens,
    placed after the host's first three eighths (module doc). Host and guest blocks are taken in turn; ``count`` is
    cut to the blocks at hand."""
    length = host.shape[1]
    passage = length // 4
    before = (length - passage) // 2
    if before < 1 or passage < 1:
        raise ValueError(f"mixed documents need sequences of at least 4 tokens, got {length}")
    drop = torch.tensor(eos_ids, dtype=host.dtype)

    def without_eos(block: torch.Tensor) -> torch.Tensor:
        return block[~torch.isin(block, drop)]

    rows, segments = [], []
    for index in range(min(count, len(host), len(guest))):
        h, g = without_eos(host[index]), without_eos(guest[index])
        if len(h) < length - passage or len(g) < passage:
            continue  # a block mostly EOS tokens (short documents): too little text for the layout
        rows.append(torch.cat((h[:before], g[:passage], h[before : length - passage])))
        segments.append(torch.tensor([0] * before + [1] * passage + [2] * (length - passage - before)))
    if not rows:
        raise ValueError("no block holds enough text for a mixed document: raise data.seq_len or use longer documents")
    return MixedSet(torch.stack(rows), torch.stack(segments))


@torch.no_grad()
def segment_readings(model: nn.Module, mixed: MixedSet, batch_size: int = 4) -> dict[str, dict[str, float]]:
    """``{"perplexity": {segment: ...}}`` over the tokens each segment's positions predict (the first token of a
    segment is predicted from the one before it, in the other segment), and with a router, ``{"base_weight":
    {segment: mean}}``: the base's weight where those tokens are predicted."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    count = len(SEGMENTS)
    nll, tokens, weight = torch.zeros(count, dtype=torch.float64), torch.zeros(count), torch.zeros(count)
    routed = mixes_experts(model)
    try:
        for start in range(0, len(mixed.input_ids), batch_size):
            ids = mixed.input_ids[start : start + batch_size].to(device)
            which = mixed.segment[start : start + batch_size, 1:].flatten()
            logits = model(input_ids=ids).logits
            losses = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none")
            nll.index_add_(0, which, losses.double().cpu())
            tokens.index_add_(0, which, torch.ones_like(which, dtype=torch.float))
            if routed:
                weight.index_add_(0, which, base_weight_of(model)[:, :-1].flatten().float().cpu())
    finally:
        model.train(was_training)
    readings = {"perplexity": {n: math.exp(min(float(nll[i] / tokens[i]), 700.0)) for i, n in enumerate(SEGMENTS)}}
    if routed:
        readings["base_weight"] = {name: float(weight[i] / tokens[i]) for i, name in enumerate(SEGMENTS)}
    return readings
