"""Trainer callbacks."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

from scale_cl.files import write_text


def _flatten(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    flat: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}/"))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            flat[f"{prefix}{key}"] = float(value)
    return flat


class PeriodicEval(TrainerCallback):
    """Calls ``evaluate(model) -> dict`` at step 0 and every ``every`` optimizer steps (and at the end).

    With ``early_every`` it also evaluates every ``early_every`` steps up to step ``early_until``:
    forgetting can collapse in the first few hundred steps (the biography benchmark's "spurious"
    drop), which a sparse schedule would step over (the original benchmark: 5, 10, ..., 200, then
    every 1,000).

    Each record ``{"step": s, **metrics}`` is appended to ``self.records`` and, when ``path`` is
    given, to a JSONL file, so a long run can be watched while it works. With ``tokens_per_step``
    each record after step 0 also holds ``train_tokens_per_s``: training throughput since the
    previous record, evaluation time excluded. With ``report`` set (`scale_cl.train.reporting.connect_reporting`
    sets it to ``trainer.log``) every numeric value of a record also goes to the Trainer's reporting
    integrations (TensorBoard, W&B, MLflow...) as ``eval_<name>``, which they show as ``eval/<name>``
    (nested names joined by ``/``: ``eval/forgetting_ppl/en``).

    Resuming: records after the step a run resumes from are dropped from the JSONL file (they
    were made after the checkpoint and are made again), and the step it resumes from is evaluated only if it is on
    the schedule (a checkpoint between evaluations adds no record: the file is the uninterrupted run's). Only the
    main process evaluates, unless
    ``every_process`` is set (`scale_cl.train.recipe.train_model` sets it when the weights are sharded: a forward pass
    then needs every process); the main process alone still records and writes.

    ``initial`` is used as the step-0 record instead of evaluating: every method starts from the
    base model's function (Theorem 3.1, LoRA's B = 0, LLaMA Pro's zero blocks), so a sweep measures
    step 0 once and hands it to every run.
    """

    def __init__(
        self,
        evaluate: Callable[[Any], dict],
        every: int,
        path: Path | None = None,
        tokens_per_step: int | None = None,
        initial: dict[str, Any] | None = None,
        early_every: int = 0,
        early_until: int = 0,
    ) -> None:
        if every <= 0 or early_every < 0 or early_until < 0:
            raise ValueError(
                f"evaluation intervals must be positive, got every={every}, early_every={early_every}, "
                f"early_until={early_until}"
            )
        self.evaluate, self.every, self.path = evaluate, every, path
        self.early_every, self.early_until = early_every, early_until
        self.tokens_per_step = tokens_per_step
        self.initial = initial
        self.records: list[dict] = []
        self.report: Callable[[dict[str, float]], None] | None = None
        self.every_process = False
        self._train_seconds, self._steps, self._mark = 0.0, 0, 0.0

    def is_eval_step(self, step: int) -> bool:
        """Whether ``step`` (an optimizer step count) is on the schedule (the last step always is)."""
        early = self.early_every > 0 and step <= self.early_until and step % self.early_every == 0
        return early or step % self.every == 0

    def _resume(self, step: int, main: bool) -> None:
        """Keep the records up to ``step``; every evaluating process reads them (so all skip the same evaluations),
        the main process alone rewrites the file (atomically: a reader sees the old file or the new one)."""
        if self.path is None or not self.path.is_file():
            return
        kept = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        self.records = [r for r in kept if r["step"] <= step] if step > 0 else []
        if main:
            write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.records))

    def _record(self, step: int, model: Any, main: bool = True, report: bool = True) -> None:
        if self.records and self.records[-1]["step"] == step:
            return
        record: dict[str, Any] = {"step": step}
        if self.tokens_per_step and self._steps:
            record["train_tokens_per_s"] = self._steps * self.tokens_per_step / self._train_seconds
        record.update(self.initial if step == 0 and self.initial is not None else self.evaluate(model))
        self.records.append(record)
        if main and self.path is not None:
            with open(self.path, "a") as handle:
                handle.write(json.dumps(record) + "\n")
        if main and report and self.report is not None:
            self.report({f"eval_{key}": value for key, value in _flatten(record).items() if key != "step"})
        self._train_seconds, self._steps = 0.0, 0

    def add(self, step: int, record: dict[str, Any]) -> None:
        """A record measured after training (a reading fitted at the end), kept and written after the last."""
        self.records.append({"step": step, **record})
        if self.path is not None:
            with open(self.path, "a") as handle:
                handle.write(json.dumps(self.records[-1]) + "\n")

    def _evaluates(self, state) -> bool:
        return state.is_world_process_zero or self.every_process

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not self._evaluates(state):
            return
        self._resume(state.global_step, state.is_world_process_zero)
        if self.is_eval_step(state.global_step):  # step 0, or a resumed step on the schedule (else no extra record)
            self._record(state.global_step, model, state.is_world_process_zero)
        self._mark = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if not self._evaluates(state):
            return
        self._train_seconds += time.perf_counter() - self._mark
        self._steps += 1
        if self.is_eval_step(state.global_step):
            self._record(state.global_step, model, state.is_world_process_zero)
        self._mark = time.perf_counter()

    def on_epoch_end(self, args, state, control, model=None, **kwargs):
        # The last record, taken before on_train_end: the reporting integrations' own on_train_end (called
        # before this callback's) closes their writers and runs.
        if self._evaluates(state) and control.should_training_stop:
            self._record(state.global_step, model, state.is_world_process_zero)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if not self._evaluates(state):
            return
        # none if on_epoch_end took it
        self._record(state.global_step, model, state.is_world_process_zero, report=False)


class SaveAtEvaluations(TrainerCallback):
    """Asks for a checkpoint at an evaluation step once ``minutes`` of wall time have passed since the last one.

    Why wall time rather than a step interval: a short run (the bio micro and small presets, seconds
    to minutes per method) writes no checkpoint and pays nothing, while a long one (the paper preset,
    hours per method) loses at most about ``minutes`` of training when killed. Why at evaluation
    steps (multiples of ``every``): `PeriodicEval` has a record there, so a run resumed from the
    checkpoint records exactly the steps an uninterrupted one does. The last step is never saved (the
    run is about to finish). The clock is per process: use it in single-process runs (a multi-process
    run must save by steps, ``save_every``, so that every process saves together).
    """

    def __init__(self, every: int, minutes: float) -> None:
        if every <= 0 or minutes < 0:
            raise ValueError(f"need every > 0 and minutes >= 0, got every={every}, minutes={minutes}")
        self.every, self.seconds = every, minutes * 60
        self._last = time.monotonic()

    def on_train_begin(self, args, state, control, **kwargs):
        self._last = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if step % self.every == 0 and step < state.max_steps and time.monotonic() - self._last >= self.seconds:
            control.should_save = True

    def on_save(self, args, state, control, **kwargs):
        self._last = time.monotonic()


class LossLog(TrainerCallback):
    """Writes every log record of the Trainer (loss, learning rate, gradient norm) to a JSONL file with the tokens
    trained so far, whatever ``report_to`` says: the training curve is always kept.

    Resuming drops the records after the step the run resumes from (they are logged again), as `PeriodicEval` does.
    Only the main process writes.
    """

    def __init__(self, path: Path, tokens_per_step: int) -> None:
        self.path, self.tokens_per_step = Path(path), tokens_per_step

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        if state.global_step == 0 or not self.path.is_file():
            write_text(self.path, "")
            return
        kept = [line for line in self.path.read_text().splitlines() if line.strip()]
        kept = [line for line in kept if json.loads(line)["step"] <= state.global_step]
        write_text(self.path, "".join(line + "\n" for line in kept))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        record = {"step": state.global_step, "tokens": state.global_step * self.tokens_per_step}
        record.update({k: v for k, v in logs.items() if isinstance(v, int | float) and not isinstance(v, bool)})
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")


class SaveEveryMinutes(TrainerCallback):
    """Asks for a checkpoint at the first logging step after ``minutes`` of wall time have passed since the last one
    (or the start).

    Why at a logging step: the Trainer logs the mean loss since its last log, and a run resumed from a checkpoint
    between two logs would log the mean of fewer steps; saved at a logging step, the resumed run logs exactly the
    uninterrupted run's losses. On several processes the main process's clock decides and the others follow it (one
    broadcast per logging step), so that every process saves at the same step. The last step is left to the end of
    training.
    """

    def __init__(self, minutes: float) -> None:
        if minutes <= 0:
            raise ValueError(f"minutes must be positive, got {minutes}")
        self.seconds = minutes * 60
        self._last = time.monotonic()

    def on_train_begin(self, args, state, control, **kwargs):
        self._last = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % max(1, int(args.logging_steps)) or state.global_step >= state.max_steps:
            return
        due = time.monotonic() - self._last >= self.seconds
        if args.world_size > 1:
            import torch
            import torch.distributed as dist

            flag = torch.tensor([int(due)], device=args.device)
            dist.broadcast(flag, src=0)
            due = bool(flag.item())
        if due:
            control.should_save = True

    def on_save(self, args, state, control, **kwargs):
        self._last = time.monotonic()


class TokensProgress(ProgressCallback):
    """The Trainer's progress bar (steps, rate, time left) with the training tokens per second beside it."""

    def __init__(self, tokens_per_step: int) -> None:
        super().__init__()
        self.tokens_per_step = tokens_per_step
        self._start, self._first = 0.0, 0

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        if self.training_bar is not None and state.global_step:
            self.training_bar.update(state.global_step)  # a resumed run starts where it stopped
            self.current_step = state.global_step
        self._start, self._first = time.perf_counter(), state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        super().on_step_end(args, state, control, **kwargs)
        if self.training_bar is not None:
            seconds = time.perf_counter() - self._start
            steps = state.global_step - self._first
            if seconds > 0 and steps > 0:
                self.training_bar.set_postfix(tokens_per_s=f"{steps * self.tokens_per_step / seconds:,.0f}")
