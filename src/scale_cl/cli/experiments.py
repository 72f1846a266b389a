"""``scale-cl bio``, ``scale-cl cpt``, ``scale-cl base`` and ``scale-cl train``: each a `Command` over its settings
(preset, then YAML, then options) and output folder, which live with the experiment
(``experiments/<name>/config.py``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from scale_cl.cli.command import Command
from scale_cl.experiments.base.config import PRESETS as BASE_PRESETS
from scale_cl.experiments.base.config import BaseCommand, base_settings
from scale_cl.experiments.bio.config import PRESETS as BIO_PRESETS
from scale_cl.experiments.bio.config import BioCommand, bio_settings
from scale_cl.experiments.cpt.config import PRESETS as CPT_PRESETS
from scale_cl.experiments.cpt.config import CptCommand, cpt_settings
from scale_cl.experiments.train.config import PRESETS as TRAIN_PRESETS
from scale_cl.experiments.train.config import WHY_DEFAULT, TrainCommand, train_settings


def experiment_command(
    *,
    name: str,
    help: str,
    what: str,
    usage: str,
    examples: str,
    presets: tuple[str, ...],
    settings: Callable[..., Any],
    run: Callable[[Any], int],
    config_example: str,
) -> Command:
    """An experiment's `Command`, declared one way: ``what`` it does, then where its settings come from; its usage
    line lists every preset (``{presets}`` in ``usage``); the epilog its ``examples``. The default preset is the
    one ``settings()`` gives."""
    default = getattr(settings(), name).preset  # the command settings hold the experiment's under its name
    description = (
        f"{what} Settings come from --preset, then --config (YAML, the options' nesting), then the options below. "
        f"Defaults shown are the preset's given with --help (scale-cl {name} --preset NAME --help), else the "
        f"{default} preset's."
    )
    return Command(
        name=name,
        help=help,
        description=description,
        epilog=f"examples:\n{examples}",
        usage=usage.format(presets="|".join(presets)),
        settings=settings,
        presets=True,
        run=run,
        config_example=config_example,
    )


def run_bio_command(settings: BioCommand) -> int:
    from scale_cl.experiments.bio.pipeline import run_bio
    from scale_cl.experiments.bio.report import figures
    from scale_cl.experiments.bio.sequence import run_bio_sequence

    out = Path(settings.out or f"outputs/bio-{settings.bio.preset}")
    run = run_bio_sequence if settings.bio.sequence.tasks > 1 else run_bio
    results = run(settings.bio, out, Path(settings.cache) if settings.cache else None)
    print((out / "results.md").read_text())
    written = [out / name for name in ("results.md", "results.json", *figures(results))]
    print(f"[bio] wrote {', '.join(map(str, written[:-1]))} and {written[-1]}")
    return 0 if results["methods"] else 1


BIO = experiment_command(
    name="bio",
    help="the biography continual-learning benchmark (paper Fig. 8): every method, figure and table",
    what=(
        "Pre-train a GPT-NeoX model on synthetic biographies (stage 1), fine-tune QA of Task 0 (stage 2), "
        "then, for every method, fine-tune QA of Task 1 while measuring Task 0 and Task 1 with hard "
        "first-token accuracy (stage 3). Stages 1-2 are cached and shared by the methods; a re-run "
        "resumes and skips what is done."
    ),
    examples=(
        "  scale-cl bio                                   # small preset, all seven methods, one seed\n"
        "  scale-cl bio --seeds 0 1 2                     # mean and spread over seeds\n"
        "  scale-cl bio --methods fft scale_route --task1.scale_route_lr 3e-4 --out outputs/try\n"
        "  scale-cl bio --preset paper --config my.yaml   # Pythia-160M, 200k people (for a GPU)"
    ),
    usage="scale-cl bio [--preset {presets}] [--methods M ...] [--seed S ...] [--out DIR] [options]",
    presets=BIO_PRESETS,
    settings=bio_settings,
    run=run_bio_command,
    config_example="{task1: {lr: 1e-4}, methods: [fft, scale_route]}",
)


def run_cpt_command(settings: CptCommand) -> int:
    from scale_cl.experiments.cpt.pipeline import run_cpt
    from scale_cl.experiments.cpt.sequence import run_cpt_sequence
    from scale_cl.experiments.train.prepare import process_state

    out = Path(settings.out or f"outputs/cpt-{settings.cpt.preset}")
    if settings.cpt.sequence.then:
        results = {"methods": run_cpt_sequence(settings.cpt, out)}
    else:
        results = run_cpt(settings.cpt, out)
    if process_state().is_main_process:
        print((out / "results.md").read_text())
        figures = "" if settings.cpt.sequence.then else f", {out / 'perplexity.png'}"
        print(f"[cpt] wrote {out / 'results.md'}, {out / 'results.json'}{figures}")
    return 0 if results["methods"] else 1


CPT = experiment_command(
    name="cpt",
    help="continual pre-training of a causal LM on new-domain text with every method (paper Fig. 4, 9)",
    what=(
        "Continually pre-train a base model (hub id, local folder, .gguf file, or 'smollm2') on new-domain "
        "text with each method, measuring learning perplexity (held-out new-domain split), forgetting "
        "perplexity (each old-domain set), representation drift and SCALE-Route's routing share every "
        "--eval.every steps. Writes metrics.jsonl per method, results.md/json and figures. Re-running the "
        "same command resumes from the last checkpoint. Runs under torchrun / accelerate launch (DDP)."
    ),
    examples=(
        "  scale-cl cpt --data.train 'ko/*.jsonl' --data.old_eval en=en_eval.jsonl\n"
        "  scale-cl cpt --model meta-llama/Llama-3.2-1B --preset paper --data.train hf:user/korean-corpus \\\n"
        "               --data.old_eval en=hf:user/english-eval::validation --data.streaming --train.max_steps 2000\n"
        "  scale-cl cpt --model path/to/model.gguf --methods fft scale_route --train.scale_route_lr 3e-4"
    ),
    usage="scale-cl cpt --data.train FILE... [--data.old_eval NAME=FILE...] [--preset {presets}] "
    "[--model M] [--methods M ...] [--out DIR] [options]",
    presets=CPT_PRESETS,
    settings=cpt_settings,
    run=run_cpt_command,
    config_example="{data: {train: [ko/*.jsonl]}, train: {max_steps: 50}}",
)


def run_base_command(settings: BaseCommand) -> int:
    from scale_cl.experiments.base.build import build_base

    out = Path(settings.out or f"outputs/{settings.base.preset}")
    model_dir = build_base(settings.base, out)
    print(f"[base] the base model is {model_dir} (an ordinary Hugging Face folder)")
    return 0


BASE = experiment_command(
    name="base",
    help="build the clean English base model (a small Llama pre-trained here) that `cpt --model clean-en` uses",
    what=(
        "Pre-train a small Llama-family model (GQA, RMSNorm, SwiGLU, RoPE, tied embeddings) from scratch on English "
        "text, with a byte-level BPE tokenizer trained on that text alone, and save it as an ordinary Hugging Face "
        "folder. It is the base of the clean CPT benchmark: unlike SmolLM2 (an instruct model de-quantised from "
        "Q4_1, which any update partly repairs), it has nothing to repair, so English perplexity rising during "
        "continual pre-training is forgetting. Built once: a re-run resumes an interrupted build and reuses a "
        "finished one. The clean-en preset takes ~25 min on 2 CPU cores; its corpus comes from "
        "`python measurements/cpt_corpus.py --corpora english-base` (Debian documentation packages)."
    ),
    examples=(
        "  scale-cl base                                   # outputs/clean-en/model, what --model clean-en names\n"
        "  scale-cl base --data.train 'my_english/*.jsonl' --train.max_steps 3000 --out outputs/my-base\n"
        "  scale-cl base --preset micro --data.train notes.txt --out /tmp/micro-base   # seconds: a smoke test"
    ),
    usage="scale-cl base [--preset {presets}] [--data.train FILE...] [--out DIR] [options]",
    presets=BASE_PRESETS,
    settings=base_settings,
    run=run_base_command,
    config_example="{train: {max_steps: 3000}, model: {layers: 8}}",
)


def run_train_command(settings: TrainCommand) -> int:
    out = Path(settings.out or f"outputs/train-{settings.train.preset}-{settings.train.method}")
    if settings.dry_run:
        from scale_cl.bench.plan import plan, plan_config

        config, note = plan_config(settings.train)
        cfg = settings.fitted(config)
        print(f"[train] the plan for {out} (--dry_run: nothing was loaded or written)")
        print(plan(cfg, config, settings.processes, note))
        return 0
    from scale_cl.experiments.run_folder import check_output_folder
    from scale_cl.experiments.train.pipeline import CONFIG_FILE, FIGURE, MODEL_DIR, run_train
    from scale_cl.experiments.train.prepare import base_model_config, process_state

    check_output_folder(out, CONFIG_FILE, None)  # a bad --out before the model is looked up
    cfg = settings.fitted(base_model_config(settings.train))

    summary = run_train(cfg, out, settings.command)
    if process_state().is_main_process:
        last = (summary.get("curve") or [{}])[-1]
        measured = ", ".join(
            [*([f"held-out ppl {last['learning_ppl']:.4g}"] if "learning_ppl" in last else [])]
            + [f"{name} ppl {value:.4g}" for name, value in last.get("forgetting_ppl", {}).items()]
        )
        print(f"[train] {cfg.method}: {summary['steps']:,} steps; {measured}")
        print(f"[train] wrote {out / MODEL_DIR} (model and card), {out / 'metrics.jsonl'}, {out / FIGURE}")
    return 0


TRAIN = experiment_command(
    name="train",
    help="train one model on your own corpus with one method: checkpoints kept, resumable, a model and its card",
    what=(
        "Continually pre-train a base model (hub id, local folder, .gguf file, 'smollm2', 'clean-en') on your "
        "new-domain text with one method, for a token budget (--train.tokens 2B) or a number of steps, measuring "
        "held-out new-domain perplexity (learning) and every old-domain set's (forgetting) as it goes. The corpus is "
        "read by the datasets library (.txt, .jsonl, .jsonl.gz, .parquet, .arrow, save_to_disk folders, hub ids, "
        "globs; several sources mixed by --data.weights), tokenised once into its cache, or streamed "
        "(--data.streaming). Checkpoints are kept (--train.save_every, --train.save_minutes, "
        "--train.save_total_limit); rerunning the same command resumes exactly where it stopped, on one process or "
        "under torchrun / accelerate launch. Writes model/ (what scale-cl eval, export and load_trained take, with a "
        "model card), metrics.jsonl, train_log.jsonl and curves.png. --dry_run prints the plan first. Where you "
        "choose none, options.scale.preserve_layers and options.freeze_layers are a fifth of the model's decoder "
        "layers (the defaults below are SmolLM2-135M's 6 of 30), and the run is measured twenty times whatever its "
        f"length (eval.every 0). {WHY_DEFAULT}"
    ),
    examples=(
        "  scale-cl train --data.train 'ko/*.jsonl.gz' --data.old_eval en=en_eval.jsonl --train.tokens 50M --dry_run\n"
        "  scale-cl train --model Qwen/Qwen2.5-0.5B --data.train ko.parquet --data.old_eval en=hf:user/en::test \\\n"
        "                 --train.tokens 2B --train.schedule wsd --out outputs/qwen-ko\n"
        "  accelerate launch --num_processes 8 -m scale_cl.cli train --config configs/train-llama-3.2-1b-8gpu.yaml\n"
        "  scale-cl train --preset clean-en                       # the clean English base learns Korean, 2M tokens"
    ),
    usage="scale-cl train --data.train SOURCE... [--data.old_eval NAME=SOURCE...] [--train.tokens N] "
    "[--preset {presets}] [--model M] [--method M] [--reading R] [--out DIR] [--dry_run] [options]",
    presets=TRAIN_PRESETS,
    settings=train_settings,
    run=run_train_command,
    config_example="{data: {train: [ko/*.jsonl]}, train: {tokens: 2B}}",
)
