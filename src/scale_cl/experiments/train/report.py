"""What a `scale-cl train` run leaves for people: the model card of its model and its learning-and-forgetting figure.

Everything stated comes from the run's settings and its own files (``result.json``, ``metrics.jsonl``,
``train_log.jsonl``); what is not known is left out.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from scale_cl.data.corpus import CorpusStats, eval_sets
from scale_cl.experiments.train.config import TRAINED, TrainConfig
from scale_cl.methods import method_spec
from scale_cl.train.arguments import resolved_optimizer

PAPER = "https://arxiv.org/abs/2511.03270"


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _hub_id(name: str) -> str | None:
    """``name`` when it reads as a hub id (``org/model``), not a local path."""
    if Path(name).expanduser().exists() or name.startswith(("/", ".", "~")) or name.count("/") != 1:
        return None
    return name


def _perplexities(record: dict[str, Any]) -> str:
    parts = []
    if "learning_ppl" in record:
        parts.append(f"held-out new-domain {record['learning_ppl']:.4g}")
    parts += [f"{name} {value:.4g}" for name, value in record.get("forgetting_ppl", {}).items()]
    return ", ".join(parts) or "none measured"


def model_card(cfg: TrainConfig, summary: dict[str, Any], stats: dict[str, CorpusStats], command: str = "") -> str:
    """The README.md of the run's model folder: what it is, how to load it, what it was trained on and how."""
    spec = method_spec(cfg.method)
    t, d = cfg.train, cfg.data
    steps = summary["steps"]
    tokens = steps * t.batch_size * d.seq_len
    reading = cfg.read_with
    hub = _hub_id(cfg.model)
    front = ["---", "library_name: scale-cl", "tags:", "- scale-cl", "- continual-pretraining", f"- {cfg.method}"]
    if hub:
        front.append(f"base_model: {hub}")
    front.append("---")
    read = "" if reading == TRAINED else f", read with the {reading} router"
    lines = [
        *front,
        "",
        f"# {spec.title}{read}: {cfg.model}, continually pre-trained",
        "",
        f"Trained with scale-cl's `scale-cl train` ([SCALE]({PAPER}): width-upscaled continual "
        "learning). This folder holds what the method trained, in its own format; the base model is loaded from "
        "where the run found it.",
        "",
        "```python",
        "from scale_cl.models import load_trained",
        'model, tokenizer, method = load_trained("path/to/model")',
        "```",
        "",
        "`scale-cl eval path/to/model` runs lm-eval on it; `scale-cl export path/to/model --out DIR` writes a folder "
        "that loads with transformers alone.",
        "",
        "## Method",
        "",
        f"- method: {spec.title} (`{cfg.method}`){read}",
        f"- trainable parameters: {summary['trainable']:,}",
    ]
    if spec.is_scale:
        s = cfg.options.scale
        lines.append(
            f"- widths added: hidden {s.hidden_up}, FFN {s.ffn_up}; collaborative layers from {s.preserve_layers}"
        )
    lines += ["", "## Data", ""]
    weights = dict(zip(d.train, d.weights, strict=True)) if d.weights else {}
    for source in d.train:
        lines.append(f"- new domain: `{source}`" + (f" (weight {weights[source]:g})" if weights else ""))
    if d.heldout_fraction:
        lines.append(f"- held out: {d.heldout_fraction:g} of the new-domain documents (by a hash of their text)")
    for name, source in eval_sets(d.old_eval).items():
        lines.append(f"- old-domain evaluation set `{name}`: `{source}`")
    if d.replay_ratio:
        lines.append(f"- replay: {d.replay_ratio:g} of the sequences from {', '.join(f'`{s}`' for s in d.replay)}")
    train_stats = stats.get("train")
    if train_stats is not None and not train_stats.streamed:
        lines.append(
            f"- training split: {train_stats.documents:,} documents, {train_stats.tokens:,} tokens, "
            f"{train_stats.sequences:,} blocks of {d.seq_len} tokens"
        )
    elif train_stats is not None:
        lines.append("- training split: streamed")
    lines += [
        "",
        "## Training",
        "",
        f"- tokens trained: {tokens:,} ({steps:,} steps of {t.batch_size} sequences of {d.seq_len} tokens)",
        f"- learning rate: {summary['lr']:g}, schedule {t.schedule} after "
        f"{max(t.warmup_steps, math.ceil(t.warmup_ratio * steps))} warm-up steps, weight decay {t.weight_decay:g}",
        f"- optimizer: {resolved_optimizer(t)}, gradient clipping {t.max_grad_norm:g}",
        f"- device: {summary.get('device', '?')}, precision {summary.get('precision', '?')}, "
        f"{summary.get('seconds', 0) / 60:,.1f} min of training in its last session",
        f"- seed: {cfg.seed}",
    ]
    curve = summary.get("curve") or []
    if curve:
        first, last = curve[0], curve[-1]
        lines += [
            "",
            "## Measured (perplexity; lower is better)",
            "",
            f"- at step 0 (the base model): {_perplexities(first)}",
            f"- at step {last['step']}: {_perplexities(last)}",
        ]
    if command:
        lines += ["", "## Command", "", "```bash", command, "```"]
    return "\n".join(lines) + "\n"


def curves_figure(run: Path, path: Path) -> Path | None:
    """Learning (held-out new-domain perplexity), forgetting (each old-domain set's) and the training loss against the
    tokens trained, from the run's ``metrics.jsonl`` and ``train_log.jsonl``; None when there is nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads((run / "result.json").read_text()) if (run / "result.json").is_file() else {}
    metrics = _records(run / "metrics.jsonl")
    losses = [r for r in _records(run / "train_log.jsonl") if "loss" in r]
    if not metrics and not losses:
        return None
    tokens_per_step = (losses[0]["tokens"] / losses[0]["step"]) if losses and losses[0]["step"] else 1
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] * tokens_per_step for r in metrics]
    if any("learning_ppl" in r for r in metrics):
        left.plot(steps, [r.get("learning_ppl", math.nan) for r in metrics], marker="o", label="held-out new domain")
    names = sorted({name for r in metrics for name in r.get("forgetting_ppl", {})})
    for name in names:
        values = [r.get("forgetting_ppl", {}).get(name, math.nan) for r in metrics]
        left.plot(steps, values, marker="s", label=f"old domain: {name}")
    left.set(xlabel="tokens trained", ylabel="perplexity", yscale="log", title="learning and forgetting")
    if metrics:
        left.legend()
    few = "o" if len(losses) == 1 else None  # a line of one point draws nothing
    right.plot([r["tokens"] for r in losses], [r["loss"] for r in losses], color="tab:gray", marker=few)
    right.set(xlabel="tokens trained", ylabel="training loss", title="training loss")
    reading = result.get("reading")
    figure.suptitle(
        f"{result.get('method', '')}" + (f", read with {reading}" if reading not in (None, TRAINED) else "")
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
