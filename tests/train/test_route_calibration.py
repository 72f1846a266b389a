"""SCALE-Route's tau chosen from data: the share it targets, Eq. 5 with it, resume, settings."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from scale_cl import load, set_method
from scale_cl.experiments.cpt.pipeline import run_cpt
from scale_cl.models import load_trained
from scale_cl.train.route_calibration import calibrate_route_tau, route_cosines, sequence_batches, tau_for_share
from scale_cl.train.trainer import CheckpointingTrainer
from tests.conftest import tiny_config
from tests.tuner.routing.test_route import (
    assert_eq5,
    base_hidden_size,
    eq5_references,
    input_batch,
    reference_route,
    scale_model,
)

pytestmark = pytest.mark.exactness


@pytest.mark.parametrize("share", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_tau_routes_exactly_the_share_of_distinct_cosines(share):
    cosines = torch.rand(1000, generator=torch.Generator().manual_seed(0)) * 2 - 1
    tau = tau_for_share(cosines, share)
    assert -1.0 <= tau <= 1.0
    assert int((cosines > tau).sum()) == round(share * 1000)


def test_ties_route_the_nearest_share_they_allow():
    tied = torch.tensor([0.9, 0.7, 0.7, 0.7, 0.7, 0.2])
    assert int((tied > tau_for_share(tied, 0.6)).sum()) == 5  # 4 wanted: 1 (above the tie) or 5 (through it)
    assert int((tied > tau_for_share(tied, 0.5)).sum()) == 1  # 3 wanted: as far from 1 as from 5; fewer it is
    assert int((tied > tau_for_share(tied, 0.34)).sum()) == 1  # 2 wanted: 1 is nearer than 5
    ones = torch.ones(8)  # every cosine at init, when W12 = 0 and both paths are one
    assert int((ones > tau_for_share(ones, 0.9)).sum()) == 8 and int((ones > tau_for_share(ones, 0.2)).sum()) == 0
    with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
        tau_for_share(tied, 1.5)


@pytest.mark.parametrize("arch", ["llama-gqa2-tied", "neox-parallel-rot0.25"])
@pytest.mark.parametrize("share", [0.25, 0.8])
def test_calibrated_tau_reproduces_its_share_on_the_sample_and_is_eq5_with_that_tau(arch, share):
    model = scale_model(arch, preserve_layers=1)
    sample = input_batch(batch=4, length=10, seed=2)
    tau = calibrate_route_tau(model, sequence_batches(sample, 3), share)
    assert model.scale_route.tau == tau == model.scale_config.route_tau, "the model's threshold, saved config too"
    assert -1.0 < tau < 1.0
    with torch.no_grad():
        logits = model(sample).logits
    assert int(model.scale_route.last.routed.sum()) == round(share * sample.numel())
    _, _, cos = reference_route(model, base_hidden_size(arch), sample, tau)
    assert (cos - tau).abs().min() > 1e-5, "no token within rounding of tau: the reference decides as route does"
    stock, exact, to_preserve = eq5_references(model, base_hidden_size(arch), sample, tau)
    assert torch.equal(model.scale_route.last.routed, to_preserve)
    assert_eq5(logits, stock, exact)
    assert torch.equal(route_cosines(model, sequence_batches(sample, 4)), model.scale_route.last.cosine.flatten())


def test_calibration_needs_route_mode_and_the_tau_is_saved(tmp_path):
    model = scale_model("llama-gqa2-tied")
    sample = input_batch()
    tau = calibrate_route_tau(model, sequence_batches(sample), 0.6)
    model.save_pretrained(tmp_path / "saved", full=True)
    assert load(tmp_path / "saved").scale_route.tau == tau
    set_method(model, "adapt")
    with pytest.raises(ValueError, match="needs a model in SCALE-Route mode"):
        calibrate_route_tau(model, sequence_batches(sample), 0.6)


def _cfg(workspace, **options):
    cfg = tiny_config(workspace, ["scale_route"], steps=6, save_every=2)
    data = replace(cfg.data, replay=[f"toy={workspace / 'old.jsonl'}"])
    defaults = {"route_share": 0.9, "route_calibrate_every": 3, "route_calibration_sequences": 4}
    return replace(cfg, data=data, options=replace(cfg.options, **{**defaults, **options}))


def _taus(path) -> dict[int, float]:
    return {record["step"]: record["route_tau"] for record in json.loads(path.read_text())["curve"]}


@pytest.mark.slow
def test_cpt_recalibrates_during_training_and_a_resumed_run_keeps_the_same_taus(workspace, tmp_path, monkeypatch):
    cfg = _cfg(workspace)
    run_cpt(cfg, tmp_path / "straight")
    straight = _taus(tmp_path / "straight" / "scale_route" / "result.json")
    # Calibrated at steps 0 and 3 (before the evaluation there); evaluated at 0, 3 and 6.
    assert list(straight) == [0, 3, 6] and straight[0] != straight[3] == straight[6], "tau changes as W12 trains"
    model, _, _ = load_trained(tmp_path / "straight" / "scale_route" / "model")
    assert model.scale_route.tau == straight[6], "the saved model keeps the last tau (calibrated at step 3)"

    step = CheckpointingTrainer.training_step

    def crash_after_step_three(self, *args, **kwargs):
        if self.state.global_step == 3:
            raise KeyboardInterrupt("interrupted after checkpoint-2")
        return step(self, *args, **kwargs)

    monkeypatch.setattr(CheckpointingTrainer, "training_step", crash_after_step_three)
    with pytest.raises(KeyboardInterrupt):
        run_cpt(cfg, tmp_path / "resumed")
    monkeypatch.setattr(CheckpointingTrainer, "training_step", step)
    run_cpt(cfg, tmp_path / "resumed")  # from checkpoint-2
    result = json.loads((tmp_path / "resumed" / "scale_route" / "result.json").read_text())
    # The resumed run records the uninterrupted run's evaluations, no more (step 2 is not on the schedule), and
    # trains steps 2-3 with step 0's tau, read from checkpoint-2 (calibrated afresh on step 2's weights it would
    # route another share, and the last evaluation would differ)
    assert _taus(tmp_path / "resumed" / "scale_route" / "result.json") == straight
    assert (
        result["curve"][-1]["learning_ppl"]
        == json.loads((tmp_path / "straight" / "scale_route" / "result.json").read_text())["curve"][-1]["learning_ppl"]
    )


def test_calibration_without_old_domain_text_is_refused_before_anything_is_written(workspace, tmp_path):
    cfg = _cfg(workspace)
    cfg = replace(cfg, data=replace(cfg.data, replay=[]))
    with pytest.raises(ValueError, match="route_share calibrates its tau on old-domain text"):
        run_cpt(cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=r"route_share must be in \[0, 1\]"):
        replace(cfg.options, route_share=1.5)


@pytest.mark.slow
def test_bio_calibrates_on_task0_training_questions(tmp_path, monkeypatch):
    import scale_cl.experiments.bio.pipeline as bio
    from scale_cl.experiments.bio.config import preset
    from scale_cl.experiments.overrides import apply_overrides
    from scale_cl.train.route_calibration import RouteCalibration

    taus, real = [], RouteCalibration._calibrate

    def recorded(self):
        assert all("attention_mask" in batch for batch in self.batches), "padded questions: pads are left out"
        real(self)
        taus.append(self.tau)

    monkeypatch.setattr(RouteCalibration, "_calibrate", recorded)
    options = {"route_share": 0.9, "route_calibrate_every": 2, "route_calibration_sequences": 8}
    cfg = apply_overrides(preset("micro"), {"methods": ["scale_route"], "seeds": [0], "options": options})
    bio.run_bio(cfg, tmp_path / "run")
    assert len(taus) == 2, "before training and after step 2 of 4"
    assert all(-1.0 <= tau <= 1.0 for tau in taus) and 0.5 not in taus
