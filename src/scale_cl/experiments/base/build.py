"""Build the clean base model once: English text -> byte-level BPE -> a Llama pre-trained from scratch -> an HF folder.

Output folder::

    base_config.json   the settings (a later build into this folder must use the same ones)
    metrics.jsonl      English perplexity every ``eval_every`` steps (and the training loss)
    logs/              TensorBoard's events, with ``--train.report_to tensorboard``
    run/checkpoint-N   resumable checkpoints, deleted when the model is saved
    model/             the base: config.json, model.safetensors, tokenizer files, and clean_base.json
                       (what it was built from and measured at); clean_base.json's presence means "built"

Re-running resumes from the last checkpoint, and a built base is reused, never rebuilt. Every input
error (no English text, text that is not English, too little text for one sequence) is raised
before anything is written.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, default_data_collator

from scale_cl.data.corpus import Corpus, build_corpus, check_corpus, split_documents
from scale_cl.data.tokenizer import train_bpe_tokenizer
from scale_cl.eval.perplexity import perplexity
from scale_cl.experiments.base.config import BaseBuildConfig
from scale_cl.experiments.run_folder import check_output_folder, claim_output_folder
from scale_cl.files import sha256_of, write_json
from scale_cl.train.arguments import training_arguments
from scale_cl.train.callbacks import PeriodicEval
from scale_cl.train.device import stage_placement, used_placement
from scale_cl.train.recipe import train_model
from scale_cl.train.reporting import report_to_argument
from scale_cl.train.sharding import refuse_sharding

CONFIG_FILE = "base_config.json"
INFO_FILE = "clean_base.json"
MODEL_DIR = "model"


def ascii_letter_share(texts: list[str]) -> float:
    """The share of the texts' letters that are ASCII: ~1 for English, ~0 for Korean, Russian, Chinese."""
    letters = ascii_letters = 0
    for text in texts:
        for char in text:
            if char.isalpha():
                letters += 1
                ascii_letters += char.isascii()
    return ascii_letters / letters if letters else 0.0


def read_english(cfg: BaseBuildConfig) -> list[str]:
    """The training documents, checked to be there and to be English (a ValueError that says what to pass)."""
    if not cfg.data.train:
        raise ValueError(
            "no English text given: pass --data.train FILE... (.txt/.jsonl/.parquet, globs, hf:...); "
            "`python measurements/cpt_corpus.py --corpora english-base` builds the default corpus"
        )
    check_corpus(cfg.data)
    texts = [t for t in split_documents(cfg.data, "train") if t.strip()]
    if not texts:
        raise ValueError(f"no English text found in {cfg.data.train}: every document is empty")
    share = ascii_letter_share(texts)
    if share < cfg.min_english_share:
        raise ValueError(
            f"the text in {cfg.data.train} is not English: {share:.0%} of its letters are ASCII, below "
            f"min_english_share={cfg.min_english_share:.0%}. The clean base is an English model; pass English text "
            "(or lower --min_english_share for a Latin-script language with accents)"
        )
    return texts


def tokenizer_sample(texts: list[str], max_chars: int) -> list[str]:
    """The documents the tokenizer learns from: all, or the first ones up to ``max_chars`` characters."""
    if max_chars <= 0:
        return texts
    sample, total = [], 0
    for text in texts:
        if total >= max_chars:
            break
        sample.append(text)
        total += len(text)
    return sample


def has_one_sequence(tokenizer: PreTrainedTokenizerFast, texts: list[str], seq_len: int) -> bool:
    """Whether the documents (each with its EOS) hold ``seq_len`` tokens; tokenises only as many as that takes."""
    tokens = 0
    for text in texts:
        tokens += len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 1
        if tokens >= seq_len:
            return True
    return False


def llama_config(cfg: BaseBuildConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    arch = cfg.model
    eos = tokenizer.eos_token_id
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.layers,
        num_attention_heads=arch.heads,
        num_key_value_heads=arch.kv_heads,
        max_position_embeddings=cfg.data.seq_len,
        rope_theta=arch.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )


def english_perplexity(corpus: Corpus, batch_size: int = 8, bf16: bool = False) -> Any:
    """``evaluate(model)``: perplexity on the held-out split and on each named English evaluation set (``bf16``: in
    bf16 autocast, the training's precision)."""

    def ppl(model: torch.nn.Module, blocks: torch.Tensor) -> float:
        return perplexity(model, blocks, batch_size, bf16).perplexity

    def evaluate(model: torch.nn.Module) -> dict[str, Any]:
        record: dict[str, Any] = {}
        if corpus.heldout is not None:
            record["heldout_ppl"] = ppl(model, corpus.heldout.blocks)
        record["eval_ppl"] = {n: ppl(model, d.blocks) for n, d in corpus.old_eval.items()}
        return record

    return evaluate


def is_built(model_dir: Path) -> bool:
    return (Path(model_dir) / INFO_FILE).is_file()


def build_base(cfg: BaseBuildConfig, out: Path) -> Path:
    """Build (or resume, or reuse) the base described by ``cfg`` in ``out``; returns its model folder."""
    out = Path(out)
    refuse_sharding("scale-cl base", "the clean base is a small model trained by one process")
    check_output_folder(out, CONFIG_FILE, cfg.to_dict())  # before any text is read
    model_dir = out / MODEL_DIR
    if is_built(model_dir):
        claim_output_folder(out, CONFIG_FILE, cfg.to_dict(), write=False)  # the same settings, or an error
        print(f"[base] {model_dir} is built; reusing it")
        return model_dir
    start = time.perf_counter()
    report_to_argument(cfg.train.report_to)  # its backends are installed
    stage_placement(cfg.train, "train.")  # a device that is not there, bf16 on a GPU without it
    texts = read_english(cfg)
    print(f"[base] {len(texts):,} English documents, {sum(map(len, texts)):,} characters; training the tokenizer")
    tokenizer = train_bpe_tokenizer(tokenizer_sample(texts, cfg.tokenizer_chars), cfg.model.vocab_size)
    if not has_one_sequence(tokenizer, texts, cfg.data.seq_len):
        raise ValueError(
            f"too little text in {cfg.data.train}: fewer tokens than one sequence of data.seq_len="
            f"{cfg.data.seq_len}; pass more English text"
        )
    corpus = build_corpus(cfg.data, tokenizer, seed=cfg.seed)  # a split too small: an error here
    for line in corpus.summary():
        print(f"[base] data {line}")
    claim_output_folder(out, CONFIG_FILE, cfg.to_dict())

    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(llama_config(cfg, tokenizer))
    t = cfg.train
    logging_dir = out / "logs"
    args = training_arguments(
        t,
        out / "run",
        cfg.seed,
        save_every=cfg.save_every,
        save_total_limit=2,
        logging_steps=min(50, cfg.eval_every),
        logging_dir=logging_dir,
    )
    tracker = PeriodicEval(
        english_perplexity(corpus, bf16=args.bf16),
        every=cfg.eval_every,
        path=out / "metrics.jsonl",
        tokens_per_step=t.batch_size * cfg.data.seq_len,
    )
    parameters = sum(p.numel() for p in model.parameters())
    print(f"[base] {parameters:,} parameters, {t.max_steps} steps of {t.batch_size} x {cfg.data.seq_len} tokens")
    trainer = train_model(
        model,
        corpus.train,
        args,
        collator=corpus.collator or default_data_collator,
        callbacks=[tracker],
        run_info={"base": "clean", "preset": cfg.preset, "seed": cfg.seed},
        resume=True,
        logging_dir=logging_dir,
    )
    info = {
        "preset": cfg.preset,
        "parameters": parameters,
        "steps": t.max_steps,
        "train_tokens_seen": t.max_steps * t.batch_size * cfg.data.seq_len,
        "epochs": t.max_steps * t.batch_size / len(corpus.train),
        "corpus": {name: vars(stats) for name, stats in corpus.stats.items()},
        "tokens_per_byte": corpus.stats["train"].tokens / sum(len(x.encode()) + 1 for x in texts),
        "final": tracker.records[-1],
        "final_loss": next((r["loss"] for r in reversed(trainer.state.log_history) if "loss" in r), math.nan),
        "sources": {s: sha256_of(Path(s)) for s in cfg.data.train if Path(s).is_file()},
        "seconds_this_session": time.perf_counter() - start,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        **used_placement(args),  # device, precision (and the GPU) it trained on
        "settings": cfg.to_dict(),
    }
    save_model(trainer.model, tokenizer, info, model_dir)
    shutil.rmtree(out / "run", ignore_errors=True)
    print(f"[base] saved {model_dir}: English perplexity {json.dumps(info['final'])}")
    return model_dir


def save_model(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, info: dict, model_dir: Path) -> None:
    """An ordinary HF folder, written beside and renamed into place, with ``INFO_FILE`` last: complete or absent."""
    staging = model_dir.with_name(model_dir.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    write_json(staging / INFO_FILE, info)
    shutil.rmtree(model_dir, ignore_errors=True)
    staging.rename(model_dir)
