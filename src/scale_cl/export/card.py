"""The README.md model card of an exported folder: how to load it, what was trained, and what the run measured.

Hugging Face reads the YAML front matter (``library_name``, ``tags``, ``base_model``); the rest is for
people. Everything the card states comes from the model itself or the run's own files (``result.json``,
``cpt_config.json``); what is not known is left out rather than guessed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scale_cl.methods import REGISTRY, MethodSpec
from scale_cl.tuner.config import ScaleConfig

PAPER = "https://arxiv.org/abs/2511.03270"
SCALE_PREFIX = "scale."  # a method setting of the ScaleConfig (`MethodSpec.reads`)
BASELINES = {
    "fft": "full fine-tuning",
    "freeze": "fine-tuning with the embedding and the bottom decoder layers frozen",
    "llama_pro": "LLaMA Pro: identity-initialised copies of decoder blocks inserted and trained, the rest frozen",
    "lora": "LoRA; the adapter is merged into the weights",
}


@dataclass
class CardInfo:
    """What a model card says. ``method`` is a scale-cl method name (``scale_route``, ``lora``, ...)."""

    method: str
    custom_code: bool
    base_model: str | None = None  # the base model's hub id or path, as the run named it
    scale: ScaleConfig | None = None  # the ScaleConfig a SCALE model saved
    run_settings: dict[str, Any] | None = None  # the run's cpt_config.json
    result: dict[str, Any] | None = None  # the method's result.json
    extra: dict[str, Any] = field(default_factory=dict)  # more "key: value" lines under "Training"


def read_json(path: Path | None) -> dict[str, Any] | None:
    """A JSON file's content, or None where there is no such file or it cannot be read."""
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _hub_id(name: str | None) -> str | None:
    """``name`` when it reads as a hub id (``org/model``), not a local path (front matter wants an id)."""
    if not name or Path(name).expanduser().exists() or name.startswith(("/", ".", "~")) or name.count("/") != 1:
        return None
    return name


def _front_matter(info: CardInfo) -> str:
    tags = ["scale-cl", "continual-learning", info.method.replace("_", "-")]
    if info.custom_code:
        tags.append("custom_code")
    lines = ["---", "library_name: transformers", "pipeline_tag: text-generation", "tags:"]
    lines += [f"  - {tag}" for tag in tags]
    hub_id = _hub_id(info.base_model)
    if hub_id:
        lines.append(f"base_model: {json.dumps(hub_id)}")
    return "\n".join([*lines, "---"])


def _spec(method: str) -> MethodSpec | None:
    """The declaration of ``method`` (a method's name), or None for one the card cannot name ("fine-tuned")."""
    return REGISTRY.get(method)


def _scale_settings(method: str) -> tuple[str, ...]:
    """The ScaleConfig fields ``method`` reads: its declared method settings below ``scale``."""
    spec = _spec(method)
    settings = spec.reads if spec else ()
    return tuple(s.removeprefix(SCALE_PREFIX) for s in settings if s.startswith(SCALE_PREFIX))


def _usage(info: CardInfo) -> str:
    spec = _spec(info.method)
    remote = ", trust_remote_code=True" if info.custom_code else ""
    lines = [
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("path/to/this/folder"{remote})',
        f'tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder"{remote})',
        "```",
    ]
    if info.custom_code:
        lines += [
            "",
            "It needs torch and transformers, not scale-cl: `modeling_scale.py` in this folder defines the model "
            "(a stock transformers class whose norms normalise the original and the added features apart"
            + (", with SCALE-Route's two paths and per-token routing" if spec and spec.two_paths else "")
            + "). The tokenizer reads the model's config, so it takes `trust_remote_code=True` too (or transformers "
            "asks).",
            "",
            _serving(info),
        ]
    return "\n".join(lines)


def _serving(info: CardInfo) -> str:
    """Whether vLLM's Transformers backend can serve a SCALE export: not where it mixes at the logits
    (`scale_cl.export.modeling_scale.mixes_logits`: a routed model, `ScaleConfig.routed`); transformers' ``generate``
    serves every one."""
    command = "`vllm serve path/to/this/folder --model-impl transformers --trust-remote-code`"
    if info.scale is None:  # a model exported from memory without its settings: config.json says
        return (
            f"Serving: transformers' `generate` serves it; vLLM's Transformers backend ({command}) only where "
            "config.json has `scale_vllm_servable: true` (SCALE-Adapt, and SCALE-Preserve without a mixing router)."
        )
    if info.scale.routed:
        return (
            "Serving: not servable by vLLM's Transformers backend (SCALE-Route's per-token routing, or a mixing "
            "router, mixes at the logits, which its plain LM head cannot compute); use transformers' `generate`."
        )
    return (
        f"Serving: transformers' `generate`, or vLLM's Transformers backend: {command} (the split norms are in the "
        "base model `AutoModel` loads; the LM head is one plain linear)."
    )


def _method(info: CardInfo) -> list[str]:
    lines = [f"- method: `{info.method}`"]
    if info.method in BASELINES:
        lines.append(f"- {BASELINES[info.method]}")
    if info.scale is not None:
        lines.append(
            f"- SCALE ([arXiv 2511.03270]({PAPER})): width-upscaled continual learning; the original weights are "
            "frozen, new width is added beside them"
        )
        for key in _scale_settings(info.method):
            value = getattr(info.scale, key)
            shown = ", ".join(map(str, value)) if isinstance(value, (list, tuple)) else value
            lines.append(f"- {key}: `{shown}`")
    if info.base_model:
        lines.append(f"- base model: `{info.base_model}`")
    return lines


def _data(settings: dict[str, Any]) -> list[str]:
    data = settings.get("data") or {}
    lines = []
    if data.get("train"):
        lines.append(f"- new-domain training data: {', '.join(f'`{t}`' for t in data['train'])}")
    if data.get("old_eval"):
        lines.append(f"- old-domain (forgetting) evaluation: {', '.join(f'`{t}`' for t in data['old_eval'])}")
    if data.get("seq_len"):
        lines.append(f"- sequence length: {data['seq_len']} tokens")
    if data.get("extend_vocab"):
        lines.append(f"- vocabulary extended by {data['extend_vocab']} tokens learned on the training data")
    return lines


def _fmt(value: Any) -> str:
    return "—" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)


def _results(result: dict[str, Any]) -> list[str]:
    """Learning and forgetting perplexity at the first and last measurement of the run (its ``curve``)."""
    curve = result.get("curve") or []
    if not curve:
        return []
    first, last = curve[0], curve[-1]
    lines = [
        f"Measured by scale-cl during training (step {first.get('step', 0)} → step {last.get('step', '?')}); "
        "lower perplexity is better.",
        "",
        "| measure | start | end |",
        "|---|---|---|",
    ]
    if "learning_ppl" in last:
        start, end = _fmt(first.get("learning_ppl")), _fmt(last["learning_ppl"])
        lines.append(f"| learning: held-out new-domain perplexity | {start} | {end} |")
    for name, value in (last.get("forgetting_ppl") or {}).items():
        start = (first.get("forgetting_ppl") or {}).get(name)
        lines.append(f"| forgetting: old-domain perplexity `{name}` | {_fmt(start)} | {_fmt(value)} |")
    if "representation_similarity" in last:
        start, end = first.get("representation_similarity"), last["representation_similarity"]
        start, end = ("—" if start is None else f"{start:.4f}"), f"{end:.4f}"
        lines.append(f"| representation similarity with step 0 | {start} | {end} |")
    for name, share in (last.get("route_preserve_share") or {}).items():
        lines.append(f"| tokens routed to the preserve path `{name}` | — | {share:.0%} |")
    return lines


def _training(info: CardInfo) -> list[str]:
    result, lines = info.result or {}, []
    if result.get("steps") is not None:
        lines.append(f"- optimizer steps: {result['steps']}")
    if result.get("lr") is not None:
        lines.append(f"- learning rate: {result['lr']:g}")
    if result.get("trainable") is not None:
        lines.append(f"- trainable parameters: {result['trainable']:,}")
    lines += [f"- {key}: {value}" for key, value in info.extra.items()]
    return lines + _data(info.run_settings or {})


def model_card(info: CardInfo) -> str:
    """The README.md text of an exported model folder."""
    title = f"# {info.method} model (scale-cl export)"
    parts = [_front_matter(info), "", title, "", "## Usage", "", _usage(info), "", "## Method", "", *_method(info)]
    training = _training(info)
    if training:
        parts += ["", "## Training", "", *training]
    results = _results(info.result or {})
    if results:
        parts += ["", "## Results", "", *results]
    parts += ["", f"Exported by `scale-cl export` (scale-cl, an implementation of [SCALE]({PAPER}))."]
    return "\n".join(parts) + "\n"
