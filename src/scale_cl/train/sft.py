"""Instruction tuning of an upscaled model with TRL: `ScaleSFTTrainer`, TRL's ``SFTTrainer`` with the model's own loss.

TRL's ``SFTTrainer`` (1.x) computes the loss with a fused LM head of its own: it multiplies the backbone's output by
``lm_head.weight`` and adds ``lm_head.bias``, without calling the head. An upscaled model's head is not that linear:
its ``weight`` is the frozen ``W_out`` alone, the backbone's output is ``[h; h_up]``, and the logits are
``Z + alpha Z_up`` (or a router's mixture of experts, which is no linear at all), so the stock ``SFTTrainer`` fails
on a SCALE model with a shape error. `ScaleSFTTrainer` keeps everything else of TRL (the chat template, the loss on
the completions or the assistant turns only, packing, its checkpoints) and computes the loss as the stock
``Trainer`` does, from the model's own forward: the head, the router and the gradient floor (no gradient for a
frozen weight) are SCALE's. TRL's token-accuracy and entropy metrics, computed from its fused head, are not logged.

Checkpoints are the stock ``Trainer``'s, holding SCALE's new weights only (`scale_cl.tuner.io`), so
``train(resume_from_checkpoint=...)`` resumes bitwise. A model that is not upscaled trains as with ``SFTTrainer``.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import Trainer
from trl import SFTTrainer


class ScaleSFTTrainer(SFTTrainer):
    """TRL's ``SFTTrainer``; for an upscaled model, the loss of the model's own forward (see the module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.upscaled = getattr(self.model, "is_scale_upscaled", False)
        if self.upscaled and "forward" in vars(self.model):
            del self.model.forward  # TRL's fused head, set on the instance: the class's own forward again

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        if not self.upscaled:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return Trainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
