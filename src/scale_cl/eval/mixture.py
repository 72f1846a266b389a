"""The two-model control of the likelihood router: a trained model and its base, mixed per token by the posterior
SCALE-Route's likelihood router uses (`scale_cl.tuner.routing.likelihood.likelihood_mix`), in two forward passes.

``p = w p_base + (1 - w) p_trained``, ``w`` the posterior that the document so far is the base's. This is Bayesian
model averaging over the prefix, the mechanism of DEMix layers (Gururangan et al., 2021) and of mixing experts by a
domain posterior; it is not SCALE's. SCALE-Route read with the router computes the same mixture of its two paths in
one model and one pass; this control is what the router's reading of any other method (FFT, Freeze, LoRA, ...)
gives with its base beside it, at the cost of both models' forward passes (issue 40).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import ModelOutput

from scale_cl.tuner.routing.likelihood import RouterMemory, likelihood_mix

# A token of an extended vocabulary has no row in the base: the base gives it this logit below its least, a
# probability of about e^-10000 (finite, so that masked evidence stays a number: -inf x 0 would be NaN).
MISSING_ROW_LOGIT_GAP = 1e4


def _eos_ids(config: Any) -> tuple[int, ...]:
    eos = getattr(config, "eos_token_id", None)
    return tuple(eos if isinstance(eos, list | tuple) else [] if eos is None else [eos])


def _cache_argument(model: nn.Module) -> str:
    """The name a model's forward takes its KV cache by (transformers 5 renamed ``past_key_values`` to ``cache``)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _returned_cache(output: ModelOutput) -> Any:
    return output["cache"] if "cache" in output else output["past_key_values"]


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

    def _mix(
        self,
        base_logits: torch.Tensor,
        new_logits: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        memory: RouterMemory | None = None,
    ) -> tuple[torch.Tensor, RouterMemory]:
        missing = new_logits.shape[-1] - base_logits.shape[-1]
        if missing > 0:  # an extended vocabulary: rows the base lacks
            floor = base_logits.amin(dim=-1, keepdim=True) - MISSING_ROW_LOGIT_GAP
            base_logits = torch.cat((base_logits, floor.expand(*floor.shape[:-1], missing)), dim=-1)
        logits, self.last_base_weight, memory = likelihood_mix(
            base_logits,
            new_logits,
            input_ids,
            prior=self.prior,
            decay=self.decay,
            eos_ids=self.eos_ids,
            attention_mask=attention_mask,
            memory=memory,
        )
        return logits, memory

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        position_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        base_logits = self.base(**inputs).logits
        out = self.trained(**inputs, output_hidden_states=output_hidden_states)
        logits, _ = self._mix(base_logits, out.logits, input_ids, attention_mask)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=out.hidden_states)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 20,
        min_new_tokens: int = 0,
        do_sample: bool = False,
        pad_token_id: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Greedy decoding of the mixture, each model with its own KV cache and the router's memory carried from
        step to step (as SCALE-Route's ``generate()``); the prompt and the new tokens. A prompt may be left-padded
        (``attention_mask``). It stops after ``max_new_tokens``, or once every row has produced an EOS token and
        ``min_new_tokens`` are out; a finished row continues with ``pad_token_id`` (its EOS without one)."""
        if do_sample:
            raise ValueError("the two-model control generates greedily only: call it with do_sample=False")
        if kwargs:
            raise ValueError(f"the two-model control's generate() takes no {sorted(kwargs)}")
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        out, step_ids, memory, caches = input_ids, input_ids, None, (None, None)
        finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for step in range(max_new_tokens):
            positions = (mask.long().cumsum(-1) - 1).clamp_min(0)[:, -step_ids.shape[1] :]
            inputs = {"input_ids": step_ids, "attention_mask": mask, "position_ids": positions, "use_cache": True}
            base = self.base(**inputs, **{_cache_argument(self.base): caches[0]})
            trained = self.trained(**inputs, **{_cache_argument(self.trained): caches[1]})
            caches = (_returned_cache(base), _returned_cache(trained))
            step_mask = mask[:, -step_ids.shape[1] :]
            logits, memory = self._mix(base.logits, trained.logits, step_ids, step_mask, memory)
            token = logits[:, -1].argmax(-1)
            if finished.any():
                token = token.masked_fill(finished, self.eos_ids[0] if pad_token_id is None else pad_token_id)
            finished |= torch.isin(token, torch.tensor(self.eos_ids, dtype=token.dtype, device=token.device))
            out, step_ids = torch.cat((out, token[:, None]), 1), token[:, None]
            mask = torch.cat((mask, mask.new_ones(mask.shape[0], 1)), 1)
            if self.eos_ids and finished.all() and step + 1 >= min_new_tokens:
                break
        return out


__all__ = ["TwoModelMixture"]
