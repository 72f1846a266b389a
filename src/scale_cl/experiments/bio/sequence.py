"""The biography benchmark as a sequence of tasks (``--sequence.tasks T``): after Task 0, T cohorts of new
people in turn, the same QA format each time; after each task every earlier task is measured (the accuracy
matrix, `scale_cl.eval.continual`).

Each method trains one model through the whole sequence: FFT, Freeze and LLaMA Pro keep training what they train;
a SCALE method either keeps training the blocks it added before Task 1 (``growth once``) or is grown again before
every later task (``per_task``: everything trained so far becomes the frozen base, `scale_cl.tuner.stages`), and LoRA
likewise keeps its adapter or adds one per task (stacked beside the frozen earlier ones, or after merging them into
the weights: ``lora_per_task``).
Every task trains as Task 1 does (``task1.*``: the method's rate, steps and evaluation schedule).

Resumable per task: after each task the model's whole state (safetensors) and the results so far are saved under
``<out>/seed-<s>/<method>.tasks/``; a killed run rebuilds the model as the sequence built it (prepared, grown as
often) and continues from the last finished task (and within a task from its last checkpoint, as a Task-1 run
does).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import GPTNeoXForCausalLM

from scale_cl.eval.continual import accuracy_matrix, continual_metrics
from scale_cl.experiments.bio.config import BioConfig
from scale_cl.experiments.bio.datasets import PadCollator
from scale_cl.experiments.bio.pipeline import (
    CHECKPOINT_MINUTES,
    CHECKPOINTS_KEPT,
    BioData,
    evaluate_tasks,
    gate_questions,
    result_path,
    run_bio,
    task1_placement,
)
from scale_cl.experiments.method_run import GATE_RECIPE
from scale_cl.experiments.sequence_progress import (
    GateFitter,
    SequenceControl,
    SequenceProgress,
    read_with_fitted_gate,
    task_cost,
)
from scale_cl.files import write_json
from scale_cl.methods import method_spec
from scale_cl.train.arguments import training_arguments
from scale_cl.train.callbacks import PeriodicEval, SaveAtEvaluations
from scale_cl.train.recipe import train_model
from scale_cl.train.router_fit import fit_router, scale_reads_gate, train_unrouted


def task_names(tasks: int) -> list[str]:
    """The accuracy matrix's columns: Task 0 (held-out people) and each new cohort."""
    return ["task0", *(f"task{j}" for j in range(1, tasks + 1))]


def task_gate_fitter(cfg: BioConfig, data: BioData, task: int, seed: int) -> GateFitter | None:
    """With ``options.scale.router calibrated``: what fits the gate after ``task``, on its training questions
    (`gate_questions`, the one recipe ``GATE_RECIPE``) and the samples of every expert before the newest; else None."""
    if cfg.options.scale.router != "calibrated":
        return None
    text, tokenizer = gate_questions(data.task_train(task), data.tokenizer.pad_token_id), data.tokenizer
    bf16 = task1_placement(cfg).bf16
    return partial(fit_router, new_text=text, start_id=tokenizer.eos_token_id, seed=seed, recipe=GATE_RECIPE, bf16=bf16)


def _start_model(cfg: BioConfig, task0_dir: Path, method: str, seed: int) -> torch.nn.Module:
    from scale_cl.methods import prepare

    model = GPTNeoXForCausalLM.from_pretrained(task0_dir)
    model = prepare(model, method, **cfg.options.prepare_options(method, seed))
    return model.to(task1_placement(cfg).device)  # prepared on the CPU; measured at step 0 where it trains


def run_sequence(
    cfg: BioConfig,
    data: BioData,
    task0_dir: Path,
    method: str,
    seed: int,
    out: Path,
    initial: dict[str, Any] | None = None,
) -> dict:
    """Tasks 1..T for one method (see module doc): returns (and caches) its curve, matrix and metrics."""
    path = result_path(out, seed, method)
    if path.is_file():
        return json.loads(path.read_text())
    tasks, names = cfg.sequence.tasks, task_names(cfg.sequence.tasks)
    grows = cfg.sequence.grows(method)
    state_dir = path.with_suffix(".tasks")
    progress = SequenceProgress(state_dir)
    done = progress.tasks_done
    model = _start_model(cfg, task0_dir, method, seed)
    if done:  # the model as the sequence built it, then its state after the last finished task
        for task in range(2, done + 1):
            model = cfg.sequence.grow(model, method, cfg.options, seed, task) if grows else model
        progress.restore(model)
    else:
        progress.start(initial if initial is not None else evaluate_tasks(model, data))
    control = None
    # the control of the routers' readings: for a method that neither routes nor grows (a grown SCALE-Preserve model
    # holds its earlier stages itself: options.scale.router nested reads them in one pass)
    if cfg.task1.likelihood_control and not method_spec(method).two_paths and not grows:
        task0 = GPTNeoXForCausalLM.from_pretrained(task0_dir).to(task1_placement(cfg).device)
        scale = cfg.options.scale
        prepared = partial(_start_model, cfg, task0_dir, method, seed)
        control = SequenceControl(state_dir, task0, prepared, scale)
        control.restore(done)
    lr = cfg.task1.lr_of(method)
    stage = replace(cfg.task1, lr=lr)
    collator = PadCollator(data.tokenizer.pad_token_id)
    probe = torch.tensor([data.pretrain[0]["input_ids"][:COST_TOKENS]])
    for task in range(done + 1, tasks + 1):
        if task > 1 and grows:
            model = cfg.sequence.grow(model, method, cfg.options, seed, task)
        cost = task_cost(model, probe)
        trainable, total = cost["trainable"], cost["total"]
        print(f"[bio] seed {seed}, {method}: task {task}/{tasks}, lr {lr:g}, {trainable:,} trainable of {total:,}")
        tracker = PeriodicEval(
            lambda m: evaluate_tasks(m, data),
            every=cfg.task1.eval_every,
            path=state_dir / f"task-{task}.jsonl",
            initial=progress.rows[-1],  # as the last task left it (growing changes the outputs by rounding only)
            early_every=cfg.task1.early_eval_every,
            early_until=cfg.task1.early_eval_until,
        )
        run_dir = state_dir / f"task-{task}.checkpoints"
        args = training_arguments(stage, run_dir, seed + task - 1, save_total_limit=CHECKPOINTS_KEPT)
        run_info = {"method": method, "lr": lr, "seed": seed, "task": task, "task0_model": task0_dir.name}
        start = time.perf_counter()
        calibrate = task_gate_fitter(cfg, data, task, seed + task - 1)
        gated = calibrate is not None and scale_reads_gate(model)
        if gated:  # a reading fitted after the task: the task trains the model unrouted
            train_unrouted(model)
        train_model(
            model,
            data.task_train(task),
            args,
            collator=collator,
            callbacks=[tracker, SaveAtEvaluations(cfg.task1.eval_every, CHECKPOINT_MINUTES)],
            run_info=run_info,
            lr_ratios=cfg.options.lr_ratios(method),
            resume=True,
        )
        model.eval()
        evaluate = partial(evaluate_tasks, data=data)
        if gated:  # the task's row: the model read with the gate fitted on it
            tracker.add(tracker.records[-1]["step"], read_with_fitted_gate(model, calibrate, evaluate))
        if control is not None:  # read before the task's row is saved, so that a resume has it
            control.add(task, model)
            tracker.records[-1]["control"] = control.reading(evaluate, calibrate)
        progress.finish_task(task, model, tracker.records, cost, time.perf_counter() - start)
        shutil.rmtree(run_dir, ignore_errors=True)
    state = progress.state
    matrix = accuracy_matrix(state["rows"], names)
    result = {
        "method": method,
        "seed": seed,
        "lr": lr,
        "tasks": tasks,
        "growth": cfg.sequence.label(method),
        "trainable": state["parameters"][-1]["trainable"],
        "parameters": state["parameters"],
        "seconds": state["seconds"],
        "curve": state["curve"],
        "rows": state["rows"],
        "matrix": matrix,
        "metrics": continual_metrics(matrix),
        **task1_placement(cfg).record(),  # device, precision (and the GPU) every task trained on
    }
    if control is not None:  # the mixture of the Task-0 model and every model so far; before Task 1, it alone
        rows = [state["rows"][0], *(row["control"] for row in state["rows"][1:])]
        control_matrix = accuracy_matrix(rows, names)
        result["control"] = {
            "router": control.router,
            "models": "the Task-0 model and the model after each task so far",
            "rows": rows,
            "matrix": control_matrix,
            "metrics": continual_metrics(control_matrix),
        }
    write_json(path, result)
    shutil.rmtree(state_dir, ignore_errors=True)  # finished: nothing to resume (the control's models included)
    return result


COST_TOKENS = 64  # the pre-training text's first tokens: the one sequence every method's cost is counted on


def run_bio_sequence(cfg: BioConfig, out: Path, cache: Path | None = None) -> dict[str, Any]:
    """`scale_cl.experiments.bio.pipeline.run_bio` with every method trained through the sequence (`run_sequence`)."""
    return run_bio(cfg, out, cache, run_one=run_sequence)


__all__ = ["run_bio_sequence", "run_sequence", "task_names"]
