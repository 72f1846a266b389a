"""Save/load: only the new parameters (plus a JSON config naming the base), bitwise round trips, clear errors."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import scale_cl
from scale_cl import ScaleConfig, set_method, upscale
from tests.conftest import ARCHS, VOCAB, hold_w12, make_model, tiny_scale_config

CONFIG = "scale_config.json"
WEIGHTS = "model.safetensors"
BASE_WEIGHTS = "base_model.safetensors"
NEW_NAMES = ("w12", "w21", "w22", "bias_up", "weight_up")
IO_ARCHS = ["llama-gqa2-tied", "neox-parallel-rot0.25"]


def probe_ids() -> torch.Tensor:
    gen = torch.Generator().manual_seed(21)
    return torch.randint(3, VOCAB, (2, 10), generator=gen)


def scale_cfg(base, method: str = "route") -> ScaleConfig:
    return tiny_scale_config(base, method, ffn_up=16, preserve_layers=1, w22_init="random", route_tau=0.3, seed=2)


def train_a_little(model, steps: int = 3):
    """A few Adam steps, so that every trainable new parameter (W12 included) has a non-trivial value."""
    gen = torch.Generator().manual_seed(8)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    model.train()
    for _ in range(steps):
        ids = torch.randint(3, VOCAB, (4, 12), generator=gen)
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return model


def trained(base) -> torch.nn.Module:
    model = train_a_little(upscale(base, scale_cfg(base)))
    head = model.get_output_embeddings()
    assert head.weight_up.abs().sum() > 0
    assert any(n.endswith("w12") and p.abs().sum() > 0 for n, p in model.named_parameters())
    return model


def logits(model, ids=None) -> torch.Tensor:
    with torch.no_grad():
        return model(probe_ids() if ids is None else ids).logits


def saved_names(path: Path) -> set[str]:
    with safe_open(str(path), framework="pt") as f:
        return set(f.keys())


def new_param_names(model) -> set[str]:
    return {n for n, _ in model.named_parameters() if n.rsplit(".", 1)[-1] in NEW_NAMES}


def other_config(arch: str, **changes):
    model_cls, config = ARCHS[arch]
    config = copy.deepcopy(config)
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return model_cls(config).eval()


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("arch", IO_ARCHS)
def test_round_trip_in_memory_base(arch, tmp_path):
    model = trained(make_model(arch, seed=0))
    expected = logits(model)
    model.save_pretrained(tmp_path)

    assert sorted(os.listdir(tmp_path)) == sorted([CONFIG, WEIGHTS])
    names = saved_names(tmp_path / WEIGHTS)
    assert names == new_param_names(model)
    assert all(n.rsplit(".", 1)[-1] in NEW_NAMES for n in names)

    loaded = scale_cl.load(tmp_path, base_model=make_model(arch, seed=0)).eval()
    assert torch.equal(logits(loaded), expected)
    assert loaded.scale_config.method == "route"
    assert loaded.scale_config == model.scale_config
    assert loaded.scale_route.active
    for name, param in model.named_parameters():
        assert torch.equal(dict(loaded.named_parameters())[name], param), name
        assert dict(loaded.named_parameters())[name].requires_grad == param.requires_grad, name
    # The other methods agree too (W12 etc. restored, not only the route output).
    for method in ("preserve", "adapt"):
        assert torch.equal(logits(set_method(loaded, method)), logits(set_method(model, method)))


@pytest.mark.parametrize("arch", IO_ARCHS)
def test_round_trip_base_from_disk_needs_no_base_argument(arch, tmp_path):
    base_dir, ckpt = tmp_path / "base", tmp_path / "ckpt"
    make_model(arch, seed=0).save_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    model = trained(base)
    expected = logits(model)
    model.save_pretrained(ckpt)

    meta = json.loads((ckpt / CONFIG).read_text())
    assert Path(meta["base_model"]["name_or_path"]) == base_dir
    loaded = scale_cl.load(ckpt).eval()
    assert torch.equal(logits(loaded), expected)
    assert loaded.scale_config.method == "route"
    # Explicitly passing the path works the same.
    assert torch.equal(logits(scale_cl.load(ckpt, base_model=str(base_dir)).eval()), expected)


@pytest.mark.parametrize("arch", IO_ARCHS)
def test_round_trip_full_needs_no_base(arch, tmp_path):
    model = trained(make_model(arch, seed=0))  # built in memory: the checkpoint names no base
    expected = logits(model)
    model.save_pretrained(tmp_path, full=True)

    assert sorted(os.listdir(tmp_path)) == sorted([CONFIG, WEIGHTS, BASE_WEIGHTS])
    assert saved_names(tmp_path / WEIGHTS) == new_param_names(model)
    base_names = saved_names(tmp_path / BASE_WEIGHTS)
    assert base_names and not base_names & new_param_names(model)
    assert all(n.rsplit(".", 1)[-1] in ("weight", "bias") for n in base_names)

    loaded = scale_cl.load(tmp_path).eval()
    assert torch.equal(logits(loaded), expected)
    assert loaded.scale_config.method == "route"
    if ARCHS[arch][1].tie_word_embeddings:
        assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight


def test_round_trip_keeps_method_and_trainability(tmp_path):
    base = make_model("llama-mha-untied", seed=0)
    model = train_a_little(upscale(base, scale_cfg(base, method="adapt")))
    expected = logits(model)
    model.save_pretrained(tmp_path)
    loaded = scale_cl.load(tmp_path, base_model=make_model("llama-mha-untied", seed=0)).eval()
    assert loaded.scale_config.method == "adapt"
    assert not loaded.scale_route.active
    assert torch.equal(logits(loaded), expected)
    trainable = {n for n, p in loaded.named_parameters() if p.requires_grad}
    assert trainable == {n for n, p in model.named_parameters() if p.requires_grad}


def test_preserve_holds_and_saves_no_w12(tmp_path):
    """SCALE-Preserve never computes W12 (Eq. 1 with W12 = 0): it holds none, trains none and saves none; switching to
    Adapt allocates it at zero (the function unchanged), and switching back keeps what it learned."""
    base = make_model("llama-gqa2-tied", seed=0)
    model = upscale(base, scale_cfg(base, method="preserve"))
    assert not [n for n, _ in model.named_parameters() if n.endswith(".w12")]
    model.save_pretrained(tmp_path)
    assert not [n for n in saved_names(tmp_path / WEIGHTS) if n.endswith(".w12")]

    before = logits(model)
    adapt = set_method(model, "adapt")
    held = {n: p for n, p in adapt.named_parameters() if n.endswith(".w12")}
    assert held and all(p.requires_grad and not p.any() for p in held.values())
    assert all(".layers.0." not in n for n in held)  # below preserve_layers: none
    assert torch.equal(logits(adapt), before)
    train_a_little(adapt)
    assert any(p.any() for p in held.values())
    preserve = set_method(adapt, "preserve")
    assert {n for n, _ in preserve.named_parameters() if n.endswith(".w12")} == set(held)
    assert not any(p.requires_grad for p in held.values())


@pytest.mark.parametrize("trained_w12", [False, True])
def test_a_folder_with_w12_where_preserve_holds_none_loads(tmp_path, trained_w12):
    """A Preserve folder written when every linear held a (zero) W12 loads: the zero blocks are dropped; a nonzero
    one (a model trained as Adapt, then switched to Preserve and saved) is held again with its values."""
    base = make_model("llama-gqa2-tied", seed=0)
    model = upscale(base, scale_cfg(base, method="preserve"))
    hold_w12(model)  # as every SCALE-Preserve model held them before
    if trained_w12:
        with torch.no_grad():
            model.model.layers[1].mlp.up_proj.w12.fill_(0.5)
    expected = logits(model)
    model.save_pretrained(tmp_path)
    assert sum(n.endswith(".w12") for n in saved_names(tmp_path / WEIGHTS)) == 7 * model.config.num_hidden_layers

    loaded = scale_cl.load(tmp_path, base_model=make_model("llama-gqa2-tied", seed=0)).eval()
    assert torch.equal(logits(loaded), expected)
    held = {n: p for n, p in loaded.named_parameters() if n.endswith(".w12")}
    assert set(held) == ({"model.layers.1.mlp.up_proj.w12"} if trained_w12 else set())
    assert all(torch.equal(p, torch.full_like(p, 0.5)) and not p.requires_grad for p in held.values())


def test_save_twice_to_same_directory(tmp_path):
    model = trained(make_model("llama-gqa2-tied", seed=0))
    model.save_pretrained(tmp_path, full=True)
    model.save_pretrained(tmp_path, full=True)
    assert sorted(os.listdir(tmp_path)) == sorted([CONFIG, WEIGHTS, BASE_WEIGHTS])

    # Training on and saving again (this time without the base) replaces everything.
    train_a_little(model, steps=1)
    expected = logits(model)
    model.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted([CONFIG, WEIGHTS])
    assert json.loads((tmp_path / CONFIG).read_text())["full"] is False
    loaded = scale_cl.load(tmp_path, base_model=make_model("llama-gqa2-tied", seed=0)).eval()
    assert torch.equal(logits(loaded), expected)


def test_save_creates_nested_directory_without_temporary_files(tmp_path):
    model = upscale(make_model("llama-mqa", seed=0), scale_cfg(make_model("llama-mqa")))
    target = tmp_path / "a" / "b"
    model.save_pretrained(target)
    assert sorted(os.listdir(target)) == sorted([CONFIG, WEIGHTS])
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.parent != target]


# ----------------------------------------------------------------------------- errors


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory) -> Path:
    """A default (new-params-only) checkpoint of an in-memory llama-gqa2-tied base (seed 0)."""
    directory = tmp_path_factory.mktemp("ckpt")
    trained(make_model("llama-gqa2-tied", seed=0)).save_pretrained(directory)
    return directory


def copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for name in os.listdir(src):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


def test_error_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match=r"scale_config\.json is missing"):
        scale_cl.load(tmp_path, base_model=make_model("llama-gqa2-tied"))
    with pytest.raises(FileNotFoundError, match="does-not-exist: no such folder"):
        scale_cl.load(tmp_path / "does-not-exist")


def test_error_invalid_json(saved_llama, tmp_path):
    ckpt = copy_checkpoint(saved_llama, tmp_path / "c")
    (ckpt / CONFIG).write_text('{"format": "scale-cl", "version": 1,')
    with pytest.raises(ValueError, match="not valid JSON"):
        scale_cl.load(ckpt, base_model=make_model("llama-gqa2-tied"))


def test_error_config_of_another_format(saved_llama, tmp_path):
    ckpt = copy_checkpoint(saved_llama, tmp_path / "c")
    (ckpt / CONFIG).write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="not a scale-cl checkpoint"):
        scale_cl.load(ckpt, base_model=make_model("llama-gqa2-tied"))


@pytest.mark.parametrize("damage", ["truncate", "header", "empty", "payload"])
def test_error_corrupted_safetensors(saved_llama, tmp_path, damage):
    ckpt = copy_checkpoint(saved_llama, tmp_path / "c")
    path = ckpt / WEIGHTS
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "header":  # garbage in the 8-byte header length and the JSON header
        path.write_bytes(b"\xff" * 64 + data[64:])
    elif damage == "payload":  # one flipped byte in the tensor data: still valid safetensors
        flipped = bytearray(data)
        flipped[-5] ^= 0xFF
        path.write_bytes(bytes(flipped))
    else:
        path.write_bytes(b"")
    with pytest.raises(ValueError, match="corrupted"):
        scale_cl.load(ckpt, base_model=make_model("llama-gqa2-tied"))


def test_error_missing_weights_file(saved_llama, tmp_path):
    ckpt = copy_checkpoint(saved_llama, tmp_path / "c")
    (ckpt / WEIGHTS).unlink()
    with pytest.raises(ValueError, match="missing"):
        scale_cl.load(ckpt, base_model=make_model("llama-gqa2-tied"))


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"num_hidden_layers": 2}, "num_hidden_layers"),
        ({"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3}, "hidden_size"),
        ({"intermediate_size": 64}, "intermediate_size"),
    ],
)
def test_error_base_of_another_shape_names_the_difference(saved_llama, changes, field):
    base = other_config("llama-gqa2-tied", **changes)
    with pytest.raises(ValueError, match=f"does not match.*{field}: checkpoint"):
        scale_cl.load(saved_llama, base_model=base)


def test_error_base_of_another_architecture(saved_llama):
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM"):
        scale_cl.load(saved_llama, base_model=make_model("neox-parallel-rot0.25"))


def test_error_base_with_other_weights_fingerprint(saved_llama):
    other = make_model("llama-gqa2-tied", seed=1)
    with pytest.raises(ValueError, match="fingerprint"):
        scale_cl.load(saved_llama, base_model=other)
    # Accepted on request: the new parameters are the saved ones, on top of the other base.
    loaded = scale_cl.load(saved_llama, base_model=make_model("llama-gqa2-tied", seed=1), check_base_weights=False)
    with safe_open(str(saved_llama / WEIGHTS), framework="pt") as f:
        params = dict(loaded.named_parameters())
        for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            assert torch.equal(params[name], f.get_tensor(name)), name
    reference = make_model("llama-gqa2-tied", seed=1)
    assert torch.equal(loaded.get_input_embeddings().weight, reference.get_input_embeddings().weight)


def test_error_no_base_name_and_no_base_model(saved_llama):
    with pytest.raises(ValueError, match="does not name its base model"):
        scale_cl.load(saved_llama)


def test_failed_load_does_not_upscale_the_given_base(saved_llama):
    """A rejected base model is left as it was (upscale runs only after every check)."""
    other = make_model("llama-gqa2-tied", seed=1)
    before = logits(other)
    with pytest.raises(ValueError):
        scale_cl.load(saved_llama, base_model=other)
    assert not getattr(other, "is_scale_upscaled", False)
    assert torch.equal(logits(other), before)


def test_interrupted_save_leaves_no_temporary_files_and_no_complete_looking_checkpoint(tmp_path, monkeypatch):
    model = trained(make_model("llama-gqa2-tied", seed=0))
    model.save_pretrained(tmp_path)

    def broken_save_file(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(scale_cl.tuner.io, "save_file", broken_save_file)
    with pytest.raises(OSError, match="disk full"):
        model.save_pretrained(tmp_path)
    left = sorted(os.listdir(tmp_path))
    assert not [name for name in left if name.endswith(".tmp") or name.startswith(".")], left
    assert CONFIG not in left  # the old config is gone: the directory does not claim to be complete
    with pytest.raises(ValueError, match=r"scale_config\.json is missing"):
        scale_cl.load(tmp_path, base_model=make_model("llama-gqa2-tied", seed=0))
