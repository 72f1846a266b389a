"""One method's run in an experiment: the steps bio's Task 1 and cpt (``scale-cl train`` through it) take, in one
order.

A finished run is read back from its result file. Otherwise the method is prepared on the model it starts from,
given that model's logits as a distillation teacher and SCALE-Route's tau calibrated on old data where its settings
ask, trained by `scale_cl.train.recipe.train_model` (resuming from its last complete checkpoint), read afterwards
training nothing (`ReadPlan`), and its result written; its checkpoints are then deleted. An experiment subclasses
`MethodRun` with what it does its own way: the models and data, the Trainer's settings, the evaluation, its messages
and what its result holds besides.
"""

from __future__ import annotations

import json
import shutil
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from scale_cl.eval.mixture import mixture_read_as
from scale_cl.eval.readings import Calibrate, up_logit_frontier, wise_ft_frontier
from scale_cl.experiments.settings import MethodSettings
from scale_cl.files import write_json
from scale_cl.methods import method_spec, prepare, trainable_parameter_count
from scale_cl.train.callbacks import PeriodicEval
from scale_cl.train.distill import Distillation, teacher_for
from scale_cl.train.recipe import train_model
from scale_cl.train.route_calibration import Batch, RouteCalibration
from scale_cl.train.router_fit import GateRecipe, RouterFit, fit_router
from scale_cl.train.sharding import is_sharded
from scale_cl.tuner.config import ScaleConfig

GATE_RECIPE = GateRecipe()  # the calibrated router's fit: one recipe for every experiment (no per-benchmark settings)


@dataclass(frozen=True)
class ReadPlan:
    """What is read of the trained model afterwards, training nothing, and the result's keys for each reading."""

    frontier: tuple[float, ...] | None  # `up_logit_frontier`'s alphas for the method (its trait); None: not read
    routers: tuple[str, ...]  # the mixing routers of the frontier and of the control
    wise_ft: tuple[float, ...]  # `wise_ft_frontier`'s alphas, for a method WiSE-FT reads; () = off
    control: bool  # `likelihood_control`, for a method without two paths (one that does not route)
    gate_objectives: tuple[str, ...]  # the calibrated router's: a reading fitted by each (where routers name it)
    frontier_key: str
    wise_ft_key: str


@dataclass
class Training:
    """How an experiment trains the prepared method: `train_model`'s data and settings."""

    data: Any
    args: TrainingArguments
    tracker: PeriodicEval  # the evaluation along training; its ``evaluate`` reads the trained model afterwards too
    calibration_batches: Callable[[int], list[Batch]]  # the first ``n`` old-data sequences as batches (tau's sample)
    options: dict[str, Any]  # `train_model`'s other arguments: run_info (a checkpoint of another run is refused), ...
    callbacks: list[TrainerCallback] = field(default_factory=list)  # after the tracker


def likelihood_control(
    trained: torch.nn.Module,
    start: torch.nn.Module,
    evaluate: Any,
    routers: tuple[str, ...],
    scale: ScaleConfig,
    calibrate: Sequence[Calibrate] = (),
) -> list[dict[str, Any]]:
    """The trained model and the model it started from (``start``: the Task-0 model, the base) mixed by each router
    of ``routers`` (their settings from ``scale``), evaluated as one model: the two-model control of SCALE's router
    readings (`scale_cl.eval.mixture`); the calibrated router's gate fitted on the mixture by each of ``calibrate``
    (a record each)."""
    device = next(trained.parameters()).device
    start = start.to(device).requires_grad_(False)
    records = []
    for router in routers:
        record = {"alpha": 1.0, "router": router, "control": "two models"}
        if router == "calibrated" and calibrate:
            for fit_on in calibrate:
                mixture = mixture_read_as([start, trained], router, scale)
                fit = fit_on(mixture)
                gate = {**fit.fit.gate.settings(), "gate_fit": fit.summary()}
                records.append({**record, **gate, **evaluate(mixture)})
        else:
            records.append({**record, **evaluate(mixture_read_as([start, trained], router, scale))})
    return records


class MethodRun(ABC):
    """One method's run (module doc): `run` takes the shared steps, the methods after it are the experiment's parts.

    A subclass sets ``method``, ``seed`` (the method's initialisation), ``options``, ``result_path`` (its presence
    means "finished"), ``run_dir`` (the Trainer's checkpoints), ``logging_dir`` and ``readings``.
    """

    method: str
    seed: int
    options: MethodSettings
    result_path: Path
    run_dir: Path
    logging_dir: Path
    read_plan: ReadPlan
    keep_checkpoints = False  # keep the resumable checkpoints once the method has finished
    is_main = True  # this process writes and reads afterwards (under torchrun every process runs the method)

    def run(self) -> dict[str, Any]:
        """Train the method (or read its finished result); returns its result."""
        if self.result_path.is_file():
            return json.loads(self.result_path.read_text())
        self.result_path.parent.mkdir(parents=True, exist_ok=True)
        base = self.base_model()  # first: it may set the options (cpt's layer choice)
        model = prepare(base, self.method, **self.options.prepare_options(self.method, self.seed))
        distillation = None
        if (distill := self.options.distill_config(self.method)) is not None:
            distillation = Distillation(distill, teacher_for(model, self.start_model, self.bf16))
        training = self.training(model, mark=distillation is not None)
        tracker, args = training.tracker, training.args
        calibration = self.options.route_calibration(self.method, model, training.calibration_batches, args.bf16)
        trainable = trainable_parameter_count(model)
        self.announce(trainable, distillation, calibration)
        start = time.perf_counter()
        trainer = train_model(
            model,
            training.data,
            args,
            callbacks=[tracker, *training.callbacks],
            calibration=calibration,
            lr_ratios=self.options.lr_ratios(self.method),
            resume=True,
            logging_dir=self.logging_dir,
            distillation=distillation,
            **training.options,
        )
        result = self.result(trainer, tracker, trainable, time.perf_counter() - start)
        result.update(self.read_after(trainer.model, tracker.evaluate, sharded=is_sharded(trainer)))
        if self.is_main:
            self.save(trainer, tracker, result)
            write_json(self.result_path, result)
            if not self.keep_checkpoints:
                shutil.rmtree(self.run_dir, ignore_errors=True)  # the method is finished: nothing to resume
        self.finish()
        return result

    def read_after(self, model: torch.nn.Module, evaluate: Any, sharded: bool = False) -> dict[str, Any]:
        """The readings (`ReadPlan`) of the trained ``model`` that apply to its method: on the main process (the
        frontier on every process where the weights are sharded: a forward pass needs them all)."""
        r, spec, found = self.read_plan, method_spec(self.method), {}
        wanted = r.gate_objectives if "calibrated" in r.routers else ()
        calibrate = [fit for objective in wanted if (fit := self.calibrator(objective)) is not None]
        if r.frontier is not None and (self.is_main or sharded):
            found[r.frontier_key] = up_logit_frontier(model, evaluate, r.frontier, r.routers, calibrate)
        if self.is_main and r.wise_ft and spec.wise_ft:
            found[r.wise_ft_key] = wise_ft_frontier(model, self.start_model(), evaluate, r.wise_ft)
        if self.is_main and r.control and not spec.two_paths:
            scale = self.options.scale
            control = likelihood_control(model, self.start_model(), evaluate, r.routers, scale, calibrate)
            found["likelihood_control"] = control
        return found

    def calibrator(self, objective: str = GATE_RECIPE.objective) -> Calibrate | None:
        """Fits the calibrated router's gate on a model by the one recipe (`GATE_RECIPE`, by ``objective``) on
        `gate_text`; None where the experiment gives no text."""
        found = self.gate_text()
        if found is None:
            return None
        text, start_id = found
        recipe = replace(GATE_RECIPE, objective=objective)

        def calibrate(model: torch.nn.Module) -> RouterFit:
            return fit_router(model, text, start_id, seed=self.seed, recipe=recipe, bf16=self.bf16)

        return calibrate

    # The experiment's parts.

    @abstractmethod
    def start_model(self) -> torch.nn.Module:
        """A fresh copy of the model the method starts from, on the CPU (the distillation teacher, WiSE-FT's anchor,
        the control's other model)."""

    def base_model(self) -> torch.nn.Module:
        """The model the method is prepared on: `start_model`, which an experiment may read first."""
        return self.start_model()

    @property
    @abstractmethod
    def bf16(self) -> bool:
        """The run's precision (the teacher copy's)."""

    @abstractmethod
    def training(self, model: torch.nn.Module, mark: bool) -> Training:
        """How the prepared ``model`` trains; ``mark``: each example says whether it is (pseudo-)replayed (for the
        distillation term)."""

    def gate_text(self) -> tuple[Any, int] | None:
        """The calibrated router's new side, text the method trained on (blocks or batches, the first
        ``GATE_RECIPE.sequences`` read), and the token its base's samples start from; None: no gate is fitted."""
        return None

    def announce(self, trainable: int, distillation: Distillation | None, calibration: RouteCalibration | None) -> None:  # noqa: B027 (optional)
        """Say what is about to train."""

    @abstractmethod
    def result(self, trainer: Trainer, tracker: PeriodicEval, trainable: int, seconds: float) -> dict[str, Any]:
        """The result's record of the training (``seconds``: this process's part of it)."""

    def save(self, trainer: Trainer, tracker: PeriodicEval, result: dict[str, Any]) -> None:  # noqa: B027 (optional)
        """On the main process, before ``result`` is written: what else the experiment keeps."""

    def finish(self) -> None:  # noqa: B027 (optional)
        """On every process, once the result is written."""
