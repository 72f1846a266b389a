"""Continual pre-training as a sequence of new domains (``--sequence.then NAME=SOURCE ...``): the base
learns ``data.train`` (task 1, named ``--sequence.first``), then each later domain in turn, each for the run's
``train.*`` steps at the method's rate; after each task (and every ``eval.every`` steps) the old-domain sets and
every domain's held-out split are measured, so the result holds a perplexity matrix that includes the old domain.

The matrix's metrics (`scale_cl.eval.continual`) read ``-ln(perplexity)`` (the mean log-likelihood per token, in
nats: higher is better, as an accuracy): task 0 is the first old-domain set (``en`` on the clean base), then each
new domain. BWT < 0 is forgetting; FWT > 0 is a domain learned before it was trained (through earlier ones).

Output folder: ``cpt_config.json``; per method ``<method>/task-<k>.jsonl`` (the records of task k),
``<method>/result.json`` (its perplexity matrix, metrics, cost per task); ``results.json`` and ``results.md``.
Resumable per task as the biography sequence is (``<method>/progress.json`` and the model's state after the last
finished task; within a task from its last checkpoint). One process (no DDP) for now.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from scale_cl.data.corpus import build_corpus, check_corpus
from scale_cl.data.tokens import eos_id
from scale_cl.eval.continual import continual_metrics
from scale_cl.eval.perplexity import perplexity
from scale_cl.experiments.cpt.config import CptConfig
from scale_cl.experiments.method_run import GATE_RECIPE
from scale_cl.experiments.run_folder import check_output_folder, claim_output_folder
from scale_cl.experiments.sequence_progress import (
    GateFitter,
    SequenceControl,
    SequenceProgress,
    read_with_fitted_gate,
    task_cost,
)
from scale_cl.experiments.train.method import RESULT_FILE
from scale_cl.files import write_json, write_text
from scale_cl.models import BaseModelRef, load_base
from scale_cl.train.callbacks import PeriodicEval
from scale_cl.train.recipe import train_model
from scale_cl.train.router_fit import fit_router, gate_blocks, scale_reads_gate, train_unrouted
from scale_cl.train.sharding import refuse_sharding

COST_TOKENS = 64  # the first evaluation set's first tokens: the one sequence each task's cost is counted on


def validate_sequence(cfg: CptConfig) -> None:
    """What a sequence of domains needs, and the options it does not take yet, refused by name before any writing."""
    from scale_cl.experiments.train.prepare import process_state

    cfg.check()  # the settings' own checks, the sequence's among them (`scale_cl.experiments.train.sections.check_run`)
    if process_state().num_processes > 1:
        raise ValueError("a sequence of domains (sequence.then) runs in one process for now")
    for _, source in cfg.sequence.tasks()[1:]:
        check_corpus(replace(cfg.data, train=[source]))


def sequence_corpora(cfg: CptConfig, tokenizer: Any) -> tuple[list[tuple[str, Any]], dict[str, Any]]:
    """Each task's (name, training split) and every evaluation set by name: the old-domain sets, then each domain's
    held-out split (under its name)."""
    trains, evals = [], {}
    for index, (name, source) in enumerate(cfg.sequence.tasks()):
        data = cfg.data if source is None else replace(cfg.data, train=[source], old_eval=[], replay=[])
        corpus = build_corpus(data, tokenizer, seed=cfg.seed)
        for line in corpus.summary():
            print(f"[cpt] {name}: data {line}")
        if index == 0:
            evals.update(corpus.old_eval)
        evals[name] = corpus.heldout
        trains.append((name, corpus.train))
    return trains, evals


def evaluator(cfg: CptConfig, evals: dict[str, Any], bf16: bool):
    def evaluate(model: torch.nn.Module) -> dict[str, Any]:
        return {
            "ppl": {
                name: perplexity(model, data.blocks, cfg.eval.batch_size, bf16).perplexity
                for name, data in evals.items()
            }
        }

    return evaluate


def task_gate_fitter(cfg: CptConfig, train: Any, start_id: int, seed: int, bf16: bool) -> GateFitter | None:
    """With ``options.scale.router calibrated``: what fits the gate after a task, on that task's training blocks
    (`scale_cl.train.router_fit.gate_blocks`, the one recipe ``GATE_RECIPE``) and the samples of every expert before
    the newest; else None."""
    if cfg.options.scale.router != "calibrated":
        return None
    text = gate_blocks(train, GATE_RECIPE.sequences)
    return partial(fit_router, new_text=text, start_id=start_id, seed=seed, recipe=GATE_RECIPE, bf16=bf16)


def run_method_sequence(
    cfg: CptConfig, ref: BaseModelRef, trains: list[tuple[str, Any]], evals: dict[str, Any], method: str, out: Path
) -> dict[str, Any]:
    """Every task in turn for one method (module doc); returns (and saves) its result."""
    from scale_cl.experiments.train.prepare import run_placement, total_steps, training_arguments
    from scale_cl.methods import method_spec, prepare

    method_dir = out / method
    result_path = method_dir / RESULT_FILE
    if result_path.is_file():
        return json.loads(result_path.read_text())
    progress = SequenceProgress(method_dir)
    done, growth = progress.tasks_done, cfg.sequence
    base, tokenizer = load_base(ref)
    model = prepare(base, method, **cfg.options.prepare_options(method, cfg.seed))
    placement = run_placement(cfg)
    model.to(placement.device)  # step 0 is evaluated where the tasks train (prepared on the CPU, as always)
    evaluate = evaluator(cfg, evals, placement.bf16)
    if done:  # rebuilt as the sequence built it, then its state after the last finished task
        for task in range(2, done + 1):
            model = growth.grow(model, method, cfg.options, cfg.seed, task) if growth.grows(method) else model
        progress.restore(model)
    else:
        progress.start(evaluate(model))
    control = None
    # the control of the routers' readings: for a method that neither routes nor grows (a grown SCALE-Preserve model
    # holds its earlier stages itself: options.scale.router nested reads them in one pass)
    if cfg.eval.likelihood_control and not method_spec(method).two_paths and not growth.grows(method):
        options, scale = cfg.options.prepare_options(method, cfg.seed), cfg.options.scale

        def prepared() -> torch.nn.Module:
            return prepare(load_base(ref)[0], method, **options).to(placement.device)

        start = load_base(ref)[0].to(placement.device)
        control = SequenceControl(method_dir, start, prepared, scale)
        control.restore(done)
    probe = next(iter(evals.values())).blocks[:1, :COST_TOKENS]
    for task, (name, train) in enumerate(trains, start=1):
        if task <= done:
            continue
        if task > 1 and growth.grows(method):
            model = growth.grow(model, method, cfg.options, cfg.seed, task)
        cost = task_cost(model, probe)
        task_cfg = replace(cfg, seed=cfg.seed + task - 1)  # each task's own data order
        steps = total_steps(task_cfg, train)
        args = training_arguments(task_cfg, method, method_dir / f"task-{task}.run", steps)
        print(
            f"[cpt] {method}: task {task}/{len(trains)} ({name}), lr {args.learning_rate:g}, {cost['trainable']:,} "
            f"trainable of {cost['total']:,}, {steps} steps"
        )
        tracker = PeriodicEval(
            evaluate, every=cfg.eval.interval(steps), path=method_dir / f"task-{task}.jsonl", initial=progress.rows[-1]
        )
        run_info = {
            "method": method,
            "lr": args.learning_rate,
            "base": ref.name_or_path,
            "task": task,
            "seed": cfg.seed,
        }
        start = time.perf_counter()
        lr_ratios = cfg.options.lr_ratios(method)
        calibrate = task_gate_fitter(cfg, train, eos_id(tokenizer), task_cfg.seed, placement.bf16)
        gated = calibrate is not None and scale_reads_gate(model)
        if gated:  # a reading fitted after the task: the task trains the model unrouted
            train_unrouted(model)
        train_model(
            model,
            train,
            args,
            callbacks=[tracker],
            run_info=run_info,
            lr_ratios=lr_ratios,
            resume=True,
            sliced=cfg.train.loss == "sliced",
        )
        model.eval()
        if gated:  # the task's row: the model read with the gate fitted on it
            tracker.add(tracker.records[-1]["step"], read_with_fitted_gate(model, calibrate, evaluate))
        if control is not None:  # read before the task's row is saved, so that a resume has it
            control.add(task, model)
            tracker.records[-1]["control_ppl"] = control.reading(evaluate, calibrate)["ppl"]
        cost = {"name": name, "lr": args.learning_rate, **cost}
        progress.finish_task(task, model, tracker.records, cost, time.perf_counter() - start)
        shutil.rmtree(method_dir / f"task-{task}.run", ignore_errors=True)
    columns, state = [*evals], progress.state
    names = [columns[0], *(name for name, _ in trains)]  # the metrics' tasks: the first old-domain set, each domain
    matrix = [[-math.log(row["ppl"][name]) for name in names] for row in state["rows"]]
    result = {
        "method": method,
        "seed": cfg.seed,
        "growth": growth.label(method),
        "tasks": names,
        "columns": columns,
        "ppl_matrix": [[row["ppl"][name] for name in columns] for row in state["rows"]],
        "matrix": matrix,
        "metrics": continual_metrics(matrix),
        "parameters": state["parameters"],
        "seconds": state["seconds"],
        "curve": state["curve"],
        **placement.record(),  # device, precision (and the GPU) it trained on
    }
    if control is not None:  # the mixture of the base and every model so far; before any task, the base alone
        rows = [state["rows"][0]["ppl"], *(row["control_ppl"] for row in state["rows"][1:])]
        control_matrix = [[-math.log(row[name]) for name in names] for row in rows]
        result["control"] = {
            "router": control.router,
            "models": "the base and the model after each task so far",
            "ppl_matrix": [[row[name] for name in columns] for row in rows],
            "matrix": control_matrix,
            "metrics": continual_metrics(control_matrix),
        }
    write_json(result_path, result)
    progress.clear()
    if control is not None:
        control.clear()
    return result


def sequence_markdown(cfg: CptConfig, results: dict[str, dict[str, Any]]) -> str:
    """Each method's perplexity matrix and its metrics in nats of -ln(perplexity) (module doc)."""
    first = next(iter(results.values()))
    lines = [
        f"A sequence of {len(first['tasks']) - 1} new domains after `{first['tasks'][0]}` (model `{cfg.model}`, seed "
        f"{cfg.seed}, {cfg.train.max_steps or cfg.train.epochs} {'steps' if cfg.train.max_steps else 'epochs'} per "
        "task). Metrics on -ln(perplexity) per token, in nats (task 0: the first old-domain set; BWT < 0: "
        "forgetting; FWT > 0: a domain learned before it was trained).",
        "",
        "| method | growth | LA | ACC | BWT | FWT | forgetting | max forgetting | parameters after the last task |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for method, r in results.items():
        m, last = r["metrics"], r["parameters"][-1]
        cells = [f"{m[k]:+.3f}" for k in ("la", "acc", "bwt", "fwt", "forgetting", "max_forgetting")]
        lines.append(f"| {method} | {r['growth']} | " + " | ".join(cells) + f" | {last['total']:,} |")
        if r.get("control"):  # the base and the model after each task, kept apart and mixed by the router
            m = r["control"]["metrics"]
            cells = [f"{m[k]:+.3f}" for k in ("la", "acc", "bwt", "fwt", "forgetting", "max_forgetting")]
            models = len(r["control"]["matrix"])
            lines.append(
                f"| {method} + the base and each task's model, mixed (control) | kept apart | "
                + " | ".join(cells)
                + f" | {models} models x {last['total']:,} |"
            )
    for method, r in results.items():
        lines += [
            "",
            f"{method} ({r['growth']}): perplexity after each task",
            "",
            "| after | " + " | ".join(r["columns"]) + " |",
        ]
        lines.append("|---" * (len(r["columns"]) + 1) + "|")
        for i, row in enumerate(r["ppl_matrix"]):
            label = "start" if i == 0 else r["tasks"][i]
            lines.append(f"| {label} | " + " | ".join(f"{v:,.2f}" for v in row) + " |")
    return "\n".join(lines) + "\n"


def run_cpt_sequence(cfg: CptConfig, out: Path) -> dict[str, Any]:
    """Run (or resume) every method through the sequence of domains into ``out``; returns the results by method."""
    from scale_cl.experiments.cpt.pipeline import CONFIG_FILE
    from scale_cl.experiments.train.prepare import base_model_config, base_model_ref, validate

    out = Path(out)
    refuse_sharding("scale-cl cpt --sequence.then", "its stages evaluate and save on the main process alone")
    check_output_folder(out, CONFIG_FILE, cfg.to_dict())  # before any data or model is loaded
    validate(cfg, base_model_config(cfg))
    validate_sequence(cfg)
    ref = base_model_ref(cfg)
    _, tokenizer = load_base(ref)
    trains, evals = sequence_corpora(cfg, tokenizer)
    claim_output_folder(out, CONFIG_FILE, cfg.to_dict())
    results = {method: run_method_sequence(cfg, ref, trains, evals, method, out) for method in cfg.methods}
    write_json(out / "results.json", {"config": cfg.to_dict(), "methods": results})
    write_text(out / "results.md", sequence_markdown(cfg, results))
    return results


__all__ = ["run_cpt_sequence", "run_method_sequence", "sequence_corpora", "sequence_markdown", "validate_sequence"]
