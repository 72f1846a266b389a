"""measurements/bio_confidence_table.py reads the confidence runs: every reading's accuracies and router record,
its oracle (the Task-0 model on Task 0, the new expert alone on Task 1, at the reading's alpha) and Eq. 5's share."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "measurements" / "bio_confidence_table.py"


def _module():
    spec = importlib.util.spec_from_file_location("bio_confidence_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _accuracies(task0: float, trained: float, task1: float) -> dict:
    return {"task0": {"overall": task0}, "task0_trained": {"overall": trained}, "task1": {"overall": task1}}


def _router(w0: float, w1: float, auroc: float) -> dict:
    names = ("task0", "task0_trained", "task1")
    return {**{f"{n}_base_weight": w for n, w in zip(names, (w0, w0, w1), strict=True)}, "auroc": auroc}


def test_the_table_reads_each_reading_with_its_oracle_and_eq5_s_share(tmp_path):
    start = {"step": 0, **_accuracies(0.8, 1.0, 0.0)}
    for seed, t0 in ((0, 0.6), (1, 0.7)):
        folder = tmp_path / f"seed-{seed}"
        folder.mkdir()
        preserve = {
            "method": "scale_preserve",
            "curve": [start, {"step": 200, **_accuracies(0.5, 0.7, 0.9)}],
            "readings": [
                {"alpha": 1.0, **_accuracies(0.5, 0.7, 0.9)},
                {"alpha": 1.5, **_accuracies(0.3, 0.5, 1.0)},
                {
                    "alpha": 1.5,
                    "router": "confidence",
                    **_accuracies(t0, 0.9, 0.8),
                    "likelihood_router": _router(0.7, 0.2, 0.9),
                },
            ],
        }
        route = {
            "method": "scale_route",
            "curve": [
                {**start, "eq5_routing": _router(1.0, 1.0, 0.5)},
                {"step": 200, **_accuracies(0.3, 0.4, 1.0), "eq5_routing": _router(0.6, 0.4, 0.6)},
            ],
        }
        (folder / "scale_preserve.json").write_text(json.dumps(preserve))
        (folder / "scale_route.json").write_text(json.dumps(route))
    table = _module().table(tmp_path)
    row = next(line for line in table.splitlines() if "confidence, alpha 1.5" in line)
    cells = [cell.strip() for cell in row.split("|")[1:-1]]
    # two seeds: held-out 60 and 70; kept 75% and 87.5% of the Task-0 model's 80; AUROC 0.9 on both
    assert cells[1:5] == ["2", "65.0 ± 5.0", "90.0 ± 0.0", "80.0 ± 0.0"] and cells[5] == "81.2 ± 6.2"
    assert cells[6] == "0.900 (0.90-0.90)" and cells[7] == "0.70 / 0.20"
    assert cells[8] == "80.0 ± 0.0 / 100.0 ± 0.0 / 100.0 ± 0.0", "the oracle's Task 1 is the new expert's at alpha 1.5"
    eq5 = _module().eq5_table(tmp_path).splitlines()
    assert eq5[2].startswith("| 0 | 2 | 1.00 / 1.00 / 1.00 | 0.500 |")
    assert eq5[3].startswith("| 200 | 2 | 0.60 / 0.60 / 0.40 | 0.600 | 30.0 ± 0.0 |")
    # the seeds of runs kept in separate folders read together: seed 1 alone in another root
    other = tmp_path / "other"
    (other / "seed-1").mkdir(parents=True)
    for name in ("scale_preserve.json", "scale_route.json"):
        (tmp_path / "seed-1" / name).rename(other / "seed-1" / name)
    assert _module().table(tmp_path, other) == table
