"""Peak memory, measured in a fresh process per method so no other model or allocator history counts.

CPU: the process's peak resident set (Linux ``VmHWM``) minus its resident set after the imports.
The peak is reset (``/proc/self/clear_refs``) once the model is built, so a training peak excludes
one-off build costs (e.g. the SVD of upscale); where that reset is unavailable the peak is
``ru_maxrss`` and includes the build, which the result says. CUDA: ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import re
import resource
import subprocess
import sys
from typing import Any

import torch

MIB = 1024 * 1024
RESULT_PREFIX = "SCALE_BENCH_RESULT "


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def release_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc), so RSS reflects live memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakMemory:
    """Peak memory of this process in bytes above a baseline, on CPU (RSS) or CUDA (allocated)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.includes_setup = False
        release_memory()
        self.baseline = self.current()

    def current(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        rss = _status_kib("VmRSS")
        return (rss or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def reset(self) -> None:
        """Start a new peak from now (what is resident now still counts)."""
        release_memory()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.includes_setup = True

    def peak(self) -> int:
        """The peak since `reset` (or since start), minus the baseline."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        hwm = _status_kib("VmHWM")
        if hwm is None:
            self.includes_setup = True
            hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return hwm * 1024 - self.baseline

    def above_baseline(self) -> int:
        return self.current() - self.baseline


def run_child(task: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
    """Run ``task`` in a fresh ``python -m scale_cl.bench.child`` and return its JSON result.

    A failure is returned as ``{"error": ...}`` (with the end of its stderr), not raised, so one
    method that runs out of memory does not lose the others' results.
    """
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "scale_cl.bench.child", json.dumps(task)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line.removeprefix(RESULT_PREFIX))
    tail = "\n".join(done.stderr.strip().splitlines()[-5:])
    return {"error": f"child exited with {done.returncode}: {tail}"}
