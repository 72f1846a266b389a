"""Replay: old-domain data mixed into training at a fixed share of the training sequences.

Continual pre-training studies mix a little of the original training text back in (about 1-5% for a
mild domain shift, about 25% for a new language) to forget less; the biography benchmark replays Task 0's
questions during Task 1 the same way. Here the training sequences (packed text blocks, or whole examples)
run in one fixed order in which sequence ``i`` is a replay sequence exactly when
``floor((i + 1) r) > floor(i r)`` for the ratio ``r``: the first ``n`` sequences always hold
``floor(n r)`` replay sequences, spread evenly. When ``r B`` is whole for the optimizer batch of ``B``
consecutive sequences, every batch holds exactly ``r B`` replay sequences (`whole_per_batch`); otherwise
(1% of a batch of 8) batches hold ``floor(r B)`` or ``ceil(r B)`` of them and the share is exact over the
run. Either way it holds on any number of processes and across resumes (the Trainer reads the order
sequentially and skips the batches a checkpoint already trained on).

Which new-domain and replay sequence fills each slot is drawn from ``(seed, epoch)``: a fresh
permutation of the new-domain sequences every epoch (as the Trainer's own sampler would shuffle),
and the replay sequences in a permutation drawn afresh each time they are used up. With ``mark=True`` each
example says where it came from (``REPLAY_KEY``: 1 for replay, 0 for new-domain), for a loss that treats
them differently (`scale_cl.train.distill`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from fractions import Fraction
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset

# The batch key of the per-example replay flag (``mark=True``); the Trainer takes it out of the batch before the
# model sees it (`scale_cl.train.trainer`).
REPLAY_KEY = "from_replay"


def as_fraction(ratio: float) -> Fraction:
    """``ratio`` as the decimal fraction it was written as (0.05 -> 1/20), so schedules are exact."""
    return Fraction(str(ratio))


def replay_before(index: int, ratio: float) -> int:
    """How many of the first ``index`` sequences are replay sequences: ``floor(index r)``."""
    return int(index * as_fraction(ratio))


def is_replay(index: int, ratio: float) -> bool:
    """Whether sequence ``index`` of the training order is a replay sequence."""
    return replay_before(index + 1, ratio) > replay_before(index, ratio)


def whole_per_batch(ratio: float, batch_size: int) -> bool:
    """Whether ``ratio`` of every batch of ``batch_size`` sequences is a whole number of them (then exact per batch)."""
    return (as_fraction(ratio) * batch_size).denominator == 1


def describe_share(ratio: float, batch_size: int) -> str:
    """``ratio`` as the log says it: exact per batch, or over the run when a batch cannot hold it whole."""
    if whole_per_batch(ratio, batch_size):
        return f"{ratio:.0%} of every batch"
    average = float(as_fraction(ratio) * batch_size)
    return f"{ratio:g} of the sequences over the run (a batch of {batch_size} holds {average:.2g} on average)"


def _check_replay(replay: Sequence[Any], ratio: float) -> None:
    if not 0 < ratio < 1:
        raise ValueError(f"replay ratio must be in (0, 1), got {ratio}")
    if not len(replay):
        raise ValueError("replay needs at least one replay sequence")


class ReplayOrder:
    """Which replay sequence is used ``used``-th in an epoch: the rows in a permutation drawn from ``(seed, epoch,
    pass)``, a fresh one each time they are used up."""

    def __init__(self, rows: int, seed: int) -> None:
        self.rows, self.seed = rows, seed
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._passes = epoch, {}

    def __call__(self, used: int) -> int:
        turn, position = divmod(used, self.rows)
        if turn not in self._passes:
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) * 7_919 + turn + 1)
            self._passes[turn] = torch.randperm(self.rows, generator=generator)
        return int(self._passes[turn][position])


def as_example(item: Any, replay: bool | None = None) -> Any:
    """A training example: a dataset's own item (a dict) as it is, a packed block as a language-modelling one;
    with ``replay`` given, marked with where it came from (``REPLAY_KEY``)."""
    example = dict(item) if isinstance(item, dict) else {"input_ids": item, "labels": item}
    if replay is not None:
        example[REPLAY_KEY] = int(replay)
    return example


class ReplayMix(Dataset):
    """New-domain and replay sequences in the fixed order above; one epoch covers the new-domain sequences once.

    ``new`` and ``replay``: packed blocks (rows of a tensor) or any dataset of training examples (dicts, e.g. QA
    with the loss on the answer only), returned as they are.

    An epoch is ``length`` sequences: the most whole batches whose new-domain slots do not outnumber the
    new-domain sequences (a few of them may sit out an epoch; the next epoch's permutation differs). The
    Trainer must read it in order (``in_order``: `scale_cl.train.recipe.train_model` sets
    ``train_sampling_strategy="sequential"``) and call `set_epoch`. ``mark``: each example carries
    ``REPLAY_KEY`` (see the module doc).
    """

    in_order = True

    def __init__(
        self, new: Sequence[Any], replay: Sequence[Any], ratio: float, seed: int, batch_size: int, mark: bool = False
    ) -> None:
        _check_replay(replay, ratio)
        self.new, self.replay, self.ratio, self.seed, self.mark = new, replay, ratio, seed, mark
        self.replay_order = ReplayOrder(len(replay), seed)
        # the first n sequences hold n - floor(n r) = ceil(n (1 - r)) new-domain ones: at most len(new) for
        # n <= len(new) / (1 - r); whole batches of that
        most = int(len(new) / (1 - as_fraction(ratio)))
        self.length = most // batch_size * batch_size
        if not self.length:
            raise ValueError(
                f"{len(new)} new-domain sequences do not fill one batch of {batch_size} with replay ratio {ratio}; "
                "add text or lower train.batch_size"
            )
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        """Draw the order of epoch ``epoch`` (the same for every process and resume)."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        self.new_order = torch.randperm(len(self.new), generator=generator)
        self.replay_order.set_epoch(epoch)

    def source(self, index: int) -> tuple[str, int]:
        """``("replay" | "new", row)``: where sequence ``index`` of the current epoch comes from."""
        if not 0 <= index < self.length:
            raise IndexError(index)
        before = replay_before(index, self.ratio)
        if is_replay(index, self.ratio):
            return "replay", self.replay_order(before)
        return "new", int(self.new_order[index - before])

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        kind, row = self.source(index)
        item = (self.replay if kind == "replay" else self.new)[row]
        return as_example(item, kind == "replay" if self.mark else None)


class ReplayStream(IterableDataset):
    """`ReplayMix` for a streamed training split (`scale_cl.data.stream`): the new-domain blocks in the stream's
    order, replay blocks (rows of a tensor or a dataset of blocks) in the slots the schedule gives them; an epoch ends
    with the stream."""

    in_order = True

    def __init__(
        self, new: Iterable[dict[str, torch.Tensor]], replay: Sequence[Any], ratio: float, seed: int, mark: bool = False
    ) -> None:
        _check_replay(replay, ratio)
        self.new, self.replay, self.ratio, self.mark = new, replay, ratio, mark
        self.replay_order = ReplayOrder(len(replay), seed)
        self._resume: dict[str, Any] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.replay_order.set_epoch(epoch)
        if hasattr(self.new, "set_epoch"):  # the stream's shuffle buffer draws its epoch's order
            self.new.set_epoch(epoch)

    def position(self, consumed: int) -> dict[str, Any] | None:
        """Where sequence ``consumed`` starts: the stream's position at its new-domain blocks so far
        (`scale_cl.data.stream`), or None when the stream keeps none."""
        if not hasattr(self.new, "position"):
            return None
        inner = self.new.position(consumed - replay_before(consumed, self.ratio))
        return None if inner is None else {"emitted": consumed, "new": inner}

    def resume(self, position: dict[str, Any]) -> None:
        """Start the next pass at ``position`` (what `position` returned)."""
        self._resume = position

    def __iter__(self) -> Iterator[dict[str, Any]]:
        resume, self._resume = self._resume, None
        if resume is not None:
            self.new.resume(resume["new"])
        new = iter(self.new)
        index = 0 if resume is None else resume["emitted"]
        while True:
            if is_replay(index, self.ratio):
                ids = self.replay[self.replay_order(replay_before(index, self.ratio))]
                yield as_example(ids, True if self.mark else None)
            else:
                item = next(new, None)
                if item is None:
                    return
                yield as_example(item, False if self.mark else None)
            index += 1
