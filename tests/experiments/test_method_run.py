"""One method's run (`scale_cl.experiments.method_run`): which readings each experiment asks for which method.

The runs themselves are exercised end to end by the bio and cpt pipeline tests."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from scale_cl.eval.mixture import MIXTURE_ROUTERS
from scale_cl.experiments.bio import config as bio_config
from scale_cl.experiments.bio.pipeline import Task1Run
from scale_cl.experiments.cpt import config as cpt_config
from scale_cl.experiments.train.method import CorpusRun
from scale_cl.methods import METHOD_NAMES


def _read_along_alpha(runs: dict) -> set[str]:
    return {method for method, run in runs.items() if run.read_plan.frontier is not None}


def test_bio_reads_the_models_whose_base_logits_are_exact_with_every_mixing_router(tmp_path: Path):
    cfg = bio_config.preset("micro")
    runs = {m: Task1Run(cfg, None, tmp_path / "task0", m, 0, tmp_path) for m in METHOD_NAMES}
    assert _read_along_alpha(runs) == {"scale_preserve", "scale_route"}
    route = runs["scale_route"]
    assert route.read_plan.frontier == cfg.task1.reading_alphas and route.read_plan.routers == MIXTURE_ROUTERS
    assert route.result_path == tmp_path / "seed-0" / "scale_route.json"
    assert route.read_plan.frontier_key == route.read_plan.wise_ft_key == "readings"


def test_cpt_weighs_every_scale_models_new_logits_when_alphas_are_asked(tmp_path: Path):
    cfg = cpt_config.preset("smollm2")
    runs = {m: CorpusRun(cfg, None, None, None, m, tmp_path) for m in METHOD_NAMES}
    assert _read_along_alpha(runs) == set(), "no eval.up_logit_scales: no frontier"
    cfg = replace(cfg, eval=replace(cfg.eval, up_logit_scales=(0.5, 1.0)))
    runs = {m: CorpusRun(cfg, None, None, None, m, tmp_path) for m in METHOD_NAMES}
    assert _read_along_alpha(runs) == {"scale_preserve", "scale_adapt", "scale_route"}
    assert runs["fft"].result_path == tmp_path / "fft" / "result.json"
    assert runs["fft"].read_plan.wise_ft_key == "wise_ft_frontier"
