"""The training data order of the Trainer's random sampler, without holding it as a Python list.

accelerate replaces the Trainer's ``RandomSampler`` with its ``SeedableRandomSampler`` (every process draws the same
order: the permutation seeded with ``data_seed + epoch``), whose ``__iter__`` is torch's: ``torch.randperm(n)
.tolist()``, a Python list of every index of the epoch, about 36 bytes a block (29M blocks a rank at the paper's
60B tokens of 2,048: ~1 GB). `LeanSeedableRandomSampler` draws the same permutations from the same generator in the
same calls and yields them from the tensor (8 bytes a block) a slice at a time: the same order, index for index, so
no result moves; `lean_sampler` puts it in place of the prepared data loader's sampler.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from accelerate.data_loader import SeedableRandomSampler
from torch.utils.data import RandomSampler

SLICE = 1 << 16  # indices turned into Python ints at a time


def _yield_in_slices(indices: torch.Tensor) -> Iterator[int]:
    for start in range(0, len(indices), SLICE):
        yield from indices[start : start + SLICE].tolist()


class LeanSeedableRandomSampler(SeedableRandomSampler):
    """`SeedableRandomSampler` (its seed, epoch and draws) with each permutation kept as a tensor (module doc)."""

    def __iter__(self) -> Iterator[int]:
        if self.generator is None:
            self.generator = torch.Generator(device=torch.get_default_device())
            self.generator.manual_seed(self.initial_seed)
        self.generator.manual_seed(self.epoch + self.initial_seed)
        if self.replacement:  # torch draws these 32 at a time already
            yield from RandomSampler.__iter__(self)
        else:
            n = len(self.data_source)
            for _ in range(self.num_samples // n):
                yield from _yield_in_slices(torch.randperm(n, generator=self.generator))
            # torch's last draw, also when it keeps none of it: the generator ends where torch's would
            yield from _yield_in_slices(torch.randperm(n, generator=self.generator)[: self.num_samples % n])
        self.set_epoch(self.epoch + 1)


def lean_sampler(loader: Any) -> Any:
    """Give ``loader`` (the Trainer's prepared training data loader) `LeanSeedableRandomSampler` in place of its
    ``SeedableRandomSampler``, state kept (the class is swapped on the same object: the data loader, a resumed run's
    batch skipping and accelerate's checkpointing hold that object). Any other sampler is left as it is."""
    holder, seen = loader, 0
    while holder is not None and seen < 4:  # DataLoaderShard -> (BatchSamplerShard ->) BatchSampler -> sampler
        sampler = getattr(holder, "sampler", None)
        if type(sampler) is SeedableRandomSampler:
            sampler.__class__ = LeanSeedableRandomSampler
            return loader
        holder, seen = getattr(holder, "batch_sampler", None), seen + 1
    return loader
