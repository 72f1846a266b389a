"""Loaders for the test tasks: read the JSONL files beside this file (no download, any working directory).

`datasets.load_dataset("json", data_files=...)` would resolve a relative ``data_files`` against the
current working directory, not against the task YAML, so the tasks load their data here instead.
"""

import json
from pathlib import Path

import datasets

HERE = Path(__file__).parent


def _jsonl(name: str, **_metadata) -> datasets.DatasetDict:
    rows = [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def tiny_mc(**metadata) -> datasets.DatasetDict:
    return _jsonl("tiny_mc.jsonl", **metadata)


def tiny_text(**metadata) -> datasets.DatasetDict:
    return _jsonl("tiny_text.jsonl", **metadata)
