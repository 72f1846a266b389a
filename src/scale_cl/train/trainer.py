"""A Trainer whose checkpoints hold only what trains, are written atomically, and which stops on NaN/inf loss.

``checkpoint-N`` holds ``model.safetensors`` (the trainable parameters, under the live model's names),
``checkpoint.json`` (the run), a stream's ``stream.json`` and the Trainer's own optimizer, scheduler, RNG and state
files; it is staged and renamed into place, so it is complete or absent. Why, and what FSDP / DeepSpeed change:
docs/design.md §7, "Checkpoints and models".
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from scale_cl.data.replay import REPLAY_KEY
from scale_cl.files import atomic_write, sha256_of, write_json
from scale_cl.train.chunked_loss import LossTargets, sliced_head
from scale_cl.train.distill import Distillation, distill_sum
from scale_cl.train.sampler import lean_sampler
from scale_cl.tuner.io import check_tensors
from scale_cl.tuner.sliced_loss import chunkable, use_sliced_loss

TRAINABLE_WEIGHTS = "model.safetensors"  # the stock Trainer's name: it resumes these checkpoints too (strict=False)
LEGACY_TRAINABLE_WEIGHTS = "trainable.safetensors"  # the same file in checkpoints written before 2026-12-04
CHECKPOINT_META = "checkpoint.json"
STREAM_POSITION = "stream.json"  # where a streamed training split's next block starts
STAGING_DIR = ".staging"


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN or infinite loss; nothing after the last good checkpoint was saved."""


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter that trains, detached on the CPU (tied parameters once)."""
    seen: set[int] = set()
    state = {}
    for name, param in model.named_parameters():
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            state[name] = param.detach().contiguous().cpu()
    return state


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """``checkpoint-N`` folders of ``run_dir`` that were written completely, oldest first."""
    found = []
    for path in Path(run_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
        suffix = path.name.removeprefix(f"{PREFIX_CHECKPOINT_DIR}-")
        if path.is_dir() and suffix.isdigit() and (path / CHECKPOINT_META).is_file():
            found.append((int(suffix), path))
    return [path for _, path in sorted(found)]


class CheckpointingTrainer(Trainer):
    """HF Trainer with trainable-only atomic checkpoints and a hard stop on non-finite loss.

    Args:
        run_info: JSON-able description written into every checkpoint (method, base model, ...);
            resuming refuses a checkpoint whose ``run_info`` differs.
        distillation: a KL term to the base model's logits added to the training loss
            (`scale_cl.train.distill`); None = the language-modelling loss alone.
        slice_positions: the training loss's positions per slice of the head (`scale_cl.train.chunked_loss`: the
            logits never whole); 0 = chosen from the shapes (`slice_positions`), None = the plain loss (whole logits).
        lr_ratios: ``{name suffix: multiple}``: parameters whose name ends with a suffix train at that multiple
            of the learning rate (their own optimizer groups, under the same schedule); the others at the rate.
        other arguments: as `transformers.Trainer`.
    """

    def __init__(
        self,
        *args: Any,
        run_info: dict[str, Any] | None = None,
        lr_ratios: dict[str, float] | None = None,
        distillation: Distillation | None = None,
        slice_positions: int | None = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.run_info = run_info or {}
        self.lr_ratios = dict(lr_ratios or {})
        self.distillation = distillation
        self.slice_positions = slice_positions
        self._resumed_from: Path | None = None
        # the model's own forward computes the sliced loss when it trains on labels (`use_sliced_loss`); a sharded
        # model's head gathers its weights in its own call, which the slices would repeat: the whole loss there
        sharded = self.is_fsdp_enabled or self.is_deepspeed_enabled
        if self.model is not None:
            use_sliced_loss(self.model, None if sharded else slice_positions)

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """The Trainer's loss, plus the distillation term while training (`scale_cl.train.distill`).

        The term is summed over the batch's labelled positions and divided by the token count the
        cross-entropy is divided by (``num_items_in_batch`` across accumulation steps and processes, as the
        Trainer's loss; else this batch's), then scaled by the same factor the Trainer applies to it.
        """
        from_replay = inputs.pop(REPLAY_KEY, None)
        if self.distillation is None or not model.training:  # the sliced loss where the model computes it
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.slices_loss(model, inputs):
            return self.sliced_loss(model, inputs, return_outputs, num_items_in_batch, from_replay)
        outputs, teacher_logits = self.distillation.teacher.run(
            lambda: super(CheckpointingTrainer, self).compute_loss(model, inputs, True, num_items_in_batch), inputs
        )
        loss, outputs = outputs
        labels = inputs["labels"]
        total = distill_sum(outputs.logits, teacher_logits, labels, from_replay, self.distillation.config)
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            count = num_items_in_batch
            if self.args.average_tokens_across_devices:  # the Trainer multiplies its loss so; do the same
                scale = self.accelerator.num_processes // self.get_tp_size()
                total = total * (scale if self.args.n_gpu <= 1 else self.args.n_gpu)
        else:
            count = (labels[:, 1:] != -100).sum()
        loss = loss + self.distillation.config.weight * total / count
        return (loss, outputs) if return_outputs else loss

    def slices_loss(self, model: nn.Module, inputs: dict[str, Any]) -> bool:
        """Whether this distilled training batch's loss is computed a slice of positions at a time (`sliced_loss`):
        training, ``slice_positions`` not None, the Trainer's own causal-LM loss (no label smoother, no
        ``compute_loss_func``), weights held whole (not sharded: a sharded head gathers its weights in its own call)
        and a head that reads each position alone (`chunkable`)."""
        if not (self.slice_positions is not None and model.training and torch.is_grad_enabled()):
            return False
        if "labels" not in inputs or self.label_smoother is not None or self.compute_loss_func is not None:
            return False
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            return False
        head = self.accelerator.unwrap_model(model).get_output_embeddings()
        return head is not None and chunkable(head)

    def sliced_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool,
        num_items_in_batch: Any,
        from_replay: torch.Tensor | None,
    ) -> Any:
        """The Trainer's causal-LM loss and the distillation term with the logits never whole
        (`scale_cl.train.chunked_loss`): divided as the Trainer divides its own."""
        labels = inputs["labels"]
        model_inputs = {k: v for k, v in inputs.items() if k != "labels"}
        head = self.accelerator.unwrap_model(model).get_output_embeddings()
        across_batches = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        divisor = num_items_in_batch if across_batches else (labels[:, 1:] != -100).sum()
        divisor = torch.as_tensor(divisor, device=labels.device)
        distill = self.distillation
        teacher = distill.teacher.slices(inputs) if distill is not None else contextlib.nullcontext()
        with teacher as slice_teacher:
            config = distill.config if distill is not None else None
            targets = LossTargets(labels, divisor, config, slice_teacher, from_replay)
            with sliced_head(head, targets, self.slice_positions or None):
                outputs = model(**model_inputs)
        loss = outputs.logits
        if across_batches and self.args.average_tokens_across_devices:  # as the Trainer scales its own loss
            scale = self.accelerator.num_processes // self.get_tp_size()
            loss = loss * (scale if self.args.n_gpu <= 1 else self.args.n_gpu)
        return (loss, outputs) if return_outputs else loss

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer, each of its groups split by `lr_ratios` (before any step, so no state moves)."""
        optimizer = super().create_optimizer(model)
        if not self.lr_ratios:
            return optimizer
        names = {id(p): n for n, p in (model or self.model).named_parameters()}
        groups = []
        for group in optimizer.param_groups:
            by_ratio: dict[float, list[nn.Parameter]] = {}
            for param in group["params"]:
                ratio = next((r for s, r in self.lr_ratios.items() if names[id(param)].endswith(s)), 1.0)
                by_ratio.setdefault(ratio, []).append(param)
            groups += [{**group, "params": ps, "lr": group["lr"] * r} for r, ps in by_ratio.items()]
        unmatched = [s for s in self.lr_ratios if not any(n.endswith(s) for n in names.values())]
        if unmatched:
            raise ValueError(f"lr_ratios: no parameter name ends with {unmatched}")
        optimizer.param_groups.clear()
        for group in groups:
            optimizer.add_param_group(group)
        return optimizer

    def get_train_dataloader(self) -> Any:
        """The Trainer's, its random order drawn as a tensor rather than a list (`scale_cl.train.sampler`)."""
        return lean_sampler(super().get_train_dataloader())

    def get_resumed_dataloader(self, dataloader: Any, num_batches: int) -> Any:
        """A stream whose position the checkpoint saved starts there; other data is skipped through, as the Trainer
        does."""
        step = self.state.global_step
        checkpoint = self._resumed_from or Path(self.args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"
        saved = checkpoint / STREAM_POSITION
        if saved.is_file() and hasattr(self.train_dataset, "resume"):
            self.train_dataset.resume(json.loads(saved.read_text()))
            return dataloader
        return super().get_resumed_dataloader(dataloader, num_batches)

    def _stream_position(self) -> dict[str, Any] | None:
        """The training stream's position after this step's blocks: every step took gradient_accumulation_steps
        batches of the per-device batch on every process (read by rank 0 and handed out, or by every rank)."""
        position = getattr(self.train_dataset, "position", None)
        if position is None:
            return None
        args = self.args
        per_step = args.gradient_accumulation_steps * self._train_batch_size * args.world_size
        return position(self.state.global_step * per_step)

    def _own_format(self) -> bool:
        return not (self.is_fsdp_enabled or self.is_deepspeed_enabled)

    # --- saving -------------------------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if not self._own_format():
            return super()._save(output_dir, state_dict)
        if not self.args.should_save:
            return None
        directory = Path(output_dir or self.args.output_dir)
        directory.mkdir(parents=True, exist_ok=True)
        weights = trainable_state(self.accelerator.unwrap_model(self.model))
        # the weights first, the meta that names them last (also for a save_model outside a checkpoint)
        atomic_write(directory / TRAINABLE_WEIGHTS, lambda tmp: save_file(weights, tmp, metadata={"format": "pt"}))
        meta = {
            "run": self.run_info,
            "global_step": self.state.global_step,
            "tensors": {name: list(t.shape) for name, t in weights.items()},
            "sha256": sha256_of(directory / TRAINABLE_WEIGHTS),
        }
        write_json(directory / CHECKPOINT_META, meta)
        return None

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """Write ``checkpoint-N`` under a staging folder, then rename it into place (see module doc).

        The Trainer writes a checkpoint into ``<args.output_dir>/checkpoint-N``, as `TrainingArguments`
        documents for ``output_dir``; for the length of the write ``args.output_dir`` points at the
        staging folder. No public hook does this: callbacks' ``on_save`` runs after the files are
        written, and ``save_model``'s ``output_dir`` covers the weights only, not the optimizer,
        scheduler, RNG and trainer-state files. So this overrides the private ``Trainer._save_checkpoint``
        and relies on it reading ``args.output_dir`` when called (through the private ``_get_output_dir``),
        as transformers 5.23 (the version checked) does; tests/train/test_checkpointing.py fails naming both
        if a release changes that. A hyper-parameter search trial (its own sub-folder) keeps the
        Trainer's saving.
        """
        if trial is not None:
            return super()._save_checkpoint(model, trial)
        if self._own_format():  # a finite loss can still come with a non-finite gradient
            params = self.accelerator.unwrap_model(self.model).named_parameters()
            bad = [name for name, p in params if p.requires_grad and not bool(torch.isfinite(p.detach()).all())]
            if bad:
                self._stop(f"the trainable weights {bad[:3]} became non-finite at step {self.state.global_step}")
        output_dir = self.args.output_dir
        run_dir = Path(output_dir)
        staging = run_dir / STAGING_DIR
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)  # what a save killed part-way (kill -9, power) left
        self.accelerator.wait_for_everyone()
        self.args.output_dir = str(staging)
        try:
            super()._save_checkpoint(model, trial)
        except BaseException:  # Ctrl-C, SIGTERM, a full disk: no half-written files stay behind
            if self.args.should_save:
                shutil.rmtree(staging, ignore_errors=True)
            raise
        finally:
            self.args.output_dir = output_dir
        self.accelerator.wait_for_everyone()  # every process has written its RNG state (and its shards)
        if self.args.should_save:
            if (position := self._stream_position()) is not None:
                write_json(staging / name / STREAM_POSITION, position)
            if not self._own_format():  # the Trainer's (sharded) files; the meta marks them complete and whose
                meta = {"run": self.run_info, "global_step": self.state.global_step, "format": "accelerate"}
                write_json(staging / name / CHECKPOINT_META, meta)
            _fsync_tree(staging / name)
            final = run_dir / name
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging / name, final)
            with contextlib.suppress(OSError):  # empty now, unless another process still writes there
                staging.rmdir()  # the run folder holds checkpoints and results only
            _fsync_dir(run_dir)
            rotate_checkpoints(
                output_dir=str(run_dir),
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=False,
            )
        self.accelerator.wait_for_everyone()

    # --- loading ------------------------------------------------------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        self._resumed_from = Path(resume_from_checkpoint)
        if not self._own_format():
            check_run(Path(resume_from_checkpoint), self.run_info)
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_trainable(self.accelerator.unwrap_model(model or self.model), Path(resume_from_checkpoint), self.run_info)
        return None

    # --- non-finite loss ----------------------------------------------------------------------
    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        finite = torch.isfinite(loss.detach()).all()
        if self.args.world_size > 1:  # every process must stop, or the others wait forever
            finite = self.accelerator.gather(finite.reshape(1).to(loss.device)).all()
        if not bool(finite):
            self._stop(
                f"the training loss became {loss.item()} at step {self.state.global_step + 1}; training stopped "
                "before the optimizer applied it"
            )
        return loss

    def _stop(self, what: str) -> None:
        last = complete_checkpoints(Path(self.args.output_dir))
        kept = f"the last good checkpoint is {last[-1]}" if last else "no checkpoint had been written yet"
        raise NonFiniteLossError(f"{what} ({kept}). Lower the learning rate, add warm-up, or check the data.")


def check_run(checkpoint: Path, run_info: dict[str, Any] | None) -> dict[str, Any]:
    """A checkpoint's meta (`CHECKPOINT_META`); refuse an incomplete checkpoint or one of another run."""
    meta_path = checkpoint / CHECKPOINT_META
    if not meta_path.is_file():
        raise ValueError(f"{checkpoint} is not a complete scale-cl training checkpoint ({CHECKPOINT_META} missing)")
    meta = json.loads(meta_path.read_text())
    if run_info is not None and meta["run"] != run_info:
        raise ValueError(
            f"{checkpoint} belongs to another run: it records {meta['run']}, this run is {run_info}. "
            "Use another output folder, or delete the old checkpoints."
        )
    return meta


def load_trainable(model: nn.Module, checkpoint: Path, run_info: dict[str, Any] | None = None) -> None:
    """Copy a checkpoint's trainable weights into ``model``; refuse a checkpoint of another run or a damaged one."""
    meta = check_run(checkpoint, run_info)
    if meta.get("format") == "accelerate":
        raise ValueError(
            f"{checkpoint} was written by a sharded run (FSDP / ZeRO-3: the weights are in the launcher's sharded "
            "format): resume it under the same accelerate config"
        )
    weights_path = checkpoint / TRAINABLE_WEIGHTS
    if not weights_path.is_file() and (checkpoint / LEGACY_TRAINABLE_WEIGHTS).is_file():
        weights_path = checkpoint / LEGACY_TRAINABLE_WEIGHTS
    if not weights_path.is_file() or sha256_of(weights_path) != meta["sha256"]:
        raise ValueError(f"{weights_path} is missing or does not match its recorded SHA-256; the checkpoint is damaged")
    weights = load_file(weights_path)
    params = dict(model.named_parameters())
    check_tensors(
        {name: value.shape for name, value in weights.items()},
        {name: p.shape for name, p in params.items() if p.requires_grad},
        str(checkpoint),
    )
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)


def _fsync_tree(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
