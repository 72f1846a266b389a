"""Issue 28's target read off a `scale-cl sweep cpt` folder run with ``--eval.up_logit_scales``: every trained SCALE
model at each alpha of ``Z + alpha Z_up``, and FFT at each of its swept rates, as shares of FFT's gain and loss.

Per seed, as `target_table.py`: gain = ln(base new-domain ppl) - ln(the run's), loss = ln(the run's old-domain
ppl) - ln(base's), each divided by FFT's at its preset rate (x1) in the same seed; mean ± population std over the
seeds. The target (no old-domain data): a loss <= 50% of FFT's at a gain >= 90% of FFT's. Each SCALE point's
best alpha is the one with the least mean `en` loss among those whose mean gain is >= 90%.

FFT's points with ``--eval.wise_ft_alphas`` show their WiSE-FT frontier (weights interpolated towards the base's);
a point run with ``--eval.likelihood_control`` also shows its two-model control (the trained model and the base mixed
by the likelihood router: alpha "1 control").

Usage: python measurements/frontier_table.py SWEEP_DIR [MORE_SWEEP_DIRS]  (the first holds FFT's x1 point, the
reference; every folder's points are read, labelled with the folder's name, e.g. FFT's lower rates in
outputs/sweep-cpt-clean-fft-frontier or the teacher's sweeps of measurements/cpt_clean_teacher.sh; all on one base)
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

from target_table import reference, share, spread


def frontiers(point_dir: Path, point: dict, seeds: list[str]) -> tuple[dict[str, list[dict]] | None, dict]:
    """The SCALE alpha frontier (--eval.up_logit_scales) or FFT's WiSE-FT one (--eval.wise_ft_alphas), see below,
    and the two-model control (--eval.likelihood_control: alpha "1 control"; {} without it)."""
    key = "wise_ft_frontier" if point["method"] == "fft" else "up_logit_frontier"
    control = _frontiers(point_dir, point, seeds, "likelihood_control") or {}
    return _frontiers(point_dir, point, seeds, key), {f"{a.split()[0]} control": r for a, r in control.items()}


def _frontiers(point_dir: Path, point: dict, seeds: list[str], frontier_key: str) -> dict[str, list[dict]] | None:
    """alpha (and " exact" / " likelihood" where read with route_exact / the likelihood router) -> the seeds' records
    of one SCALE point (None if a
    seed's run has no frontier)."""
    by_alpha: dict[str, list[dict]] = {}
    for seed in seeds:
        result = point_dir / f"seed-{seed}" / point["method"] / "result.json"
        frontier = json.loads(result.read_text()).get(frontier_key) if result.is_file() else None
        if not frontier:
            return None
        for record in frontier:
            flat = {"learning": record["learning_ppl"], **{f"old/{k}": v for k, v in record["forgetting_ppl"].items()}}
            key = f"{record['alpha']:g}" + (" exact" if record.get("route_exact") else "")  # evaluated with route_exact
            key += " likelihood" if record.get("router") == "likelihood" else ""  # with the likelihood router
            by_alpha.setdefault(key, []).append(flat)
    return by_alpha


def main(folders: list[Path]) -> None:
    base = json.loads((folders[0] / "base_metrics.json").read_text())
    new0 = math.log(base["learning_ppl"])
    old0 = {name: math.log(ppl) for name, ppl in base["forgetting_ppl"].items()}
    names = sorted(old0)
    fft, seeds = reference(folders[0])
    ffts = [fft["seeds"][s] for s in seeds]

    def gain(records: list[dict]) -> list[float]:
        return [
            share(new0 - math.log(r["learning"]), new0 - math.log(f["learning"]))
            for r, f in zip(records, ffts, strict=True)
        ]

    def loss(records: list[dict], name: str) -> list[float]:
        key = f"old/{name}"
        return [
            share(math.log(r[key]) - old0[name], math.log(f[key]) - old0[name])
            for r, f in zip(records, ffts, strict=True)
        ]

    head = ["run", "lr", "alpha", "new-domain ppl", *(f"`{n}` ppl" for n in names), "% of FFT's gain"]
    head += [f"% of FFT's `{n}` loss" for n in names]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))

    def row(label: str, lr: float, alpha: str, records: list[dict]) -> None:
        cells = [label, f"{lr:g}", alpha, spread([r["learning"] for r in records])]
        cells += [spread([r[f"old/{n}"] for r in records], digits=1) for n in names]
        cells += [spread(gain(records), 100, 1), *(spread(loss(records, n), 100, 1) for n in names)]
        print("| " + " | ".join(cells) + " |")

    best: list[str] = []
    for folder in folders:
        for path in sorted((folder / "points").glob("*/point.json")):
            point = json.loads(path.read_text())
            if not all(s in point["seeds"] for s in seeds):
                continue
            label = point["method"] + (f" ({point['label']})" if point["label"] else "")
            if folder != folders[0] and point["method"] != "fft":
                label += f" [{folder.name}]"
            by_alpha, control = frontiers(path.parent, point, seeds)
            trained = [point["seeds"][s] for s in seeds]
            if point["method"] == "fft":
                label = f"{label} [{folder.name}, lr {point['lr']:g}]"
                if by_alpha is not None:
                    label += " WiSE-FT"
            if by_alpha is None and not control:
                row(label, point["lr"], "—" if point["method"] == "fft" else "1", trained)
                continue
            by_alpha = {**(by_alpha or {}), **control}
            if point["method"] == "fft":
                by_alpha["1"] = trained  # the trained model itself
            for alpha, records in by_alpha.items():
                row(label, point["lr"], alpha, records)
            enough = {a: r for a, r in by_alpha.items() if statistics.fmean(gain(r)) >= 0.9}
            if enough:
                alpha = min(enough, key=lambda a: statistics.fmean(loss(enough[a], names[0])))
                losses = ", ".join(f"`{n}` {spread(loss(enough[alpha], n), 100, 1)}%" for n in names)
                best.append(f"{label}: alpha {alpha}, gain {spread(gain(enough[alpha]), 100, 1)}%, loss {losses}")
            else:
                best.append(f"{label}: no alpha reaches 90% of FFT's gain")
    print(
        f"\nbase model: new-domain ppl {base['learning_ppl']:,.0f}, "
        + ", ".join(f"`{n}` {math.exp(v):.2f}" for n, v in sorted(old0.items()))
        + f"; FFT x1 at lr {fft['lr']:g}; {len(seeds)} seeds ({', '.join(seeds)})\n"
    )
    print("Least `" + names[0] + "` loss at >= 90% of FFT's gain (target: loss <= 50%):")
    for line in best:
        print(f"* {line}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main([Path(arg) for arg in sys.argv[1:]])
