"""scripts/behaviour_fingerprint.py's bio comparison: wall-clock fields are not behaviour, anything else is."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "scripts" / "behaviour_fingerprint.py"
spec = importlib.util.spec_from_file_location("behaviour_fingerprint", SCRIPT)
fingerprint = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fingerprint)


def _run(folder: Path, accuracy: float, seconds: float, weights: bytes) -> Path:
    (folder / "seed-0").mkdir(parents=True)
    (folder / "seed-0" / "fft.json").write_text(json.dumps({"curve": [{"acc": accuracy}], "seconds": seconds}))
    (folder / "seed-0" / "fft.jsonl").write_text(json.dumps({"step": 1, "acc": accuracy}) + "\n")
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "results.md").write_text(f"took {seconds} s")
    return folder


def test_compare_bio_ignores_the_clock_and_finds_every_other_difference(tmp_path):
    before = _run(tmp_path / "before", 0.5, 10.0, b"\x00\x01")
    assert fingerprint.compare_bio(before, _run(tmp_path / "same", 0.5, 99.0, b"\x00\x01")) == []
    changed = _run(tmp_path / "changed", 0.5000001, 10.0, b"\x00\x02")
    assert fingerprint.compare_bio(before, changed) == [
        "differs: model.safetensors",
        "differs: seed-0/fft.json",
        "differs: seed-0/fft.jsonl",
    ]
