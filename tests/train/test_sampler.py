"""The lean random sampler: the order of accelerate's seedable sampler, index for index, epoch after epoch, and the
one the Trainer's training data loader uses."""

from __future__ import annotations

import pytest
import torch
from accelerate.data_loader import SeedableRandomSampler

from scale_cl.train.sampler import SLICE, LeanSeedableRandomSampler, lean_sampler


def epochs(sampler, count: int) -> list[list[int]]:
    return [list(sampler) for _ in range(count)]


@pytest.mark.parametrize(
    ("size", "num_samples", "seed"),
    [(1, None, 0), (7, None, 42), (SLICE + 3, None, 1), (100, 250, 3), (100, 40, 5)],
)
def test_the_same_order_as_the_seedable_sampler_every_epoch(size, num_samples, seed):
    data = range(size)
    stock = SeedableRandomSampler(data, num_samples=num_samples, data_seed=seed)
    lean = LeanSeedableRandomSampler(data, num_samples=num_samples, data_seed=seed)
    assert epochs(lean, 3) == epochs(stock, 3) and lean.epoch == stock.epoch == 3
    stock.set_epoch(7), lean.set_epoch(7)  # the Trainer sets the epoch of a resumed run
    assert list(lean) == list(stock)
    if num_samples is None:
        assert sorted(lean) == list(range(size)), "a permutation"


def test_sampling_with_replacement_is_the_seedable_samplers():
    stock = SeedableRandomSampler(range(10), replacement=True, num_samples=70, data_seed=2)
    lean = LeanSeedableRandomSampler(range(10), replacement=True, num_samples=70, data_seed=2)
    assert epochs(lean, 2) == epochs(stock, 2)


def test_the_trainers_training_loader_draws_with_the_lean_sampler(tmp_path):
    from transformers import TrainingArguments

    from scale_cl.train.trainer import CheckpointingTrainer

    data = [{"input_ids": torch.tensor([i, i + 1]), "labels": torch.tensor([i, i + 1])} for i in range(20)]
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, report_to=[], seed=5, remove_unused_columns=False
    )
    trainer = CheckpointingTrainer(model=torch.nn.Linear(2, 2), args=args, train_dataset=data)
    loader = trainer.get_train_dataloader()
    found = [s for s in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)) if s is not None]
    assert any(type(s) is LeanSeedableRandomSampler for s in found)
    stock = SeedableRandomSampler(range(20), data_seed=5)
    assert [int(i) for batch in loader for i in batch["input_ids"][:, 0]] == list(stock), "the stock order"
    assert lean_sampler(object()) is not None, "a loader without a seedable sampler is left as it is"
