"""Per-group learning rates: W12 at a multiple of the SCALE method's rate."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import TrainingArguments

from scale_cl.experiments.cpt.pipeline import run_cpt
from scale_cl.experiments.settings import MethodSettings
from scale_cl.experiments.sweep.runner import concerns
from scale_cl.models import load_trained
from scale_cl.train.trainer import CheckpointingTrainer
from tests.conftest import make_model, tiny_config, upscaled_copy


def _trainer(model, tmp_path, lr_ratios):
    args = TrainingArguments(output_dir=str(tmp_path), learning_rate=1e-3, lr_scheduler_type="linear", use_cpu=True)
    return CheckpointingTrainer(model=model, args=args, lr_ratios=lr_ratios)


def test_w12_gets_its_own_groups_at_the_ratio_under_the_same_schedule(tmp_path):
    model = upscaled_copy(make_model("llama-gqa2-tied"), "adapt")
    trainer = _trainer(model, tmp_path, {".w12": 0.1})
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    names = {id(p): n for n, p in model.named_parameters()}
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    grouped = [id(p) for g in trainer.optimizer.param_groups for p in g["params"]]
    assert sorted(grouped) == sorted(trained), "every trained parameter in exactly one group"
    base_rates = []
    for _ in range(4):
        rates = {}
        for group in trainer.optimizer.param_groups:
            kinds = {names[id(p)].endswith(".w12") for p in group["params"]}
            assert len(kinds) == 1, "a group holds W12 blocks only or none"
            rates.setdefault(kinds.pop(), set()).add(group["lr"])
        assert len(rates[False]) == len(rates[True]) == 1
        assert rates[True].pop() == pytest.approx(0.1 * rates[False].pop())
        base_rates.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.optimizer.step()  # no gradients: moves nothing, keeps the scheduler call order
        trainer.lr_scheduler.step()
    assert base_rates == sorted(base_rates, reverse=True) and base_rates[0] > base_rates[-1], "the schedule applies"


def test_a_suffix_that_names_no_parameter_is_refused(tmp_path):
    model = make_model("llama-gqa2-tied")
    with pytest.raises(ValueError, match=r"no parameter name ends with \['.w12'\]"):
        _trainer(model, tmp_path, {".w12": 0.5}).create_optimizer()


@pytest.mark.parametrize("ratio", [1.0, 0.1])
def test_one_adam_step_moves_w12_by_the_ratio_times_the_rate(workspace, tmp_path, ratio):
    cfg = tiny_config(workspace, ["scale_adapt"], steps=1, save_every=0)
    cfg = replace(
        cfg,
        train=replace(cfg.train, schedule="constant", method_lr={"scale_adapt": 1e-3}),
        options=replace(cfg.options, w12_lr_ratio=ratio),
    )
    run_cpt(cfg, tmp_path)
    model, _, _ = load_trained(tmp_path / "scale_adapt" / "model")
    w12 = torch.cat([p.detach().flatten() for n, p in model.named_parameters() if n.endswith(".w12")])
    w21 = torch.cat([p.detach().flatten() for n, p in model.named_parameters() if n.endswith(".w21")])
    # Adam's first step from W12 = 0 moves each entry by lr x g / (|g| + eps): at most the rate, about it for most
    assert w12.abs().max().item() == pytest.approx(1e-3 * ratio, rel=1e-3)
    assert w21.abs().max().item() > 0  # the rest trains (from its random start) at the method's rate


def test_only_the_methods_that_train_w12_read_the_ratio():
    settings = MethodSettings(w12_lr_ratio=0.25)
    assert settings.lr_ratios("scale_adapt") == settings.lr_ratios("scale_route") == {".w12": 0.25}
    assert settings.lr_ratios("scale_preserve") == settings.lr_ratios("fft") == {}
    assert MethodSettings().lr_ratios("scale_route") == {}
    assert concerns("options.w12_lr_ratio", "scale_route") and not concerns("options.w12_lr_ratio", "lora")
    with pytest.raises(ValueError, match=r"options\.w12_lr_ratio must be > 0, got 0"):
        MethodSettings(w12_lr_ratio=0)
