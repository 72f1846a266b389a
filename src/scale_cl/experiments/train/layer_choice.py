"""SCALE-Adapt/Route's collaborative layers chosen from a forgetting budget (beyond the paper).

The paper picks L_fp (the first layer whose W12 trains) and the collaborative modules by hand. Here short
probe runs pick them: the run's method is trained for a few steps at its own rate from a few candidate
settings, and each probe measures how much the new domain's loss falls (learning, on training sequences the
probe did not train on) and how much the old domain's rises (forgetting, on the replay text, which no
evaluation set reads). The setting chosen is the one that learns most among those whose forgetting stays
within ``budget`` x their learning (both in nats per token): "if I need this much of the new domain, keep
as much of the old as a budget allows". Candidates: L_fp at ``PROBES`` evenly spaced layers and the top
layer alone (attention and FFN collaborative), then attention-only and FFN-only at the chosen L_fp.

A probe is short, so its numbers are small and early; they rank settings, they do not predict the run's
end. Every probe and the reason for the choice are written to ``<method>/layer_choice.json``, printed, and
kept in the method's ``result.json``; a re-run reuses the file (the probes are deterministic under the seed).
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Subset
from transformers import PreTrainedModel

from scale_cl.data.corpus import Corpus, PackedDataset
from scale_cl.data.replay import ReplayMix
from scale_cl.eval.perplexity import perplexity
from scale_cl.experiments.train.sections import RunSettings
from scale_cl.files import write_json
from scale_cl.train.recipe import train_model

PROBES = 5  # L_fp candidates besides the top layer
PROBE_SEQUENCES = 16  # sequences each of the old- and new-domain samples a probe is measured on
CHOICE_FILE = "layer_choice.json"
BOTH = ("attn", "ffn")


@dataclass(frozen=True)
class LayerProbe:
    """One probe: a setting and what a few steps from it did (losses in nats per token)."""

    preserve_layers: int
    collab_modules: tuple[str, ...]
    learning: float  # new-domain loss before minus after: positive = learnt
    forgetting: float  # old-domain loss after minus before: positive = forgot


def candidate_layers(num_layers: int, probes: int = PROBES) -> list[int]:
    """L_fp candidates: ``probes`` evenly spaced from 0 (every layer collaborative) and the top layer alone."""
    return sorted({i * num_layers // probes for i in range(probes)} | {num_layers - 1})


def choose(probes: list[LayerProbe], budget: float) -> tuple[LayerProbe, str]:
    """The probe that learns most with ``forgetting <= budget x learning``; ties go to fewer collaborative
    weights. With none within budget, the one that forgets least. Returns it and why, in words."""
    if not probes:
        raise ValueError("no probes to choose from")
    within = [p for p in probes if p.forgetting <= budget * max(p.learning, 0.0)]
    if within:
        best = max(within, key=lambda p: (p.learning, p.preserve_layers, -len(p.collab_modules)))
        return best, (
            f"learns most ({best.learning:.4f} nats/token) of the {len(within)} of {len(probes)} probes whose "
            f"old-domain loss rise is within {budget:g} x their learning (this one: {best.forgetting:.4f})"
        )
    best = min(probes, key=lambda p: (p.forgetting, -p.learning))
    return best, (
        f"none of the {len(probes)} probes keeps its old-domain loss rise within {budget:g} x its learning; "
        f"this one forgets least ({best.forgetting:.4f} nats/token for {best.learning:.4f} learnt)"
    )


def check_probe_data(cfg: RunSettings, corpus: Corpus) -> None:
    """Raise a ValueError unless the corpus can feed the probes (checked before any run is written; `validate`
    has refused data.streaming already)."""
    if corpus.replay is None:
        raise ValueError(
            "options.auto_layers measures forgetting on old-domain text no evaluation set reads: set "
            "--data.replay NAME=SOURCE (with --data.replay_ratio 0 it is only measured on, not trained on)"
        )
    if cfg.data.replay_ratio and len(corpus.replay) <= PROBE_SEQUENCES:
        raise ValueError(
            f"options.auto_layers with replay needs more than {PROBE_SEQUENCES} replay sequences (the first "
            f"{PROBE_SEQUENCES} measure forgetting, the rest are replayed); the corpus has {len(corpus.replay)}"
        )
    needed = cfg.options.auto_layers_steps * cfg.train.batch_size + PROBE_SEQUENCES
    if len(corpus.train) < needed:
        raise ValueError(
            f"options.auto_layers needs {needed} training sequences ({cfg.options.auto_layers_steps} probe steps of "
            f"{cfg.train.batch_size} and {PROBE_SEQUENCES} to measure learning on); the corpus has {len(corpus.train)}"
        )


def probe_training_data(cfg: RunSettings, corpus: Corpus) -> Subset:
    """The probe steps' sequences: the run's kind of batches (replay mixed in as the run mixes it), drawn from
    everything but the sequences the probes are measured on."""
    new = corpus.train.blocks[:-PROBE_SEQUENCES]
    if cfg.data.replay_ratio:
        mixed = ReplayMix(
            new, corpus.replay.blocks[PROBE_SEQUENCES:], cfg.data.replay_ratio, cfg.seed, cfg.train.batch_size
        )
    else:
        mixed = PackedDataset(new)
    steps = Subset(mixed, range(cfg.options.auto_layers_steps * cfg.train.batch_size))
    steps.in_order = getattr(mixed, "in_order", False)  # the first steps of the run's own order (replay's)
    return steps


def _loss(model: torch.nn.Module, blocks: torch.Tensor, cfg: RunSettings, bf16: bool) -> float:
    return perplexity(model, blocks, cfg.eval.batch_size, bf16).loss


def probe(
    cfg: RunSettings, base: PreTrainedModel, corpus: Corpus, method: str, setting: dict[str, Any], args: Any
) -> LayerProbe:
    """Train a copy of ``base`` prepared as ``method`` with ``setting`` for the probe steps; measure it."""
    from scale_cl.methods import prepare

    options = replace(cfg.options, scale=replace(cfg.options.scale, **setting))
    model = prepare(copy.deepcopy(base), method, **options.prepare_options(method, cfg.seed))
    model.to(args.device)  # measured before training where the Trainer then trains it (train.device)
    new, old = corpus.train.blocks[-PROBE_SEQUENCES:], corpus.replay.blocks[:PROBE_SEQUENCES]
    before = _loss(model, new, cfg, args.bf16), _loss(model, old, cfg, args.bf16)
    train_model(model, probe_training_data(cfg, corpus), args, lr_ratios=options.lr_ratios(method))
    after = _loss(model, new, cfg, args.bf16), _loss(model, old, cfg, args.bf16)
    return LayerProbe(
        preserve_layers=setting["preserve_layers"],
        collab_modules=tuple(setting["collab_modules"]),
        learning=before[0] - after[0],
        forgetting=after[1] - before[1],
    )


def choose_layers(
    cfg: RunSettings, base: PreTrainedModel, corpus: Corpus, method: str, method_dir: Path, args: Any
) -> dict[str, Any]:
    """Run (or reuse) the probes of ``method`` and return the choice record (``chosen``: the ScaleConfig fields)."""
    path = method_dir / CHOICE_FILE
    if path.is_file():
        return json.loads(path.read_text())
    check_probe_data(cfg, corpus)
    layers = base.config.num_hidden_layers
    budget = cfg.options.auto_layers_budget
    probes = []
    for index, layer in enumerate(candidate_layers(layers)):
        print(f"[cpt] {method}: probe {index + 1}: L_fp {layer} of {layers}, attn+ffn")
        probes.append(probe(cfg, base, corpus, method, {"preserve_layers": layer, "collab_modules": BOTH}, args))
    best, _ = choose(probes, budget)
    for modules in (("attn",), ("ffn",)):
        print(f"[cpt] {method}: probe: L_fp {best.preserve_layers}, {modules[0]} only")
        setting = {"preserve_layers": best.preserve_layers, "collab_modules": modules}
        probes.append(probe(cfg, base, corpus, method, setting, args))
    best, why = choose(probes, budget)
    record = {
        "budget": budget,
        "probe_steps": cfg.options.auto_layers_steps,
        "probes": [asdict(p) for p in probes],
        "chosen": {"preserve_layers": best.preserve_layers, "collab_modules": list(best.collab_modules)},
        "why": why,
    }
    write_json(path, record)
    return record


def describe(record: dict[str, Any]) -> str:
    """The probes as a small table and the choice, for the console."""
    lines = ["  L_fp  modules    learning  forgetting  (nats/token over the probe)"]
    for p in record["probes"]:
        modules = "+".join(p["collab_modules"])
        lines.append(f"  {p['preserve_layers']:>4}  {modules:<9} {p['learning']:>9.4f}  {p['forgetting']:>10.4f}")
    chosen = record["chosen"]
    lines.append(f"  chosen: L_fp {chosen['preserve_layers']}, {'+'.join(chosen['collab_modules'])}: {record['why']}")
    return "\n".join(lines)
