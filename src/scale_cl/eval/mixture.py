"""The two-model control of the likelihood router: a trained model and its base, mixed per token by the posterior
SCALE-Route's likelihood router uses (`scale_cl.tuner.routing.likelihood.likelihood_mix`), in two forward passes.

``p = w p_base + (1 - w) p_trained``, ``w`` the posterior that the document so far is the base's. This is Bayesian
model averaging over the prefix, the mechanism of DEMix layers (Gururangan et al., 2021) and of mixing experts by a
domain posterior; it is not SCALE's. SCALE-Route read with the router computes the same mixture of its two paths in
one model and one pass; this control is what the router's reading of any other method (FFT, Freeze, LoRA, ...)
gives with its base beside it, at the cost of both models' forward passes (issue 40).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from scale_cl.tuner.routing.likelihood import likelihood_mix

# A token of an extended vocabulary has no row in the base: the base gives it this logit below its least, a
# probability of about e^-10000 (finite, so that masked evidence stays a number: -inf x 0 would be NaN).
MISSING_ROW_LOGIT_GAP = 1e4


def _eos_ids(config: Any) -> tuple[int, ...]:
    eos = getattr(config, "eos_token_id", None)
    return tuple(eos if isinstance(eos, list | tuple) else [] if eos is None else [eos])


class TwoModelMixture(nn.Module):
    """``trained`` and ``base`` read together by the likelihood router (module doc); ``prior`` and ``decay`` as in
    `ScaleConfig.router_prior` / ``router_decay``. Called as a causal LM (``input_ids``, ``attention_mask``,
    ``labels``, ``output_hidden_states``: the trained model's); its logits are the mixture's log-probabilities.
    A document starts at each of the trained model's EOS tokens (its config's ``eos_token_id``)."""

    def __init__(self, trained: nn.Module, base: nn.Module, prior: float = 0.0, decay: float = 0.95) -> None:
        super().__init__()
        self.trained, self.base, self.prior, self.decay = trained, base, prior, decay
        self.eos_ids = _eos_ids(getattr(trained, "config", None))
        self.last_base_weight: torch.Tensor | None = None  # w per position of the last call

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        base_logits = self.base(**inputs).logits
        out = self.trained(**inputs, output_hidden_states=output_hidden_states)
        new_logits = out.logits
        missing = new_logits.shape[-1] - base_logits.shape[-1]
        if missing > 0:  # an extended vocabulary: rows the base lacks
            floor = base_logits.amin(dim=-1, keepdim=True) - MISSING_ROW_LOGIT_GAP
            base_logits = torch.cat((base_logits, floor.expand(*floor.shape[:-1], missing)), dim=-1)
        logits, weight, _ = likelihood_mix(
            base_logits,
            new_logits,
            input_ids,
            prior=self.prior,
            decay=self.decay,
            eos_ids=self.eos_ids,
            attention_mask=attention_mask,
        )
        self.last_base_weight = weight
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=out.hidden_states)


__all__ = ["TwoModelMixture"]
