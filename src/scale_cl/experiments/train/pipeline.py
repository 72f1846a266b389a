"""`scale-cl train`: one method trained on one corpus for a token budget, kept resumable, saved as a model.

Output folder::

    train_config.json          the settings (a later run into this folder must use the same ones: rerunning the
                               same command resumes)
    run/checkpoint-N           resumable checkpoints (what trains, the optimizer, scheduler, RNG and data position),
                               every train.save_every steps and train.save_minutes minutes, the last
                               train.save_total_limit kept, never deleted at the end
    metrics.jsonl              every evaluation: held-out new-domain perplexity (learning) and each old-domain set's
                               (forgetting), read as the model is saved (``--reading``)
    train_log.jsonl            every logged training loss, learning rate and gradient norm (whatever report_to says)
    logs/                      TensorBoard's events, with --train.report_to tensorboard
    model/                     the trained model (`scale_cl.models.save_trained`, its reading set) and its model card
                               README.md: what `scale-cl eval`, `scale-cl export` and `scale_cl.models.load_trained`
                               take
    result.json, curves.png    the summary, and learning and forgetting over the run

It trains through the path `scale-cl cpt` and `scale-cl sweep cpt` share
(`scale_cl.experiments.train.method.run_method`) on their data path (`scale_cl.data.corpus`): the same settings mean
the same thing in every command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scale_cl.experiments.run_folder import check_output_folder, claim_output_folder
from scale_cl.experiments.train.config import TrainConfig
from scale_cl.experiments.train.corpus import load_run_corpus, save_run_tokenizer
from scale_cl.experiments.train.measure import reference_hidden
from scale_cl.experiments.train.method import RESULT_FILE, RunOptions, run_method
from scale_cl.experiments.train.prepare import base_model_config, base_model_ref, process_state, validate
from scale_cl.files import write_text

CONFIG_FILE = "train_config.json"
FIGURE = "curves.png"
MODEL_DIR = "model"


def run_train(cfg: TrainConfig, out: Path, command: str = "") -> dict[str, Any]:
    """Train (or resume) ``cfg``'s method into ``out`` (module doc); returns the run's summary."""
    from scale_cl.models import load_base
    from scale_cl.tuner.vocab import vocab_rows

    out = Path(out)
    check_output_folder(out, CONFIG_FILE, cfg.to_dict())  # before any data or model is loaded
    cfg.check()  # the command line's checks, for a caller of this function too
    validate(cfg, base_model_config(cfg))
    ref = base_model_ref(cfg)
    base, tokenizer = load_base(ref)
    corpus = load_run_corpus(cfg, tokenizer, vocab_rows(base), log_prefix="train")
    main = process_state().is_main_process
    claim_output_folder(out, CONFIG_FILE, cfg.to_dict(), write=main)
    save_run_tokenizer(corpus, out)
    reference = reference_hidden(cfg, base, corpus, out)
    del base
    summary = run_method(
        cfg,
        ref,
        corpus,
        reference,
        cfg.method,
        out,
        RunOptions(method_dir=out, keep_checkpoints=True, reading=cfg.read_with, log_prefix="train"),
    )
    if main:
        from scale_cl.experiments.train.report import curves_figure, model_card

        card = model_card(cfg, summary, corpus.stats, command)
        write_text(out / MODEL_DIR / "README.md", card)
        curves_figure(out, out / FIGURE)
    process_state().wait_for_everyone()
    return summary


def finished(out: Path) -> bool:
    """Whether a run in ``out`` has finished (its summary is written)."""
    return (Path(out) / RESULT_FILE).is_file()
