"""Continual pre-training of one base model with every method, measuring learning and forgetting as it trains.

Output folder::

    cpt_config.json            the settings (a later run into this folder must use the same ones)
    reference_hidden.safetensors  the base model's final hidden states on a fixed old-domain batch
    <method>/run/checkpoint-N  resumable checkpoints (trainable weights + optimizer/scheduler/RNG),
                               deleted when the method finishes
    <method>/metrics.jsonl     one record per evaluation (see `evaluate_method`)
    <method>/logs/             TensorBoard's events, with ``--train.report_to tensorboard``
    <method>/model/            the trained model (`scale_cl.models.save_trained`), for ``scale-cl eval``
    <method>/result.json       the finished method's summary; its presence means "done"
    tokenizer/                 with ``--data.extend_vocab N``: the extended tokenizer every method trains with,
                               and vocab_extension.json (the new tokens, their ids, the base ids they merge)
    results.json, results.md, perplexity.png, representation.png

With ``--data.extend_vocab N`` the base tokenizer learns ``N`` tokens from the new-domain training
split (`scale_cl.tuner.vocab`), every set (training, held-out, old-domain) is packed with the extended
tokenizer, and every method starts from the base model grown by ``N`` rows (the reference hidden
states and step 0 too). Old-domain text splits into the same ids as with the base tokenizer wherever
no new merge fires, so its perplexity stays comparable, except that the softmax now spans the new
tokens as well (see `scale_cl.tuner.vocab`).

Re-running the same command resumes: finished methods are skipped, an interrupted one continues
from its last complete checkpoint (bitwise the same weights as an uninterrupted run on CPU).
Under ``torchrun``/``accelerate launch`` every process runs this; the Trainer makes it DDP, and
only the main process evaluates and writes results. Each method trains through the path `scale-cl train` takes
(`scale_cl.experiments.train.method.run_method`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scale_cl.experiments.cpt.config import CptConfig
from scale_cl.experiments.run_folder import check_output_folder, claim_output_folder
from scale_cl.experiments.train.corpus import load_run_corpus, save_run_tokenizer
from scale_cl.experiments.train.layer_choice import check_probe_data
from scale_cl.experiments.train.measure import reference_hidden
from scale_cl.experiments.train.method import run_method
from scale_cl.experiments.train.prepare import base_model_config, base_model_ref, process_state, validate
from scale_cl.models import load_base
from scale_cl.tuner.vocab import vocab_rows

CONFIG_FILE = "cpt_config.json"


def run_cpt(cfg: CptConfig, out: Path) -> dict[str, Any]:
    """Run (or resume) every method of ``cfg`` into ``out``; returns the collected results."""
    from scale_cl.experiments.cpt.report import collect, write_report

    if cfg.sequence.then:
        raise ValueError(
            "sequence.then runs through scale_cl.experiments.cpt.sequence.run_cpt_sequence (as `scale-cl cpt` does)"
        )
    out = Path(out)
    check_output_folder(out, CONFIG_FILE, cfg.to_dict())  # before any data or model is loaded
    validate(cfg, base_model_config(cfg))
    ref = base_model_ref(cfg)
    base, tokenizer = load_base(ref)
    corpus = load_run_corpus(cfg, tokenizer, vocab_rows(base))
    if any(cfg.options.chooses_layers(m) for m in cfg.methods):
        check_probe_data(cfg, corpus)
    claim_output_folder(out, CONFIG_FILE, cfg.to_dict(), write=process_state().is_main_process)
    save_run_tokenizer(corpus, out)
    reference = reference_hidden(cfg, base, corpus, out)
    del base
    for method in cfg.methods:
        run_method(cfg, ref, corpus, reference, method, out)
    results = collect(cfg, out)
    if process_state().is_main_process:
        write_report(results, out)
    process_state().wait_for_everyone()  # the report exists when any process returns
    return results
