"""LoRA (Hu et al. 2022) through the PEFT library: the parameter-efficient baseline of Section 5."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from scale_cl.methods.matching import match_lora_rank, scale_trainable_count
from scale_cl.tuner.config import ScaleConfig
from scale_cl.tuner.vocab import merge_vocab, new_token_ids


def prepare_lora(
    model: nn.Module,
    *,
    rank: int | str = 8,
    alpha: float | None = None,
    dropout: float = 0.0,
    target_modules: str | Sequence[str] = "all-linear",
    match: ScaleConfig | None = None,
) -> nn.Module:
    """Wrap ``model`` with PEFT LoRA adapters and return the ``PeftModel`` (only ``lora_A``/``lora_B`` train).

    Why: LoRA adds trainable low-rank updates next to frozen weights, the common PEFT answer to
    forgetting; the paper targets every attention and FFN matrix (PEFT's ``"all-linear"``, which
    leaves the LM head out).

    ``rank="match"`` picks the rank whose trainable count is closest to what the SCALE config
    ``match`` trains on this model (see `scale_cl.methods.matching.match_lora_rank`; an error when
    no rank is within 10%). ``alpha=None`` means ``2 * rank`` (a common choice that keeps the
    update scale ``alpha / rank = 2`` fixed across ranks; the paper does not state its alpha).
    PEFT initialises ``B = 0``, so the model computes the base model's logits until it trains.

    With an extended vocabulary (`scale_cl.tuner.vocab`) the new tokens' embedding rows (and an untied head's)
    train through PEFT's own trainable tokens (``trainable_token_indices``; PEFT ties a tied head), the
    original rows stay frozen, and PEFT saves the new rows with the adapter.
    """
    from peft import LoraConfig, get_peft_model

    if not isinstance(target_modules, str):
        names_ok = isinstance(target_modules, Sequence) and all(isinstance(t, str) for t in target_modules)
        if not names_ok or not target_modules:
            raise ValueError(
                f"lora: target_modules must be 'all-linear', a regex or a list of names, got {target_modules!r}"
            )
        target_modules = list(target_modules)
    if match is not None and not isinstance(match, ScaleConfig):
        raise ValueError(f"lora: match must be a ScaleConfig, got {type(match).__name__}")
    if rank == "match":
        if match is None:
            raise ValueError("lora: rank='match' needs match=ScaleConfig(...), the SCALE config to match")
        rank = match_lora_rank(model, scale_trainable_count(model, match), target_modules)
    elif match is not None:
        raise ValueError("lora: match= is only read with rank='match'")
    elif isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora: rank must be a positive int or 'match', got {rank!r}")
    if alpha is None:
        alpha = 2 * rank
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"lora: alpha must be a positive number or None (2 * rank), got {alpha!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"lora: dropout must be a number in [0, 1), got {dropout!r}")
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=float(dropout),
        target_modules=target_modules,
        bias="none",
        task_type="CAUSAL_LM",
        trainable_token_indices=_new_token_indices(model),
    )
    return get_peft_model(model, config)


def _new_token_indices(model: nn.Module) -> dict[str, list[int]] | None:
    """PEFT's ``trainable_token_indices`` of an extended vocabulary: embedding (and untied head) -> new ids."""
    ids = new_token_ids(model)
    if not ids:
        return None
    merge_vocab(model)  # PEFT wraps a plain nn.Embedding / nn.Linear of all rows
    names = {module: name for name, module in model.named_modules()}
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    indices = {names[embedding]: ids}
    if head is not None and head.weight is not embedding.weight:
        indices[names[head]] = ids
    return indices


def describe_lora(model: nn.Module, options: dict) -> str:
    """The bench's one-line description of the prepared model."""
    return f"rank {model.peft_config['default'].r}, all linears"
