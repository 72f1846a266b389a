"""The Python steps of scripts/gpu_check.sh: what the machine is (``versions``), the train step's model, corpus
and run (``train``), and what the check found (``summary``: every step's outcome and the GPU targets
(training step, router reading, `scale-cl train`), met or missed, in summary.md and summary.json).

    python -m scale_cl.bench.gpu_check versions OUT/versions.json
    python -m scale_cl.bench.gpu_check train OUT --shape llama-1b --first-checkpoint 20 -- TRAIN_OPTIONS...
    python -m scale_cl.bench.gpu_check summary OUT --budget 600 --seconds 455 [--dry-run]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib.util
import json
import platform
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

# Packages the check uses beyond torch, transformers, accelerate and peft, and what their absence skips.
OPTIONAL = {
    "pytest": "the GPU-gated tests",
    "matplotlib": "the figures of bio and cpt (their runs fail without it)",
    "lm_eval": "the eval command's test",
    "deepspeed": "the ZeRO-3 test",
}


def versions() -> dict[str, Any]:
    """The card(s), the library versions and which optional packages are there."""
    import accelerate
    import peft
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    gpus = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())] if cuda else []
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "peft": peft.__version__,
        "gpus": [{"name": g.name, "memory_gib": round(g.total_memory / 1024**3, 1)} for g in gpus],
        "bf16": bool(cuda and torch.cuda.is_bf16_supported()),
        "optional": {name: importlib.util.find_spec(name) is not None for name in OPTIONAL},
    }


TRAIN_FILES = 8  # the train step's corpus files: the stream's shards


def train_setup(folder: Path, shape_name: str, people: int = 2000) -> Path:
    """The train step's inputs, made where it runs (no network, no weights to download): a base model of the bench's
    ``shape_name`` with random weights (`scale_cl.bench.shapes`), a BPE tokenizer and a corpus of synthetic
    biographies (`scale_cl.data.biography`) in `TRAIN_FILES` JSONL files. The tokenizer's vocabulary is the text's
    (at most the shape's); the model keeps the shape's, so a step costs what the bench timed."""
    from scale_cl.bench.shapes import SHAPES, build_base
    from scale_cl.data.biography import bio_spec, biography_corpus, generate_people
    from scale_cl.data.tokenizer import train_bpe_tokenizer

    shape = SHAPES[shape_name]
    spec = bio_spec("small", people=people)
    texts = list(biography_corpus(generate_people(spec, seed=0), count=5))
    documents = [" ".join(texts[i : i + 5]) for i in range(0, len(texts), 5)]  # a person's biographies: a document
    (folder / "corpus").mkdir(parents=True, exist_ok=True)
    for index in range(TRAIN_FILES):
        with open(folder / "corpus" / f"part-{index}.jsonl", "w") as file:
            file.writelines(json.dumps({"text": d}) + "\n" for d in documents[index::TRAIN_FILES])
    vocab = min(8192, shape.make_config().vocab_size)
    tokenizer = train_bpe_tokenizer(documents, vocab_size=vocab)
    model = build_base(shape)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder / "base")
    tokenizer.save_pretrained(folder / "base")
    return folder


def train_run(out: Path, shape: str, people: int, first_checkpoint: int, options: list[str]) -> int:
    """The train step: `train_setup` into ``out/train-setup``, then `scale-cl train` on it streamed (its position
    saved with each checkpoint, SCALE-Preserve as trained) with ``options`` into ``out/train``, killed with SIGKILL
    once checkpoint ``first_checkpoint`` is complete, and run again to the end, which resumes from it. Returns the
    last run's exit code."""
    import os
    import signal
    import subprocess
    import time

    setup = train_setup(out / "train-setup", shape, people)
    command = [
        sys.executable, "-m", "scale_cl.cli", "train", "--model", str(setup / "base"),
        "--data.train", str(setup / "corpus" / "*.jsonl"), "--data.streaming",
        "--data.heldout_fraction", "0.02", "--data.max_eval_sequences", "4", "--options.scale.w21_init", "random",
        "--reading", "trained", *options, "--out", str(out / "train"),
    ]  # fmt: skip
    print("[gpu-check] train:", " ".join(command), flush=True)
    first = subprocess.Popen(command)
    marker = out / "train" / "run" / f"checkpoint-{first_checkpoint}" / "checkpoint.json"
    while first.poll() is None and not marker.is_file():
        time.sleep(0.2)
    if first.poll() is None:
        os.kill(first.pid, signal.SIGKILL)
        print(f"[gpu-check] train: killed (SIGKILL) after checkpoint-{first_checkpoint}", flush=True)
    first.wait()
    return subprocess.run(command).returncode


def _train(out: Path, bench: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the train step found: its tokens/s over the last evaluation interval against the bench's step for the same
    method and batch, the loss at its first and last log, whether it resumed from the checkpoint it was killed after."""
    run = out / "train"
    if not (run / "result.json").is_file():
        return None
    result = json.loads((run / "result.json").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [
        json.loads(line)["loss"] for line in (run / "train_log.jsonl").read_text().splitlines() if '"loss"' in line
    ]
    log = (out / "train.log").read_text(errors="replace") if (out / "train.log").is_file() else ""
    found: dict[str, Any] = {
        "method": result["method"],
        "steps": result["steps"],
        "tokens_per_s": records[-1].get("train_tokens_per_s") if records else None,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "checkpoints": sorted(p.name for p in (run / "run").glob("checkpoint-*")),
        "resumed": "resuming from" in log,
        "stream_position": all((p / "stream.json").is_file() for p in (run / "run").glob("checkpoint-*")),
    }
    for entry in (bench or {}).get("shapes", {}).values():
        timed = entry.get("methods", {}).get(result["method"], {}).get("train_tokens_per_s")
        if timed and found["tokens_per_s"]:
            found["bench_tokens_per_s"] = timed
            found["vs_bench"] = found["tokens_per_s"] / timed
    return found


def _steps(out: Path) -> list[dict[str, Any]]:
    with open(out / "steps.tsv") as f:
        return [
            {**row, "rc": int(row["rc"]), "seconds": int(row["seconds"])} for row in csv.DictReader(f, delimiter="\t")
        ]


def _tests(out: Path, dry_run: bool) -> dict[str, Any] | None:
    """What the tests step found: counts and the failures' names (the JUnit file), or, in a dry run, how many
    GPU tests were collected."""
    log = out / "tests.log"
    if not log.is_file():
        return None
    if dry_run:
        match = re.search(r"(\d+)(?:/\d+)? tests? collected", log.read_text())
        return {"collected": int(match.group(1)) if match else 0}
    junit = out / "tests.xml"
    if not junit.is_file():
        return {"error": "no JUnit file: " + " ".join(log.read_text().splitlines()[-3:])}
    cases = ET.parse(junit).getroot().iter("testcase")
    result: dict[str, Any] = {"passed": 0, "failed": [], "skipped": 0}
    for case in cases:
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            result["failed"].append(name)
        elif case.find("skipped") is not None:
            result["skipped"] += 1
        else:
            result["passed"] += 1
    return result


def _bench(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    results = json.loads(path.read_text())
    shapes = results["shapes"]
    return {"meta": results["meta"], "config": results["config"], "shapes": shapes}


def _compiled(eager: dict[str, Any] | None, compiled: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Each method's compiled step over its eager step (two runs on the same warm machine)."""
    if not eager or not compiled:
        return []
    rows = []
    for shape, entry in compiled["shapes"].items():
        for method, record in entry["methods"].items():
            before = eager["shapes"].get(shape, {}).get("methods", {}).get(method, {}).get("step_s")
            if before and record.get("step_s"):
                rows.append({"shape": shape, "method": method, "eager_s": before, "compiled_s": record["step_s"]})
    return rows


def summary(out: Path, budget: int, seconds: int, dry_run: bool) -> dict[str, Any]:
    """Everything the check found, as a dictionary (summary.json) and as markdown (summary.md)."""
    info = json.loads((out / "versions.json").read_text()) if (out / "versions.json").is_file() else {}
    eager, compiled = _bench(out / "bench" / "results.json"), _bench(out / "bench-compiled" / "results.json")
    readings = _bench(out / "bench-readings" / "results.json")
    memory = _bench(out / "bench-memory" / "results.json")
    whole_loss = _bench(out / "bench-memory-whole" / "results.json")
    targets = [  # the GPU's (a bench run also states the CPU rows, "(CPU)")
        {"shape": shape, **t}
        for run, issues in ((eager, (38, 53)), (memory, (38, 53)), (readings, (40, 53)))
        for shape, entry in (run or {}).get("shapes", {}).items()
        for t in entry.get("targets", [])
        if t.get("issue") in issues and "(CPU)" not in t.get("target", "")
    ]
    targets += _sliced_memory_targets(memory, whole_loss)
    bio = out / "bio-micro" / "results.json"
    train = _train(out, eager)
    if train is not None and "vs_bench" in train and not dry_run:
        met = abs(train["vs_bench"] - 1) <= 0.1
        targets.append({"shape": "llama-1b", "issue": 49, "target": f"{train['method']} train tokens/s / the bench's",
                        "value": train["vs_bench"], "limit": 0.9, "at_most": False, "met": met})  # fmt: skip
    return {
        "dry_run": dry_run,
        "budget_s": budget,
        "seconds": seconds,
        "versions": info,
        "steps": _steps(out),
        "tests": _tests(out, dry_run),
        "bio_micro": json.loads(bio.read_text())["machine"] if bio.is_file() else None,
        "train": train,
        "targets": targets,
        "mfu": {
            shape: {m: r.get("mfu") for m, r in entry.get("methods", {}).items()}
            for shape, entry in (eager or {}).get("shapes", {}).items()
        },
        "compiled": _compiled(eager, compiled),
        "readings": {
            shape: {name: r.get("vs_fft", {}) for name, r in entry.get("readings", {}).items()}
            for shape, entry in (readings or {}).get("shapes", {}).items()
        },
        "peak_train_mib": _peaks(memory),
        "peak_train_mib_whole_loss": _peaks(whole_loss),
    }


def _peaks(memory: dict[str, Any] | None) -> dict[str, dict[str, float | None]]:
    return {
        shape: {m: r.get("peak_train_mib") for m, r in entry.get("methods", {}).items()}
        for shape, entry in (memory or {}).get("shapes", {}).items()
    }


def _sliced_memory_targets(sliced: dict[str, Any] | None, whole: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The sliced loss's memory target: each method's peak training memory with the sliced loss (the default) over
    the whole loss's, at the shape's own vocabulary (Llama-3.2-1B's 128k), <= 0.6."""
    found = []
    for shape, peaks in _peaks(sliced).items():
        for method, peak in peaks.items():
            before = _peaks(whole).get(shape, {}).get(method)
            if peak and before:
                target = f"{method} peak training memory, sliced / whole loss"
                ratio = peak / before
                found.append({"shape": shape, "issue": 53, "target": target, "value": ratio, "limit": 0.6,
                              "at_most": True, "met": ratio <= 0.6})  # fmt: skip
    return found


def _markdown(found: dict[str, Any]) -> str:
    info = found["versions"]
    gpus = ", ".join(f"{g['name']} ({g['memory_gib']} GiB)" for g in info.get("gpus", [])) or "no GPU"
    title = "GPU check (dry run on a CPU: wiring only, no measurement)" if found["dry_run"] else "GPU check"
    lines = [
        f"# {title}",
        "",
        f"{info.get('date', '?')}; {gpus}; torch {info.get('torch')} (CUDA {info.get('cuda')}), transformers "
        f"{info.get('transformers')}, accelerate {info.get('accelerate')}, peft {info.get('peft')}, Python "
        f"{info.get('python')}. Took {found['seconds']} s of a {found['budget_s']} s budget.",
        "",
        "| step | outcome | seconds (limit) |",
        "|---|---|---|",
    ]
    for s in found["steps"]:
        outcome = "ok" if s["rc"] == 0 else "**timed out**" if s["rc"] == 124 else f"**failed** (exit {s['rc']})"
        lines.append(f"| {s['step']} | {outcome} | {s['seconds']} ({s['limit']}) |")
    missing = [f"{name} (skips {what})" for name, what in OPTIONAL.items() if not info.get("optional", {}).get(name)]
    if missing:
        lines += ["", "Not installed: " + "; ".join(missing) + "."]
    tests = found["tests"]
    if tests is not None:
        if "collected" in tests:
            lines += ["", f"GPU-gated tests collected: {tests['collected']}."]
        elif "error" in tests:
            lines += ["", f"GPU-gated tests: {tests['error']}"]
        else:
            failed = "; ".join(tests["failed"]) or "none"
            lines += ["", f"GPU-gated tests: {tests['passed']} passed, {tests['skipped']} skipped, failed: {failed}."]
    if found["bio_micro"]:
        lines += ["", f"bio micro (bf16): finished on {found['bio_micro'].get('device')}."]
    train = found.get("train")
    if train:
        rate = f"{train['tokens_per_s']:,.0f}" if train.get("tokens_per_s") else "?"
        versus = (
            f" ({train['vs_bench']:.2f}x the bench's {train['bench_tokens_per_s']:,.0f})" if "vs_bench" in train else ""
        )
        lines += ["", f"train ({train['method']}, streamed, killed after a checkpoint and resumed: "
                  f"{'yes' if train['resumed'] else '**no**'}, at the stream's saved position: "
                  f"{'yes' if train.get('stream_position') else '**no**'}): {train['steps']} steps, "
                  f"{rate} tokens/s{versus}, "
                  f"loss {train['first_loss']:.3f} -> {train['last_loss']:.3f}, checkpoints "
                  f"{', '.join(train['checkpoints'])}."]  # fmt: skip
    if found["targets"]:
        lines += ["", "The issues' targets:", "", "| issue | shape | target | measured | limit | met |"]
        lines.append("|---|---|---|---|---|---|")
        for t in found["targets"]:
            bound = "within 10%" if t["issue"] == 49 else f"{'<=' if t['at_most'] else '>='} {t['limit']:g}"
            met = "yes" if t["met"] else "**no**"
            lines.append(f"| {t['issue']} | {t['shape']} | {t['target']} | {t['value']:.3f} | {bound} | {met} |")
    for shape, rows in found.get("readings", {}).items():
        lines += ["", f"Inference read with the likelihood router at {shape}, against FFT's model alone:", ""]
        lines += ["| reading | forward FLOPs | forward speed | generate() speed |", "|---|---|---|---|"]
        for name, versus in rows.items():
            cells = [versus.get(k) for k in ("fwd_flops_per_token", "forward_tokens_per_s", "generate_tokens_per_s")]
            lines.append(f"| {name} | " + " | ".join("—" if c is None else f"{c:.2f}x" for c in cells) + " |")
    for shape, mfu in found["mfu"].items():
        cells = ", ".join(f"{m} {100 * v:.1f}%" for m, v in mfu.items() if v is not None)
        lines += ["", f"MFU at {shape}: {cells or 'not measured (no known peak)'}."]
    for key, loss in (("peak_train_mib", ""), ("peak_train_mib_whole_loss", ", the whole loss")):
        for shape, peaks in found.get(key, {}).items():
            cells = ", ".join(f"{m} {v:,.0f} MiB" for m, v in peaks.items() if v is not None)
            lines += ["", f"Peak training memory at {shape}{loss} (a fresh process each): {cells or 'not measured'}."]
    if found["compiled"]:
        lines += ["", "torch.compile (default mode) against eager, step time:", ""]
        lines += [f"* {r['method']} ({r['shape']}): {r['compiled_s'] / r['eager_s']:.2f}x" for r in found["compiled"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scale_cl.bench.gpu_check", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("versions", help="write the machine's versions as JSON").add_argument("path", type=Path)
    train = commands.add_parser("train", help="the train step: its model and corpus, a run killed and resumed")
    train.add_argument("out", type=Path)
    train.add_argument("--shape", default="llama-1b", help="the bench's shape of the base model")
    train.add_argument("--people", type=int, default=2000, help="people of the synthetic biographies")
    train.add_argument("--first-checkpoint", type=int, required=True, help="the step whose checkpoint the kill awaits")
    train.epilog = "Everything after -- goes to `scale-cl train`."
    report = commands.add_parser("summary", help="write OUT/summary.md and OUT/summary.json")
    report.add_argument("out", type=Path)
    report.add_argument("--budget", type=int, required=True, help="the check's time budget, seconds")
    report.add_argument("--seconds", type=int, required=True, help="how long the check took, seconds")
    report.add_argument("--dry-run", action="store_true", help="the check ran on a CPU at toy sizes")
    argv = sys.argv[1:] if argv is None else list(argv)
    options = argv[argv.index("--") + 1 :] if "--" in argv else []  # the train step's `scale-cl train` options
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.command == "train":
        return train_run(args.out, args.shape, args.people, args.first_checkpoint, options)
    if args.command == "versions":
        found = versions()
        args.path.write_text(json.dumps(found, indent=2) + "\n")
        print(json.dumps(found, indent=2))
        return 0
    found = summary(args.out, args.budget, args.seconds, args.dry_run)
    (args.out / "summary.json").write_text(json.dumps(found, indent=2) + "\n")
    text = _markdown(found)
    (args.out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
