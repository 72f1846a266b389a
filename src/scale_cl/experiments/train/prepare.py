"""What a corpus run sets up before any method trains: where it runs (`process_state`, the placements), the checks
that need the model's config or the launch (`validate`), the steps, the training data and the Trainer's arguments."""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from transformers import AutoConfig, PreTrainedModel, TrainingArguments

from scale_cl.data.corpus import Corpus, check_corpus, eos_id, is_stream
from scale_cl.data.pseudo_replay import cached_blocks, generate_blocks
from scale_cl.data.replay import ReplayMix, ReplayStream
from scale_cl.experiments.base.name import resolve_model_name
from scale_cl.experiments.train.sections import RunSettings
from scale_cl.models import BaseModelRef
from scale_cl.remote_code import own_code_kwargs
from scale_cl.train.arguments import training_arguments as stage_training_arguments
from scale_cl.train.device import Placement, stage_placement
from scale_cl.train.reporting import report_to_argument
from scale_cl.train.sharding import requested_sharding


def process_state(cpu: bool | None = None) -> PartialState:
    """This process's place in a ``torchrun``/``accelerate launch`` run, set up as the Trainer's (``use_cpu``) will be.

    Without CUDA a bare ``PartialState()`` does not see the launcher's processes (accelerate sets up
    gloo only when asked for the CPU): every process would count as the main one and the world size
    as 1 until the first ``TrainingArguments`` re-initialised the state. ``cpu``: the run's ``train.device`` is
    the CPU (default: no CUDA); it counts at the first call, which `validate` makes.
    """
    return PartialState(cpu=not torch.cuda.is_available() if cpu is None else cpu)


def run_placement(cfg: RunSettings) -> Placement:
    """Where the run trains and evaluates, and in which precision (``train.device``, ``train.precision``)."""
    return stage_placement(cfg.train)


def base_placement(cfg: RunSettings) -> Placement:
    """Where the base model itself runs outside the Trainer (the reference hidden states, a sweep's step 0,
    pseudo-replay sampling): as the run, but on the CPU in fp32 under sharded weights (FSDP, ZeRO-3), where a
    whole copy of the base may not fit one GPU."""
    return Placement("cpu", bf16=False) if requested_sharding() is not None else run_placement(cfg)


def validate(cfg: RunSettings, base_config: Any) -> None:
    """Raise a ValueError for settings that cannot work with this base model, before anything is written."""
    placement = run_placement(cfg)  # train.device cuda without a GPU, bf16 on a GPU without it: refused here
    cfg.options.validate(base_config, cfg.methods)
    report_to_argument(cfg.train.report_to)  # its backends are installed
    cfg.check()  # the settings' own checks, for settings built in Python (the command line ran them first)
    world = process_state(cpu=placement.device == "cpu").num_processes
    t = cfg.train
    if t.batch_size % (t.micro_batch_size * world):
        raise ValueError(
            f"train.batch_size={t.batch_size} must be a multiple of train.micro_batch_size={t.micro_batch_size} "
            f"x {world} process(es)"
        )
    sharding = requested_sharding()
    if sharding is not None:
        unsupported = [
            ("options.base_quant", cfg.options.base_quant != "none"),
            ("options.auto_layers", any(cfg.options.chooses_layers(m) for m in cfg.methods)),
            ("eval.wise_ft_alphas", bool(cfg.eval.wise_ft_alphas)),
            ("eval.likelihood_control", cfg.eval.likelihood_control),
        ]
        named = [name for name, used in unsupported if used]
        if named:
            raise ValueError(
                f"{', '.join(named)}: not supported with sharded weights ({sharding}, from the accelerate config; "
                "untested there: the quantized base, the weight interpolation and the two-model control need whole "
                "weights, the layer probes evaluate on one process). Drop them, or launch without FSDP / ZeRO-3."
            )


def total_steps(cfg: RunSettings, train: Any) -> int:
    """The steps of the token budget (``train.tokens``), or ``max_steps``, or of ``epochs`` passes over the training
    data (``train``, replay mixed in)."""
    if cfg.train.token_budget:
        return math.ceil(cfg.train.token_budget / (cfg.train.batch_size * cfg.data.seq_len))
    if cfg.train.max_steps > 0:
        return cfg.train.max_steps
    return math.ceil(cfg.train.epochs * len(train) / cfg.train.batch_size)


def training_data(
    cfg: RunSettings, corpus: Corpus, pseudo_replay: torch.Tensor | None = None, mark: bool = False
) -> Any:
    """The training split, or with ``data.replay_ratio`` the split with replay mixed in on replay's schedule (this
    run's seed draws the order, `scale_cl.data.replay`); with ``data.pseudo_replay_ratio`` the base model's own
    text (``pseudo_replay``, `pseudo_replay_blocks`) takes replay's place. ``mark``: each sequence says whether it
    is (pseudo-)replay, for the distillation term."""
    ratio = cfg.data.replay_ratio or cfg.data.pseudo_replay_ratio
    if not ratio:
        return corpus.train
    if cfg.data.pseudo_replay_ratio:
        if pseudo_replay is None:
            raise ValueError("data.pseudo_replay_ratio needs the sampled blocks (pseudo_replay_blocks)")
        replay = pseudo_replay
    elif corpus.replay is None:
        raise ValueError(f"data.replay_ratio={ratio} but the corpus was packed without replay text (data.replay)")
    else:
        replay = corpus.replay
    if is_stream(corpus.train):
        return ReplayStream(corpus.train, replay, ratio, cfg.seed, mark=mark)
    return ReplayMix(corpus.train, replay, ratio, cfg.seed, cfg.train.batch_size, mark=mark)


def pseudo_replay_blocks(
    cfg: RunSettings, ref: BaseModelRef, base: PreTrainedModel, tokenizer: Any, cache: Path
) -> torch.Tensor | None:
    """The base model's own sequences for ``data.pseudo_replay_ratio`` (sampled once per seed, cached in
    ``cache``), or None without pseudo-replay. ``base``: the model before any method touches it."""
    d = cfg.data
    if not d.pseudo_replay_ratio:
        return None
    placement = base_placement(cfg)
    settings = {
        "base": asdict(ref),
        "vocab": len(tokenizer),
        "seed": cfg.seed,
        "sequences": d.pseudo_replay_sequences,
        "seq_len": d.seq_len,
        "temperature": d.pseudo_replay_temperature,
        **({"bf16": True} if placement.bf16 else {}),  # sampled in bf16: another draw (fp32 keeps its old key)
    }

    def sample() -> torch.Tensor:
        print(f"[cpt] pseudo-replay: the base model samples {d.pseudo_replay_sequences} sequences (seed {cfg.seed})")
        start = eos_id(tokenizer)
        base.to(placement.device)  # sampled where the run trains; prepared back on the CPU, as without pseudo-replay
        try:
            sequences, temperature = d.pseudo_replay_sequences, d.pseudo_replay_temperature
            return generate_blocks(base, start, sequences, d.seq_len, cfg.seed, temperature, bf16=placement.bf16)
        finally:
            base.to("cpu")

    with process_state().main_process_first():  # one process samples and writes; the others read its file
        return cached_blocks(cache, settings, sample)


def training_arguments(
    cfg: RunSettings, method: str, run_dir: Path, steps: int, logging_dir: Path | None = None
) -> TrainingArguments:
    """cpt's settings for the shared builder: ``batch_size`` split into per-process micro-batches and accumulation."""
    t = cfg.train
    world = process_state().num_processes
    return stage_training_arguments(
        t,
        run_dir,
        cfg.seed,
        learning_rate=t.lr_of(method),
        max_steps=steps,
        micro_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.batch_size // (t.micro_batch_size * world),
        warmup_steps=max(t.warmup_steps, math.ceil(t.warmup_ratio * steps)),
        save_every=t.save_every,
        save_total_limit=t.save_total_limit,
        activation_checkpointing=t.gradient_checkpointing,
        logging_steps=t.logging_steps or min(cfg.eval.interval(steps), 50),
        logging_dir=logging_dir,
        loader_workers=cfg.data.loader_workers,
    )


def probe_arguments(cfg: RunSettings, method: str, method_dir: Path) -> TrainingArguments:
    """The Trainer settings of a layer-choice probe: the run's, for ``auto_layers_steps`` steps, never saving."""
    probe_cfg = replace(cfg, train=replace(cfg.train, save_every=0, report_to=["none"]))
    return training_arguments(probe_cfg, method, method_dir / "probe", cfg.options.auto_layers_steps)


def base_model_ref(cfg: RunSettings) -> BaseModelRef:
    """Where the run's base model comes from (``clean-en`` resolved to the built base's folder)."""
    return BaseModelRef.parse(resolve_model_name(cfg.model))


def base_model_config(cfg: RunSettings) -> Any:
    """The base model's configuration (cheap: no weights), or a FileNotFoundError that names the model."""
    check_corpus(cfg.data)  # cheap input checks first: no model is loaded for a typo in a path
    ref = base_model_ref(cfg)
    kwargs = {"gguf_file": ref.gguf_file} if ref.gguf_file else {}
    try:
        if not ref.gguf_file:  # a scale-cl export runs its own modeling code (`scale_cl.remote_code`)
            kwargs.update(own_code_kwargs(ref.name_or_path))
        return AutoConfig.from_pretrained(ref.name_or_path, **kwargs)
    except OSError as err:
        raise FileNotFoundError(
            f"cannot load the configuration of model {cfg.model!r}: {str(err).splitlines()[0]}"
        ) from err
