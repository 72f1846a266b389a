"""A `scale-cl train` run on the CPU to the end of a 2M-token budget, killed and resumed once, against the same run
uninterrupted (issue 49): the loss curve, the evaluations and the saved model must be equal.

`scale-cl train --preset clean-en` (the clean English base learning Korean, SCALE-Preserve read with the likelihood
router, 2M tokens = 1,000 steps of 8 x 256, a checkpoint every 100 steps, the loss logged every 50) runs twice: once
straight, once killed with SIGKILL as soon as its checkpoint ``--kill_after`` is complete and then run again with the
same command. Needs the corpora and the base (`measurements/cpt_corpus.py`, `scale-cl base`). Nothing else should run
meanwhile (the times are reported).

    python measurements/train_resume.py [--kill_after 500] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train(out: Path, kill_after: int | None = None) -> float:
    """Run the preset into ``out`` (killed after checkpoint ``kill_after`` when given); the seconds it took."""
    command = [sys.executable, "-m", "scale_cl.cli", "train", "--preset", "clean-en", "--out", str(out)]
    start = time.perf_counter()
    with open(out.with_suffix(".log"), "a") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        marker = out / "run" / f"checkpoint-{kill_after}" / "checkpoint.json"
        while kill_after is not None and process.poll() is None and not marker.is_file():
            time.sleep(0.2)
        if kill_after is not None and process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
        if process.wait() != 0 and kill_after is None:
            raise RuntimeError(f"{command} failed; see {out.with_suffix('.log')}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kill_after", type=int, default=500, help="the checkpoint step the kill awaits")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench-train-resume"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    straight, killed = args.out / "straight", args.out / "killed"
    seconds = {"straight": train(straight)}
    seconds["killed"] = train(killed, args.kill_after)
    stopped = max(int(p.name.split("-")[1]) for p in (killed / "run").glob("checkpoint-*"))
    seconds["resumed"] = train(killed)
    runs = (straight, killed)
    losses = [[(r["step"], r["loss"]) for r in lines(run / "train_log.jsonl") if "loss" in r] for run in runs]
    evaluations = [
        [{k: v for k, v in r.items() if k != "train_tokens_per_s"} for r in lines(run / "metrics.jsonl")]
        for run in runs
    ]
    weights = [load_file(run / "model" / "model.safetensors") for run in runs]
    same_weights = weights[0].keys() == weights[1].keys() and all(
        torch.equal(weights[0][k], weights[1][k]) for k in weights[0]
    )
    result = json.loads((straight / "result.json").read_text())
    last = evaluations[0][-1]
    found = {
        "date": f"{datetime.datetime.now():%Y-%m-%d %H:%M}",
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "steps": result["steps"],
        "tokens": result["steps"] * 8 * 256,
        "killed_at_checkpoint": stopped,
        "seconds": seconds,
        "losses_equal": losses[0] == losses[1],
        "loss_records": len(losses[0]),
        "first_last_loss": [losses[0][0][1], losses[0][-1][1]],
        "evaluations_equal": evaluations[0] == evaluations[1],
        "weights_bitwise_equal": same_weights,
        "step_0": evaluations[0][0],
        "end": last,
        "checkpoints_kept": sorted(p.name for p in (killed / "run").glob("checkpoint-*")),
    }
    (args.out / "results.json").write_text(json.dumps(found, indent=2))
    print(json.dumps(found, indent=2))


if __name__ == "__main__":
    main()
