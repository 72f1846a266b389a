"""CheckpointingTrainer: atomic trainable-only checkpoints, refusal of foreign or damaged ones, NaN stop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

from scale_cl.data.corpus import PackedDataset
from scale_cl.methods import prepare
from scale_cl.train.trainer import (
    CHECKPOINT_META,
    LEGACY_TRAINABLE_WEIGHTS,
    STAGING_DIR,
    TRAINABLE_WEIGHTS,
    CheckpointingTrainer,
    NonFiniteLossError,
    complete_checkpoints,
    load_trainable,
)
from tests.conftest import VOCAB, make_model

RUN = {"method": "scale_adapt", "lr": 1e-3}


def _dataset() -> PackedDataset:
    gen = torch.Generator().manual_seed(0)
    return PackedDataset(torch.randint(1, VOCAB, (32, 12), generator=gen))


def _model():
    return prepare(make_model("llama-gqa2-tied"), "scale_adapt", hidden_up=32, ffn_up=16, preserve_layers=1)


def _trainer(model, out: Path, steps: int = 6, callbacks=(), run_info=RUN) -> CheckpointingTrainer:
    args = TrainingArguments(
        output_dir=str(out),
        learning_rate=1e-3,
        max_steps=steps,
        per_device_train_batch_size=4,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=5,
        logging_nan_inf_filter=False,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    return CheckpointingTrainer(
        model=model,
        args=args,
        train_dataset=_dataset(),
        data_collator=default_data_collator,
        callbacks=list(callbacks),
        run_info=run_info,
    )


@pytest.mark.parametrize("stop", [OSError("disk full (simulated)"), KeyboardInterrupt("Ctrl-C (simulated)")])
def test_checkpoint_is_complete_or_absent_when_saving_crashes(stop, tmp_path, monkeypatch):
    original = Trainer._save_rng_state

    def crash_at_step_4(self, output_dir):
        if self.state.global_step == 4:
            raise stop
        return original(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_rng_state", crash_at_step_4)
    with pytest.raises(type(stop), match="simulated"):
        _trainer(_model(), tmp_path).train()
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["checkpoint-2"]
    assert not (tmp_path / "checkpoint-4").exists(), "a half-written checkpoint must not look like one"
    assert not (tmp_path / STAGING_DIR).exists(), "the failed save removed its half-written files"

    monkeypatch.setattr(Trainer, "_save_rng_state", original)
    resumed = _trainer(_model(), tmp_path)
    resumed.train(resume_from_checkpoint=str(complete_checkpoints(tmp_path)[-1]))
    assert resumed.state.global_step == 6
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]


def test_checkpoint_holds_exactly_the_trainable_parameters(tmp_path):
    model = _model()
    _trainer(model, tmp_path, steps=2).train()
    weights = load_file(tmp_path / "checkpoint-2" / TRAINABLE_WEIGHTS)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(weights) == trainable
    assert all(torch.equal(weights[n], p.detach()) for n, p in model.named_parameters() if n in trainable)
    meta = json.loads((tmp_path / "checkpoint-2" / CHECKPOINT_META).read_text())
    assert meta["run"] == RUN and meta["global_step"] == 2


def test_a_checkpoint_written_before_the_rename_still_loads(tmp_path):
    """Checkpoints named their weights ``trainable.safetensors`` before they took the stock Trainer's name."""
    trained = _model()
    _trainer(trained, tmp_path, steps=2).train()
    checkpoint = tmp_path / "checkpoint-2"
    (checkpoint / TRAINABLE_WEIGHTS).rename(checkpoint / LEGACY_TRAINABLE_WEIGHTS)
    loaded = _model()
    load_trainable(loaded, checkpoint, RUN)
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), trained.parameters(), strict=True))


def test_foreign_or_damaged_checkpoints_are_refused(tmp_path):
    _trainer(_model(), tmp_path, steps=2).train()
    checkpoint = tmp_path / "checkpoint-2"
    with pytest.raises(ValueError, match="belongs to another run"):
        load_trainable(_model(), checkpoint, {**RUN, "lr": 2e-3})
    fft = make_model("llama-gqa2-tied")
    with pytest.raises(ValueError, match="does not fit this model: missing"):
        load_trainable(fft, checkpoint, RUN)
    wider = prepare(make_model("llama-gqa2-tied"), "scale_adapt", hidden_up=64, ffn_up=16, preserve_layers=1)
    with pytest.raises(ValueError, match=r"does not fit this model: missing \[\], unexpected \[\], wrong shape \[\("):
        load_trainable(wider, checkpoint, RUN)
    path = checkpoint / TRAINABLE_WEIGHTS
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="SHA-256"):
        load_trainable(_model(), checkpoint, RUN)


class _PoisonAfter(TrainerCallback):
    """Makes one trainable weight NaN after optimizer step ``step``: the next loss is NaN."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            with torch.no_grad():
                next(p for p in model.parameters() if p.requires_grad).fill_(float("nan"))


def test_nan_loss_stops_training_and_keeps_the_last_good_checkpoint(tmp_path):
    with pytest.raises(NonFiniteLossError, match=r"loss became nan at step 4.*checkpoint-2"):
        _trainer(_model(), tmp_path, callbacks=[_PoisonAfter(3)]).train()
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["checkpoint-2"]
    weights = load_file(tmp_path / "checkpoint-2" / TRAINABLE_WEIGHTS)
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_checkpoint_goes_through_the_staging_folder(tmp_path, monkeypatch):
    """Guards the private transformers API that CheckpointingTrainer._save_checkpoint relies on (see its docstring)."""
    assert callable(getattr(Trainer, "_save_checkpoint", None)), (
        "transformers.Trainer._save_checkpoint no longer exists: CheckpointingTrainer overrides this private method "
        "to write checkpoint-N atomically; port CheckpointingTrainer._save_checkpoint to this transformers release"
    )
    written: list[Path] = []
    save = CheckpointingTrainer._save

    def record(self, output_dir=None, state_dict=None):
        written.append(Path(output_dir))
        return save(self, output_dir, state_dict)

    monkeypatch.setattr(CheckpointingTrainer, "_save", record)
    try:
        _trainer(_model(), tmp_path, steps=2).train()
    except FileNotFoundError as err:  # the checkpoint was not written where it was to be renamed from
        written.append(Path(str(err)))
    assert written == [tmp_path / STAGING_DIR / "checkpoint-2"], (
        "transformers.Trainer._save_checkpoint no longer writes into the args.output_dir it reads when called "
        f"(through the private Trainer._get_output_dir): it wrote {written}, not "
        f"{tmp_path / STAGING_DIR / 'checkpoint-2'}. "
        "CheckpointingTrainer._save_checkpoint points args.output_dir at the staging folder to make checkpoints "
        "complete-or-absent; port it to this transformers release"
    )
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["checkpoint-2"]
    assert not (tmp_path / STAGING_DIR).exists(), "the staged checkpoint was renamed into place, the folder removed"


def test_files_a_killed_save_left_are_cleared_by_the_next_save(tmp_path):
    """A process killed outright (kill -9) mid-save runs no cleanup: its files stay in the staging folder, which no
    resume reads (only complete ``checkpoint-N`` folders count), until the next save removes them."""
    left = tmp_path / STAGING_DIR / "checkpoint-4"
    left.mkdir(parents=True)
    (left / "optimizer.pt").write_bytes(b"cut short")
    assert complete_checkpoints(tmp_path) == []
    _trainer(_model(), tmp_path, steps=2).train()
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["checkpoint-2"]
    assert not (tmp_path / STAGING_DIR).exists()


def test_non_finite_weights_are_never_saved_as_a_good_checkpoint(tmp_path):
    # the weights turn NaN at the end of step 4, before its checkpoint (a finite loss, a non-finite update)
    with pytest.raises(NonFiniteLossError, match=r"weights .* became non-finite at step 4.*checkpoint-2"):
        _trainer(_model(), tmp_path, callbacks=[_PoisonAfter(4)]).train()
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["checkpoint-2"]
