"""The two experiments a sweep runs, behind one small interface: set up once, run one point, read its metrics.

Everything that does not depend on a point's learning rate or ablation setting is done once in
`prepare`: bio's data, tokenizer and stage-1/2 models (cached under ``<out>/cache``), cpt's
corpus, base model reference hidden states; and the step-0 evaluation, which is the base model's
for every method (each starts from the base model's function) and is handed to every run.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from scale_cl.experiments.sweep.landscape import Metric
from scale_cl.files import write_json

CONFIG_FILE = "sweep_config.json"
BASE_FILE = "base_metrics.json"


@dataclass(frozen=True)
class PanelSpec:
    """One forgetting view of the landscape: its key in a point's metrics, its title and its metric."""

    key: str
    title: str
    metric: Metric


def with_rate(cfg: Any, section: str, method: str, lr: float) -> Any:
    """``cfg`` with ``method``'s learning rate in ``cfg.<section>`` set to ``lr``."""
    stage = getattr(cfg, section)
    return replace(cfg, **{section: replace(stage, method_lr={**stage.method_lr, method: lr})})


class BioExperiment:
    """The biography benchmark: learning = Task-1 accuracy; forgetting = Task-0 accuracy (held-out people:
    at the end and its minimum; QA-trained people: at the end)."""

    name = "bio"
    rates_section = "task1"
    is_main_process = True  # bio runs in one process
    learning = Metric("Task-1 accuracy", higher_is_better=True)
    panels = (
        PanelSpec("task0_end", "Task 0 at the end", Metric("Task-0 accuracy (end)", higher_is_better=True)),
        PanelSpec("task0_min", "Task 0, minimum along the run", Metric("Task-0 accuracy (min)", higher_is_better=True)),
        PanelSpec(
            "task0_trained_end",
            "Task 0 QA-trained people at the end",
            Metric("Task-0 QA-trained accuracy (end)", higher_is_better=True),
        ),
    )

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self._data: Any = None
        self._task0_dirs: dict[int, Path] = {}
        self._initial: dict[int, dict[str, Any]] = {}

    @staticmethod
    def check_target(target: float | None) -> None:
        """``--target`` is a Task-1 accuracy."""
        if target is not None and not 0 < target <= 1:
            raise ValueError(f"--target {target:g}: bio compares methods at a Task-1 accuracy in (0, 1] (0.9: 90%)")

    @staticmethod
    def refuse_sequence(cfg: Any) -> None:
        """A sweep point is one task after Task 0."""
        if cfg.sequence.tasks > 1:
            raise ValueError(
                "sweep bio does not run a sequence of tasks yet (sequence.tasks > 1): run `scale-cl bio "
                "--sequence.tasks T` at each rate instead"
            )

    def validate(self, cfg: Any) -> None:
        from scale_cl.experiments.bio.pipeline import validate

        self.refuse_sequence(cfg)
        validate(cfg)

    def prepare(self, out: Path) -> dict[str, float]:
        """Data and stage-1/2 models (cached), and the Task-0 model's accuracies (measured where Task 1 trains);
        returns the base metrics."""
        from scale_cl.experiments.bio.pipeline import (
            build_data,
            evaluate_tasks,
            load_stage_model,
            stage_models,
            task1_placement,
        )

        self._data = build_data(self.cfg, out / "cache")
        base = out / BASE_FILE
        stored = json.loads(base.read_text()) if base.is_file() else {}
        for seed in self.cfg.seeds:
            _, self._task0_dirs[seed] = stage_models(self.cfg, self._data, seed, out / "cache")
            if str(seed) not in stored:
                print(f"[sweep] step 0 (seed {seed}): evaluating the Task-0 model once for every run")
                model = load_stage_model(self._task0_dirs[seed], task1_placement(self.cfg).device)
                stored[str(seed)] = evaluate_tasks(model, self._data)
            self._initial[seed] = stored[str(seed)]
        write_json(base, stored)
        return self._summary([[{"step": 0, **stored[str(s)]}] for s in self.cfg.seeds])

    @staticmethod
    def _summary(curves: list[list[dict]]) -> dict[str, float]:
        """Learning and forgetting metrics of one point: means over the seeds' curves."""
        return {
            "learning": statistics.fmean(c[-1]["task1"]["overall"] for c in curves),
            "task0_end": statistics.fmean(c[-1]["task0"]["overall"] for c in curves),
            "task0_min": statistics.fmean(min(r["task0"]["overall"] for r in c) for c in curves),
            "task0_trained_end": statistics.fmean(c[-1]["task0_trained"]["overall"] for c in curves),
        }

    def run(self, cfg: Any, method: str, point_dir: Path) -> dict[str, float]:
        from scale_cl.experiments.bio.pipeline import run_method

        curves = [
            run_method(cfg, self._data, self._task0_dirs[seed], method, seed, point_dir, self._initial[seed])["curve"]
            for seed in cfg.seeds
        ]
        return self._summary(curves)

    @property
    def seeds(self) -> list[int]:
        return list(self.cfg.seeds)

    def curves(self, method: str, point_dir: Path) -> list[list[dict[str, Any]]]:
        """Each seed's evaluation records of a finished point."""
        from scale_cl.experiments.bio.pipeline import result_path

        return [json.loads(result_path(point_dir, s, method).read_text())["curve"] for s in self.cfg.seeds]

    @staticmethod
    def covers(record: dict[str, Any]) -> bool:
        """A finished point has every seed: they are part of the folder's settings."""
        return True

    def seed_metrics(self, method: str, point_dir: Path) -> dict[str, dict[str, float]]:
        """Each seed's metrics of a finished point, read from its runs' files: the spread over seeds (a point's
        own metrics are the means); empty with one seed."""
        if len(self.cfg.seeds) < 2:
            return {}
        from scale_cl.experiments.bio.pipeline import result_path

        runs = {s: json.loads(result_path(point_dir, s, method).read_text()) for s in self.cfg.seeds}
        return {str(s): self._summary([run["curve"]]) for s, run in runs.items()}


class CptExperiment:
    """Continual pre-training: learning = new-domain perplexity; forgetting = perplexity of each old-domain set."""

    name = "cpt"
    rates_section = "train"
    learning = Metric("new-domain perplexity", higher_is_better=False, log_scale=True)

    def __init__(self, cfg: Any, save_models: bool = False, seeds: list[int] | None = None) -> None:
        self.cfg = cfg
        self.save_models = save_models
        self.seeds = sorted(seeds) if seeds else [cfg.seed]
        self.per_seed = bool(seeds)  # runs in seed-<s> folders, and a point is done when it has every seed asked for
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds repeat: {self.seeds}")
        self.panels = tuple(
            PanelSpec(f"old/{name}", f"old domain: {name}", Metric(f"{name} perplexity", False, log_scale=True))
            for name in self._old_names(cfg)
        )
        self._base_config: Any = None
        self._state: dict[str, Any] = {}

    @staticmethod
    def _old_names(cfg: Any) -> list[str]:
        from scale_cl.data.corpus import eval_sets

        return list(eval_sets(cfg.data.old_eval))

    @property
    def is_main_process(self) -> bool:
        """Under torchrun / accelerate launch every process runs the sweep; only the main one writes."""
        from scale_cl.experiments.train.prepare import process_state

        return process_state().is_main_process

    @staticmethod
    def check_target(target: float | None) -> None:
        """``--target`` is a new-domain perplexity."""
        if target is not None and target < 1:
            raise ValueError(f"--target {target:g}: cpt compares methods at a new-domain perplexity, >= 1")

    @staticmethod
    def refuse_sequence(cfg: Any) -> None:
        """A sweep point is one new domain."""
        if cfg.sequence.then:
            raise ValueError(
                "sweep cpt does not run a sequence of domains yet (sequence.then): run `scale-cl cpt --sequence.then "
                "...` at each rate instead"
            )

    def validate(self, cfg: Any) -> None:
        from scale_cl.experiments.train.prepare import base_model_config, validate

        self.refuse_sequence(cfg)
        if self._base_config is None:
            self._base_config = base_model_config(cfg)
        validate(cfg, self._base_config)
        if cfg.data.heldout_fraction <= 0 or not cfg.data.old_eval:
            raise ValueError(
                "a cpt sweep needs both a learning and a forgetting measurement: set data.heldout_fraction > 0 "
                "and data.old_eval NAME=SOURCE"
            )

    def prepare(self, out: Path) -> dict[str, float]:
        """Corpus, reference hidden states and the base model's evaluation (once, on the run's device and in its
        precision, as the runs evaluate); returns the base metrics."""
        from scale_cl.experiments.train.corpus import load_run_corpus
        from scale_cl.experiments.train.measure import evaluate_method, reference_hidden
        from scale_cl.experiments.train.prepare import base_model_ref, base_placement, process_state
        from scale_cl.models import load_base

        ref = base_model_ref(self.cfg)
        base, tokenizer = load_base(ref)
        corpus = load_run_corpus(self.cfg, tokenizer)
        reference = reference_hidden(self.cfg, base, corpus, out)
        path = out / BASE_FILE
        if path.is_file():
            initial = json.loads(path.read_text())
        else:
            print("[sweep] step 0: evaluating the base model once for every run")
            placement = base_placement(self.cfg)
            evaluate = evaluate_method(self.cfg, corpus, reference, base.config.hidden_size, placement.bf16)
            initial = evaluate(base.to(placement.device))
            if process_state().is_main_process:
                write_json(path, initial)
        del base
        self._state = {"ref": ref, "corpus": corpus, "reference": reference, "initial": initial, "out": out}
        return self._summary(initial)

    @staticmethod
    def _summary(record: dict[str, Any]) -> dict[str, float]:
        return {"learning": record["learning_ppl"], **{f"old/{k}": v for k, v in record["forgetting_ppl"].items()}}

    def covers(self, record: dict[str, Any]) -> bool:
        """Whether a finished point has exactly the seeds asked for (else it is run for the missing ones and its
        means are taken again; runs already done are read, not repeated)."""
        return sorted(record.get("seeds") or {}) == sorted(map(str, self.seeds)) if self.per_seed else True

    def _seed_dir(self, point_dir: Path, seed: int) -> Path:
        return point_dir / f"seed-{seed}" if self.per_seed else point_dir

    def run(self, cfg: Any, method: str, point_dir: Path) -> dict[str, float]:
        """Train the point once per seed (data order and initialisation); its metrics are the means over seeds."""
        from scale_cl.experiments.train.method import RunOptions, run_method

        s = self._state
        finals = []
        for seed in self.seeds:
            result = run_method(
                replace(cfg, seed=seed),
                s["ref"],
                s["corpus"],
                s["reference"],
                method,
                self._seed_dir(point_dir, seed),
                RunOptions(initial=s["initial"], save_model=self.save_models, pseudo_replay_cache=s["out"]),
            )
            if "curve" not in result:  # only the main process evaluates
                return {}
            finals.append(self._summary(result["curve"][-1]))
        return {key: statistics.fmean(f[key] for f in finals) for key in finals[0]}

    def seed_metrics(self, method: str, point_dir: Path) -> dict[str, dict[str, float]]:
        """Each seed's metrics of a finished point, read from its runs' files; empty without --seeds."""
        if not self.per_seed:
            return {}
        from scale_cl.experiments.cpt.report import result_path

        files = {s: result_path(self._seed_dir(point_dir, s), method) for s in self.seeds}
        return {str(s): self._summary(json.loads(f.read_text())["curve"][-1]) for s, f in files.items() if f.is_file()}

    def curves(self, method: str, point_dir: Path) -> list[list[dict[str, Any]]]:
        """Each seed's evaluation records of a finished point (learning, forgetting, drift, routing share)."""
        from scale_cl.experiments.cpt.report import result_path

        files = [result_path(self._seed_dir(point_dir, s), method) for s in self.seeds]
        return [json.loads(f.read_text())["curve"] for f in files]
