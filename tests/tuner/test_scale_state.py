"""The typed SCALE state: one `ScaleState` per upscaled model holds its shape and its readout, every part of the
model reads it there, and nothing reads the state by string keys from the model's config."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest

from scale_cl import ScaleConfig, scale_config_of, upscale
from scale_cl.tuner.modes import set_live_settings
from scale_cl.tuner.scale_state import ScaleState, StageRecord, scale_state_of
from tests.conftest import make_model, upscaled_copy

ROOT = Path(__file__).parents[2]


def test_no_code_reads_the_state_from_the_config_by_string_keys():
    """``config.scale_cl`` (the untyped dict the state once was) is gone: no module of src, scripts, examples or
    tests touches an attribute of that name."""
    found = []
    for folder in ("src", "scripts", "examples", "tests", "measurements"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr == "scale_cl":
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found


def test_the_check_sees_an_attribute_read():
    tree = ast.parse("model.config.scale_cl['config']")
    assert any(isinstance(n, ast.Attribute) and n.attr == "scale_cl" for n in ast.walk(tree))


def test_an_upscaled_model_holds_one_typed_state_that_its_route_reads():
    model = upscaled_copy(make_model("llama-gqa2-tied"), "route", preserve_layers=1)
    state = scale_state_of(model)
    assert isinstance(state, ScaleState) and isinstance(state.config, ScaleConfig)
    assert state.base_class == "LlamaForCausalLM" and state.stages == [] and state.arch == "model"
    assert model.scale_route.scale is state, "the route reads the same object"
    assert not hasattr(model.config, "scale_cl"), "nothing SCALE's in the transformers config"
    set_live_settings(model, route_tau=0.25)
    assert model.scale_route.setting("route_tau") == 0.25 == state.config.route_tau
    copied = copy.deepcopy(model)
    assert copied.scale_route.scale is copied.scale_state is not state, "a copy has its own state, shared alike"


def test_scale_config_of_is_a_copy_to_change_freely():
    model = upscaled_copy(make_model("llama-gqa2-tied"), "preserve")
    cfg = scale_config_of(model)
    cfg.route_tau = -0.5
    assert scale_state_of(model).config.route_tau != -0.5


def test_a_grown_model_records_its_earlier_stages_typed():
    model = upscaled_copy(make_model("llama-gqa2-tied"), "preserve")
    first = scale_config_of(model)
    model = upscale(model, ScaleConfig(hidden_up=32, ffn_up=8, method="adapt", preserve_layers=1))
    (stage,) = scale_state_of(model).stages
    assert isinstance(stage, StageRecord) and stage.config == first and stage.added > 0
    assert StageRecord.from_dict(stage.to_dict()) == stage
    assert scale_state_of(model).stage_widths() == (model.scale_state.base["dims"]["hidden"], first.hidden_up)


def test_a_model_never_upscaled_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match=r"not upscaled by scale_cl; call scale_cl.tuner.upscale"):
        scale_state_of(make_model("llama-gqa2-tied"))
