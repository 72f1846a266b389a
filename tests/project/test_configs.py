"""The example recipes in ``configs/``: every ``configs/*.yaml`` is read as ``scale-cl train --config FILE``
reads it, into `TrainCommand` with every settings check run (`scale_cl.cli.command.Runner.settings`: the preset, the
YAML, then the settings' ``check()``), without loading a model or any data, and holds what its header says; every
``configs/accelerate/*.yaml`` is YAML that names the launch it is for.

How the data paths are handled: resolving the settings never reads them (the files are checked by the run and by
``--dry_run``, `scale_cl.data.corpus.check_corpus`, not by the settings), so each recipe is parsed in an empty
folder where none of its paths exists, with every way of building or loading a model made to fail the test; the
folder stays empty. The widths are then checked against each model's configuration as the run checks them
(`MethodSettings.validate`), from configurations built here with the models' published sizes (no download). The
eight-GPU recipe's ``--dry_run`` is tested with data files in place by ``tests/e2e/test_train.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from scale_cl.cli import parse_settings
from scale_cl.experiments.train.config import TrainCommand

CONFIGS = Path(__file__).parents[2] / "configs"
RECIPES = sorted(CONFIGS.glob("*.yaml"))

# What each recipe is: (model, method, train.precision, train.device, data.extend_vocab, train.tokens), and the
# shape its widths are checked against.
LLAMA, QWEN = "meta-llama/Llama-3.2-1B", "Qwen/Qwen2.5-0.5B"
EXPECTED = {
    "train-smollm2-cpu.yaml": ("smollm2", "scale_preserve", "fp32", "cpu", 0, "1M", "smollm2"),
    "train-llama-3.2-1b-1gpu.yaml": (LLAMA, "scale_preserve", "bf16", "cuda", 0, "2B", "llama-1b"),
    "train-llama-3.2-1b-8gpu.yaml": (LLAMA, "scale_preserve", "bf16", "auto", 0, "60B", "llama-1b"),
    "train-qwen2.5-0.5b-vocab.yaml": (QWEN, "scale_preserve", "bf16", "cuda", 4096, "2B", "qwen2.5-0.5b"),
}


def model_config(shape: str):
    """The model's configuration, from its published sizes (SmolLM2 and Llama: scale-cl's own copies of their
    shapes, `scale_cl.bench.shapes`; Qwen2.5-0.5B's config.json on the hub, written out here)."""
    from transformers import Qwen2Config

    from scale_cl.bench.shapes import SHAPES

    if shape == "qwen2.5-0.5b":
        return Qwen2Config(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
        )
    return SHAPES[shape].make_config()


def test_every_recipe_is_listed_here():
    assert {path.name for path in RECIPES} == set(EXPECTED), "a recipe without its expectations (or one removed)"


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_a_recipe_parses_and_passes_the_settings_check_without_a_model_or_data(path, no_model):
    settings = parse_settings(["train", "--config", str(path)])
    assert isinstance(settings, TrainCommand)
    cfg = settings.train
    model, method, precision, device, extend_vocab, tokens, _ = EXPECTED[path.name]
    assert (cfg.model, cfg.method, cfg.train.precision, cfg.train.device) == (model, method, precision, device)
    assert (cfg.data.extend_vocab, cfg.train.tokens) == (extend_vocab, tokens)
    assert cfg.read_with == "likelihood"  # SCALE-Preserve read with the likelihood router, as the headers say
    assert cfg.data.train and cfg.data.old_eval and cfg.data.heldout_fraction > 0  # learning and forgetting measured
    assert cfg.train.batch_size % cfg.train.micro_batch_size == 0
    steps = -(-cfg.train.token_budget // (cfg.train.batch_size * cfg.data.seq_len))
    assert steps >= 100, f"{steps} steps"  # a budget that trains, with a schedule to warm up on
    assert not list(no_model.iterdir()), "reading the settings wrote something"


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_a_recipe_s_widths_fit_its_model(path, no_model):
    """What the run checks against the model's configuration before its weights load (SCALE's widths in whole GQA
    groups of heads, L_fp within the layers), here against the published sizes."""
    cfg = parse_settings(["train", "--config", str(path)]).train
    config = model_config(EXPECTED[path.name][-1])
    cfg.options.validate(config, cfg.methods)
    assert cfg.options.scale.preserve_layers <= config.num_hidden_layers


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_a_recipe_s_header_gives_the_commands_that_run_it(path):
    text = path.read_text()
    header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    relative = f"configs/{path.name}"
    assert re.search(rf"scale-cl train --config {re.escape(relative)} --dry_run", header), "the plan command"
    runs = [line for line in header.splitlines() if "train --config " + relative in line and "--dry_run" not in line]
    assert runs, "the command that trains"
    assert yaml.safe_load(text)  # and the rest is YAML


def test_the_eight_gpu_recipe_runs_under_fsdp2():
    """The recipe names the FSDP2 launch and sets nothing that sharded weights refuse
    (`scale_cl.experiments.train.prepare.validate`: a quantized base, automatic layers, WiSE-FT, the two-model
    control)."""
    path = CONFIGS / "train-llama-3.2-1b-8gpu.yaml"
    assert "configs/accelerate/fsdp2.yaml" in path.read_text()
    cfg = parse_settings(["train", "--config", str(path)]).train
    assert cfg.options.base_quant == "none" and not cfg.options.auto_layers
    assert not cfg.eval.wise_ft_alphas and not cfg.eval.likelihood_control
    assert cfg.train.batch_size % (cfg.train.micro_batch_size * 8) == 0  # whole micro-batches on each of 8 GPUs


ACCELERATE = {
    "ddp.yaml": "MULTI_GPU",
    "fsdp2.yaml": "FSDP",
    "deepspeed_zero3.yaml": "DEEPSPEED",
}


def test_every_accelerate_config_is_listed_here():
    assert {p.name for p in (CONFIGS / "accelerate").glob("*.yaml")} == set(ACCELERATE)


@pytest.mark.parametrize("name", sorted(ACCELERATE))
def test_an_accelerate_config_names_its_launch(name):
    path = CONFIGS / "accelerate" / name
    config = yaml.safe_load(path.read_text())
    assert config["distributed_type"] == ACCELERATE[name]
    assert config["compute_environment"] == "LOCAL_MACHINE" and config["num_machines"] == 1
    assert config["mixed_precision"] == "no"  # precision is the command's (--train.precision), not accelerate's
    assert config["use_cpu"] is False
    assert f"--config_file configs/accelerate/{name}" in path.read_text()  # its header says how to launch it
    if name == "fsdp2.yaml":
        fsdp = config["fsdp_config"]
        assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
        assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    if name == "deepspeed_zero3.yaml":
        assert config["deepspeed_config"]["zero_stage"] == 3
