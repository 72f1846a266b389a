"""SCALE's collaborative layers chosen from a forgetting budget by probe runs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from scale_cl.experiments.cpt.pipeline import run_cpt
from scale_cl.experiments.train.layer_choice import CHOICE_FILE, LayerProbe, candidate_layers, choose
from scale_cl.models import load_trained
from tests.conftest import tiny_config


def _p(layers: int, learning: float, forgetting: float, modules=("attn", "ffn")) -> LayerProbe:
    return LayerProbe(layers, modules, learning, forgetting)


def test_the_most_learning_within_the_budget_is_chosen():
    # More collaborative layers learn more and forget more; a budget of 0.1 admits L_fp >= 12 only.
    probes = [_p(0, 0.50, 0.20), _p(6, 0.45, 0.08), _p(12, 0.40, 0.03), _p(18, 0.30, 0.01), _p(29, 0.10, 0.0)]
    best, why = choose(probes, 0.1)
    assert best.preserve_layers == 12 and "3 of 5" in why
    assert choose(probes, 1.0)[0].preserve_layers == 0  # a generous budget takes the most learning
    assert choose(probes, 0.0)[0].preserve_layers == 29  # no forgetting allowed: only the zero-forgetting probe


def test_ties_take_fewer_collaborative_weights_and_no_fit_takes_the_least_forgetting():
    tied = [_p(6, 0.4, 0.01), _p(12, 0.4, 0.01), _p(12, 0.4, 0.01, ("attn",))]
    assert choose(tied, 0.1)[0] == _p(12, 0.4, 0.01, ("attn",))
    over = [_p(0, 0.5, 0.4), _p(6, 0.3, 0.2), _p(12, -0.1, 0.3)]  # none within 0.1 x learning
    best, why = choose(over, 0.1)
    assert best.preserve_layers == 6 and "forgets least" in why


def test_candidates_span_the_depth_and_include_the_top_layer_alone():
    assert candidate_layers(30) == [0, 6, 12, 18, 24, 29]
    assert candidate_layers(3) == [0, 1, 2]
    assert candidate_layers(1) == [0]


def _cfg(workspace, **options):
    cfg = tiny_config(workspace, ["scale_adapt"], steps=4, save_every=2)
    data = replace(cfg.data, replay=[f"toy={workspace / 'old.jsonl'}"])
    settings = {"auto_layers": True, "auto_layers_steps": 2, "auto_layers_budget": 0.5, **options}
    return replace(cfg, data=data, options=replace(cfg.options, **settings))


@pytest.mark.slow
def test_cpt_probes_chooses_by_its_own_measurements_and_trains_with_the_choice(workspace, tmp_path, capsys):
    cfg = _cfg(workspace)
    run_cpt(cfg, tmp_path)
    record = json.loads((tmp_path / "scale_adapt" / CHOICE_FILE).read_text())
    probes = [
        LayerProbe(p["preserve_layers"], tuple(p["collab_modules"]), p["learning"], p["forgetting"])
        for p in record["probes"]
    ]
    assert [(p.preserve_layers, p.collab_modules) for p in probes[:3]] == [
        (0, ("attn", "ffn")),
        (1, ("attn", "ffn")),
        (2, ("attn", "ffn")),
    ]
    assert {p.collab_modules for p in probes[3:]} == {("attn",), ("ffn",)}
    assert all(p.learning != 0 for p in probes), "every probe trained and was measured"
    best, why = choose(probes, 0.5)
    assert record["chosen"] == {"preserve_layers": best.preserve_layers, "collab_modules": list(best.collab_modules)}
    assert record["why"] == why
    result = json.loads((tmp_path / "scale_adapt" / "result.json").read_text())
    assert result["layer_choice"] == record
    model, _, _ = load_trained(tmp_path / "scale_adapt" / "model")
    assert model.scale_config.preserve_layers == best.preserve_layers
    assert model.scale_config.collab_modules == best.collab_modules
    assert "chosen: L_fp" in capsys.readouterr().out
    assert not (tmp_path / "scale_adapt" / "probe").exists(), "probes leave no training folder behind"


def test_auto_layers_without_old_domain_text_is_refused_before_anything_is_written(workspace, tmp_path):
    cfg = _cfg(workspace)
    cfg = replace(cfg, data=replace(cfg.data, replay=[]))
    with pytest.raises(ValueError, match="auto_layers measures forgetting on old-domain text"):
        run_cpt(cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    cfg = _cfg(workspace, auto_layers_steps=10_000)
    with pytest.raises(ValueError, match="needs 40016 training sequences"):
        run_cpt(cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()
