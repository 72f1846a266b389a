"""Continual-learning metrics of a task sequence from its accuracy matrix.

``R[i][j]`` is the accuracy on task ``j`` after training task ``i``; row 0 is the model before the first new task
(Task 0 already learned), so for T new tasks R is (T + 1) x (T + 1) and column 0 is Task 0 (the biography
benchmark's held-out people, the pre-trained knowledge). The definitions are the standard ones, with Task 0 counted
as the first task learned:

* ACC (Lopez-Paz & Ranzato 2017, GEM): ``mean_j R[T][j]`` over all T + 1 tasks, the final model's average.
* BWT (GEM): ``mean_{j < T} (R[T][j] - R[j][j])``, what later training did to each task after it was learned
  (negative: forgetting).
* FWT (GEM): ``mean_{j >= 1} (R[j-1][j] - R[0][j])``, what earlier tasks did for a task before it was trained,
  against the model before the sequence (``R[0][j]``: the reference GEM calls ``b_j``).
* LA, learning accuracy (Riemer et al. 2019): ``mean_{j >= 1} R[j][j]``, each new task just after it was trained:
  how much each method learns, so that its forgetting is read at matched learning.
* Forgetting (Chaudhry et al. 2018): per task ``f_j = max_{l in [j, T-1]} R[l][j] - R[T][j]`` for ``j < T`` (the best
  it ever was, after it was learned, less where it ends); ``forgetting`` is their mean and ``max_forgetting`` the
  largest.
"""

from __future__ import annotations

from statistics import fmean
from typing import Any


def accuracy_matrix(rows: list[dict[str, Any]], tasks: list[str]) -> list[list[float]]:
    """``R`` from one evaluation per finished task (``rows[i]``: after task i, `evaluate_tasks`-style: each task's
    ``{"overall": accuracy}``), in the order ``tasks``."""
    if len(rows) != len(tasks):
        raise ValueError(f"an accuracy matrix needs one row per task and the start ({len(tasks)}), got {len(rows)}")
    return [[float(row[task]["overall"]) for task in tasks] for row in rows]


def continual_metrics(matrix: list[list[float]]) -> dict[str, Any]:
    """ACC, BWT, FWT, LA and forgetting (module doc) of a square accuracy matrix with at least two rows."""
    size = len(matrix)
    if size < 2 or any(len(row) != size for row in matrix):
        raise ValueError(f"need a square accuracy matrix of at least 2 x 2, got {[len(row) for row in matrix]}")
    last = size - 1
    forgetting = [max(matrix[row][task] for row in range(task, last)) - matrix[last][task] for task in range(last)]
    return {
        "acc": fmean(matrix[last]),
        "bwt": fmean(matrix[last][task] - matrix[task][task] for task in range(last)),
        "fwt": fmean(matrix[task - 1][task] - matrix[0][task] for task in range(1, size)),
        "la": fmean(matrix[task][task] for task in range(1, size)),
        "forgetting_per_task": forgetting,
        "forgetting": fmean(forgetting),
        "max_forgetting": max(forgetting),
    }


__all__ = ["accuracy_matrix", "continual_metrics"]
