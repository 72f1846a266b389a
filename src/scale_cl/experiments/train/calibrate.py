"""`scale-cl calibrate RUN`: the calibrated router's gate fitted on a finished `scale-cl train` run's model.

The same fit `scale-cl train --reading calibrated` makes at its end (`scale_cl.train.router_fit.fit_router`, the one
recipe `GATE_RECIPE`): the run's own training text (its corpus, from the cache the run wrote) against text the base
writes, nothing else read. The model folder is rewritten with the gate (a new folder written beside it, then swapped
in: an interrupted calibration leaves the old model as it was); ``result.json`` records the fit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from scale_cl.experiments.method_run import GATE_RECIPE
from scale_cl.experiments.overrides import apply_overrides
from scale_cl.experiments.train.config import TrainConfig, preset
from scale_cl.experiments.train.method import RESULT_FILE
from scale_cl.experiments.train.pipeline import CONFIG_FILE, MODEL_DIR
from scale_cl.files import write_json
from scale_cl.train.router_fit import RouterFit, check_routed, fit_router, gate_blocks


def run_config(run: Path) -> TrainConfig:
    """The settings a `scale-cl train` run in ``run`` was trained with (its ``train_config.json``)."""
    path = run / CONFIG_FILE
    if not path.is_file():
        raise ValueError(
            f"{run} is not a `scale-cl train` run folder ({CONFIG_FILE} is missing): pass the --out folder of a "
            "finished run"
        )
    recorded = json.loads(path.read_text())
    return apply_overrides(preset(recorded["preset"]), recorded)


def calibrate_run(run: str | Path) -> RouterFit:
    """Fit the gate of the model in ``run`` (module doc), save the model read by it; the fit."""
    from scale_cl.data.tokens import eos_id
    from scale_cl.experiments.train.corpus import load_run_corpus
    from scale_cl.experiments.train.prepare import base_model_ref
    from scale_cl.methods import method_spec
    from scale_cl.models import load_base, load_trained, read_run_file, save_trained
    from scale_cl.tuner.vocab import vocab_rows

    run = Path(run)
    cfg = run_config(run)
    model_dir = run / MODEL_DIR
    if not (run / RESULT_FILE).is_file() or not model_dir.is_dir():
        raise ValueError(
            f"{run} holds no finished model ({RESULT_FILE} or {MODEL_DIR}/ is missing): let the run finish"
        )
    method = read_run_file(model_dir)["method"]
    if method_spec(method).scale_method not in ("preserve", "route"):
        raise ValueError(
            f"{run} trained {method}: the calibrated router reads SCALE-Route and SCALE-Preserve (their base logits "
            "are exact); train one of them (--method scale_preserve or scale_route)"
        )
    model, tokenizer, method = load_trained(model_dir)
    check_routed(model)  # before the corpus is read (SCALE-Adapt, a baseline)
    ref = base_model_ref(cfg)
    base, base_tokenizer = load_base(ref)
    corpus = load_run_corpus(cfg, base_tokenizer, vocab_rows(base), log_prefix="calibrate")
    del base
    fit = fit_router(
        model, gate_blocks(corpus.train, GATE_RECIPE.sequences), eos_id(tokenizer), seed=cfg.seed, recipe=GATE_RECIPE
    )
    written = run / f"{MODEL_DIR}.calibrating"
    shutil.rmtree(written, ignore_errors=True)
    save_trained(model, tokenizer, method, ref, written)
    card = model_dir / "README.md"
    if card.is_file():
        shutil.copy2(card, written / "README.md")
    retired = run / f"{MODEL_DIR}.before-calibration"
    shutil.rmtree(retired, ignore_errors=True)
    model_dir.rename(retired)
    written.rename(model_dir)
    shutil.rmtree(retired)
    result: dict[str, Any] = json.loads((run / RESULT_FILE).read_text())
    write_json(run / RESULT_FILE, {**result, "reading": "calibrated", "gate_fit": fit.summary()})
    return fit
