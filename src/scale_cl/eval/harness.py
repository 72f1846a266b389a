"""lm-evaluation-harness benchmarks on a model of any training method: `evaluate`, and `run_eval` (``scale-cl eval``).

The paper (Section 5, Table 2) evaluates with EleutherAI's lm-evaluation-harness, zero-shot, on an
English set (forgetting) and a Korean set (learning); `TASK_PRESETS` names both:

* ``english``: ``arc_challenge``, ``hellaswag``, ``mmlu``, ``truthfulqa_mc2``, ``winogrande``.
  "TruthfulQA" is read as ``truthfulqa_mc2`` (the Open LLM Leaderboard's choice, and Table 2's
  37.73 for Llama-3.2-1B is an MC2-sized number; MC1 is much lower for small models). ``mmlu`` is
  lm-eval's group of 57 subjects (its ``acc`` is their sample-weighted mean).
* ``korean``: ``kobest_boolq``, ``kobest_copa``, ``kobest_hellaswag`` (KoBEST, Table 2).

`PAPER_METRICS` is the metric we read each Table 2 column as: ``acc_norm`` where the task reports
it, else ``acc``. The paper does not say; our reading is that the base model's ARC 36.60 and
HellaSwag 63.66 are the ``acc_norm`` values lm-eval gives Llama-3.2-1B (its plain ``acc`` is
several points lower), and we apply the same rule to KoBEST (a guess). Every metric lm-eval
reports is kept in the results anyway.

Models: `evaluate` passes the model *instance* to lm-eval's ``HFLM``, so whatever `prepare` or
`scale_cl.models.load_trained` returns is evaluated as it is: an upscaled model is an ordinary HF
causal LM subclass, and a LoRA model is a PEFT ``PeftModel``, which HFLM accepts too (it forwards
``config``, ``device`` and ``forward`` to the wrapped model). LoRA is evaluated unmerged by default
(exactly the trained function); ``merge_lora=True`` merges the adapter into the base weights first
(faster on large models; equal up to floating-point rounding).

Local tasks: ``include_path`` adds a folder of lm-eval task YAMLs. Note that a relative
``dataset_kwargs: {data_files: ...}`` is resolved by ``datasets`` against the *current working
directory*, not against the YAML's folder; use absolute paths, or a ``custom_dataset: !function``
loader (see ``tests/fixtures/lm_eval_tasks``). lm-eval's built-in tasks download their data from the
Hugging Face hub on first use (and KoBEST's ``f1`` loads the ``evaluate`` library's metric from the
hub; without it lm-eval only logs an error, the accuracy metrics are unaffected).
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scale_cl.eval.config import DTYPES, LIST_TASKS_HINT, TASK_PRESETS, EvalSettings
from scale_cl.files import write_text

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PreTrainedTokenizerBase

# The metric of each Table 2 column (see the module docstring).
PAPER_METRICS: dict[str, str] = {
    "arc_challenge": "acc_norm",
    "hellaswag": "acc_norm",
    "mmlu": "acc",
    "truthfulqa_mc2": "acc",
    "winogrande": "acc",
    "kobest_boolq": "acc",
    "kobest_copa": "acc",
    "kobest_hellaswag": "acc_norm",
}


class UnknownTaskError(ValueError):
    """A task name that is neither a preset, an lm-eval task/group/tag, nor a task YAML file."""


# --------------------------------------------------------------------------------------------- tasks
def expand_tasks(tasks: str | Iterable[str]) -> list[str]:
    """Task names with presets expanded, comma-separated items split, and duplicates dropped (in order)."""
    items = [tasks] if isinstance(tasks, str) else list(tasks)
    names: list[str] = []
    for item in items:
        for part in str(item).split(","):
            part = part.strip()
            if not part:
                continue
            for name in TASK_PRESETS.get(part, (part,)):
                if name not in names:
                    names.append(name)
    if not names:
        raise ValueError(f"no tasks given; name lm-eval tasks or the presets {sorted(TASK_PRESETS)}")
    return names


def _include_paths(include_path: str | Path | Sequence[str | Path] | None) -> tuple[str, ...]:
    if include_path is None:
        return ()
    paths = [include_path] if isinstance(include_path, (str, Path)) else list(include_path)
    resolved = []
    for path in paths:
        path = Path(path).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"--include_path {path} is not a folder of lm-eval task YAML files")
        resolved.append(str(path.resolve()))
    return tuple(resolved)


@lru_cache(maxsize=4)
def _task_manager(include_paths: tuple[str, ...]) -> Any:
    """lm-eval's TaskManager (built-in tasks + ``include_paths``); indexing ~15k YAMLs takes seconds, so cached."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include_paths) or None)


def check_tasks(names: Sequence[str], include_path: str | Path | Sequence[str | Path] | None = None) -> list[str]:
    """``names`` if lm-eval knows every one of them; otherwise an `UnknownTaskError` with close matches."""
    manager = _task_manager(_include_paths(include_path))
    known = set(manager.all_tasks)
    unknown = [n for n in names if n not in known and not (n.endswith((".yaml", ".yml")) and Path(n).is_file())]
    if unknown:
        candidates = [*TASK_PRESETS, *manager.all_tasks]
        lines = []
        for name in unknown:
            close = difflib.get_close_matches(name, candidates, n=5, cutoff=0.6)
            lines.append(f"  {name!r}" + (f": did you mean {', '.join(close)}?" if close else ""))
        raise UnknownTaskError(
            "unknown lm-eval task(s):\n" + "\n".join(lines) + f"\nPresets: {', '.join(sorted(TASK_PRESETS))}; "
            f"{LIST_TASKS_HINT}."
        )
    return list(names)


# ---------------------------------------------------------------------------------------- evaluate
def evaluate(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    tasks: str | Iterable[str],
    *,
    include_path: str | Path | Sequence[str | Path] | None = None,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    batch_size: int | str = 8,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    max_length: int | None = None,
    merge_lora: bool = False,
    bootstrap_iters: int = 100_000,
    seed: int = 0,
) -> dict[str, Any]:
    """Run lm-eval ``tasks`` on ``model`` and return the metrics as a plain JSON-able dict.

    Args:
        model: a causal LM of any method (`scale_cl.models.load_trained`, `load_base`, `prepare`).
        tokenizer: its tokenizer.
        tasks: lm-eval task / group / tag names, task YAML paths, or `TASK_PRESETS` names (mixed
            freely; comma-separated strings are split).
        include_path: folder(s) of extra lm-eval task YAMLs.
        num_fewshot: few-shot examples; ``None`` keeps each task's default (0 for the presets, as in
            the paper).
        limit: at most this many documents per task (a fraction if < 1); for quick checks only.
        batch_size: lm-eval batch size (an int, or ``"auto"``).
        device: move the model there first, in place (``None``: leave it where it is). lm-eval's
            own ``device``/``dtype`` options are ignored for a model instance, hence these.
        dtype: cast the model first, in place (``None``: leave it).
        max_length: the longest input in tokens (``None``: lm-eval reads it from the model config).
        merge_lora: merge a PEFT LoRA adapter into the base weights before evaluating (modifies ``model``).
        bootstrap_iters: lm-eval's bootstrap iterations for stderrs of non-mean metrics (0: none).
        seed: python / numpy / torch / few-shot seed.

    Returns:
        ``{"tasks": [...], "results": {name: {metric: {"value", "stderr"}}}, "top_level": [...],
        "groups": {group: [children]}, "n_samples", "n_shot", "versions", "higher_is_better",
        "paper_metrics": {name: {"metric", "value", "stderr"}}, "averages": {preset: value},
        "settings": {...}}``. Metric keys drop lm-eval's ``,none`` filter suffix (other filters are
        kept: ``exact_match,strict-match``); a stderr lm-eval cannot compute (``N/A``) and
        non-finite values are ``None``. ``top_level`` lists the names that are not inside a
        reported group (what `format_markdown` shows).
    """
    import lm_eval
    import torch
    import transformers
    from lm_eval.models.huggingface import HFLM

    names = check_tasks(expand_tasks(tasks), include_path)
    if merge_lora and callable(getattr(model, "merge_and_unload", None)):
        model = model.merge_and_unload()
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    if device is not None or dtype is not None:
        model = model.to(device=device, dtype=dtype)
    model.eval()

    lm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size, max_length=max_length)
    with torch.no_grad():
        raw = lm_eval.simple_evaluate(
            model=lm,
            tasks=names,
            num_fewshot=num_fewshot,
            limit=limit,
            bootstrap_iters=bootstrap_iters,
            task_manager=_task_manager(_include_paths(include_path)),
            log_samples=False,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    out = plain_results(raw, names)
    out["settings"] = {
        "num_fewshot": num_fewshot,
        "limit": limit,
        "batch_size": batch_size,
        "device": str(next(model.parameters()).device),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "max_length": lm.max_length,
        "merge_lora": merge_lora,
        "bootstrap_iters": bootstrap_iters,
        "seed": seed,
        "include_path": list(_include_paths(include_path)),
        "lm_eval_version": lm_eval.__version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }
    return out


def eval_device(device: str | None) -> str:
    """``--device`` as torch names it: ``auto`` (or nothing) is cuda when torch sees a GPU, else cpu, as the training
    commands' ``device`` (`scale_cl.train.device.resolve_device`); ``cuda:N`` picks a GPU. A device that is not
    there is refused before the model is loaded."""
    import torch

    from scale_cl.train.device import resolve_device

    if device is None or device in ("auto", "cpu", "cuda"):
        return resolve_device(device or "auto", "--device")
    index = device.removeprefix("cuda:")
    if not (device.startswith("cuda:") and index.isdigit()):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {device!r}")
    resolve_device("cuda", "--device")  # no GPU at all: the same refusal as --device cuda
    if int(index) >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: torch sees {torch.cuda.device_count()} GPU(s) (cuda:0 is the first)")
    return device


def parse_dtype(name: str) -> torch.dtype:
    import torch

    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; one of {', '.join(DTYPES)}")
    return getattr(torch, name)


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None  # lm-eval's "N/A"
    return number if math.isfinite(number) else None


def _metrics(entry: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """``{"acc,none": v, "acc_stderr,none": s, "alias": ...}`` -> ``{"acc": {"value": v, "stderr": s}}``."""
    metrics: dict[str, dict[str, float | None]] = {}
    for key, value in entry.items():
        if "," not in key or "_stderr," in key:
            continue
        metric, filt = key.split(",", 1)
        stderr = entry.get(f"{metric}_stderr,{filt}")
        name = metric if filt == "none" else key
        metrics[name] = {"value": _number(value), "stderr": _number(stderr)}
    return metrics


def plain_results(raw: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` output -> `evaluate`'s plain dict (without ``settings``)."""
    results = {name: _metrics(entry) for name, entry in raw["results"].items()}
    groups = {name: list(children) for name, children in raw.get("group_subtasks", {}).items()}
    inside = {child for children in groups.values() for child in children}
    top_level = [name for name in results if name not in inside]
    paper = {}
    for name, metric in PAPER_METRICS.items():
        if metric in results.get(name, {}):
            paper[name] = {"metric": metric, **results[name][metric]}
    averages = {}
    for preset, members in TASK_PRESETS.items():
        values = [paper[m]["value"] for m in members if m in paper]
        if len(values) == len(members) and None not in values:
            averages[preset] = sum(values) / len(values)
    return {
        "tasks": names,
        "results": results,
        "top_level": top_level,
        "groups": groups,
        "n_samples": {k: dict(v) for k, v in raw.get("n-samples", {}).items()},
        "n_shot": dict(raw.get("n-shot", {})),
        "versions": {k: v if isinstance(v, (int, float, str)) else str(v) for k, v in raw.get("versions", {}).items()},
        "higher_is_better": {k: {m: bool(b) for m, b in v.items()} for k, v in raw.get("higher_is_better", {}).items()},
        "paper_metrics": paper,
        "averages": averages,
    }


# ---------------------------------------------------------------------------------------- markdown
def _fmt(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.4f}" if abs(value) < 1e4 else f"{value:.4g}"


def format_markdown(results: dict[str, Any]) -> str:
    """Markdown: task | metric | value | ± stderr of the top-level tasks and groups, then the paper's metrics."""
    lines = ["| task | metric | value | ± stderr |", "|---|---|---:|---:|"]
    for name in results["top_level"]:
        for i, (metric, mv) in enumerate(results["results"][name].items()):
            stderr = "" if mv["stderr"] is None else _fmt(mv["stderr"])
            lines.append(f"| {name if i == 0 else ''} | {metric} | {_fmt(mv['value'])} | {stderr} |")
    hidden = len(results["results"]) - len(results["top_level"])
    if hidden:
        lines.append(f"\n({hidden} subtasks and subgroups of the groups above are in the JSON results.)")
    if results["paper_metrics"]:
        lines += ["", "Paper Table 2 metrics (x100):", "", "| task | metric | value |", "|---|---|---:|"]
        for name, entry in results["paper_metrics"].items():
            value = "n/a" if entry["value"] is None else f"{100 * entry['value']:.2f}"
            lines.append(f"| {name} | {entry['metric']} | {value} |")
        for preset, value in results["averages"].items():
            lines.append(f"| **{preset} avg** | | {100 * value:.2f} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ saved models
def _batch_size(text: str | int) -> int | str:
    text = str(text)
    if text.isdigit() and int(text) > 0:
        return int(text)
    if text.startswith("auto"):
        return text
    raise ValueError(f"--batch_size must be a positive integer or 'auto', got {text!r}")


def _limit(value: float | None) -> int | float | None:
    """lm-eval's limit: a count of documents (>= 1) or a fraction of each task (< 1); `EvalSettings` checks > 0."""
    if value is None:
        return None
    return int(value) if value >= 1 else value


def run_eval(settings: EvalSettings) -> tuple[dict[str, Any], Path | None]:
    """Load the model of ``settings``, evaluate it and write the JSON results; returns them and where they went.

    Bad settings raise a ValueError / FileNotFoundError before the (slow) model load.
    """
    from scale_cl.models import RUN_FILE, BaseModelRef, load_base, load_trained, read_run_file

    s = settings
    if (s.model_dir is None) == (s.base is None):
        hint = ""
        if s.model_dir is None and any(Path(t).is_dir() for t in s.tasks or ()):
            hint = " (--tasks takes every name after it: put MODEL_DIR before --tasks)"
        raise ValueError(f"give either MODEL_DIR (a trained checkpoint) or --base MODEL (an untrained model){hint}")
    if not s.tasks:
        raise ValueError(f"--tasks is required: lm-eval task names or presets ({', '.join(TASK_PRESETS)})")
    batch_size, limit = _batch_size(s.batch_size), _limit(s.limit)
    dtype = parse_dtype(s.dtype)
    device = eval_device(s.device)
    directory = None if s.model_dir is None else Path(s.model_dir)
    if directory is not None:
        if not directory.is_dir():
            raise FileNotFoundError(f"MODEL_DIR {directory} does not exist or is not a folder")
        if not (directory / RUN_FILE).is_file() and (directory / "model" / RUN_FILE).is_file():
            directory = directory / "model"  # a finished cpt method folder, as `scale-cl export` takes it
        read_run_file(directory)  # a clear error for a folder that is not a saved run
    include_path = s.include_path or None  # a folder or a list of them (YAML may give either)
    names = check_tasks(expand_tasks(s.tasks), include_path)  # before the (slow) model load

    if directory is not None:
        model, tokenizer, method = load_trained(directory, dtype=dtype)
        source = {"model_dir": str(directory.resolve()), "method": method}
        out = Path(s.out) if s.out else directory / "eval.json"
    else:
        ref = BaseModelRef.parse(s.base)
        model, tokenizer = load_base(ref, dtype=dtype)
        source = {"base": ref.name_or_path, "gguf_file": ref.gguf_file, "method": "base"}
        out = Path(s.out) if s.out else None

    results = evaluate(
        model,
        tokenizer,
        names,
        include_path=include_path,
        num_fewshot=s.num_fewshot,
        limit=limit,
        batch_size=batch_size,
        device=device,
        dtype=dtype,
        max_length=s.max_length,
        merge_lora=s.merge_lora,
        bootstrap_iters=s.bootstrap_iters,
        seed=s.seed,
    )
    results = {"model": source, **results}
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_text(out, json.dumps(results, indent=2) + "\n")
    return results, out
