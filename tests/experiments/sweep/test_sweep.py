"""`scale-cl sweep`: planning, a micro bio sweep and a tiny cpt sweep end to end, resuming, bad input."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from scale_cl.cli import build_parser, main
from scale_cl.experiments.bio.config import preset
from scale_cl.experiments.sweep.experiments import BASE_FILE, BioExperiment, CptExperiment
from scale_cl.experiments.sweep.report import write_report
from scale_cl.experiments.sweep.runner import POINT_FILE, Axis, SweepSettings, plan, point_config, run_sweep
from tests.conftest import tiny_config

METHODS = ["fft", "scale_adapt"]


def micro(methods: list[str] = METHODS):
    cfg = preset("micro")
    cfg.methods = list(methods)
    return cfg


# --- planning ---------------------------------------------------------------------------------


def test_plan_crosses_methods_rates_and_axes_without_duplicates():
    cfg = micro(["fft", "scale_preserve", "scale_adapt", "scale_route"])
    settings = SweepSettings(
        lr_scales=(0.5, 1.0),
        axes=(Axis("options.scale.collab_modules", ("attn", "attn+ffn")), Axis("options.scale.route_tau", ("0.2",))),
    )
    points = plan(BioExperiment(cfg), settings)
    plain = [p for p in points if not p.overrides]
    assert len(plain) == 4 * 2
    # collab_modules concerns adapt and route only; "attn+ffn" is the preset's value: the plain runs serve it.
    collab = [p for p in points if p.overrides == (("options.scale.collab_modules", ("attn",)),)]
    assert sorted(p.method for p in collab) == ["scale_adapt", "scale_adapt", "scale_route", "scale_route"]
    tau = [p for p in points if p.overrides == (("options.scale.route_tau", 0.2),)]
    assert [p.method for p in tau] == ["scale_route", "scale_route"]
    assert len(points) == 8 + 4 + 2 and len({p.key for p in points}) == len(points)
    fft = sorted(p.lr for p in plain if p.method == "fft")
    assert fft == pytest.approx([0.5 * cfg.task1.lr_of("fft"), cfg.task1.lr_of("fft")])


def test_method_lr_scales_add_rates_for_that_method_only():
    cfg = micro(["fft", "scale_preserve"])
    settings = SweepSettings(lr_scales=(0.5, 1.0), method_lr_scales={"scale_preserve": (1.0, 2.0)})
    points = plan(BioExperiment(cfg), settings)
    scales = {m: sorted(p.scale for p in points if p.method == m) for m in cfg.methods}
    assert scales == {"fft": [0.5, 1.0], "scale_preserve": [0.5, 1.0, 2.0]}  # x1 is in both: run once
    # A method that is not swept this time adds nothing (a script may name it for its full run).
    lora_too = replace(settings, method_lr_scales={**settings.method_lr_scales, "lora": (3.0,)})
    assert plan(BioExperiment(cfg), lora_too) == points
    args = build_parser().parse_args(
        ["sweep", "bio", "--lr-scales", "0.5", "1", "--method-lr-scales", "scale_preserve", "1.5", "2"]
    )
    assert args.method_lr_scales == [["scale_preserve", "1.5", "2"]]


def test_settings_that_vary_together_form_one_axis():
    cfg = micro(["fft", "scale_preserve"])
    pair = Axis("options.scale.w21_init,options.scale.w22_init", ("svd,zero", "random,random", "zero,svd"))
    points = plan(BioExperiment(cfg), SweepSettings(lr_scales=(1.0,), axes=(pair,)))
    changed = [p.overrides for p in points if p.overrides]
    # "svd,zero" is the preset's pair: the plain run serves it; fft has no W21/W22.
    assert changed == [
        (("options.scale.w21_init", "random"), ("options.scale.w22_init", "random")),
        (("options.scale.w21_init", "zero"), ("options.scale.w22_init", "svd")),
    ]
    assert {p.method for p in points if p.overrides} == {"scale_preserve"}
    with pytest.raises(ValueError, match="2 comma-separated parts"):
        plan(BioExperiment(cfg), SweepSettings(axes=(Axis(pair.setting, ("svd",)),)))
    with pytest.raises(ValueError, match="must be one of"):
        run_sweep(BioExperiment(cfg), SweepSettings(axes=(Axis(pair.setting, ("svd,bogus",)),)), Path("/nonexistent"))


def test_bio_replay_axis_concerns_every_method_and_with_route_share_only_route():
    cfg = micro(["fft", "lora", "scale_route"])
    settings = SweepSettings(
        lr_scales=(1.0,),
        axes=(
            Axis("task1.replay_ratio", ("0.25",)),
            Axis("task1.replay_ratio,options.route_share", ("0.25,0.9",)),
        ),
    )
    points = plan(BioExperiment(cfg), settings)
    replay = [p.method for p in points if p.overrides == (("task1.replay_ratio", 0.25),)]
    assert replay == ["fft", "lora", "scale_route"]
    both = [p.method for p in points if len(p.overrides) == 2]
    assert both == ["scale_route"]
    configs = [point_config(BioExperiment(cfg), p) for p in points if p.overrides]
    assert [c.task1.replay_ratio for c in configs] == [0.25] * 4
    assert [c.options.route_share for c in configs] == [0.0, 0.0, 0.0, 0.9]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (SweepSettings(axes=(Axis("task1.replay_ratio", ("1.0",)),)), r"task1\.replay_ratio must be in \[0, 1\)"),
        (SweepSettings(lr_scales=(1.0,), reference="lora"), "reference method 'lora' is not swept"),
        (SweepSettings(lr_scales=(0.0, 1.0)), "must be positive"),
        (SweepSettings(lr_scales=(1.0, 1.0)), "repeat"),
        (SweepSettings(method_lr_scales={"scale_presrve": (2.0,)}), "'scale_presrve', which is not a method"),
        (SweepSettings(method_lr_scales={"fft": (-2.0,)}), "must be positive"),
        (SweepSettings(axes=(Axis("options.scale.route_tau", ("0.3",)),)), "none is swept"),
        (SweepSettings(axes=(Axis("options.scale.no_such_thing", ("1",)),)), "unknown setting"),
        (SweepSettings(axes=(Axis("options.scale.preserve_layers", ("two",)),)), "not a valid int"),
        (
            SweepSettings(axes=(Axis("options.scale.preserve_layers", ("5",)),)),
            "does not fit the model's 2 decoder layers",
        ),
    ],
)
def test_bad_sweeps_fail_before_anything_is_written(tmp_path, settings, message):
    out = tmp_path / "sweep"
    with pytest.raises(ValueError, match=message):
        run_sweep(BioExperiment(micro()), settings, out)
    assert not out.exists()


@pytest.mark.slow
def test_cli_reports_bad_input_with_exit_code_2(tmp_path, capsys):
    out = tmp_path / "sweep"
    code = main(["sweep", "bio", "--methods", "scale_adapt", "--lr-scales", "1", "--out", str(out)])
    assert code == 2 and "reference method 'fft' is not swept" in capsys.readouterr().err
    assert not out.exists()


# --- a micro bio sweep end to end ----------------------------------------------------------------


@pytest.fixture(scope="module")
def bio_sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("bio-sweep")
    experiment = BioExperiment(micro())
    settings = SweepSettings(lr_scales=(1.0, 4.0), axes=(Axis("options.scale.collab_modules", ("attn", "attn+ffn")),))
    result = run_sweep(experiment, settings, out)
    report = write_report(experiment, settings, result, out)
    return experiment, settings, out, report


@pytest.mark.slow
def test_bio_sweep_writes_the_landscape_tables_and_ablation_figures(bio_sweep):
    _, _, out, report = bio_sweep
    for name in ("results.md", "results.json", "landscape.png", "ablation-collab_modules-task0_end.png"):
        assert (out / name).stat().st_size > 0, name
    assert len(report["points"]) == 2 * 2 + 2  # fft, adapt x 2 rates + adapt with attn only x 2 rates
    text = (out / "results.md").read_text()
    assert "## Matched learning" in text and "## At each method's preset rate" in text
    assert "### Ablation: options.scale.collab_modules" in text
    # Fresh runs (held in memory, tuples) and runs read back from point.json (lists) are found alike.
    assert all(sorted(t["cells"]["scale_adapt"]) == ["attn", "attn+ffn"] for t in report["ablations"])
    assert json.loads((out / "results.json").read_text())["target"] == report["target"]


@pytest.mark.slow
def test_bio_matched_table_reads_the_reference_at_its_own_point(bio_sweep):
    experiment, _, _, report = bio_sweep
    fft = [r for r in report["points"] if r["method"] == "fft"]
    preset_run = next(r for r in fft if r["scale"] == 1.0)
    assert report["target"] == preset_run["metrics"]["learning"]  # default target: FFT at its preset rate
    # Accuracies are discrete: where the other rate learns exactly as much, the better forgetting of the two is read.
    at_target = [r for r in fft if r["metrics"]["learning"] == report["target"]]
    rows = {(r["panel"], r["method"]): r for r in report["matched"]}
    for spec in experiment.panels:
        best = max(at_target, key=lambda r: (r["metrics"][spec.key], -r["lr"]))
        row = rows[(spec.title, "fft")]
        assert row["status"] == "ok"
        assert row["matched_forgetting"] == pytest.approx(best["metrics"][spec.key])
        assert row["matched_lr"] == pytest.approx(best["lr"])
        assert rows[(spec.title, "scale_adapt")]["status"] in ("ok", "not reached", "below range")


@pytest.mark.slow
def test_bio_sweep_measures_step_0_and_stages_once(bio_sweep):
    _, _, out, report = bio_sweep
    base = json.loads((out / BASE_FILE).read_text())["0"]
    for log in (out / "points").glob("*/seed-0/*.jsonl"):
        first = json.loads(log.read_text().splitlines()[0])
        assert first == {"step": 0, **base}
    assert len(list((out / "cache").glob("stage1-*"))) == 1
    assert len(list((out / "cache").glob("stage2-*"))) == 1
    assert report["base"]["learning"] == base["task1"]["overall"]


@pytest.mark.slow
def test_resuming_recomputes_nothing_and_finishes_only_what_is_missing(bio_sweep, tmp_path):
    experiment, settings, out, _ = bio_sweep
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    calls: list[str] = []
    fresh = BioExperiment(experiment.cfg)
    original = fresh.run

    def counting(cfg, method, point_dir):
        calls.append(point_dir.name)
        return original(cfg, method, point_dir)

    fresh.run = counting
    resumed = run_sweep(fresh, settings, copy)
    assert calls == []
    # Read back from point.json (a tuple setting's value is a JSON list there), the ablation still finds its runs.
    tables = write_report(fresh, settings, resumed, copy)["ablations"]
    assert tables and all(sorted(t["cells"]["scale_adapt"]) == ["attn", "attn+ffn"] for t in tables)
    redo = next((copy / "points").iterdir())
    (redo / POINT_FILE).unlink()
    shutil.rmtree(redo / "seed-0")
    result = run_sweep(fresh, settings, copy)
    assert calls == [redo.name]
    assert len(result.points) == 6


@pytest.mark.slow
def test_a_folder_of_other_settings_is_refused(bio_sweep):
    _, settings, out, _ = bio_sweep
    other = micro()
    other.task1.max_steps = 99
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match="another configuration"):
        run_sweep(BioExperiment(other), settings, out)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before


# --- a tiny cpt sweep ----------------------------------------------------------------------------


@pytest.mark.slow
def test_cpt_sweep_end_to_end(workspace, tmp_path):
    cfg = tiny_config(workspace, ["fft", "scale_preserve"], steps=3, save_every=0)
    experiment = CptExperiment(cfg)
    settings = SweepSettings(lr_scales=(0.5, 2.0))
    out = tmp_path / "sweep"
    result = run_sweep(experiment, settings, out)
    report = write_report(experiment, settings, result, out)
    assert (out / "landscape.png").stat().st_size > 0
    assert [p.key for p in experiment.panels] == ["old/toy"]
    assert len(report["points"]) == 4 and {r["panel"] for r in report["matched"]} == {"old domain: toy"}
    base = json.loads((out / BASE_FILE).read_text())
    for metrics in (out / "points").glob("*/*/metrics.jsonl"):
        first = json.loads(metrics.read_text().splitlines()[0])
        assert first["learning_ppl"] == base["learning_ppl"] and first["forgetting_ppl"] == base["forgetting_ppl"]
    assert not list((out / "points").glob("*/*/model")), "a sweep keeps only metrics unless --save-models"
    assert report["base"] == {"learning": base["learning_ppl"], "old/toy": base["forgetting_ppl"]["toy"]}


def test_cpt_sweep_needs_old_domain_sets(workspace, tmp_path):
    cfg = tiny_config(workspace, ["fft"])
    cfg.data.old_eval = []
    with pytest.raises(ValueError, match=r"data\.old_eval"):
        run_sweep(CptExperiment(cfg), SweepSettings(lr_scales=(1.0,)), tmp_path / "sweep")
    assert not (tmp_path / "sweep").exists()


def test_sweep_options_reach_the_sweep_and_the_experiment():
    args = build_parser().parse_args(
        ["sweep", "cpt", "--lr-scales", "0.5", "2", "--axis", "options.scale.route_tau", "0.1", "0.9",
         "--reference", "lora", "--target", "3.5", "--save-models", "--train.fft_lr", "1e-4"]
    )  # fmt: skip
    assert args.lr_scales == [0.5, 2.0] and args.axis == [["options.scale.route_tau", "0.1", "0.9"]]
    assert (args.reference, args.target, args.save_models) == ("lora", 3.5, True)
    assert vars(args)["train.method_lr"] == {"fft": 1e-4}


def test_step_0_records_come_from_initial(tmp_path):
    from scale_cl.train.callbacks import PeriodicEval

    calls = []
    tracker = PeriodicEval(lambda m: calls.append(m) or {"x": 1.0}, every=1, initial={"x": 2.0})
    tracker._record(0, "model")
    tracker._record(1, "model")
    assert [r["x"] for r in tracker.records] == [2.0, 1.0] and calls == ["model"]


# --- the spread over seeds -----------------------------------------------------------------------


def test_seed_readings_read_each_seeds_own_sweep_and_the_table_shows_their_spread():
    """Seed 0 reaches Task 1 = 90% half-way (in log lr) between its 2e-4 and 4e-4 runs, keeping 30% of Task 0;
    seed 1 never reaches it: the table's cell (read off the means) says so as '1/2 seeds'."""
    from scale_cl.experiments.sweep.landscape import matched_markdown, matched_table
    from scale_cl.experiments.sweep.report import panels, seed_readings
    from scale_cl.experiments.sweep.runner import SweepResult

    experiment = BioExperiment(micro(["fft"]))
    per_seed = {"0": ([0.5, 0.8, 1.0], [0.6, 0.4, 0.2]), "1": ([0.3, 0.6, 0.85], [0.7, 0.5, 0.3])}
    records = []
    for i, lr in enumerate((1e-4, 2e-4, 4e-4)):
        seeds = {
            s: {"learning": learn[i], "task0_end": kept[i], "task0_min": kept[i], "task0_trained_end": kept[i]}
            for s, (learn, kept) in per_seed.items()
        }
        means = {k: sum(m[k] for m in seeds.values()) / 2 for k in seeds["0"]}
        records.append({"method": "fft", "lr": lr, "label": "", "overrides": {}, "metrics": means, "seeds": seeds})
    result = SweepResult(base={"learning": 0.0, "task0_end": 0.9, "task0_min": 0.9, "task0_trained_end": 1.0})
    result.points = records
    readings = seed_readings(experiment, result, {"0": 0.9, "1": 0.9})
    first = experiment.panels[0].title
    assert readings[(first, "fft")] == [pytest.approx(0.3), None]
    views = panels(experiment, result, 0.9)
    assert views[0].points[0].forgetting_sd == pytest.approx(0.05)  # 0.6 and 0.7 around 0.65
    rows = matched_table(views, ["fft"])
    for row in rows:
        row["seed_forgetting"] = readings[(row["panel"], row["method"])]
    assert "(1/2 seeds)" in matched_markdown(rows)  # the means reach 90% (0.925 at 4e-4), seed 1 does not
    rows[0]["seed_forgetting"] = [0.3, 0.5]
    assert "± 10.0%" in matched_markdown(rows)


def test_an_ablation_cell_reads_each_seeds_own_runs_too():
    """An axis setting's matched reading carries the same per-seed spread as the plain sweep's (the same runs as
    above, under task1.replay_ratio=0.25): seed 0 reaches Task 1 = 90% keeping 30%, seed 1 never does."""
    from scale_cl.experiments.sweep.report import _ablation_markdown, ablation
    from scale_cl.experiments.sweep.runner import SweepResult, stored_overrides

    experiment = BioExperiment(micro(["fft"]))
    axis = Axis("task1.replay_ratio", ("0.25",))
    settings = SweepSettings(lr_scales=(1.0, 2.0, 4.0), axes=(axis,))
    wanted = stored_overrides(axis.overrides(experiment.cfg, "0.25"))
    per_seed = {"0": ([0.5, 0.8, 1.0], [0.6, 0.4, 0.2]), "1": ([0.3, 0.6, 0.85], [0.7, 0.5, 0.3])}
    records = []
    for i, (scale, lr) in enumerate(((1.0, 1e-4), (2.0, 2e-4), (4.0, 4e-4))):
        seeds = {
            s: {"learning": learn[i], "task0_end": kept[i], "task0_min": kept[i], "task0_trained_end": kept[i]}
            for s, (learn, kept) in per_seed.items()
        }
        means = {k: sum(m[k] for m in seeds.values()) / 2 for k in seeds["0"]}
        records.append(
            {
                "method": "fft",
                "lr": lr,
                "scale": scale,
                "label": "",
                "overrides": wanted,
                "metrics": means,
                "seeds": seeds,
            }
        )
    result = SweepResult(base={"learning": 0.0, "task0_end": 0.9, "task0_min": 0.9, "task0_trained_end": 1.0})
    result.points = records
    tables = ablation(experiment, settings, result, 0.9, {"0": 0.9, "1": 0.9})
    first = tables[0]
    assert first["cells"]["fft"]["0.25"][5] == [pytest.approx(0.3), None]
    spec = next(s for s in experiment.panels if s.key == first["panel"])
    assert "(1/2 seeds)" in _ablation_markdown(first, experiment, spec)


def test_seed_readings_are_paired_with_each_seeds_own_reference_level():
    """With the reference's learning as the target, each seed is read at its own reference run's level: the
    reference reads exactly its own per-seed forgetting (no spread from how much the seeds learn, no seed left
    short of the mean), another method is read where it learns as much as the reference did in that seed.
    A given --target is one level for all seeds."""
    from scale_cl.experiments.sweep.report import seed_readings, seed_targets
    from scale_cl.experiments.sweep.runner import SweepResult

    experiment = BioExperiment(micro(["fft", "scale_route"]))
    keys = ("task0_end", "task0_min", "task0_trained_end")

    def record(method, lr, per_seed):
        seeds = {s: {"learning": learn, **dict.fromkeys(keys, kept)} for s, (learn, kept) in per_seed.items()}
        means = {k: sum(m[k] for m in seeds.values()) / 2 for k in seeds["0"]}
        return {"method": method, "lr": lr, "label": "", "overrides": {}, "metrics": means, "seeds": seeds}

    # fft at its preset 1e-4: seed 0 learns 0.8, seed 1 0.9 (mean 0.85); each below the other's level.
    fft = [
        record("fft", 1e-4, {"0": (0.8, 0.5), "1": (0.9, 0.3)}),
        record("fft", 4e-4, {"0": (1.0, 0.1), "1": (1.0, 0.1)}),
    ]
    route = [
        record("scale_route", 1e-4, {"0": (0.7, 0.8), "1": (0.7, 0.8)}),
        record("scale_route", 4e-4, {"0": (0.9, 0.6), "1": (0.9, 0.6)}),
    ]
    result = SweepResult(base={"learning": 0.0, **dict.fromkeys(keys, 0.9)})
    result.points = fft + route
    target = fft[0]["metrics"]["learning"]  # the reference at its preset rate: the seeds' mean, 0.85
    targets = seed_targets(SweepSettings(lr_scales=(1.0, 4.0)), result, target)
    assert targets == {"0": 0.8, "1": 0.9}
    readings = seed_readings(experiment, result, targets)
    first = experiment.panels[0].title
    assert readings[(first, "fft")] == [pytest.approx(0.5), pytest.approx(0.3)]
    assert readings[(first, "scale_route")] == [pytest.approx(0.7), pytest.approx(0.6)]  # half-way, and at 4e-4
    given = seed_targets(SweepSettings(lr_scales=(1.0, 4.0), target=0.85), result, 0.85)
    assert given == {"0": 0.85, "1": 0.85}


@pytest.mark.slow
def test_a_sweep_over_two_seeds_keeps_each_seeds_metrics(tmp_path):
    cfg = micro(["fft"])
    cfg.seeds = [0, 1]
    experiment = BioExperiment(cfg)
    settings = SweepSettings(lr_scales=(1.0, 4.0))
    result = run_sweep(experiment, settings, tmp_path)
    report = write_report(experiment, settings, result, tmp_path)
    for record in report["points"]:
        assert sorted(record["seeds"]) == ["0", "1"]
        for key, mean in record["metrics"].items():
            assert mean == pytest.approx(sum(m[key] for m in record["seeds"].values()) / 2)
        point = next(p for p in (tmp_path / "points").iterdir() if p.name.endswith(f"lr={record['lr']:.4g}"))
        for seed, metrics in record["seeds"].items():
            curve = json.loads((point / f"seed-{seed}" / "fft.json").read_text())["curve"]
            assert metrics["learning"] == curve[-1]["task1"]["overall"]
            assert metrics["task0_min"] == min(r["task0"]["overall"] for r in curve)
        assert json.loads((point / POINT_FILE).read_text())["seeds"] == record["seeds"]
    assert all(len(row["seed_forgetting"]) == 2 for row in report["matched"])
