"""The control of the likelihood routers: separate models (a base and what was trained from it), mixed per token by
the posterior over which model the document so far is from, in one forward pass each.

``p = sum_j w_j p_j``, ``w`` the posterior that the document so far is model j's (`scale_cl.tuner.routing.posterior.
posterior_mix`; with two models, the base and a trained one, the likelihood router's ``w p_base + (1 - w) p_trained``).
This is Bayesian model averaging over the prefix, the mechanism of DEMix layers (Gururangan et al., 2021) and of
mixing experts by a domain posterior; it is not SCALE's. SCALE-Route and SCALE-Preserve read with the likelihood
router compute the same mixture of their base logits and their own in one model and one pass, a grown
SCALE-Preserve model with the nested router that of the base and each stage's model; this control is what the
routers' reading of any other method (FFT, Freeze, LoRA, ...) gives with its base (and its earlier models) beside
it, at the cost of every model's forward pass. The confidence and hybrid routers weigh the
same experts by each one's confidence at the position too (`scale_cl.tuner.routing.confidence`), the calibrated router
by a fitted gate over both (`scale_cl.tuner.routing.calibrated`): each mixes as its declaration says
(`MixtureRouter.mixture`), as in the one-pass model.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import ModelOutput

from scale_cl.tuner.config import ScaleConfig
from scale_cl.tuner.routing import router_named
from scale_cl.tuner.routing.posterior import Evidence, ExpertMemory, expert_evidence, posterior_mix, with_missing_rows

# The routers a mixture of separate models is read by: those of `scale_cl.tuner.routing` that mix whole models, the
# ones read with their settings as given, and the calibrated router, whose gate is fitted to the model.
FIXED_MIXTURE_ROUTERS = ("likelihood", "confidence", "hybrid")
MIXTURE_ROUTERS = (*FIXED_MIXTURE_ROUTERS, "calibrated")
# The calibrated router's gate weights and their unfitted defaults (ScaleConfig's router_<name> fields).
GATE_DEFAULTS = {
    name: ScaleConfig.__dataclass_fields__[f"router_{name}"].default
    for name in ("prefix_weight", "entropy_weight", "top_weight")
}


def _eos_ids(config: Any) -> tuple[int, ...]:
    eos = getattr(config, "eos_token_id", None)
    return tuple(eos if isinstance(eos, list | tuple) else [] if eos is None else [eos])


def _cache_argument(model: nn.Module) -> str:
    """The name a model's forward takes its KV cache by (transformers 5 renamed ``past_key_values`` to ``cache``)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _returned_cache(output: ModelOutput) -> Any:
    return output["cache"] if "cache" in output else output["past_key_values"]


class ModelMixture(nn.Module):
    """``experts`` (the base first, then each model trained from it, the last the newest) read together by the
    likelihood routers' posterior (module doc), or by the confidence routers' (``router`` ``"confidence"`` or
    ``"hybrid"``, `scale_cl.tuner.routing.confidence`), or the calibrated router's gate; ``prior`` (the base's prior
    log-odds), ``decay``, ``confidence``, ``temperature`` and ``gate`` (the calibrated router's ``prefix_weight``,
    ``entropy_weight``, ``top_weight``) as in `ScaleConfig.router_prior` / ``router_decay`` / ``router_confidence`` /
    ``router_temperature`` / ``router_*_weight`` (`mixture_read_as` takes them from one). Called as a causal LM
    (``input_ids``, ``attention_mask``, ``labels``, ``output_hidden_states``: the newest model's); its logits are
    the mixture's log-probabilities. A document starts at each of the newest model's EOS tokens (its config's
    ``eos_token_id``)."""

    def __init__(
        self,
        experts: Sequence[nn.Module],
        prior: float = 0.0,
        decay: float = 0.95,
        router: str = "likelihood",
        confidence: str = "entropy",
        temperature: float = 1 / 3,
        gate: dict[str, float] | None = None,
    ) -> None:
        super().__init__()
        if len(experts) < 2:
            raise ValueError(f"a mixture needs the base and at least one trained model, got {len(experts)} model(s)")
        if router not in MIXTURE_ROUTERS:
            raise ValueError(f"a mixture of models is read by one of {MIXTURE_ROUTERS}, got {router!r}")
        unknown = sorted(set(gate or {}) - set(GATE_DEFAULTS))
        if unknown:
            raise ValueError(f"a mixture's gate has the weights {tuple(GATE_DEFAULTS)}, got {unknown}")
        self.experts = nn.ModuleList(experts)
        self.prior, self.decay = prior, decay
        self.router, self.confidence, self.temperature = router, confidence, temperature
        self.gate = {**GATE_DEFAULTS, **(gate or {})}
        self.eos_ids = _eos_ids(getattr(experts[-1], "config", None))
        self.last_weights: torch.Tensor | None = None  # every expert's weight per position of the last call (E, B, T)
        self.evidence: list[Evidence] | None = None  # a list: each call's `Evidence` appended (the gate's fit)

    @property
    def last_base_weight(self) -> torch.Tensor | None:
        """The base's weight ``w_0`` per position of the last call."""
        return None if self.last_weights is None else self.last_weights[0]

    def _mix(
        self,
        expert_logits: list[torch.Tensor],
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        memory: ExpertMemory | None = None,
    ) -> tuple[torch.Tensor, ExpertMemory]:
        vocab = max(z.shape[-1] for z in expert_logits)
        if self.evidence is not None:
            full = [with_missing_rows(z, vocab) for z in expert_logits]
            self.evidence.append(expert_evidence(full, input_ids, attention_mask))
        settings = {
            "router_prior": self.prior,
            "router_decay": self.decay,
            "router_confidence": self.confidence,
            "router_temperature": self.temperature,
            **{f"router_{name}": value for name, value in self.gate.items()},
        }
        mixture = router_named(self.router).mixture(settings.__getitem__)  # what it reads: its declaration
        logits, self.last_weights, memory = posterior_mix(
            [with_missing_rows(z, vocab) for z in expert_logits],  # an extended vocabulary: rows a model lacks
            input_ids,
            eos_ids=self.eos_ids,
            attention_mask=attention_mask,
            memory=memory,
            **mixture,
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
        *earlier, newest = self.experts
        logits = [model(**inputs).logits for model in earlier]
        out = newest(**inputs, output_hidden_states=output_hidden_states)
        mixed, _ = self._mix([*logits, out.logits], input_ids, attention_mask)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                mixed[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(mixed.device), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=mixed, hidden_states=out.hidden_states)

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
        step to step (as a routed SCALE model's ``generate()``); the prompt and the new tokens. A prompt may be
        left-padded (``attention_mask``). It stops after ``max_new_tokens``, or once every row has produced an EOS
        token and ``min_new_tokens`` are out; a finished row continues with ``pad_token_id`` (its EOS without one)."""
        if do_sample:
            raise ValueError("the mixture generates greedily only: call it with do_sample=False")
        if kwargs:
            raise ValueError(f"the mixture's generate() takes no {sorted(kwargs)}")
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        out, step_ids, memory, caches = input_ids, input_ids, None, [None] * len(self.experts)
        finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for step in range(max_new_tokens):
            positions = (mask.long().cumsum(-1) - 1).clamp_min(0)[:, -step_ids.shape[1] :]
            inputs = {"input_ids": step_ids, "attention_mask": mask, "position_ids": positions, "use_cache": True}
            outputs = [
                model(**inputs, **{_cache_argument(model): cache})
                for model, cache in zip(self.experts, caches, strict=True)
            ]
            caches = [_returned_cache(output) for output in outputs]
            step_mask = mask[:, -step_ids.shape[1] :]
            logits, memory = self._mix([output.logits for output in outputs], step_ids, step_mask, memory)
            token = logits[:, -1].argmax(-1)
            if finished.any():
                token = token.masked_fill(finished, self.eos_ids[0] if pad_token_id is None else pad_token_id)
            finished |= torch.isin(token, torch.tensor(self.eos_ids, dtype=token.dtype, device=token.device))
            out, step_ids = torch.cat((out, token[:, None]), 1), token[:, None]
            mask = torch.cat((mask, mask.new_ones(mask.shape[0], 1)), 1)
            if self.eos_ids and finished.all() and step + 1 >= min_new_tokens:
                break
        return out


def mixture_read_as(experts: Sequence[nn.Module], router: str, settings: Any) -> ModelMixture:
    """`ModelMixture` of ``experts`` read by ``router`` with the router settings of ``settings`` (a `ScaleConfig`)."""
    return ModelMixture(
        experts,
        settings.router_prior,
        settings.router_decay,
        router=router,
        confidence=settings.router_confidence,
        temperature=settings.router_temperature,
        gate={name: getattr(settings, f"router_{name}") for name in GATE_DEFAULTS},
    )


__all__ = ["FIXED_MIXTURE_ROUTERS", "MIXTURE_ROUTERS", "ModelMixture", "mixture_read_as"]
