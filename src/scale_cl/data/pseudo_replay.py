"""Pseudo-replay: old-domain text the base model writes itself, for a user who cannot replay its training data.

The base model samples ``count`` sequences of ``length`` tokens from a document start (its EOS token, which
separates packed documents), at ``temperature``, with nothing cut off (top-k and top-p off) and an EOS inside a
sequence starting the next document, as packed text does. The draw is fixed by ``seed``, made once per run and
cached in a safetensors file whose name hashes everything it depends on; the training loop mixes the blocks in
as replay (`scale_cl.data.replay`), so pseudo-replay and replay share one schedule.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from scale_cl.files import atomic_write


def generate_blocks(
    model: nn.Module,
    start_id: int,
    count: int,
    length: int,
    seed: int,
    temperature: float = 1.0,
    batch_size: int = 64,
    bf16: bool = False,
) -> torch.Tensor:
    """``count`` sampled sequences of ``length`` tokens (the first is ``start_id``), as a (count, length) tensor on
    the CPU, sampled on the model's device; ``bf16``: under bf16 autocast (the run's precision)."""
    if count < 1 or length < 2:
        raise ValueError(f"pseudo-replay needs count >= 1 and length >= 2, got {count} and {length}")
    device = next(model.parameters()).device
    blocks = []
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            for first in tqdm(range(0, count, batch_size), desc="pseudo-replay", unit="batch"):
                rows = min(batch_size, count - first)
                prompt = torch.full((rows, 1), start_id, dtype=torch.long, device=device)
                autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
                with torch.no_grad(), autocast:
                    out = model.generate(
                        prompt,
                        attention_mask=torch.ones_like(prompt),
                        do_sample=True,
                        temperature=temperature,
                        top_k=0,
                        top_p=1.0,
                        max_new_tokens=length - 1,
                        eos_token_id=None,  # an EOS starts the next document; the sequence goes on
                        pad_token_id=start_id,
                    )
                if out.shape[1] < length:
                    raise RuntimeError(f"generation stopped after {out.shape[1]} of {length} tokens")
                blocks.append(out[:, :length].cpu())
    finally:
        model.train(was_training)
    return torch.cat(blocks)


def pseudo_replay_key(**settings: Any) -> str:
    """A short hash of the settings a draw depends on (base model, seed, sizes, temperature)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cached_blocks(folder: Path, settings: dict[str, Any], generate: Any) -> torch.Tensor:
    """The blocks cached under ``folder`` for ``settings``, or ``generate()`` written there first (atomically)."""
    path = Path(folder) / f"pseudo_replay-{pseudo_replay_key(**settings)}.safetensors"
    if path.is_file():
        return load_file(path)["blocks"]
    blocks = generate()
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"settings": json.dumps(settings, sort_keys=True, default=str)}
    atomic_write(path, lambda tmp: save_file({"blocks": blocks.contiguous()}, tmp, metadata=metadata))
    return blocks
