"""What a sequence of tasks has done so far, kept on disk so that a killed run resumes per task: shared
by the biography sequence and the language sequence.

A folder holds ``progress.json`` (the tasks done, the evaluation after each, the whole curve, each task's cost and
the training time) and the model's whole state after the last finished task (``task-<k>.safetensors``,
safetensors). The state is written before the progress file that names it, so a progress file always names a saved
state; the state of the task before is then deleted. Resuming rebuilds the model as the sequence built it (prepared,
grown as often) and loads the state into it strictly, so trainability and every weight are as they were.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model

from scale_cl.eval.cost import forward_flops_per_token, train_flops_per_token
from scale_cl.files import atomic_write, write_json
from scale_cl.train.router_fit import RouterFit
from scale_cl.tuner.modes import set_live_settings

GateFitter = Callable[[torch.nn.Module], RouterFit]  # fits the calibrated router's gate on a model, sets it

PROGRESS_FILE = "progress.json"
RECORD_KEYS = ("step", "train_tokens_per_s")  # a curve record's own keys, beside the evaluation's


class SequenceProgress:
    """The progress of one method's sequence in ``folder`` (module doc); a fresh one when there is none."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / PROGRESS_FILE
        fresh = {"tasks_done": 0, "rows": [], "curve": [], "parameters": [], "seconds": 0.0}
        self.state: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else fresh

    @property
    def tasks_done(self) -> int:
        return self.state["tasks_done"]

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The evaluation before the first task, then after each finished one."""
        return self.state["rows"]

    def start(self, row: dict[str, Any]) -> None:
        """The evaluation before the first task."""
        self.state["rows"] = [row]

    def restore(self, model: torch.nn.Module) -> None:
        """Load the state after the last finished task into ``model``, rebuilt as the sequence built it, and the
        calibrated router's gate fitted after it (`read_with_fitted_gate`), which is a setting, not a weight."""
        load_model(model, self.folder / f"task-{self.tasks_done}.safetensors", strict=True)
        gate = self.rows[-1].get("gate") if self.rows else None
        if gate is not None:
            set_live_settings(model, router="calibrated", **gate)

    def finish_task(
        self, task: int, model: torch.nn.Module, records: list[dict[str, Any]], cost: dict[str, Any], seconds: float
    ) -> None:
        """Task ``task`` is trained: its records join the curve (``step`` counted over the whole sequence,
        ``task_step`` within the task), its last one is the task's row, and the model's state is saved."""
        before = self.state["curve"][-1]["step"] if self.state["curve"] else 0
        self.state["curve"] += [
            {**r, "task": task, "task_step": r["step"], "step": before + r["step"]} for r in records
        ]
        self.state["rows"].append({k: v for k, v in records[-1].items() if k not in RECORD_KEYS})
        self.state["parameters"].append({"task": task, **cost})
        self.state["seconds"] += seconds
        atomic_write(self.folder / f"task-{task}.safetensors", lambda path: save_model(model, path))
        self.state["tasks_done"] = task
        write_json(self.folder / PROGRESS_FILE, self.state)  # after the state: a progress file names a saved one
        (self.folder / f"task-{task - 1}.safetensors").unlink(missing_ok=True)

    def clear(self) -> None:
        """The sequence is finished and its result saved: nothing left to resume."""
        (self.folder / PROGRESS_FILE).unlink(missing_ok=True)
        for path in self.folder.glob("task-*.safetensors"):
            path.unlink()


class SequenceControl:
    """The control of a sequence (``likelihood_control``): the base and the method's model after each task so far,
    kept apart and mixed per token by the likelihood routers' posterior (`scale_cl.eval.mixture.ModelMixture`: k + 1
    models after task k), read after every task beside the model itself. Each task's model is kept on disk
    (``<folder>/experts/task-<k>.safetensors``) until the method's result is saved, so a resumed run has them.

    ``base``: the model the sequence started from (the base, or bio's Task-0 model); ``prepared``: a fresh model as
    the sequence prepares it, to load a saved task's state into; ``settings``: the router's (``options.scale``: its
    prior, decay, confidence and temperature). The mixture reads with ``options.scale.router`` where that is a
    confidence router (``confidence``, ``hybrid``), else with the likelihood routers' posterior."""

    def __init__(
        self, folder: Path, base: torch.nn.Module, prepared: Callable[[], torch.nn.Module], settings: Any
    ) -> None:
        from scale_cl.eval.mixture import MIXTURE_ROUTERS

        self.folder, self.prepared, self.settings = Path(folder) / "experts", prepared, settings
        self.router = settings.router if settings.router in MIXTURE_ROUTERS else "likelihood"
        self.experts = [base.eval()]  # the base, then each task's model

    def restore(self, done: int) -> None:
        """The models of the tasks finished before a resume, from their saved states."""
        for task in range(1, done + 1):
            model = self.prepared().eval()
            load_model(model, self.folder / f"task-{task}.safetensors", strict=True)
            self.experts.append(model)

    def add(self, task: int, model: torch.nn.Module) -> None:
        """Task ``task``'s model joins the experts (a frozen copy; its state saved for a resume)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write(self.folder / f"task-{task}.safetensors", lambda path: save_model(model, path))
        self.experts.append(copy.deepcopy(model).eval())

    def reading(
        self, evaluate: Callable[[torch.nn.Module], dict[str, Any]], calibrate: GateFitter | None = None
    ) -> dict[str, Any]:
        """The mixture of the experts so far, evaluated as one model; read by the calibrated router, its gate
        fitted first by ``calibrate`` (as the model's is, `read_with_fitted_gate`)."""
        from scale_cl.eval.mixture import mixture_read_as

        mixture = mixture_read_as(self.experts, self.router, self.settings)
        if self.router == "calibrated" and calibrate is not None:
            return read_with_fitted_gate(mixture, calibrate, evaluate)
        return evaluate(mixture)

    def clear(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def read_with_fitted_gate(
    model: torch.nn.Module, calibrate: GateFitter, evaluate: Callable[[torch.nn.Module], dict[str, Any]]
) -> dict[str, Any]:
    """After a task, a model read by the calibrated router (a SCALE model, or a control's mixture): its gate fitted
    on the task's training text (``calibrate``: `scale_cl.train.router_fit.fit_router` with that text), the model
    evaluated with it; the row records the gate (``gate``, re-set on a resume) and the fit (``gate_fit``)."""
    fitted = calibrate(model)
    return {"gate": fitted.fit.gate.settings(), "gate_fit": fitted.summary(), **evaluate(model)}


def task_cost(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, Any]:
    """What the model a task trains costs: its parameters (all, trainable) and the FLOPs per token of a training step
    and of inference on ``ids`` (one sequence; `scale_cl.eval.cost`: exact op counts)."""
    from scale_cl.methods import trainable_parameter_count

    ids = ids.to(next(model.parameters()).device)  # after a task trained on a GPU, the model is there
    was_training = model.training
    cost = {
        "trainable": trainable_parameter_count(model),
        "total": sum(p.numel() for p in model.parameters()),
        "train_flops_per_token": train_flops_per_token(model, ids),
        "inference_flops_per_token": forward_flops_per_token(model, ids),
    }
    model.train(was_training)
    return cost


__all__ = ["PROGRESS_FILE", "SequenceControl", "SequenceProgress", "read_with_fitted_gate", "task_cost"]
