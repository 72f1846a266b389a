"""Writing files so that a reader (or a crash) never sees half of one: the one place that does it.

Everything the project saves (checkpoints, result tables, JSON records, figures) goes through
`atomic_write`: the data is written under a temporary name in the same folder and renamed into
place, which POSIX makes atomic.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _read_umask() -> int:
    """The process's umask (read once: setting it, the only way to read it, is process-wide)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def atomic_write(path: str | os.PathLike, write: Callable[[str], Any]) -> Path:
    """Call ``write(tmp_path)`` on a temporary file beside ``path``, then rename it to ``path``.

    If ``write`` raises, the temporary file is removed and ``path`` is left as it was.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes the file private (0600); give it the usual mode
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """``data`` as indented JSON, atomically."""
    return write_text(path, json.dumps(data, indent=2))


def sha256_of(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
