"""Every numeric setting of every command has a declared range: a value outside it is refused with a message that
names the setting and its range, before the output folder (or anything else) is written.

The settings are walked from each command's settings dataclass, so a numeric setting added later without a range
fails `test_every_numeric_setting_declares_its_range`. Ranges that depend on the model (a SCALE config's
``preserve_layers``) are checked against the model's config, before anything is written, too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scale_cl.bounds import bounds, describe
from scale_cl.cli import commands, main
from scale_cl.setting_types import leaf_settings

# Settings whose valid range is the model's: the out-of-range value tried, and what the message says.
MODEL_BOUND = {"options.scale.preserve_layers": ("1000000", "options.scale.preserve_layers=1000000 does not fit")}


def is_numeric(f, value) -> bool:
    annotation = str(f.type)
    if "bool" in annotation or "str" in annotation:
        return False
    return "int" in annotation or "float" in annotation


def numeric_settings():
    """(command path, option name, field) of every numeric option of every command."""
    for command in commands():
        for sub in command.subcommands or (command,):
            path = (command.name, sub.name) if command.subcommands else (command.name,)
            for name, f, value, _ in leaf_settings(sub.settings()):
                if is_numeric(f, value):
                    yield path, name, f


CASES = list(numeric_settings())


def test_every_numeric_setting_declares_its_range():
    assert len(CASES) > 150  # bio, cpt, base, sweeps, eval, bench, demo: the walk found them
    missing = sorted({name for _, name, f in CASES if not bounds(f.metadata) and name not in MODEL_BOUND})
    assert not missing, f"numeric settings without a declared range (metadata ge/gt/le/lt): {missing}"


def out_of_range(f) -> str:
    """A value just outside the field's declared range, as typed on the command line."""
    found = bounds(f.metadata)
    is_float = "float" in str(f.type)
    if "ge" in found or "gt" in found:
        low = found.get("ge", found.get("gt"))
        value = low - (0.5 if is_float and "le" in found else 1)
    else:
        value = found.get("le", found.get("lt")) + 1
    return str(float(value)) if is_float else str(int(value))


@pytest.fixture(scope="module")
def inputs(workspace, tmp_path_factory) -> dict[str, list[str]]:
    """The arguments each command needs besides the bad setting (valid inputs, so only the setting is wrong)."""
    root = tmp_path_factory.mktemp("inputs")
    english = root / "en.jsonl"
    english.write_text("".join(json.dumps({"text": f"the cat sat on the mat {i} times."}) + "\n" for i in range(50)))
    cpt = ["--model", str(workspace / "base"), "--data.train", str(workspace / "new.jsonl")]
    cpt += ["--data.old_eval", f"toy={workspace / 'old.jsonl'}", "--methods", "fft", "scale_route"]
    return {
        "demo": [],
        "bio": ["--preset", "micro"],
        "cpt": cpt,
        "base": ["--preset", "micro", "--data.train", str(english)],
        "eval": ["--base", "smollm2", "--tasks", "arc_easy"],
        "bench": ["--shapes", "tiny"],
        "sweep bio": [],
        "sweep cpt": cpt,
        "train": [
            *cpt[: cpt.index("--methods")],
            *(
                "--options.scale.hidden_up",
                "32",
                "--options.scale.ffn_up",
                "32",
                "--options.scale.preserve_layers",
                "1",
            ),
        ],
    }


@pytest.mark.parametrize(("path", "name", "f"), CASES, ids=[f"{' '.join(p)}:{n}" for p, n, _ in CASES])
def test_out_of_range_value_is_named_with_its_range_before_anything_is_written(
    path, name, f, inputs, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)  # a default output folder (outputs/...) would appear here
    out = tmp_path / "out"
    value, message = MODEL_BOUND.get(name) or (out_of_range(f), f"{name} must be {describe(f.metadata)}")
    argv = [*path, *inputs[" ".join(path)]]
    if any(option.startswith("out") for option, *_ in leaf_settings(commands_settings(path))):
        argv += ["--out", str(out)]
    if isinstance(getattr(f, "default", None), dict) or "dict" in str(f.type):
        argv += [f"--{name}", f"fft={value}"]
    else:
        argv += [f"--{name}", value]
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert message in err, err
    assert not out.exists() and not list(tmp_path.iterdir()), "something was written"


def commands_settings(path: tuple[str, ...]):
    command = next(c for c in commands() if c.name == path[0])
    sub = next(s for s in command.subcommands if s.name == path[1]) if command.subcommands else command
    return sub.settings()


@pytest.mark.parametrize(
    ("argv", "message", "folder"),
    [
        # the two examples, as a new user typed them
        (["cpt", "--preset", "clean-en", "--train.lr", "-1"], "train.lr must be > 0, got -1.0", "outputs/cpt-clean-en"),
        (
            ["bio", "--preset", "micro", "--seeds", "-1"],
            "seeds must be in [0, 4294967295], got -1",
            "outputs/bio-micro",
        ),
        # a YAML file's values are checked the same way (and YAML 1.1's string 1e-3 is a number)
        (["bio", "--preset", "micro", "--config", "{yaml}"], "task1.lr must be > 0, got -0.001", "outputs/bio-micro"),
    ],
)
def test_out_of_range_examples_name_the_setting_and_write_nothing(argv, message, folder, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("bad.yaml").write_text("task1: {lr: -1e-3}\n")
    assert main([a.replace("{yaml}", "bad.yaml") for a in argv]) == 2
    assert f"error: {message}" in capsys.readouterr().err
    assert not Path(folder).exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


def test_a_numeric_string_in_yaml_is_read_as_the_number(tmp_path):
    """PyYAML reads ``1e-3`` (no dot) as a string: it is the number the user meant, and still range-checked."""
    from scale_cl.cli import parse_settings

    config = tmp_path / "rates.yaml"
    config.write_text("task1: {lr: 1e-3, method_lr: {fft: 2e-4}}\n")
    settings = parse_settings(["bio", "--preset", "micro", "--config", str(config)]).bio
    assert settings.task1.lr == 1e-3 and settings.task1.lr_of("fft") == 2e-4
    config.write_text("task1: {lr: fast}\n")
    with pytest.raises(ValueError, match=r"task1\.lr must be a number, e.g. 0.001, got 'fast'"):
        parse_settings(["bio", "--preset", "micro", "--config", str(config)])


# --- device and precision: the values each takes, and a device that is not there ---------------------

# The option each training command is refused on when it asks for CUDA on a machine without it.
CUDA_OPTIONS = {
    "cpt": "train.device",
    "base": "train.device",
    "sweep cpt": "train.device",
    "train": "train.device",
    "bio": "task1.device",
    "sweep bio": "pretrain.device",
}


@pytest.fixture
def no_cuda(monkeypatch):
    """torch sees no GPU, whatever the machine (the refusal is tested on GPU machines too)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch sees a GPU (nothing is run on it: only the settings are resolved); ``set(bf16=False)`` takes bf16 away."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "Fake GPU")

    def gpu(bf16: bool = True) -> None:
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16)

    gpu()
    return gpu


@pytest.mark.parametrize("path", sorted(CUDA_OPTIONS))
def test_device_cuda_without_a_gpu_is_refused_before_anything_is_written(
    path, inputs, tmp_path, monkeypatch, capsys, no_cuda
):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    option = CUDA_OPTIONS[path]
    assert main([*path.split(), *inputs[path], "--out", str(out), f"--{option}", "cuda"]) == 2
    err = capsys.readouterr().err
    assert f"error: {option}=cuda, but torch sees no CUDA device" in err and f"set {option} auto or cpu" in err, err
    assert not out.exists() and not list(tmp_path.iterdir()), "something was written"


@pytest.mark.parametrize(
    ("argv", "yaml", "message"),
    [
        (
            ["cpt", "--preset", "clean-en"],
            "train: {device: gpu}",
            "train.device must be one of ('auto', 'cpu', 'cuda')",
        ),
        (["bio", "--preset", "micro"], "task1: {precision: fp16}", "task1.precision must be one of ('auto', 'bf16', "),
        (
            ["base", "--preset", "micro"],
            "train: {precision: half}",
            "precision must be one of ('auto', 'bf16', 'fp32')",
        ),
    ],
)
def test_a_bad_device_or_precision_in_yaml_names_the_valid_values(argv, yaml, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("bad.yaml").write_text(yaml + "\n")
    assert main([*argv, "--config", "bad.yaml"]) == 2
    assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


def test_device_and_precision_resolve_on_a_gpu_and_on_the_cpu(fake_gpu, monkeypatch):
    """auto: the GPU when torch sees one, in bf16 where it has it; cpu keeps off a present GPU (fp32 by default, bf16
    under CPU autocast when asked); fp32 and bf16 are taken as given; bf16 on a GPU without it is refused."""
    import torch

    from scale_cl.train.config import StageConfig
    from scale_cl.train.device import Placement, stage_placement

    def placed(**settings: str) -> Placement:
        return stage_placement(StageConfig(**settings), "train.")

    assert placed() == Placement("cuda", bf16=True)
    assert placed(precision="fp32") == placed(device="cuda", precision="fp32") == Placement("cuda", bf16=False)
    assert placed(device="cpu") == Placement("cpu", bf16=False)
    assert placed(device="cpu", precision="bf16") == Placement("cpu", bf16=True)
    assert placed().record() == {"device": "cuda", "precision": "bf16", "gpu": "Fake GPU"}
    fake_gpu(bf16=False)  # e.g. a V100
    assert placed() == Placement("cuda", bf16=False)
    with pytest.raises(
        ValueError, match=r"train\.precision=bf16, but this GPU \(Fake GPU\) has no bf16; set train\.pre"
    ):
        placed(precision="bf16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert placed() == Placement("cpu", bf16=False) and placed().record() == {"device": "cpu", "precision": "fp32"}
    with pytest.raises(ValueError, match=r"train\.device=cuda, but torch sees no CUDA device"):
        placed(device="cuda")
