"""Issue 28's biography verdict read off the sweeps of measurements/bio_teacher.sh, along each run's own curve.

Matched learning without a rate sweep: for each run, the first evaluation step where Task-1 accuracy reaches the
target (90%), linearly interpolated between the two evaluations around it, and held-out Task-0 accuracy at that
point. Loss = the Task-0 model's held-out Task-0 accuracy - that value; each run's loss is divided by FFT's (its
preset rate, nothing added) for the same seed. Mean ± population std over the seeds; 'k/n' where only k seeds reach
the target. An FFT/Freeze run with WiSE-FT readings (task1.wise_ft_alphas) is also read at the alpha where its
interpolation towards the Task-0 model reaches the target. Then, for SCALE-Route and SCALE-Preserve: the readings of
each trained model at the end (as trained; Route with route_exact; both with the likelihood router) and the
likelihood router's base weight and AUROC of Task-0 against Task-1 questions at the position that predicts the answer;
FFT's two-model control (task1.likelihood_control) read alike.

Usage: python measurements/bio_teacher_table.py ROOT [--target 0.9]   (ROOT: BIO_TEACHER_OUT of bio_teacher.sh)
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

from scale_cl.methods import method_spec

# FFT at its preset rate, nothing added: the no-old-data sweep's, else the router sweep's (its control is a reading)
REFERENCES = (("no-old-data", "fft__lr="), ("router", "fft__lr="))


def at_target(curve: list[dict], target: float) -> tuple[float, float] | None:
    """(step, held-out Task-0 accuracy) where Task-1 accuracy first reaches ``target``; None if it never does."""
    for before, after in itertools.pairwise(curve):
        t0, t1 = before["task1"]["overall"], after["task1"]["overall"]
        if t1 >= target > t0:
            f = (target - t0) / (t1 - t0)
            step = before["step"] + f * (after["step"] - before["step"])
            return step, before["task0"]["overall"] + f * (after["task0"]["overall"] - before["task0"]["overall"])
    if curve and curve[0]["task1"]["overall"] >= target:
        return curve[0]["step"], curve[0]["task0"]["overall"]
    return None


def wise_ft_at_target(run: dict, target: float) -> tuple[float, float] | None:
    """(alpha, held-out Task-0 accuracy) where WiSE-FT's interpolation of an FFT/Freeze run towards the Task-0
    model first reaches ``target`` on Task 1, linear in alpha between the readings (alpha 0 is the Task-0 model,
    1 the trained one); None without readings or if even alpha 1 stays below."""
    if not method_spec(run["method"]).wise_ft:  # SCALE's readings are its routers', not an interpolation
        return None
    readings = [r for r in run.get("readings", []) if "alpha" in r]
    if not readings:
        return None
    points = [{**run["curve"][0], "step": 0.0}, *({**r, "step": r["alpha"]} for r in readings)]
    points.append({**run["curve"][-1], "step": 1.0})
    points = sorted({p["step"]: p for p in points}.values(), key=lambda p: p["step"])
    return at_target(points, target)


def runs(point: Path) -> dict[str, dict]:
    """The point's runs by seed."""
    return {p.parent.name.removeprefix("seed-"): json.loads(p.read_text()) for p in sorted(point.glob("seed-*/*.json"))}


def spread(values: list[float], scale: float = 100.0, digits: int = 1) -> str:
    if not values:
        return "—"
    return f"{statistics.fmean(values) * scale:.{digits}f} ± {statistics.pstdev(values) * scale:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--target", type=float, default=0.9)
    args = parser.parse_args()
    points = sorted(p for p in args.root.glob("*/points/*") if p.is_dir())
    if not points:
        raise SystemExit(f"no sweep points under {args.root}/*/points")
    candidates = [
        p for sweep, name in REFERENCES for p in points if p.parent.parent.name == sweep and p.name.startswith(name)
    ]
    if not candidates:
        raise SystemExit(f"no FFT reference under {args.root}: run the no-old-data or router sweep of bio_teacher.sh")
    reference = candidates[0]
    start = {s: run["curve"][0]["task0"]["overall"] for s, run in runs(reference).items()}
    fft_at = {s: at_target(run["curve"], args.target) for s, run in runs(reference).items()}
    fft_loss = {s: start[s] - v[1] for s, v in fft_at.items() if v is not None}  # seeds where FFT reaches it
    print(f"Held-out Task 0 at Task 1 = {args.target:.0%} along each run (Task-0 model: {spread([*start.values()])})")
    print()
    print("| sweep | point | seeds | step | Task 0 % | loss, % of FFT's | Task 1 end % | Task 0 end % |")
    print("|---|---|---|---|---|---|---|---|")
    for point in points:
        by_seed = runs(point)
        reached = {s: at_target(r["curve"], args.target) for s, r in by_seed.items()}
        reached = {s: v for s, v in reached.items() if v is not None}
        count = "" if len(reached) == len(by_seed) else f"{len(reached)}/{len(by_seed)}"
        shares = [(start[s] - v[1]) / fft_loss[s] for s, v in reached.items() if fft_loss.get(s)]
        print(
            f"| {point.parent.parent.name} | {point.name} | {count or len(by_seed)} "
            f"| {spread([v[0] for v in reached.values()], 1, 0)} | {spread([v[1] for v in reached.values()])} "
            f"| {spread(shares)} | {spread([r['curve'][-1]['task1']['overall'] for r in by_seed.values()])} "
            f"| {spread([r['curve'][-1]['task0']['overall'] for r in by_seed.values()])} |"
        )
        wise = {s: wise_ft_at_target(r, args.target) for s, r in by_seed.items()}
        wise = {s: v for s, v in wise.items() if v is not None}
        if wise:
            shares = [(start[s] - v[1]) / fft_loss[s] for s, v in wise.items() if fft_loss.get(s)]
            print(
                f"| {point.parent.parent.name} | {point.name}, WiSE-FT | {len(wise)}/{len(by_seed)} "
                f"| alpha {spread([v[0] for v in wise.values()], 1, 2)} | {spread([v[1] for v in wise.values()])} "
                f"| {spread(shares)} | | |"
            )
    print()
    print("SCALE-Route and SCALE-Preserve at the end of training, read each way (training nothing), and FFT's")
    print("two-model control (its model and the Task-0 model mixed by the likelihood router); the router's base")
    print("weight where the answer is predicted, and its AUROC of Task-0 (held-out / QA-trained) vs Task-1 questions")
    print()
    print("| sweep | point | reading | Task 1 % | Task 0 % | w Task 0 | w Task 1 | AUROC | AUROC QA-trained |")
    print("|---|---|---|---|---|---|---|---|---|")
    for point in points:
        routed = point.name.startswith(("scale_route", "scale_preserve"))
        key = "readings" if routed else "likelihood_control"  # FFT's: its model and the Task-0 model mixed
        by_seed = {s: r for s, r in runs(point).items() if r.get(key)}
        if not by_seed:
            continue
        readings = list(zip(*(r[key] for r in by_seed.values()), strict=True))
        for records in readings:
            name = "route_exact" if records[0].get("route_exact") else records[0].get("router", "as trained")
            name = "control (two models)" if records[0].get("control") else name
            router = [r["likelihood_router"] for r in records if "likelihood_router" in r]
            keys = ("task0_base_weight", "task1_base_weight", "auroc", "auroc_trained")
            cells = [spread([r[key] for r in router], 1, 3) for key in keys]
            print(
                f"| {point.parent.parent.name} | {point.name} | {name} "
                f"| {spread([r['task1']['overall'] for r in records])} "
                f"| {spread([r['task0']['overall'] for r in records])} | {' | '.join(cells)} |"
            )


if __name__ == "__main__":
    main()
