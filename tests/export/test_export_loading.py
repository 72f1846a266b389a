"""An exported folder loads wherever scale-cl loads a model, running only scale-cl's own modeling code.

`load_base` (behind ``eval --base``, ``cpt --model``, ``train --model``) and `scale_cl.load` pass
``trust_remote_code`` for a folder whose ``modeling_scale.py`` is byte for byte this scale-cl's, and refuse other
custom code before any of it runs (`scale_cl.remote_code`).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from scale_cl import ScaleConfig, load, upscale
from scale_cl.cli import main
from scale_cl.export import export_model
from scale_cl.models import BaseModelRef, load_base
from scale_cl.remote_code import MODELING_FILE, trust_own_code
from scale_cl.tuner.arch import refuse_export, spec_for_config
from tests.conftest import cpt_argv, randomize_new_weights, tiny_config
from tests.exactness import assert_exact_to_rounding


@pytest.fixture(scope="module")
def exported(workspace, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """(a SCALE-Adapt model exported with its tokenizer, the upscaled model it was exported from)."""
    base = LlamaForCausalLM.from_pretrained(workspace / "base").eval()
    model = upscale(copy.deepcopy(base), ScaleConfig(method="adapt", hidden_up=32, ffn_up=16, preserve_layers=1))
    randomize_new_weights(model, seed=1, w12_scale=0.05)
    out = tmp_path_factory.mktemp("export") / "adapt"
    export_model(model.eval(), out, tokenizer=AutoTokenizer.from_pretrained(workspace / "base"))
    return out, model


def _ids() -> torch.Tensor:
    return torch.randint(1, 300, (2, 12), generator=torch.Generator().manual_seed(3))


def _assert_computes(loaded: torch.nn.Module, model: torch.nn.Module) -> None:
    """The loaded export's logits as close to the upscaled model's float64 logits as its own fp32 logits are (the
    export merges the blocks into one weight: another order of the same sums, tests/export/test_export.py)."""
    with torch.no_grad():
        exact = copy.deepcopy(model).double()(_ids()).logits
        assert_exact_to_rounding(loaded.eval()(_ids()).logits, exact, stock=model(_ids()).logits, what="logits")


def _copy(folder: Path, tmp_path: Path) -> Path:
    target = tmp_path / folder.name
    shutil.copytree(folder, target)
    return target


@pytest.mark.exactness
def test_load_base_takes_an_export_and_computes_the_upscaled_model(exported):
    folder, model = exported
    loaded, tokenizer = load_base(BaseModelRef.parse(str(folder)))
    assert type(loaded).__name__ == "ScaleLlamaForCausalLM"
    assert tokenizer.pad_token is not None
    _assert_computes(loaded, model)


@pytest.mark.exactness
def test_scale_cl_load_takes_an_export(exported):
    folder, model = exported
    loaded = load(folder).eval()
    assert type(loaded).__name__ == "ScaleLlamaForCausalLM"
    _assert_computes(loaded, model)


def test_an_export_whose_code_was_edited_is_refused_before_it_runs(exported, tmp_path):
    folder = _copy(exported[0], tmp_path)
    code = folder / MODELING_FILE
    code.write_text(code.read_text() + "\nraise SystemExit('this code must not run')\n")
    with pytest.raises(ValueError, match=r"modeling_scale.py differs from this scale-cl's.*scale-cl export"):
        load_base(BaseModelRef.parse(str(folder)))
    with pytest.raises(ValueError, match="differs from this scale-cl's"):
        load(folder)


def test_custom_code_scale_cl_did_not_write_is_refused(exported, tmp_path):
    folder = _copy(exported[0], tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_other.OtherForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_other.py").write_text("raise SystemExit('this code must not run')\n")
    with pytest.raises(ValueError, match=r"names custom modeling code \(modeling_other\) that scale-cl did not write"):
        load_base(BaseModelRef.parse(str(folder)))


def test_a_stock_folder_needs_no_remote_code(workspace):
    assert trust_own_code(str(workspace / "base")) is False


def test_an_export_is_not_upscaled_again(exported):
    loaded = load(exported[0])
    with pytest.raises(ValueError, match=r"exported by scale-cl.*cannot be upscaled"):
        upscale(loaded, ScaleConfig(method="preserve", hidden_up=32, ffn_up=16))
    with pytest.raises(ValueError, match=r"'scale_llama' model was exported by scale-cl"):
        refuse_export(loaded.config)  # what a command's settings check asks, before any model loads
    assert spec_for_config(loaded.config).backbone == "model"  # its shapes are its family's (plans, FLOP floors)


@pytest.mark.slow
def test_cpt_trains_an_export(exported, workspace, tmp_path):
    """``cpt --model EXPORTED`` (full fine-tuning of the exported model) runs to its end and saves the model; in this
    process, as tests/e2e/test_cpt.py runs its runs (a fresh Python would only add its imports)."""
    cfg = tiny_config(workspace, ["fft"], steps=2, save_every=2)
    cfg.model = str(exported[0])
    argv = cpt_argv(cfg, tmp_path / "run")
    assert argv[1:4] == ["-m", "scale_cl.cli", "cpt"]
    assert main(argv[3:]) == 0
    saved = json.loads((tmp_path / "run" / "fft" / "model" / "config.json").read_text())
    assert saved["model_type"] == "scale_llama" and saved["auto_map"]["AutoModelForCausalLM"].startswith("modeling_")


def test_train_plans_an_export_and_refuses_to_upscale_it(exported, workspace, tmp_path, capsys):
    """``train --model EXPORTED --dry_run``: fine-tuning it is planned; a SCALE method is refused before anything is
    written, saying what to do."""
    common = [
        "--model",
        str(exported[0]),
        "--data.train",
        str(workspace / "new.jsonl"),
        "--data.old_eval",
        f"toy={workspace / 'old.jsonl'}",
        "--train.tokens",
        "2M",
        "--data.seq_len",
        "64",
        "--dry_run",
    ]
    assert main(["train", *common, "--method", "fft", "--out", str(tmp_path / "fft")]) == 0
    assert "parameters" in capsys.readouterr().out
    assert main(["train", *common, "--method", "scale_preserve", "--out", str(tmp_path / "scale")]) == 2
    assert "exported by scale-cl" in capsys.readouterr().err
    assert not (tmp_path / "fft").exists() and not (tmp_path / "scale").exists()


TRUSTS = (None, False, True)  # in this order in one script: a case that runs the export's code comes last
TOKENIZER_SCRIPT = """
import sys
from transformers import AutoTokenizer
for case in sys.argv[2:]:
    trusting = {} if case == "None" else {"trust_remote_code": case == "True"}
    print("CASE", case, flush=True)
    t = AutoTokenizer.from_pretrained(sys.argv[1], **trusting)
    print("IDS", t("a b c").input_ids, flush=True)
print("CASE end", flush=True)
"""


@pytest.fixture(scope="module")
def tokenizer_script(exported) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    """One script without a terminal loading the export's tokenizer each way of `TRUSTS` (a Python start each would
    triple the time): (the finished process, its output per case)."""
    done = subprocess.run(
        [sys.executable, "-c", TOKENIZER_SCRIPT, str(exported[0]), *map(str, TRUSTS)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    parts = done.stdout.split("CASE ")[1:]
    return done, {part.split("\n", 1)[0]: part for part in parts}


@pytest.mark.slow
@pytest.mark.parametrize("trust", TRUSTS)
def test_autotokenizer_loads_an_export_in_a_script_without_a_terminal(tokenizer_script, workspace, trust):
    """transformers' AutoTokenizer reads the model's config first, and an export's names custom code (``auto_map``):
    given no ``trust_remote_code`` it asks whether to run that code (in a terminal it waits 15 s for the answer). With
    no terminal the question is refused at once; ``trust_remote_code=False`` asks nothing and ``True`` runs the
    export's own modeling file. Each time the tokenizer loads from its own files, the base's, and the script ends."""
    done, cases = tokenizer_script
    assert done.returncode == 0, done.stderr[-2000:]
    assert "end" in cases  # every case returned: none waited for an answer
    expected = AutoTokenizer.from_pretrained(workspace / "base")("a b c").input_ids
    output = cases[str(trust)]
    assert f"IDS {expected}" in output
    assert ("Do you wish to run the custom code" in output) == (trust is None)
