"""Memory stays flat as the corpus grows (issue 49): the peak resident memory of a `scale-cl train` process over a
corpus of 2 GB of text against the same run over 50 MB. Target: within 300 MB of each other.

Each run is a fresh process (`scale-cl train --preset clean-en`, the clean English base, SCALE-Preserve, 20 steps of
8 x 256 tokens), its own datasets cache, so each converts and tokenises its corpus (``--data.num_proc 2``: the
tokenising workers are processes of their own, not counted) and then trains from the packed blocks on disk. The peak is
the training process's own (``ru_maxrss``); wall time is the whole command's, cache included. The corpora are the
project's text repeated with a numbered prefix (`data_throughput.write_corpus`). Nothing else should run meanwhile.

    python measurements/train_memory.py [--sizes 50 2048] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from data_throughput import write_corpus

WRAPPER = (
    "import resource, sys, time\n"
    "from scale_cl.cli import main\n"
    "start = time.time()\n"
    "code = main(sys.argv[1:])\n"
    "print('PEAK_RSS_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, 'SECONDS', time.time() - start)\n"
    "sys.exit(code)\n"
)


def run(size: int, out: Path) -> dict[str, float]:
    for folder in (out / f"run-{size}", out / f"cache-{size}", out / f"corpus-{size}"):
        shutil.rmtree(folder, ignore_errors=True)  # a fresh run: a finished one would only be read back
    files = write_corpus(out / f"corpus-{size}", size)
    command = [
        sys.executable, "-c", WRAPPER, "train", "--preset", "clean-en", "--data.train", *files,
        "--data.num_proc", "2", "--data.cache_dir", str(out / f"cache-{size}"), "--train.tokens", "40960",
        "--eval.every", "10", "--out", str(out / f"run-{size}"),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    words = next(line for line in done.stdout.splitlines() if line.startswith("PEAK_RSS_KIB")).split()
    tokens = next(line for line in done.stdout.splitlines() if "data train:" in line)
    return {"megabytes": size, "peak_rss_mib": int(words[1]) / 1024, "seconds": float(words[3]), "corpus": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[50, 2048], help="corpus sizes in MB")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench-train-memory"))
    args = parser.parse_args()
    results = [run(size, args.out) for size in args.sizes]
    header = (
        f"`python measurements/train_memory.py --sizes {' '.join(map(str, args.sizes))}`, "
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.node()}, {os.cpu_count()} CPUs"
    )
    lines = [header, "", "| corpus | peak RSS of the training process | wall time (cache included) | corpus read |"]
    lines.append("|---|---|---|---|")
    for r in results:
        lines.append(
            f"| {r['megabytes']:,} MB | {r['peak_rss_mib']:,.0f} MiB | {r['seconds']:,.0f} s | {r['corpus']} |"
        )
    spread = max(r["peak_rss_mib"] for r in results) - min(r["peak_rss_mib"] for r in results)
    lines += ["", f"Spread of the peaks: {spread:,.0f} MiB (target: within 300 MB)."]
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(table + "\n")
    (args.out / "results.json").write_text(json.dumps({"header": header, "runs": results}, indent=2))


if __name__ == "__main__":
    main()
