"""The two Python steps of scripts/gpu_check.sh: what the machine is (``versions``) and what the check found
(``summary``: every step's outcome and issue 38's targets, met or missed, in summary.md and summary.json).

    python -m scale_cl.bench.gpu_check versions OUT/versions.json
    python -m scale_cl.bench.gpu_check summary OUT --budget 480 --seconds 455 [--dry-run]
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
    targets = [
        {"shape": shape, **t}
        for run, issue in ((eager, 38), (readings, 40))
        for shape, entry in (run or {}).get("shapes", {}).items()
        for t in entry.get("targets", [])
        if t.get("issue") == issue
    ]
    memory = _bench(out / "bench-memory" / "results.json")
    bio = out / "bio-micro" / "results.json"
    return {
        "dry_run": dry_run,
        "budget_s": budget,
        "seconds": seconds,
        "versions": info,
        "steps": _steps(out),
        "tests": _tests(out, dry_run),
        "bio_micro": json.loads(bio.read_text())["machine"] if bio.is_file() else None,
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
        "peak_train_mib": {
            shape: {m: r.get("peak_train_mib") for m, r in entry.get("methods", {}).items()}
            for shape, entry in (memory or {}).get("shapes", {}).items()
        },
    }


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
    if found["targets"]:
        lines += ["", "Issues 38's and 40's targets:", "", "| issue | shape | target | measured | limit | met |"]
        lines.append("|---|---|---|---|---|---|")
        for t in found["targets"]:
            bound = f"{'<=' if t['at_most'] else '>='} {t['limit']:g}"
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
    for shape, peaks in found.get("peak_train_mib", {}).items():
        cells = ", ".join(f"{m} {v:,.0f} MiB" for m, v in peaks.items() if v is not None)
        lines += ["", f"Peak training memory at {shape} (a fresh process each): {cells or 'not measured'}."]
    if found["compiled"]:
        lines += ["", "torch.compile (default mode) against eager, step time:", ""]
        lines += [f"* {r['method']} ({r['shape']}): {r['compiled_s'] / r['eager_s']:.2f}x" for r in found["compiled"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scale_cl.bench.gpu_check", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("versions", help="write the machine's versions as JSON").add_argument("path", type=Path)
    report = commands.add_parser("summary", help="write OUT/summary.md and OUT/summary.json")
    report.add_argument("out", type=Path)
    report.add_argument("--budget", type=int, required=True, help="the check's time budget, seconds")
    report.add_argument("--seconds", type=int, required=True, help="how long the check took, seconds")
    report.add_argument("--dry-run", action="store_true", help="the check ran on a CPU at toy sizes")
    args = parser.parse_args(argv)
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
