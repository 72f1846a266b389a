"""Parameter matching: give a baseline the trainable-parameter budget of a SCALE configuration.

The paper compares methods at (about) the same number of trainable parameters: LLaMA Pro 16 -> 20
layers and LoRA rank 256 for its Llama-3.2-1B SCALE setting (Section 5.1). Everything here is
computed from the base model's shapes, without building the upscaled, LoRA or expanded model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn
from transformers.pytorch_utils import Conv1D

from scale_cl.tuner.arch import spec_for
from scale_cl.tuner.config import ScaleConfig
from scale_cl.tuner.vocab import vocab_rows
from scale_cl.tuner.widths import base_dims, growth, resolve

# A matched LoRA rank must train within this share of the SCALE count.
MATCH_TOLERANCE = 0.10


def _unique_numel(params: Iterable[nn.Parameter]) -> int:
    return sum(p.numel() for p in {id(p): p for p in params}.values())


def scale_trainable_count(model: nn.Module, cfg: ScaleConfig) -> int:
    """How many parameters ``upscale(model, cfg)`` would train, computed from ``model``'s shapes.

    Per widened linear ``W`` (``out x in``, growing by ``in_up``/``out_up``): ``W21`` (``out_up x in``),
    ``W22`` (``out_up x in_up``), ``bias_up`` (``out_up``) when ``W`` has a bias, and ``W12``
    (``out x in_up``) only for adapt/route in collaborative linears (layer ``>= preserve_layers`` and
    module in ``collab_modules``). Per norm: the new gain over ``u`` (and a bias for LayerNorm).
    Embedding and LM head: ``V x u`` each, ``V`` counting an extended vocabulary's new rows
    (`scale_cl.tuner.vocab`), whose own rows (``weight_new``) are not counted: every method trains them
    alike. Raises the same errors as `upscale` for a config that does not fit the model.
    """
    spec = spec_for(model)
    dims = base_dims(model.config, spec)
    cfg = resolve(cfg, dims)
    u = cfg.hidden_up
    grow = growth(cfg, dims)
    norm_params = u if spec.norm_kind == "rms" else 2 * u

    head = model.get_output_embeddings()
    total = vocab_rows(model) * u
    total += getattr(head, "out_features", head.weight.shape[0]) * u
    total += norm_params  # the final norm
    for index, layer in enumerate(getattr(model, spec.backbone).layers):
        total += norm_params * len(spec.layer_norms)
        for lin in spec.linears:
            base = layer.get_submodule(lin.path)
            out_features, in_features = base.out_features, base.in_features  # a quantized weight is packed
            in_up, out_up = grow[lin.grow_in], grow[lin.grow_out]
            total += out_up * in_features + out_up * in_up
            if base.bias is not None:
                total += out_up
            collaborative = index >= cfg.preserve_layers and lin.module in cfg.collab_modules
            if cfg.method != "preserve" and collaborative:
                total += out_features * in_up
    return total


def lora_target_modules(model: nn.Module, target_modules: str | Sequence[str] = "all-linear") -> list[str]:
    """Names of the modules PEFT's LoRA would wrap for ``target_modules`` (PEFT's own matching rules).

    ``"all-linear"`` is PEFT's shorthand: every ``nn.Linear`` (and transformers ``Conv1D``) except the
    LM head. Any other value goes through `peft.tuners.tuners_utils.check_target_module_exists`.
    """
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    if isinstance(target_modules, str) and target_modules.lower() == "all-linear":
        head = model.get_output_embeddings()
        return [
            name
            for name, module in model.named_modules()
            if isinstance(module, (nn.Linear, Conv1D)) and module is not head
        ]
    config = LoraConfig(target_modules=target_modules)
    return [name for name, _ in model.named_modules() if name and check_target_module_exists(config, name)]


def lora_trainable_count(model: nn.Module, rank: int, target_modules: str | Sequence[str] = "all-linear") -> int:
    """Parameters LoRA of ``rank`` trains: ``rank * (in + out)`` per targeted linear (A and B).

    An embedding target trains ``rank * (num_embeddings + dim)``; other module types are an error.
    """
    total = 0
    for name in lora_target_modules(model, target_modules):
        module = model.get_submodule(name)
        if isinstance(module, nn.Linear):
            total += rank * (module.in_features + module.out_features)
        elif isinstance(module, Conv1D):
            total += rank * sum(module.weight.shape)
        elif isinstance(module, nn.Embedding):
            total += rank * (module.num_embeddings + module.embedding_dim)
        else:
            raise ValueError(
                f"cannot count LoRA parameters of {name} ({type(module).__name__}): not a Linear/Embedding"
            )
    return total


def match_lora_rank(model: nn.Module, target: int, target_modules: str | Sequence[str] = "all-linear") -> int:
    """The rank whose LoRA trains the count closest to ``target`` (ties: the smaller rank).

    Raises a ValueError when even that rank misses ``target`` by more than `MATCH_TOLERANCE`
    (small targets fall between two ranks: rank r and r + 1 differ by a whole ``sum(in + out)``).
    """
    per_rank = lora_trainable_count(model, 1, target_modules)
    if per_rank == 0:
        raise ValueError(f"LoRA target_modules={target_modules!r} matches no module of this model")
    low = max(1, target // per_rank)
    rank = min((low, low + 1), key=lambda r: (abs(r * per_rank - target), r))
    count = rank * per_rank
    if abs(count - target) > MATCH_TOLERANCE * target:
        raise ValueError(
            f"no LoRA rank trains within {MATCH_TOLERANCE:.0%} of {target:,} parameters: each rank adds "
            f"{per_rank:,} (rank {low} -> {low * per_rank:,}, rank {low + 1} -> {(low + 1) * per_rank:,}); "
            "pass an explicit rank or change target_modules"
        )
    return rank


def llama_pro_valid_blocks(num_layers: int) -> list[int]:
    """The numbers of blocks LLaMA Pro can insert into ``num_layers`` layers: the divisors of it."""
    return [n for n in range(1, num_layers + 1) if num_layers % n == 0]


def llama_pro_sources(num_layers: int, blocks: int) -> list[int]:
    """Indices of the original layers that are copied: the last of every group of ``L / N`` layers."""
    step = num_layers // blocks
    return [index for index in range(num_layers) if (index + 1) % step == 0]


def llama_pro_trainable_count(model: nn.Module, blocks: int) -> int:
    """Parameters LLaMA Pro with ``blocks`` new blocks trains: the copied blocks' sizes."""
    layers = getattr(model, spec_for(model).backbone).layers
    if blocks not in llama_pro_valid_blocks(len(layers)):
        raise ValueError(f"blocks={blocks} must divide {len(layers)}: one of {llama_pro_valid_blocks(len(layers))}")
    return sum(_unique_numel(layers[i].parameters()) for i in llama_pro_sources(len(layers), blocks))


def match_llama_pro_blocks(model: nn.Module, target: int) -> int:
    """The valid number of new blocks whose trainable count is closest to ``target`` (ties: fewer blocks)."""
    layers = getattr(model, spec_for(model).backbone).layers
    valid = llama_pro_valid_blocks(len(layers))
    return min(valid, key=lambda n: (abs(llama_pro_trainable_count(model, n) - target), n))


def trainable_parameter_count(model: nn.Module) -> int:
    """Trainable parameters, each counted once (a tied embedding/LM head weight too)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


__all__ = [
    "MATCH_TOLERANCE",
    "llama_pro_sources",
    "llama_pro_trainable_count",
    "llama_pro_valid_blocks",
    "lora_target_modules",
    "lora_trainable_count",
    "match_llama_pro_blocks",
    "match_lora_rank",
    "scale_trainable_count",
    "trainable_parameter_count",
]
