"""Resuming a streamed training split (issue 64): how long a resumed run waits for its first block at 10k, 100k and
1M blocks into the stream, read up to there (before: the Trainer skipped the batches, which reads and tokenises them)
against started at the position the checkpoint saved (`scale_cl.data.stream`). Target: flat, <= 10 s at 1M blocks.

The corpus is the project's text (`measurements/cpt_corpus.py`: Korean, English) repeated with a numbered prefix
(`data_throughput.write_corpus`) into ``--files`` JSONL files, enough text for the last position; the tokenizer is
SmolLM2's; blocks of ``--seq`` tokens. One pass reads the stream to the last position, timing when it reaches each
(the old resume's wait) and taking the position there; then a new stream, resumed at each position, is timed to its
first block, which must equal the pass's block there. Nothing else should run meanwhile.

    python measurements/stream_resume.py [--blocks 10000 100000 1000000] [--seq 64] [--files 100] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time
from pathlib import Path

import torch
from data_throughput import write_corpus

from scale_cl.data.stream import stream_blocks
from scale_cl.models import SMOLLM2, BaseModelRef

FILE_BYTES_PER_TOKEN = 3.6  # of the written JSONL per SmolLM2 token: 3.27 measured on one file, and some to spare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[10_000, 100_000, 1_000_000], help="positions")
    parser.add_argument("--seq", type=int, default=64, help="tokens per block")
    parser.add_argument("--files", type=int, default=100, help="JSONL files the corpus is spread over")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench-stream-resume"), help="corpus and results")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    ref = BaseModelRef.parse(SMOLLM2)
    tokenizer = AutoTokenizer.from_pretrained(ref.name_or_path, gguf_file=ref.gguf_file)
    targets = sorted(args.blocks)
    megabytes = int(targets[-1] * args.seq * FILE_BYTES_PER_TOKEN / 2**20) + 1
    folder = args.out / f"corpus-{megabytes}mb-{args.files}"
    if not folder.is_dir():
        write_corpus(folder, megabytes, args.files)
    source = f"{folder}/*.jsonl"

    before: dict[int, float] = {}
    positions, expected = {}, {}
    stream = stream_blocks([source], tokenizer, args.seq)
    start = time.perf_counter()
    pending = list(targets)
    for index, item in enumerate(stream):
        if index == pending[0]:
            before[index] = time.perf_counter() - start
            positions[index], expected[index] = stream.position(index), item["input_ids"].clone()
            pending.pop(0)
            if not pending:
                break
    if pending:
        raise SystemExit(f"the corpus ended before block {pending[0]}: raise --files' text or lower --blocks")

    after: dict[int, float] = {}
    fresh = stream_blocks([source], tokenizer, args.seq)
    start = time.perf_counter()
    next(iter(fresh))
    first = time.perf_counter() - start
    for index in targets:
        resumed = stream_blocks([source], tokenizer, args.seq)
        resumed.resume(positions[index])
        start = time.perf_counter()
        block = next(iter(resumed))["input_ids"]
        after[index] = time.perf_counter() - start
        if not torch.equal(block, expected[index]):
            raise SystemExit(f"the resumed stream's block {index} differs from the pass's")

    header = (
        f"`python measurements/stream_resume.py --blocks {' '.join(map(str, targets))} --seq {args.seq} --files "
        f"{args.files}`, {datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.node()}, {os.cpu_count()} CPUs; "
        f"{megabytes} MB of JSONL in {args.files} files; a new stream's first block: {first:.2f} s"
    )
    lines = [
        header,
        "",
        "| blocks into the stream | read up to there (before) | started at the saved position | the position's file, "
        "documents skipped |",
        "|---|---|---|---|",
    ]
    for index in targets:
        mark = positions[index]["bookmark"]
        lines.append(
            f"| {index:,} | {before[index]:.1f} s | {after[index]:.2f} s | file {mark['shard'] + 1}, "
            f"{mark['documents']:,} |"
        )
    report = "\n".join(lines)
    print(report)
    (args.out / "results.md").write_text(report + "\n")


if __name__ == "__main__":
    main()
