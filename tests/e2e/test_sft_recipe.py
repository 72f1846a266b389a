"""The CPT -> SFT recipe end to end (docs/usage.md, "Instruction tuning after continual pre-training"): a tiny
`scale-cl train` run (SCALE-Preserve), then examples/sft_after_cpt.py instruction-tunes its model with TRL, as it is
and grown by a new stage. Checked: what each stage trains, and what stays exact."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from scale_cl.experiments.train.pipeline import run_train
from scale_cl.models import load_trained
from scale_cl.tuner.layers import is_new_parameter
from scale_cl.tuner.modes import set_live_settings
from tests.e2e.test_train import config
from tests.exactness import assert_exact_to_rounding
from tests.train.test_stock_trainers import CHAT_TEMPLATE, QUESTIONS

pytest.importorskip("trl")
pytestmark = pytest.mark.exactness
EXAMPLE = Path(__file__).parents[2] / "examples" / "sft_after_cpt.py"


@pytest.fixture(scope="module")
def stage1(workspace, tmp_path_factory) -> tuple[Path, Path]:
    """(stage 1's model folder: 256 tokens of SCALE-Preserve continual pre-training, the SFT inputs' folder)."""
    root = tmp_path_factory.mktemp("recipe")
    run_train(config(workspace, [str(workspace / "new.jsonl")], tokens="256"), root / "cpt", command="test")
    lines = [{"prompt": [{"role": "user", "content": q}], "completion": [{"role": "assistant", "content": a}]}
             for q, a in QUESTIONS]  # fmt: skip
    (root / "chat.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (root / "chat.jinja").write_text(CHAT_TEMPLATE)
    return root / "cpt" / "model", root


def _sft(stage1: tuple[Path, Path], out: Path, *extra: str) -> None:
    model, inputs = stage1
    command = [sys.executable, str(EXAMPLE), str(model), str(inputs / "chat.jsonl"), str(out),
               "--chat_template", str(inputs / "chat.jinja"), "--max_steps", "3", "--batch_size", "4",
               "--lr", "1e-3", "--max_length", "64", *extra]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def _ids() -> torch.Tensor:
    return torch.randint(1, 300, (2, 16), generator=torch.Generator().manual_seed(5))


def _log_probs(model: torch.nn.Module) -> torch.Tensor:
    return torch.log_softmax(model(_ids()).logits, dim=-1)


def _assert_computes(model: torch.nn.Module, reference: torch.nn.Module, what: str) -> None:
    """``model``'s log-probabilities as close to ``reference``'s float64 ones as ``reference``'s fp32 ones are (the
    upscaled model sums over a wider hidden state: rounds differently, the same function)."""
    exact = _log_probs(copy.deepcopy(reference).double())
    assert_exact_to_rounding(_log_probs(model), exact, stock=_log_probs(reference), what=what)


@pytest.mark.slow
def test_sft_trains_the_new_weights_and_keeps_the_base_exact(stage1, workspace, tmp_path):
    _sft(stage1, tmp_path / "sft")
    cpt, _, method = load_trained(stage1[0])
    sft, _, sft_method = load_trained(tmp_path / "sft" / "model")
    assert sft_method == method == "scale_preserve"
    base = LlamaForCausalLM.from_pretrained(workspace / "base").state_dict()
    before, after = dict(cpt.named_parameters()), dict(sft.named_parameters())
    moved = [n for n in after if is_new_parameter(n) and not torch.equal(after[n], before[n])]
    assert moved, "stage 2 trained nothing"
    for name, param in after.items():
        if not is_new_parameter(name):  # the base's weights: frozen in both stages
            assert torch.equal(param, base[name]), name
    with torch.no_grad():  # Theorem 3.1 in stage 2: SCALE-Preserve's Z is still the base's logits
        sft.set_up_logit_scale(0.0)  # (read by the likelihood router, as `scale-cl train` saves it: log-probabilities)
        _assert_computes(sft, LlamaForCausalLM.from_pretrained(workspace / "base").eval(), "the base's log-probs")


@pytest.mark.slow
def test_sft_on_a_grown_model_keeps_stage_1_bitwise(stage1, tmp_path):
    _sft(stage1, tmp_path / "grown", "--grow", "32", "--grow_ffn", "16")
    cpt, _, _ = load_trained(stage1[0])
    grown, _, _ = load_trained(tmp_path / "grown" / "model")
    for model in (cpt, grown):  # each model's own logits, not a router's mixture with the base
        set_live_settings(model, router="cosine")
    assert len(grown.scale_state.stages) == 1, "stage 1 became the frozen base of a new stage"
    assert grown.scale_config.hidden_up == 32
    with torch.no_grad():  # stage 2 trained: the grown model no longer computes stage 1's
        assert not torch.allclose(_log_probs(grown), _log_probs(cpt), atol=1e-4)
        grown.set_up_logit_scale(0.0)  # its own new columns off: stage 1's model exactly (its weights unchanged)
        _assert_computes(grown, cpt, "stage 1's log-probs")
