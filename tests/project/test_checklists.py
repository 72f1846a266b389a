"""docs/design.md §0's checklists, each followed once here: a family, a method and a command added in this file alone
work with the rest of scale-cl (a router is added the same way in test_routers.py, and exported)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM, TrainingArguments

import scale_cl.cli as cli
from scale_cl.cli.command import Command
from scale_cl.experiments.presets import load_preset
from scale_cl.experiments.run_folder import claim_output_folder
from scale_cl.methods import REGISTRY, MethodSpec, method_options, prepare
from scale_cl.train.recipe import train_model
from scale_cl.tuner.arch import SPECS, spec_for
from scale_cl.tuner.arch.llama import LLAMA, LlamaLayerApart
from scale_cl.tuner.scale_state import decoder_layers
from scale_cl.tuner.streams import StreamsApartLayer
from tests.conftest import make_model, token_batch, upscaled_copy
from tests.exactness import assert_exact_to_rounding

# ------------------------------------------------------------------------------------------------------------------
# Add a family: one file with its ArchSpec (and, optionally, its layer with the streams apart), one entry in SPECS.


class NewFamilyForCausalLM(LlamaForCausalLM):
    """A family transformers would ship as its own classes (here Llama's, under another name)."""


# its data: Llama's module layout under the new family's name (a real family writes its own, as tuner/arch/llama.py)
NEW_FAMILY = replace(LLAMA, family="new_family", layer_apart=None)


def _new_family_model(dtype: torch.dtype = torch.float32) -> NewFamilyForCausalLM:
    stock = make_model("llama-gqa2-tied")
    model = NewFamilyForCausalLM(stock.config)
    model.load_state_dict(stock.state_dict())
    return model.to(dtype).eval()


@pytest.mark.parametrize("layer_apart", [None, LlamaLayerApart], ids=["joined", "apart"])
@pytest.mark.parametrize("method", ["preserve", "adapt", "route"])
def test_a_family_added_by_its_spec_alone_preserves_the_base(monkeypatch, method, layer_apart):
    monkeypatch.setitem(SPECS, NewFamilyForCausalLM.__name__, replace(NEW_FAMILY, layer_apart=layer_apart))
    base = _new_family_model()
    assert spec_for(base).family == "new_family"
    model = upscaled_copy(base, method)
    keeps_apart = [isinstance(layer, StreamsApartLayer) for layer in decoder_layers(model)]
    assert keeps_apart == [layer_apart is not None] * len(keeps_apart)
    ids, mask = token_batch()
    with torch.no_grad():
        exact = _new_family_model(torch.float64)(input_ids=ids, attention_mask=mask).logits
        stock = base(input_ids=ids, attention_mask=mask).logits
        got = model(input_ids=ids, attention_mask=mask).logits
    assert_exact_to_rounding(got, exact, stock=stock, what=f"new family, {method}")


def test_a_family_with_its_layer_apart_computes_the_joined_layers_logits_bitwise(monkeypatch):
    monkeypatch.setitem(SPECS, NewFamilyForCausalLM.__name__, replace(NEW_FAMILY, layer_apart=LlamaLayerApart))
    model = upscaled_copy(_new_family_model(), "route")
    ids, mask = token_batch()
    with torch.no_grad():
        apart = model(input_ids=ids, attention_mask=mask).logits
        for layer in decoder_layers(model):
            layer.keep_streams_apart = False
        joined = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(apart, joined)


# ------------------------------------------------------------------------------------------------------------------
# Add a method: its prepare and describe functions, one REGISTRY entry with its traits and the settings it reads.


def prepare_norm_tuning(model: torch.nn.Module) -> torch.nn.Module:
    """Train the norms' weights alone (LayerNorm tuning, Zhao et al. 2023)."""
    spec = spec_for(model)
    backbone = getattr(model, spec.backbone)
    norms = [getattr(backbone, spec.final_norm)]
    norms += [getattr(layer, name) for layer in backbone.layers for name in spec.layer_norms]
    trained = {id(p) for norm in norms for p in norm.parameters()}
    for param in model.parameters():
        param.requires_grad_(id(param) in trained)
    return model


def describe_norm_tuning(model: torch.nn.Module, options: dict) -> str:
    return "the norms' weights train"


NORM_TUNING = MethodSpec(
    "norm_tuning",
    "Norm tuning",
    f"{__name__}:prepare_norm_tuning",
    f"{__name__}:describe_norm_tuning",
    wise_ft=True,
    reads=("base_quant", "distill_weight", "distill_temperature", "distill_new_tokens"),
)


def test_a_method_added_by_its_registry_entry_trains_exactly_what_it_says(monkeypatch, tmp_path):
    monkeypatch.setitem(REGISTRY, "norm_tuning", NORM_TUNING)
    model = prepare(make_model("llama-gqa2-tied"), "norm_tuning")
    assert method_options("norm_tuning") == ()
    assert NORM_TUNING.describe_function()(model, {}) == "the norms' weights train"
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained and all("norm" in name for name in trained)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids, _ = token_batch(padded=False, rows=4)
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, learning_rate=1e-2, report_to=[],
        use_cpu=True, save_strategy="no",
    )  # fmt: skip
    train_model(model.train(), data, args)
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert changed == trained  # the norms moved, every other weight bitwise as it was


# ------------------------------------------------------------------------------------------------------------------
# Add a command: a settings dataclass, a Command in the list, outputs under a claimed run folder; presets as files.


@dataclass
class GreetSettings:
    """``scale-cl greet``'s settings."""

    preset: str = field(default="plain", metadata={"help": "starting point", "choices": ("plain", "loud")})
    name: str = field(default="world", metadata={"help": "who to greet"})
    times: int = field(default=1, metadata={"ge": 1, "help": "how many greetings"})
    shout: bool = field(default=False, metadata={"help": "in capitals"})
    out: str = field(default="greetings", metadata={"help": "output folder"})


def run_greet(settings: GreetSettings) -> int:
    out = Path(settings.out)
    claim_output_folder(out, "greet_config.json", {"name": settings.name, "shout": settings.shout})
    text = f"hello {settings.name}"
    (out / "greetings.txt").write_text("\n".join([text.upper() if settings.shout else text] * settings.times))
    return 0


def greet_command(presets: Path) -> Command:
    return Command(
        "greet",
        help="greet someone",
        description="Writes greetings into a folder.",
        settings=lambda name="plain": load_preset(GreetSettings(), "greet", name, ("plain", "loud"), presets),
        run=run_greet,
        presets=True,
    )


@pytest.fixture
def greet(monkeypatch, tmp_path):
    presets = tmp_path / "presets"
    (presets / "greet").mkdir(parents=True)
    (presets / "greet" / "plain.yaml").write_text("# the defaults\n{}\n")
    (presets / "greet" / "loud.yaml").write_text("# shouting, twice\nshout: true\ntimes: 2\n")
    every = cli.commands()
    monkeypatch.setattr(cli, "commands", lambda: (*every, greet_command(presets)))
    return tmp_path


def test_a_command_added_to_the_list_takes_options_a_config_file_and_presets(greet, capsys):
    out = greet / "run"
    config = greet / "greet.yaml"
    config.write_text("name: Ada\n")
    assert cli.main(["greet", "--preset", "loud", "--config", str(config), "--out", str(out)]) == 0
    assert (out / "greetings.txt").read_text() == "HELLO ADA\nHELLO ADA"
    assert json.loads((out / "greet_config.json").read_text()) == {"name": "Ada", "shout": True}
    assert cli.main(["greet", "--name", "Bo", "--out", str(greet / "other")]) == 0
    assert (greet / "other" / "greetings.txt").read_text() == "hello Bo"
    with pytest.raises(SystemExit):
        cli.main(["greet", "--help"])
    assert "how many greetings" in capsys.readouterr().out


def test_a_command_refuses_bad_input_before_it_writes(greet, capsys):
    out = greet / "run"
    assert cli.main(["greet", "--times", "0", "--out", str(out)]) == 2
    assert "times" in capsys.readouterr().err and not out.exists()
    assert cli.main(["greet", "--out", str(out)]) == 0
    assert cli.main(["greet", "--name", "Cy", "--out", str(out)]) == 2  # the folder holds another greeting's settings
    assert "name" in capsys.readouterr().err and (out / "greetings.txt").read_text() == "hello world"


def test_every_checklist_names_a_test_that_follows_it():
    design = (Path(__file__).resolve().parents[2] / "docs" / "design.md").read_text()
    for checklist in ("Add a method", "Add a router", "Add a family", "Add a command"):
        assert f"**{checklist}.**" in design
