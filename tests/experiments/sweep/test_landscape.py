"""The stability-plasticity landscape: frontiers, forgetting at matched learning, tables and figures."""

from __future__ import annotations

import math

import pytest

from scale_cl.experiments.sweep.landscape import (
    Matched,
    Metric,
    Panel,
    Point,
    default_target,
    frontier,
    matched_forgetting,
    matched_markdown,
    matched_table,
    plot_ablation,
    plot_landscape,
    single_rate_markdown,
)

PPL = Metric("learning ppl", higher_is_better=False, log_scale=True)
OLD_PPL = Metric("forgetting ppl", higher_is_better=False, log_scale=True)
ACC = Metric("Task-1 accuracy", higher_is_better=True)
OLD_ACC = Metric("Task-0 accuracy", higher_is_better=True)


def sweep(method: str, lrs: list[float], learning: list[float], forgetting: list[float]) -> list[Point]:
    return [Point(method, lr, lo, f) for lr, lo, f in zip(lrs, learning, forgetting, strict=True)]


def test_metric_direction():
    assert PPL.better(5, 6) and not PPL.better(6, 5) and not PPL.better(5, 5)
    assert ACC.better(0.6, 0.5) and not ACC.better(0.5, 0.6)
    assert PPL.at_least(5, 5) and PPL.at_least(5 * (1 + 1e-14), 5) and not PPL.at_least(5.001, 5)
    assert ACC.at_least(0.5, 0.5) and not ACC.at_least(0.49, 0.5)


def test_frontier_lower_is_better():
    pts = sweep("fft", [1, 2, 3, 4, 5, 6, 7], [10, 8, 9, 6, 7, 6, math.nan], [5, 6, 7, 9, 9.5, 10, 1])
    # lr 3 is dominated by lr 2, lr 5 by lr 4, lr 6 by lr 4 (same learning, worse forgetting); lr 7 diverged
    assert [p.lr for p in frontier(pts, PPL, OLD_PPL)] == [1, 2, 4]


def test_frontier_higher_is_better():
    pts = sweep("fft", [1, 2, 3, 4], [0.2, 0.5, 0.4, 0.8], [0.9, 0.7, 0.6, 0.3])
    assert [p.lr for p in frontier(pts, ACC, OLD_ACC)] == [1, 2, 4]
    # mixed directions: learning accuracy (higher better) against forgetting perplexity (lower better)
    pts = sweep("fft", [1, 2, 3, 4], [0.2, 0.5, 0.4, 0.8], [3.0, 4.0, 4.5, 4.0])
    assert [p.lr for p in frontier(pts, ACC, OLD_PPL)] == [1, 4]


def test_matched_monotone_interpolates_in_log_lr():
    pts = sweep("fft", [1e-4, 1e-3], [10.0, 6.0], [2.0, 4.0])
    m = matched_forgetting(pts, 8.0, PPL, OLD_PPL)
    assert m.reached and not m.below_range and m.status == "ok"
    assert m.lr == pytest.approx(math.sqrt(1e-7), rel=1e-12)
    assert m.forgetting == pytest.approx(3.0)
    m = matched_forgetting(list(reversed(pts)), 9.0, PPL, OLD_PPL)  # t = 0.25, input order does not matter
    assert m.lr == pytest.approx(1e-4 * 10**0.25, rel=1e-12)
    assert m.forgetting == pytest.approx(2.5)


def test_matched_exact_hit_at_a_point():
    pts = sweep("fft", [1e-4, 1e-3, 1e-2], [10.0, 8.0, 6.0], [2.0, 2.7, 4.0])
    assert matched_forgetting(pts, 8.0, PPL, OLD_PPL) == Matched("fft", 8.0, 2.7, 1e-3, reached=True)
    single = [Point("fft", 1e-3, 8.0, 2.7)]
    assert matched_forgetting(single, 8.0, PPL, OLD_PPL).reached
    assert matched_forgetting(single, 7.0, PPL, OLD_PPL).status == "not reached"
    assert matched_forgetting(single, 9.0, PPL, OLD_PPL).status == "below range"


def test_matched_not_reached_and_below_range():
    pts = sweep("adapt", [1e-4, 1e-3], [10.0, 6.0], [2.0, 4.0])
    m = matched_forgetting(pts, 5.0, PPL, OLD_PPL)
    assert (m.reached, m.below_range, m.forgetting, m.lr, m.status) == (False, False, None, None, "not reached")
    m = matched_forgetting(pts, 12.0, PPL, OLD_PPL)
    assert (m.reached, m.below_range, m.forgetting, m.lr, m.status) == (False, True, None, None, "below range")


def test_matched_skips_diverged_runs():
    pts = sweep("fft", [1e-4, 1e-3, 1e-2], [10.0, 6.0, math.nan], [2.0, 4.0, math.nan])
    assert matched_forgetting(pts, 8.0, PPL, OLD_PPL).forgetting == pytest.approx(3.0)
    assert matched_forgetting(pts, 5.0, PPL, OLD_PPL).status == "not reached"  # no segment into the NaN
    assert matched_forgetting(pts, 12.0, PPL, OLD_PPL).status == "below range"


def test_matched_non_monotone_picks_best_crossing():
    # learning 10 -> 6 -> 9 -> 6 crosses 8 three times; forgetting there is 3, 2.667 and 1.5
    pts = sweep("route", [1e-4, 1e-3, 1e-2, 1e-1], [10.0, 6.0, 9.0, 6.0], [1.0, 5.0, 1.5, 1.5])
    m = matched_forgetting(pts, 8.0, PPL, OLD_PPL)
    assert m.forgetting == pytest.approx(1.5)
    assert m.lr == pytest.approx(10 ** (-2 + 1 / 3), rel=1e-12)
    # equal forgetting at every crossing: the lowest rate wins
    flat = sweep("route", [1e-4, 1e-3, 1e-2], [10.0, 6.0, 10.0], [2.0, 2.0, 2.0])
    assert matched_forgetting(flat, 8.0, PPL, OLD_PPL).lr == pytest.approx(math.sqrt(1e-7), rel=1e-12)


def test_matched_accuracy_higher_is_better():
    pts = sweep("fft", [1e-4, 1e-3], [0.2, 0.6], [0.9, 0.5])
    m = matched_forgetting(pts, 0.5, ACC, OLD_ACC)  # t = 0.75
    assert m.lr == pytest.approx(1e-4 * 10**0.75, rel=1e-12)
    assert m.forgetting == pytest.approx(0.6)
    assert matched_forgetting(pts, 0.1, ACC, OLD_ACC).status == "below range"
    assert matched_forgetting(pts, 0.7, ACC, OLD_ACC).status == "not reached"
    # two crossings of 0.5: retained accuracy 0.6 and 0.8, the higher one wins
    twice = sweep("fft", [1e-4, 1e-3, 1e-2], [0.2, 0.6, 0.2], [0.9, 0.5, 0.9])
    assert matched_forgetting(twice, 0.5, ACC, OLD_ACC).forgetting == pytest.approx(0.6)
    twice = sweep("fft", [1e-4, 1e-3, 1e-2], [0.2, 0.6, 0.2], [0.9, 0.5, 1.0])
    m = matched_forgetting(twice, 0.5, ACC, OLD_ACC)
    assert m.forgetting == pytest.approx(0.625) and m.lr > 1e-3


def test_matched_rejects_bad_input():
    with pytest.raises(ValueError, match="no points"):
        matched_forgetting([], 8.0, PPL, OLD_PPL)
    with pytest.raises(ValueError, match="one method"):
        matched_forgetting([Point("a", 1e-4, 10, 2), Point("b", 1e-3, 6, 4)], 8.0, PPL, OLD_PPL)
    with pytest.raises(ValueError, match="duplicate"):
        matched_forgetting([Point("a", 1e-4, 10, 2), Point("a", 1e-4, 6, 4, "x=1")], 8.0, PPL, OLD_PPL)
    with pytest.raises(ValueError, match="positive"):
        matched_forgetting([Point("a", 0.0, 10, 2)], 8.0, PPL, OLD_PPL)


def test_default_target_nearest_rate_in_log_space():
    by_method = {
        "fft": sweep("fft", [1e-4, 1e-3, 1e-2], [10.0, 6.0, 5.0], [1, 2, 3]),
        "adapt": sweep("adapt", [1e-3], [7.0], [1]),
    }
    assert default_target(by_method, "fft", 1e-3, PPL) == 6.0
    assert default_target(by_method, "fft", 2e-3, PPL) == 6.0  # log distance 0.69 vs 1.61
    assert default_target(by_method, "fft", 6e-3, PPL) == 5.0  # 1.79 vs 0.51 (linearly nearer 1e-3 would be wrong)
    assert default_target(by_method, "fft", math.sqrt(1e-7), PPL) == 10.0  # a tie goes to the lower rate
    with pytest.raises(ValueError, match="no points"):
        default_target(by_method, "route", 1e-3, PPL)


def panels() -> list[Panel]:
    points = (
        *sweep("fft", [1e-4, 1e-3], [10.0, 6.0], [2.0, 4.5]),
        *sweep("adapt", [1e-4, 1e-3], [12.0, 9.0], [1.5, 1.8]),  # never reaches 8
        *sweep("route", [1e-5, 1e-4], [7.0, 6.0], [1.2, 1.3]),  # already past 8 at its lowest rate
        Point("route", 1e-3, math.inf, math.inf),  # diverged
    )
    ppl = Panel("web", PPL, OLD_PPL, points, base=(20.0, 1.0), target=8.0)
    accs = (*sweep("fft", [1e-4, 1e-3], [0.2, 0.6], [0.9, 0.5]), *sweep("adapt", [1e-4, 1e-3], [0.3, 0.5], [0.9, 0.8]))
    acc = Panel("bio", ACC, OLD_ACC, accs, base=(0.0, 0.95), target=0.5)
    return [ppl, acc]


def test_matched_table_and_markdown():
    rows = matched_table(panels(), ["fft", "adapt", "route"])
    status = {(r["panel"], r["method"]): r["status"] for r in rows}
    assert status == {
        ("web", "fft"): "ok",
        ("web", "adapt"): "not reached",
        ("web", "route"): "below range",
        ("bio", "fft"): "ok",
        ("bio", "adapt"): "ok",
        ("bio", "route"): "missing",
    }
    web_fft = next(r for r in rows if (r["panel"], r["method"]) == ("web", "fft"))
    assert web_fft["matched_forgetting"] == pytest.approx(3.25)
    assert web_fft["matched_lr"] == pytest.approx(math.sqrt(1e-7))
    text = matched_markdown(rows)
    lines = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "| 3.25 | 0.000316 |" in lines["fft"]
    assert "| 60.0% |" in lines["fft"]  # accuracy at t = 0.75: 0.9 - 0.75 * 0.4
    assert "not reached" in lines["adapt"] and "| 80.0% |" in lines["adapt"]  # adapt's exact hit at 0.5
    assert "below range" in lines["route"] and lines["route"].endswith("| — | — |")
    assert "forgetting ppl at learning ppl = 8" in text
    with pytest.raises(ValueError, match="no matched-learning target"):
        matched_table([Panel("x", PPL, OLD_PPL, ())], ["fft"])


def test_single_rate_markdown():
    text = single_rate_markdown(panels(), {"fft": 1e-3, "adapt": 1e-3, "route": 1e-5})
    lines = text.splitlines()
    assert lines[2] == "| fft | 0.001 | 6 | 4.5 | 60.0% | 50.0% |"
    assert lines[3] == "| adapt | 0.001 | 9 | 1.8 | 50.0% | 80.0% |"
    assert lines[4] == "| route | 1e-05 | 7 | 1.2 | — | — |"


def is_png(path) -> bool:
    return path.stat().st_size > 1000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_landscape_writes_png(tmp_path):
    ablated = Panel("ablation", PPL, OLD_PPL, (Point("fft", 1e-4, 9.0, 2.0, "layers=4"), *panels()[0].points))
    path = plot_landscape([*panels(), ablated], tmp_path / "figs" / "landscape.png", title="sweep")
    assert path == tmp_path / "figs" / "landscape.png" and is_png(path)
    assert not list(path.parent.glob(".*tmp*"))


def test_plot_ablation_writes_png_with_a_not_reached_method(tmp_path):
    by_method = {
        "route": {"2": (7.0, 1.3, 1.2), "4": (7.5, 1.25, 1.15), "8": (8.0, 1.2, 1.1)},
        "adapt": {"2": (9.0, 1.8, None), "4": (9.5, 1.7, None)},  # never reaches the target; no run at 8
    }
    path = plot_ablation("preserve_layers", ["2", "4", "8"], by_method, PPL, OLD_PPL, tmp_path / "ablation.png")
    assert is_png(path)


def test_plot_ablation_with_no_method_reaching_the_target(tmp_path):
    """An ablation run at one rate only (no method reaches the target): the matched panel is empty, not an error."""
    by_method = {"adapt": {"0": (8.8, 69.0, None), "3": (11.8, 65.0, None), "5": (15.4, 53.0, None)}}
    path = plot_ablation("preserve_layers", ["0", "3", "5"], by_method, PPL, OLD_PPL, tmp_path / "ablation.png")
    assert is_png(path)


def test_matched_flags_a_crossing_when_the_lowest_rate_already_reaches_the_target():
    # Learns fully at its lowest rate and collapses at the highest: the only crossing swept is on the high side;
    # a rate below the grid may reach the target with less forgetting, so the value is only a bound.
    pts = sweep("lora", [1e-3, 2e-3, 4e-3], [1.0, 0.99, 0.45], [0.14, 0.06, 0.04])
    m = matched_forgetting(pts, 0.9, ACC, OLD_ACC)
    assert m.status == "ok" and m.open_below
    assert m.forgetting == pytest.approx(0.06 + (0.09 / 0.54) * (0.04 - 0.06))
    covered = sweep("fft", [1e-5, 1e-4, 1e-3], [0.5, 1.0, 1.0], [0.3, 0.2, 0.1])
    assert not matched_forgetting(covered, 0.9, ACC, OLD_ACC).open_below
    panel = Panel("bio", ACC, OLD_ACC, tuple(pts + covered), target=0.9)
    text = matched_markdown(matched_table([panel], ["lora", "fft"]))
    lora = next(line for line in text.splitlines() if line.startswith("| lora"))
    assert "% †" in lora and "†" not in next(line for line in text.splitlines() if line.startswith("| fft"))
