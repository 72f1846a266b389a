"""The command line as a user types it: options reach the settings they name (preset, then YAML, then flags)."""

from __future__ import annotations

import argparse
import sys

import pytest

from scale_cl.cli import build_parser, main, parse_settings
from scale_cl.experiments.bio.config import preset


def bio_settings(argv: list[str]):
    return parse_settings(["bio", *argv]).bio


def test_scale_options_are_a_scale_config_and_rates_are_data():
    cfg = bio_settings(
        [
            "--preset", "micro",
            "--options.scale.hidden_up", "32",
            "--options.scale.collab_modules", "attn",
            "--options.scale.preserve_layers", "-2",
            "--task1.scale_route_lr", "3e-4",
            "--task1.method_lr", "lora=2e-3", "freeze=5e-4",
        ]
    )  # fmt: skip
    scale = cfg.options.scale
    assert (scale.hidden_up, scale.collab_modules, scale.preserve_layers) == (32, ("attn",), -2)
    assert cfg.task1.lr_of("scale_route") == 3e-4
    assert cfg.task1.lr_of("lora") == 2e-3 and cfg.task1.lr_of("freeze") == 5e-4
    assert cfg.task1.lr_of("fft") == preset("micro").task1.lr  # not named: the stage's lr
    # the run's SCALE method and seed are set per run, never from the settings
    assert cfg.options.scale_config("adapt", seed=2).method == "adapt"
    assert cfg.options.scale_config("adapt", seed=2).seed == 2


def test_yaml_rates_merge_with_the_preset_and_the_command_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("task1:\n  method_lr:\n    fft: 7.0e-5\n")
    cfg = bio_settings(["--config", str(path), "--task1.lora_lr", "9e-4"])
    small = preset("small").task1
    assert cfg.task1.lr_of("fft") == 7e-5  # from the YAML
    assert cfg.task1.lr_of("lora") == 9e-4  # from the command line
    assert cfg.task1.lr_of("scale_route") == small.lr_of("scale_route")  # from the preset


@pytest.mark.parametrize(
    "argv",
    [
        ["--options.scale.method", "adapt"],  # set per run from the method name
        ["--options.scale.seed", "3"],  # set per run from --seeds
        ["--task1.method_lr", "lora"],  # not METHOD=LR
        ["--task1.method_lr", "lora=fast"],  # not a number
        ["--options.scale.hidden_up", "wide"],
    ],
)
def test_malformed_options_are_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bio", *argv])
    assert "error" in capsys.readouterr().err


def test_invalid_values_are_refused_with_the_setting_named():
    with pytest.raises(ValueError, match="collab_modules"):
        bio_settings(["--options.scale.collab_modules", "mlp"])
    with pytest.raises(ValueError, match="unknown method 'dreambooth'"):
        bio_settings(["--task1.method_lr", "dreambooth=1e-3"])


# --- every subcommand: one parser style ----------------------------------------------------------


def _leaf_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) of every subcommand that runs something (``sweep bio``, not ``sweep``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _leaf_parsers(sub, (*path, name))
            return
    yield path, parser


LEAVES = dict(_leaf_parsers(build_parser()))


def test_every_subcommand_is_built_from_its_settings():
    assert set(LEAVES) == {
        ("demo",), ("bio",), ("cpt",), ("base",), ("train",), ("calibrate",), ("eval",), ("export",), ("bench",),
        ("sweep", "bio"),
        ("sweep", "cpt"),
    }  # fmt: skip
    for path, parser in LEAVES.items():
        options = {o for a in parser._actions for o in a.option_strings}
        assert "--config" in options, path
        for action in parser._actions:
            if action.help == argparse.SUPPRESS:  # the dashed aliases
                assert all("_" not in o for o in action.option_strings), (path, action.option_strings)
                continue
            assert action.help, (path, action.dest)  # every option says what it does
            for option in action.option_strings:
                if "_" in option:  # ... and is accepted with dashes too, as the same setting
                    alias = "--" + option[2:].replace("_", "-")
                    assert parser._option_string_actions[alias].dest == action.dest, (path, option)


DEMO = {
    "hidden_up": 384,
    "ffn_up": 0,
    "preserve_layers": 2,
    "max_new_tokens": 3,
    "methods": ("scale_route", "scale_adapt"),
}


@pytest.mark.parametrize("dash", [False, True], ids=["canonical", "dashed"])
def test_demo_options_reach_its_settings(dash):
    argv = ["demo", "--hidden_up", "384", "--ffn_up", "0", "--preserve_layers", "2", "--max_new_tokens", "3"]
    argv += ["--methods", "scale_route", "scale_adapt"]
    settings = parse_settings(_spelt(argv, dash))
    assert {k: getattr(settings, k) for k in DEMO} == DEMO


def _spelt(argv: list[str], dash: bool) -> list[str]:
    """``argv`` with every option in its dashed spelling (``--hidden_up`` -> ``--hidden-up``) if ``dash``."""
    return [a.replace("_", "-") if dash and a.startswith("--") else a for a in argv]


@pytest.mark.parametrize("dash", [False, True], ids=["canonical", "dashed"])
def test_eval_options_reach_its_settings(dash):
    argv = ["eval", "runs/lora/model", "--tasks", "english", "arc_easy,hellaswag", "--include_path", "a"]
    argv += ["--include_path", "b", "--num_fewshot", "5", "--limit", "0.5", "--batch_size", "auto"]
    argv += ["--device", "cpu", "--dtype", "bfloat16", "--max_length", "512", "--merge_lora", "--bootstrap_iters"]
    argv += ["0", "--seed", "3", "--out", "x.json"]
    s = parse_settings(_spelt(argv, dash))
    assert (s.model_dir, s.base, s.tasks) == ("runs/lora/model", None, ["english", "arc_easy,hellaswag"])
    assert s.include_path == ["a", "b"]  # repeatable
    assert (s.num_fewshot, s.limit, s.batch_size, s.device, s.dtype) == (5, 0.5, "auto", "cpu", "bfloat16")
    assert (s.max_length, s.merge_lora, s.bootstrap_iters, s.seed, s.out) == (512, True, 0, 3, "x.json")
    base = parse_settings(["eval", "--base", "smollm2", "--tasks", "korean"])
    assert (base.model_dir, base.base, base.merge_lora, base.dtype) == (None, "smollm2", False, "float32")
    assert base.device == "auto"  # as the training commands' device: cuda when torch sees a GPU, else cpu


@pytest.mark.parametrize("dash", [False, True], ids=["canonical", "dashed"])
def test_bench_options_reach_its_settings(dash):
    argv = ["bench", "--shapes", "tiny", "smollm2", "--methods", "fft", "lora", "fft", "--batch", "2", "--seq", "32"]
    argv += ["--warmup", "0", "--steps", "3", "--rounds", "1", "--lr", "1e-3", "--device", "cpu", "--dtype", "fp32"]
    argv += ["--threads", "2", "--adapt_top", "2", "--route_top", "2", "--match", "adapt", "--w21_init", "random"]
    argv += ["--w22_init", "svd", "--upscale_only", "--infer_rounds", "1", "--gen_batch", "2", "--gen_prompt", "4"]
    argv += ["--gen_tokens", "0", "--skip_training", "false", "--skip_memory", "--skip_inference", "true"]
    argv += ["--skip_flops", "--skip_upscale", "--seed", "7", "--no_progress", "--out", "o"]
    s = parse_settings(_spelt(argv, dash))
    b = s.bench
    assert s.out == "o" and s.command is None
    assert (b.shapes, b.methods) == (("tiny", "smollm2"), ("fft", "lora"))  # each method once
    assert (b.batch, b.seq, b.warmup, b.steps, b.rounds, b.lr, b.device, b.dtype) == (
        2,
        32,
        0,
        3,
        1,
        1e-3,
        "cpu",
        "fp32",
    )
    assert (b.threads, b.adapt_top, b.route_top, b.match, b.w21_init, b.w22_init) == (2, 2, 2, "adapt", "random", "svd")
    assert b.upscale_only == ()  # the option alone: every shape timed for the upscale cost only
    assert (b.infer_rounds, b.gen_batch, b.gen_prompt, b.gen_tokens, b.seed) == (1, 2, 4, 0, 7)
    assert (b.skip_training, b.skip_memory, b.skip_inference, b.skip_flops, b.skip_upscale) == (
        False,
        True,
        True,
        True,
        True,
    )
    assert b.progress is False
    defaults = parse_settings(["bench"])
    assert defaults.out == "outputs/bench" and defaults.bench.upscale_only is None and defaults.bench.progress is True


@pytest.mark.parametrize("dash", [False, True], ids=["canonical", "dashed"])
def test_sweep_options_reach_the_sweep_and_the_experiment(dash):
    argv = ["sweep", "bio", "--preset", "small", "--lr_scales", "0.5", "2", "--axis", "options.scale.route_tau", "0.1"]
    argv += ["0.9", "--axis", "options.scale.w21_init,options.scale.w22_init", "svd,zero", "random,random"]
    argv += ["--reference", "lora", "--target", "0.9", "--eval_people", "10", "--task1.scale_route_lr", "3e-4"]
    argv += ["--seed", "1", "2", "--out", "o"]
    s = parse_settings(_spelt(argv, dash))
    sweep = s.sweep.sweep_settings()
    assert sweep.lr_scales == (0.5, 2.0) and (sweep.reference, sweep.target, s.sweep.out) == ("lora", 0.9, "o")
    assert [(a.setting, a.values) for a in sweep.axes] == [
        ("options.scale.route_tau", ("0.1", "0.9")),
        ("options.scale.w21_init,options.scale.w22_init", ("svd,zero", "random,random")),
    ]
    assert (s.bio.preset, s.bio.eval_people, s.bio.seeds) == ("small", 10, [1, 2])
    assert s.bio.task1.lr_of("scale_route") == 3e-4 and s.bio.data.people == preset("small").data.people
    cpt = parse_settings(_spelt(["sweep", "cpt", "--save_models", "--train.max_steps", "7", "--seed", "4"], dash))
    assert cpt.sweep.save_models is True and cpt.cpt.train.max_steps == 7 and cpt.cpt.seed == 4
    assert cpt.sweep.lr_scales == (0.25, 0.5, 1.0, 2.0, 4.0) and cpt.cpt.preset == "smollm2"
    assert parse_settings(["sweep", "bio"]).bio.preset == "micro"  # a sweep's own default preset


@pytest.mark.parametrize("dash", [False, True], ids=["canonical", "dashed"])
def test_experiment_options_reach_their_settings(dash):
    bio = parse_settings(_spelt(["bio", "--eval_people", "5", "--options.scale.hidden_up", "32", "--out", "o"], dash))
    assert (bio.out, bio.bio.eval_people, bio.bio.options.scale.hidden_up) == ("o", 5, 32)
    argv = ["cpt", "--model", "m", "--data.train", "a.jsonl", "--data.old_eval", "en=b.jsonl", "--data.streaming"]
    argv += ["--train.micro_batch_size", "2", "--eval.representation_sequences", "3", "--train.lora_lr", "1e-4"]
    cpt = parse_settings(_spelt(argv, dash)).cpt
    assert (cpt.model, cpt.data.train, cpt.data.old_eval, cpt.data.streaming) == (
        "m",
        ["a.jsonl"],
        ["en=b.jsonl"],
        True,
    )
    assert (cpt.train.micro_batch_size, cpt.eval.representation_sequences) == (2, 3)
    assert cpt.train.lr_of("lora") == 1e-4


@pytest.mark.parametrize(
    "argv",
    [
        # spellings the docs use: dashed aliases, bools standing alone, negative values in an axis
        "bench --shapes tiny --seq 64 --rounds 2 --skip-memory",
        "bench --shapes smollm2 --methods fft lora scale_adapt --skip-inference --skip-upscale --no-progress",
        "eval runs/lora/model --tasks arc_easy,hellaswag --limit 100 --merge-lora",
        "eval MODEL_DIR --tasks my_task --include-path my_tasks/",
        "sweep cpt --methods fft lora scale_route --lr-scales 0.5 1 2 --train.max_steps 100 --save-models",
        "sweep bio --preset small --axis options.scale.preserve_layers 1 2 -1 --out outputs/sweep-bio-small",
        "bio --seeds 0 1 2",
        "cpt --data.train ko.jsonl --data.old_eval en=en.jsonl --data.streaming true --train.max_steps 2000",
        "demo",
    ],
)
def test_documented_commands_still_parse(argv):
    assert parse_settings(argv.split()) is not None


def test_bool_options_take_a_value_or_stand_alone():
    assert parse_settings(["bench", "--skip_memory"]).bench.skip_memory is True
    assert parse_settings(["bench", "--skip_memory", "false"]).bench.skip_memory is False
    assert parse_settings(["bench", "--skip-memory", "yes", "--seq", "8"]).bench.skip_memory is True
    assert parse_settings(["bench", "--progress", "false"]).bench.progress is False
    assert parse_settings(["eval", "m", "--merge_lora", "--tasks", "x"]).merge_lora is True


def _yaml(tmp_path, text: str) -> str:
    path = tmp_path / "settings.yaml"
    path.write_text(text)
    return str(path)


def test_bench_yaml_then_command_line(tmp_path):
    config = _yaml(tmp_path, "shapes: [tiny]\nseq: 64\nrounds: 3\nskip_memory: true\nout: from-yaml\n")
    s = parse_settings(["bench", "--config", config, "--rounds", "1"])
    assert s.bench.shapes == ("tiny",) and s.bench.seq == 64 and s.bench.skip_memory is True  # from the YAML
    assert s.bench.rounds == 1  # the command line wins
    assert s.bench.batch == 4 and s.out == "from-yaml"  # not named anywhere: the default; out from the YAML


def test_eval_yaml_then_command_line(tmp_path):
    config = _yaml(tmp_path, "tasks: [english]\ndtype: bfloat16\nlimit: 10\ninclude_path: [a]\n")
    s = parse_settings(["eval", "model", "--config", config, "--limit", "0.5", "--tasks", "korean"])
    assert (s.model_dir, s.dtype, s.include_path) == ("model", "bfloat16", ["a"])  # YAML
    assert (s.limit, s.tasks) == (0.5, ["korean"])  # the command line wins
    assert s.batch_size == "8" and s.merge_lora is False  # defaults


def test_sweep_yaml_holds_both_the_sweep_and_the_experiment(tmp_path):
    config = _yaml(tmp_path, "preset: small\nlr_scales: [0.5, 1]\naxis: [[options.scale.route_tau, 0.1, 0.9]]\n")
    config_text = "task1: {max_steps: 3}\n"
    with open(config, "a") as handle:
        handle.write(config_text)
    s = parse_settings(["sweep", "bio", "--config", config, "--target", "0.5"])
    assert s.bio.preset == "small" and s.bio.task1.max_steps == 3 and s.bio.data.people == preset("small").data.people
    sweep = s.sweep.sweep_settings()
    assert sweep.lr_scales == (0.5, 1.0) and sweep.axes[0].values == ("0.1", "0.9") and sweep.target == 0.5


@pytest.mark.parametrize("dash", [False, True], ids=["canonical", "dashed"])
def test_device_and_precision_are_every_training_stages_settings(dash):
    """One pair of settings per training stage (`StageConfig`), spelt alike by every training command: cpt, base and
    sweep cpt have one stage (train.), bio and sweep bio three (pretrain., task0., task1.); auto by default."""
    settings = {
        ("cpt",): lambda s: [s.cpt.train],
        ("base",): lambda s: [s.base.train],
        ("train",): lambda s: [s.train.train],
        ("sweep", "cpt"): lambda s: [s.cpt.train],
        ("bio",): lambda s: [s.bio.pretrain, s.bio.task0, s.bio.task1],
        ("sweep", "bio"): lambda s: [s.bio.pretrain, s.bio.task0, s.bio.task1],
    }
    for command, stages_of in settings.items():
        assert {(t.device, t.precision) for t in stages_of(parse_settings(list(command)))} == {("auto", "auto")}
        sections = ["train"] if command[-1] != "bio" else ["pretrain", "task0", "task1"]
        for device, precision in (("cpu", "fp32"), ("cuda", "bf16")):
            argv = [*command, *(x for s in sections for x in (f"--{s}.device", device, f"--{s}.precision", precision))]
            stages = stages_of(parse_settings(_spelt(argv, dash)))
            assert {(t.device, t.precision) for t in stages} == {(device, precision)}, argv
    bio = parse_settings(["bio", "--task1.device", "cpu", "--pretrain.precision", "bf16"]).bio  # each stage its own
    assert [(t.device, t.precision) for t in (bio.pretrain, bio.task0, bio.task1)] == [
        ("auto", "bf16"),
        ("auto", "auto"),
        ("cpu", "auto"),
    ]


def test_device_and_precision_from_yaml_then_the_command_line(tmp_path):
    cpt = parse_settings(["cpt", "--config", _yaml(tmp_path, "train: {device: cpu, precision: bf16}\n")]).cpt.train
    assert (cpt.device, cpt.precision) == ("cpu", "bf16")
    config = _yaml(tmp_path, "pretrain: {device: cpu}\ntask1: {device: cpu, precision: fp32}\n")
    bio = parse_settings(["bio", "--preset", "micro", "--config", config, "--task1.precision", "bf16"]).bio
    assert (bio.pretrain.device, bio.task0.device, bio.task1.device, bio.task1.precision) == (
        "cpu",
        "auto",
        "cpu",
        "bf16",
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--methods", "lora"],  # not a SCALE method
        ["demo", "--hidden_up", "wide"],
        ["eval", "m", "--tasks", "x", "--dtype", "float64"],
        ["eval", "m", "--tasks", "x", "--merge-lora", "maybe"],
        ["bench", "--shapes", "gpt-5"],
        ["bench", "--skip_memory", "sometimes"],
        ["bench", "--seq", "1.5"],
        ["bio", "--preset", "huge"],
        ["cpt", "--train.max_steps", "many"],
        ["cpt", "--train.device", "gpu"],
        ["cpt", "--train.precision", "fp16"],
        ["base", "--train.device", "tpu"],
        ["bio", "--task1.precision", "half"],
        ["sweep", "bio", "--pretrain.device", "cuda:1"],
        ["sweep", "bio", "--target", "high"],
        ["sweep", "cpt", "--lr-scales"],
        ["sweep", "bio", "--nonsense", "1"],
    ],
)
def test_bad_values_are_refused_with_exit_code_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and err.startswith("usage: scale-cl")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--batch", "-1"], "scale-cl bench: error: batch must be >= 0, got -1"),
        (["bench", "--config", "{yaml}"], "scale-cl bench: error: unknown setting 'nonsense'"),
        (["eval", "--tasks", "english"], "scale-cl eval: error: give either MODEL_DIR"),
        (["eval", "m", "--batch_size", "-3", "--tasks", "x"], "scale-cl eval: error: --batch_size must be"),
        (["sweep", "bio", "--axis", "options.scale.route_tau"], "scale-cl sweep bio: error: --axis options.scale"),
        (["bio", "--config", "{missing}"], "scale-cl bio: error: cannot read the config file"),
    ],
)
def test_bad_settings_are_refused_with_exit_code_2_before_running(argv, message, tmp_path, capsys):
    config = _yaml(tmp_path, "nonsense: 1\n")
    argv = [a.format(yaml=config, missing=tmp_path / "missing.yaml") for a in argv]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.glob("outputs*"))


@pytest.mark.parametrize(
    ("argv0", "recorded"),
    [("/venv/bin/scale-cl", "scale-cl bench"), ("/src/scale_cl/cli/__main__.py", "python -m scale_cl.cli bench")],
)
def test_bench_records_how_it_was_started(tmp_path, monkeypatch, capsys, argv0, recorded):
    """The results say which command made them: ``scale-cl bench ARGS`` or ``python -m scale_cl.cli bench ARGS``."""
    calls = []
    monkeypatch.setattr("scale_cl.bench.runner.run_bench", lambda cfg, out, command: calls.append((cfg, out, command)))
    (tmp_path / "results.md").write_text("| table |\n")
    args = ["bench", "--shapes", "tiny", "--skip-memory", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", [argv0, *args])
    assert main(args) == 0
    cfg, out, command = calls[0]
    assert cfg.shapes == ("tiny",) and cfg.skip_memory is True and out == tmp_path
    assert command == f"{recorded} --shapes tiny --skip-memory --out {tmp_path}"
    assert "| table |" in capsys.readouterr().out


def _script_arrays(text: str) -> tuple[str, dict[str, list[str]]]:
    """A script with each ``NAME=(...)`` array on one line, and each array's words (to splice where
    ``"${NAME[@]}"`` expands it)."""
    import re
    import shlex

    pattern = re.compile(r"^(\w+)=\(([^)]*)\)", flags=re.M)
    bodies = {m.group(1): m.group(2).replace("\\\n", " ").replace("\n", " ") for m in pattern.finditer(text)}
    text = pattern.sub(lambda m: f"{m.group(1)}=({bodies[m.group(1)]})", text)
    return text, {name: shlex.split(body, comments=True) for name, body in bodies.items()}


def documented_command_lines() -> list[tuple[str, list[str]]]:
    """Every ``scale-cl ...`` (or ``... -m scale_cl.cli ...``) command in the fenced code blocks of the README,
    docs/ and measurements/README.md, and in measurements/*.sh: (where, argv after the program). A script's array
    (``common=(...)``, over several lines) is spliced where it is expanded (``"${common[@]}"``); a shell variable
    stands for a value (``1``), ``"$@"`` and an unknown array for nothing, a trailing ``...`` for more options, and
    ``--help`` is left out (it only prints)."""
    import re
    import shlex
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    found = []
    sources = [root / "README.md", *sorted((root / "docs").rglob("*.md")), root / "measurements" / "README.md"]
    for path in [*sources, *sorted((root / "measurements").glob("*.sh"))]:
        text = path.read_text()
        if path.suffix == ".md":
            blocks = re.findall(r"^[ \t]*```(\w*)\n(.*?)^[ \t]*```", text, flags=re.S | re.M)  # fences in pairs
            text = "\n".join(body for language, body in blocks if language in ("", "bash", "sh", "console"))
        text, arrays = _script_arrays(text)
        for line in text.replace("\\\n", " ").splitlines():  # continued lines joined
            if "scale-cl" not in line and "scale_cl.cli" not in line:
                continue
            for command in re.split(r"&&|;", line):
                words = []
                for word in shlex.split(command, comments=True):
                    spliced = re.fullmatch(r"\$\{(\w+)\[@\]\}", word)
                    words += arrays[spliced.group(1)] if spliced and spliced.group(1) in arrays else [word]
                array = re.fullmatch(r"\w+=\((.+)", words[0]) if words else None  # cmd=(scale-cl ... "$@")
                if array:
                    words = [array.group(1), *words[1:-1], words[-1].removesuffix(")")]
                env = 0  # VAR=value words before the program
                while env < len(words) and re.fullmatch(r"\w+=\S*", words[env]):
                    env += 1
                starts = [env + 1] if env < len(words) and Path(words[env]).name == "scale-cl" else []
                starts += [i + 2 for i, w in enumerate(words[:-1]) if w == "-m" and words[i + 1] == "scale_cl.cli"]
                if not starts:
                    continue
                argv = []
                for word in words[starts[0] :]:
                    if re.fullmatch(r"\$@|\$\{\w+\[@\]\}", word) or word == "--help":
                        continue
                    if word == "...":  # more options, or an option's value
                        if argv and argv[-1].startswith("--"):
                            argv.append("X")
                        continue
                    argv.append("1" if "$" in word else word)
                found.append((f"{path.relative_to(root)}: {line.strip()[:70]}", argv))
    return found


DOCUMENTED = documented_command_lines()


def test_the_docs_document_commands():
    assert len(DOCUMENTED) > 30 and {argv[0] for _, argv in DOCUMENTED} >= {"bio", "cpt", "base", "sweep", "export"}


@pytest.mark.parametrize(("where", "argv"), DOCUMENTED, ids=[where for where, _ in DOCUMENTED])
def test_every_documented_command_parses(where, argv, tmp_path):
    """Every command line the README, docs/ and measurements/ show still parses into its command's settings (a
    ``--config FILE`` named there is read as an empty one)."""
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    argv = [str(empty) if i and argv[i - 1] == "--config" else a for i, a in enumerate(argv)]
    assert parse_settings(argv) is not None, where


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["bio"], "number of synthetic people (splits keep the paper's shares) (default: 600)"),
        (["bio", "--preset", "micro"], "(splits keep the paper's shares) (default: 120)"),
        (["sweep", "bio", "--preset=small"], "(splits keep the paper's shares) (default: 600)"),
        (["cpt", "--preset", "clean-en"], "(default: clean-en)"),
    ],
)
def test_help_shows_the_named_presets_defaults(argv, shown, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    assert shown in " ".join(capsys.readouterr().out.split())  # help text wraps lines


@pytest.mark.parametrize("name", ["bio", "cpt", "base", "train"])
def test_an_experiment_command_is_declared_one_way(name):
    """Its usage line offers every preset its settings know (cpt's once left out clean-en), its description says
    where settings come from and which preset the defaults are, and its settings share the experiment base."""
    from scale_cl.cli import experiments
    from scale_cl.experiments.experiment import ExperimentConfig

    command = getattr(experiments, name.upper())
    config = getattr(command.settings(), name)
    assert isinstance(config, ExperimentConfig)
    assert f"[--preset {'|'.join(type(config).presets)}]" in command.usage
    assert command.description.endswith(f"else the {config.preset} preset's.")
