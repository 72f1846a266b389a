"""Where a run's metrics are sent: transformers' reporting integrations (TensorBoard, W&B, MLflow, ...).

``report_to`` says where metrics go, not what is computed, so it is left out of every run's identity
(`result_settings`): changing it reuses finished work. So is a stage's ``device`` (where it runs, as the machine
is no part of it either), and its ``precision`` where it is ``auto`` (so that the runs and caches made before the
setting existed keep their identity; ``bf16`` and ``fp32`` are part of it).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import Trainer
from transformers.integrations import TensorBoardCallback, get_available_reporting_integrations
from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

from scale_cl.train.callbacks import PeriodicEval

REPORT_ALL, REPORT_NONE = "all", "none"
# Settings that say where metrics are sent, not what is computed: left out of every run's identity (cache
# keys, the settings a run folder is claimed with), so changing them reuses finished work.
REPORTING_SETTINGS = frozenset({"report_to", "run_name"})
# Where a stage runs (`scale_cl.train.config.StageConfig.device`) and how its data is read (processes, cache folder,
# loader workers): left out of every run's identity too.
PLACEMENT_SETTINGS = frozenset({"device", "num_proc", "cache_dir", "loader_workers"})
# Settings left out of a run's identity at these values only: their defaults, which runs made before the setting
# existed ran with (``precision: auto``; ``eval.likelihood_control: false``, a reading added later).
IDENTITY_DEFAULTS = {
    "precision": "auto",
    "likelihood_control": False,
    # settings `scale-cl train` added: the Trainer's and the data path's settings at the values every
    # earlier run had (the old reader's decode policy, a setting that is gone, at its only value used)
    "optim": "auto",
    "max_grad_norm": 1.0,
    "decay_ratio": 0.1,
    "args": {},
    "tokens": "",
    "logging_steps": 0,
    "save_minutes": 0.0,
    "weights": [],
    "replay_weights": [],
    "txt_documents": "auto",
    "shuffle_buffer": 0,
    "document_mask": False,
    "on_decode_error": "error",
    # added with the confidence routers: their settings, and the readings cpt makes, at the values
    # every earlier run had or read with
    "router_confidence": "entropy",
    "router_temperature": 1 / 3,
    "routers": ("likelihood",),
    "reading_alphas": (1.0,),
    "qa_loss": "answer",  # the biography benchmark's QA loss, added later: every earlier run's
}
# Backends whose module or package is not named as the backend: (modules, any of which will do; what
# `pip install` needs). Every other backend is its own module and package.
_PACKAGES = {
    "azure_ml": (("azureml.core",), "azureml-core"),
    "comet_ml": (("comet_ml",), "comet-ml"),
    "flyte": (("flytekit",), "flytekit"),
    "tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"),
}
_NO_PACKAGE = ("kubeflow",)  # switched on by its environment, not by a package


def report_backends() -> tuple[str, ...]:
    """The backends ``report_to`` may name: the installed transformers' reporting integrations."""
    return tuple(INTEGRATION_TO_CALLBACK)


def check_report_to(report_to: Sequence[str]) -> None:
    """Raise a ValueError for a ``report_to`` that is not a list of known backends, or ``all`` or ``none`` alone."""
    valid = (*report_backends(), REPORT_ALL, REPORT_NONE)
    unknown = [name for name in report_to if name not in valid]
    if unknown or not report_to:
        given = ", ".join(map(repr, unknown)) or "nothing"
        raise ValueError(f"report_to: unknown backend {given}; valid: {', '.join(valid)}")
    alone = {REPORT_ALL, REPORT_NONE} & set(report_to)
    if (len(report_to) > 1 and alone) or len(set(report_to)) < len(report_to):
        raise ValueError(f"report_to: name each backend once, or 'all' or 'none' alone; got {' '.join(report_to)}")


def backend_installed(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it: some backends are slow to import)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is missing
        return False


def report_to_argument(report_to: Sequence[str]) -> list[str]:
    """``TrainingArguments.report_to`` of a stage's ``report_to``, or a ValueError naming the ``pip install`` it needs.

    Called where settings are validated (before anything is written) and where the Trainer is set up.
    """
    check_report_to(report_to)
    if list(report_to) == [REPORT_NONE]:
        return []
    if list(report_to) == [REPORT_ALL]:
        return list(get_available_reporting_integrations())
    for name in report_to:
        if name in _NO_PACKAGE:
            continue
        modules, package = _PACKAGES.get(name, ((name,), name))
        if not any(backend_installed(m) for m in modules):
            raise ValueError(f"report_to {name!r} needs a package that is not installed: pip install {package}")
    return list(report_to)


def result_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` (nested, as ``asdict`` gives them) without `REPORTING_SETTINGS`, `PLACEMENT_SETTINGS` and the
    `IDENTITY_DEFAULTS` at their defaults: what identifies a run (its cache keys, its output folder)."""
    return {
        key: result_settings(value) if isinstance(value, dict) else value
        for key, value in settings.items()
        if key not in REPORTING_SETTINGS | PLACEMENT_SETTINGS
        and not (key in IDENTITY_DEFAULTS and value == IDENTITY_DEFAULTS[key])
    }


def connect_reporting(trainer: Trainer, logging_dir: Path | None = None) -> Trainer:
    """Send ``trainer``'s `PeriodicEval` records to its reporting integrations, TensorBoard's files to ``logging_dir``.

    ``trainer.log`` hands a record to every integration's ``on_log``, so the run's own metrics sit beside
    the loss. Called once the Trainer exists (a callback cannot reach it). transformers 5 has no
    ``TrainingArguments.logging_dir``: its TensorBoard callback keeps its own (``TENSORBOARD_LOGGING_DIR``
    when set, which is left as it is). Without reporting this changes nothing.
    """
    if not trainer.args.report_to:
        return trainer

    def report(metrics: dict[str, float]) -> None:
        due = trainer.control.should_log
        trainer.log(metrics)
        trainer.control.should_log = due  # on_log clears it: the loss due at this step is still logged

    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, PeriodicEval):
            callback.report = report
        elif isinstance(callback, TensorBoardCallback) and getattr(callback, "logging_dir", None) is None:
            callback.logging_dir = None if logging_dir is None else str(logging_dir)
    return trainer
