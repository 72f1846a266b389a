"""Learning and forgetting per character of `scale-cl cpt` runs whose tokenizers differ (issue 15).

Perplexity per token cannot compare a model that reads Korean in SmolLM2's English-centric tokens with one
that reads it in added Korean tokens: the same text is a different number of tokens. Here every trained model
(and the base model) scores the same characters: the first held-out new-domain documents of the run (the
pipeline's own hash split) and the first old-domain evaluation documents, ~20,000 characters each, tokenised by
the model's own tokenizer, every token predicted (EOS before each document, as the pipeline packs them;
windows of 256 tokens overlapping by one). Reported: nats per character, and tokens per character.

Usage: python measurements/vocab_chars.py RUN_DIR [RUN_DIR ...]   (writes RUN_DIR/../vocab_chars.{json,md})
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from scale_cl.data.corpus import is_heldout
from scale_cl.models import load_trained
from scale_cl.models.smollm2 import load_smollm2

CHARS = 20_000
WINDOW = 256


def first_documents(paths: list[str], keep, chars: int = CHARS) -> str:
    texts, total = [], 0
    for path in paths:
        for line in Path(path).read_text().splitlines():
            text = json.loads(line)["text"]
            if keep(text):
                texts.append(text)
                total += len(text)
                if total >= chars:
                    return texts
    return texts


@torch.no_grad()
def nats_and_tokens(model, tokenizer, documents: list[str]) -> tuple[float, int, int]:
    nats, tokens, chars = 0.0, 0, 0
    for text in documents:
        ids = [tokenizer.eos_token_id, *tokenizer(text, add_special_tokens=False).input_ids]
        for start in range(0, len(ids) - 1, WINDOW):
            window = torch.tensor([ids[start : start + WINDOW + 1]])
            logits = model(input_ids=window[:, :-1]).logits.float()
            nats += torch.nn.functional.cross_entropy(logits[0], window[0, 1:], reduction="sum").item()
        tokens += len(ids) - 1
        chars += len(text)
    return nats, tokens, chars


def main(runs: list[Path]) -> None:
    config = json.loads((runs[0] / "cpt_config.json").read_text())
    data = config["data"]
    sets = {
        "new (held-out)": first_documents(data["train"], lambda t: is_heldout(t, data["heldout_fraction"])),
        **{
            name: first_documents([source], lambda t: True)
            for name, source in (item.split("=", 1) for item in data["old_eval"])
        },
    }
    models = [("base model", "base tokenizer", *load_smollm2())]
    for run in runs:
        for method_dir in sorted(p for p in run.iterdir() if (p / "model").is_dir()):
            model, tokenizer, _ = load_trained(method_dir / "model")
            models.append((method_dir.name, run.name, model, tokenizer))
    rows = []
    for name, run, model, tokenizer in models:
        row = {"model": name, "run": run, "vocab": len(tokenizer)}
        for set_name, documents in sets.items():
            nats, tokens, chars = nats_and_tokens(model.eval(), tokenizer, documents)
            row[set_name] = {
                "nats_per_char": nats / chars,
                "tokens_per_char": tokens / chars,
                "ppl_per_token": math.exp(nats / tokens),
                "chars": chars,
            }
        rows.append(row)
        print(json.dumps(row))
    out = runs[0].parent
    (out / "vocab_chars.json").write_text(json.dumps(rows, indent=1))
    names = list(sets)
    lines = [
        "| model | run | vocab | " + " | ".join(f"{n} nats/char | {n} tokens/char" for n in names) + " |",
        "|---|---|---|" + "---|---|" * len(names),
    ]
    for row in rows:
        cells = " | ".join(f"{row[n]['nats_per_char']:.4f} | {row[n]['tokens_per_char']:.3f}" for n in names)
        lines.append(f"| {row['model']} | {row['run']} | {row['vocab']:,} | {cells} |")
    (out / "vocab_chars.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main([Path(p) for p in sys.argv[1:]])
