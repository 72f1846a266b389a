"""Tables and figures of a continual pre-training run (paper Fig. 4 and Fig. 9, Table 2's perplexity side)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scale_cl.experiments.cpt.config import CptConfig
from scale_cl.experiments.train.method import RESULT_FILE
from scale_cl.files import atomic_write, write_json, write_text


def result_path(out: Path, method: str) -> Path:
    """Where a run into ``out`` writes ``method``'s summary (its presence means "finished")."""
    return Path(out) / method / RESULT_FILE


def collect(cfg: CptConfig, out: Path) -> dict[str, Any]:
    """Every finished method's summary (methods not finished are left out)."""
    methods = {}
    for method in cfg.methods:
        path = result_path(out, method)
        if path.is_file():
            methods[method] = json.loads(path.read_text())
    return {"config": cfg.to_dict(), "methods": methods}


def _series(curve: list[dict], key: str, sub: str | None = None) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for record in curve:
        value = record.get(key)
        if sub is not None:
            value = value.get(sub) if isinstance(value, dict) else None
        if value is not None:
            steps.append(record["step"])
            values.append(value)
    return steps, values


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _throughput(curve: list[dict]) -> float | None:
    rates = [r["train_tokens_per_s"] for r in curve if "train_tokens_per_s" in r]
    return sum(rates) / len(rates) if rates else None


def results_markdown(results: dict[str, Any]) -> str:
    """One row per method: learning and forgetting perplexity at step 0 and at the end, drift, routing, cost."""
    methods = results["methods"]
    old_sets = sorted({name for r in methods.values() for c in r["curve"] for name in c.get("forgetting_ppl", {})})
    header = ["method", "lr", "trainable", "learning ppl (0 → end)"]
    header += [f"forgetting ppl {name} (0 → end)" for name in old_sets]
    header += ["repr. similarity (end)", "routed to preserve (end)", "train tokens/s", "minutes"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method, r in methods.items():
        first, last = r["curve"][0], r["curve"][-1]
        row = [method, f"{r['lr']:g}", f"{r['trainable']:,}"]
        row.append(f"{_fmt(first.get('learning_ppl'))} → {_fmt(last.get('learning_ppl'))}")
        for name in old_sets:
            row.append(f"{_fmt(first['forgetting_ppl'].get(name))} → {_fmt(last['forgetting_ppl'].get(name))}")
        row.append(f"{last['representation_similarity']:.4f}")
        shares = last.get("route_preserve_share")
        row.append(", ".join(f"{k} {v:.0%}" for k, v in shares.items()) if shares else "—")
        rate = _throughput(r["curve"])
        row.append("—" if rate is None else f"{rate:,.0f}")
        row.append(f"{r['seconds'] / 60:.1f}")
        lines.append("| " + " | ".join(row) + " |")
    steps = results["config"]["train"]
    lines.append("")
    lines.append(
        f"Model {results['config']['model']}, {steps['batch_size']} sequences x {results['config']['data']['seq_len']} "
        "tokens per step. Perplexities are token-weighted over the held-out new-domain split (learning) and each "
        "old-domain set (forgetting); representation similarity is the mean cosine similarity of the final hidden "
        "states' original part with step 0 on a fixed old-domain batch (paper Fig. 4a)." + placement_note(methods)
    )
    return "\n".join(lines + frontier_markdown(methods, old_sets)) + "\n"


def placement_note(methods: dict[str, Any]) -> str:
    """Where the methods trained and in which precision (each result records it), as a sentence; empty for results
    written before they recorded it."""
    where = sorted(
        {
            f"{r['device']}{' (' + r['gpu'] + ')' if 'gpu' in r else ''} in {r['precision']}"
            for r in methods.values()
            if "device" in r
        }
    )
    return f" Trained on {', '.join(where)}." if where else ""


def frontier_markdown(methods: dict[str, Any], old_sets: list[str]) -> list[str]:
    """The trained SCALE models re-evaluated at each alpha of ``--eval.up_logit_scales`` (none: no lines)."""
    rows = [(m, point) for m, r in methods.items() for key in FRONTIERS for point in r.get(key, [])]
    if not rows:
        return []
    header = ["method", "alpha", "learning ppl", *(f"forgetting ppl {name}" for name in old_sets)]
    lines = ["", "### The new stream's weight (Z + alpha Z_up) and WiSE-FT's (base + alpha (trained - base))", ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method, point in rows:
        forgetting = [_fmt(point["forgetting_ppl"].get(name)) for name in old_sets]
        reading = " (route_exact)" if point.get("route_exact") else ""
        reading += " + its base (two-model control)" if point.get("control") else ""
        reading += f" ({point['router']} router)" if point.get("router") else ""
        lines.append(
            f"| {method}{reading} | {point['alpha']:g} | {_fmt(point.get('learning_ppl'))} | {' | '.join(forgetting)} |"
        )
    lines += [
        "",
        "Each trained model once, evaluated again: a SCALE model with its new stream's logits weighted by alpha "
        "(--eval.up_logit_scales), FFT or Freeze with its weights interpolated towards the base model's "
        "(--eval.wise_ft_alphas); alpha 1 is the model as trained. A method read with its base by the likelihood "
        "router (--eval.likelihood_control) runs both models' forward passes: SCALE-Route's reading is the same "
        "mixture of its own two paths in one pass.",
    ]
    return lines


# the re-evaluations a run's result may hold (the two-model control: one point, alpha 1)
FRONTIERS = ("up_logit_frontier", "wise_ft_frontier", "likelihood_control")


def plot(results: dict[str, Any], out: Path) -> list[Path]:
    """perplexity.png (learning and forgetting against step, as Fig. 9) and representation.png (Fig. 4a)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = results["methods"]
    old_sets = sorted({name for r in methods.values() for c in r["curve"] for name in c.get("forgetting_ppl", {})})
    panels = [("learning_ppl", None, "learning perplexity (held-out new domain)")]
    panels += [("forgetting_ppl", name, f"forgetting perplexity ({name})") for name in old_sets]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (key, sub, title) in zip(axes[0], panels, strict=True):
        for method, r in methods.items():
            steps, values = _series(r["curve"], key, sub)
            if values:
                ax.plot(steps, values, marker="o", markersize=3, label=method)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    paths = [Path(out) / "perplexity.png"]
    atomic_write(paths[0], lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 4))
    for method, r in methods.items():
        steps, values = _series(r["curve"], "representation_similarity")
        ax.plot(steps, values, marker="o", markersize=3, label=method)
    ax.set_title("representation forgetting (cosine sim. with step 0)")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(Path(out) / "representation.png")
    atomic_write(paths[1], lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)
    return paths


def write_report(results: dict[str, Any], out: Path) -> None:
    """results.json, results.md and the figures, each written atomically (a reader never sees half a file)."""
    out = Path(out)
    write_json(out / "results.json", results)
    write_text(out / "results.md", results_markdown(results))
    if results["methods"]:
        plot(results, out)
