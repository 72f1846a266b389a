"""Trainer callbacks."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback


class PeriodicEval(TrainerCallback):
    """Calls ``evaluate(model) -> dict`` at step 0 and every ``every`` optimizer steps (and at the end).

    Each record ``{"step": s, **metrics}`` is appended to ``self.records`` and, when ``path`` is
    given, to a JSONL file, so a long run can be watched while it works.
    """

    def __init__(self, evaluate: Callable[[Any], dict], every: int, path: Path | None = None) -> None:
        if every <= 0:
            raise ValueError(f"evaluation interval must be positive, got {every}")
        self.evaluate, self.every, self.path = evaluate, every, path
        self.records: list[dict] = []

    def _record(self, step: int, model: Any) -> None:
        if self.records and self.records[-1]["step"] == step:
            return
        record = {"step": step, **self.evaluate(model)}
        self.records.append(record)
        if self.path is not None:
            with open(self.path, "a") as handle:
                handle.write(json.dumps(record) + "\n")

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._record(state.global_step, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0:
            self._record(state.global_step, model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self._record(state.global_step, model)
