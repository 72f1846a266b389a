"""Where a run's base model is recorded: a local folder as its absolute path, so that a trained model is
loaded, evaluated and exported from any directory; a moved base refused with the recorded path and what to do; a
model name meant as a local path that does not exist refused at once, without asking the hub."""

from __future__ import annotations

import shutil

import pytest
import torch

from scale_cl import ScaleConfig, load, upscale
from scale_cl.models import BaseModelRef, load_base, load_trained, save_trained


def test_a_local_base_is_recorded_by_its_absolute_path_and_a_missing_one_refused_at_once(tmp_path, monkeypatch):
    (tmp_path / "ws" / "base").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert BaseModelRef.parse("ws/base").name_or_path == str(tmp_path / "ws" / "base")
    for missing in ("ws/nomodel", "./nomodel", "nomodel.gguf", "a/b/c"):
        with pytest.raises(FileNotFoundError, match=f"model '{missing}': no such folder or file"):
            BaseModelRef.parse(missing)  # no hub request: the name is a local path
    assert BaseModelRef.parse("org/model").name_or_path == "org/model"  # a hub id stays one


@pytest.fixture
def trained_from_a_relative_path(workspace, tmp_path, monkeypatch):
    """A SCALE-Preserve model trained (its new weights set) from a base given as ``ws/base`` in ``tmp_path``."""
    shutil.copytree(workspace / "base", tmp_path / "ws" / "base")
    monkeypatch.chdir(tmp_path)
    ref = BaseModelRef.parse("ws/base")
    base, tokenizer = load_base(ref)
    model = upscale(base, ScaleConfig(hidden_up=32, ffn_up=8, method="preserve"))
    with torch.no_grad():
        model.lm_head.weight_up.normal_(0, 0.5)
    save_trained(model, tokenizer, "scale_preserve", ref, tmp_path / "run" / "model")
    ids = torch.tensor([[1, 5, 9, 12]])
    with torch.no_grad():
        logits = model.eval()(input_ids=ids).logits
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    return tmp_path / "run" / "model", ids, logits


def test_a_trained_model_loads_from_any_directory(trained_from_a_relative_path):
    folder, ids, logits = trained_from_a_relative_path
    model, _, method = load_trained(folder)
    assert method == "scale_preserve"
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, logits, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(load(folder).eval()(input_ids=ids).logits, logits, rtol=0, atol=0)


def test_a_moved_base_is_refused_with_the_recorded_path_and_the_fix(trained_from_a_relative_path, tmp_path):
    folder, _, _ = trained_from_a_relative_path
    recorded = tmp_path / "ws" / "base"
    recorded.rename(tmp_path / "ws" / "moved")
    with pytest.raises(FileNotFoundError, match=f"recorded at {recorded}, which does not exist now") as info:
        load_trained(folder)
    assert "scale_cl_run.json" in str(info.value)
    with pytest.raises(FileNotFoundError, match="pass base_model="):
        load(folder)
    assert load(folder, base_model=str(tmp_path / "ws" / "moved")) is not None  # pointed at its new place


def test_a_folder_that_does_not_exist_is_named_so(tmp_path):
    for loader in (load, load_trained):
        with pytest.raises(FileNotFoundError, match="no/such/folder: no such folder"):
            loader("no/such/folder")
