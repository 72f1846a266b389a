"""Show that a refactoring changed no behaviour: fingerprints taken before and after it, compared bitwise.

    git worktree add /tmp/before <commit>          # the checkout before the change
    python scripts/behaviour_fingerprint.py tuner /tmp/before before.json
    python scripts/behaviour_fingerprint.py tuner . after.json && cmp before.json after.json
    (cd /tmp && PYTHONPATH=/tmp/before/src python -m scale_cl.cli bio --preset micro --out /tmp/bio-before)
    python -m scale_cl.cli bio --preset micro --out /tmp/bio-after
    python scripts/behaviour_fingerprint.py compare-bio /tmp/bio-before /tmp/bio-after

``tuner``: for each SCALE method on four architectures (and SCALE-Route with the likelihood router, and without
``route_exact``), the logits of an upscaled model with random new weights (Eq. 5 where it routes), four AdamW
steps' losses and the trained weights, as sha256 prefixes and reprs, in one thread with deterministic algorithms.
The checkout's ``src`` and ``tests`` (its tiny models) are imported. ``compare-bio``: every file two ``bio`` runs
wrote, equal (JSON without wall-clock fields; the cached stage models bitwise). Used for issue 39's move of the
tuner into one folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

ARCHS = ("llama-gqa2-tied", "llama-mha-untied", "qwen2-qkv-bias", "neox-parallel-rot0.25")
CLOCK_FIELDS = {"seconds", "date"}


def tuner_fingerprint(checkout: Path) -> dict[str, dict]:
    sys.path[:0] = [str(checkout / "src"), str(checkout), str(checkout / "tests")]
    import torch

    if (checkout / "tests" / "__init__.py").is_file():  # the tests as a package (tests/__init__.py)
        from tests.conftest import make_model, randomize_new_weights, token_batch, upscaled_copy
        from tests.train.test_training import loss_of
    else:  # a checkout from before: every test file in tests/ itself
        from conftest import make_model, randomize_new_weights, token_batch, upscaled_copy
        from test_training import loss_of

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    def digest(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()[:16]

    cases = [(arch, method, {}) for arch in ARCHS for method in ("preserve", "adapt", "route")]
    cases += [(ARCHS[0], "route", {"router": "likelihood"}), (ARCHS[0], "route", {"route_exact": False})]
    found = {}
    for arch, method, extra in cases:
        model = upscaled_copy(make_model(arch), method, preserve_layers=1, **extra)
        randomize_new_weights(model, seed=1, w12_scale=0.05)
        ids, mask = token_batch()
        with torch.no_grad():
            logits = model.eval()(input_ids=ids, attention_mask=mask).logits
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        losses = []
        for _ in range(4):
            optimizer.zero_grad()
            loss = loss_of(model, ids, mask)
            loss.backward()
            optimizer.step()
            losses.append(repr(loss.item()))
        weights = b"".join(p.detach().numpy().tobytes() for p in _used_parameters(model))
        found[f"{arch}/{method}/{extra}"] = {
            "logits": digest(logits.float().numpy().tobytes()),
            "losses": losses,
            "weights": digest(weights),
        }
    return found


def _used_parameters(model):
    """The model's parameters but the W12 blocks of linears that do not use W12 (``use_w12`` false): those never
    enter a product nor train, and a checkout from before SCALE-Preserve dropped them held them (random here)."""
    from scale_cl.tuner.layers import ScaleLinear

    unused = {id(m.w12) for m in model.modules() if isinstance(m, ScaleLinear) and not m.use_w12}
    return [p for p in model.parameters() if id(p) not in unused]


def _without_clock(value):
    if isinstance(value, dict):
        return {k: _without_clock(v) for k, v in value.items() if k not in CLOCK_FIELDS}
    if isinstance(value, list):
        return [_without_clock(v) for v in value]
    return value


def _records(path: Path) -> list:
    if path.suffix == ".json":
        return [json.loads(path.read_text())]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compare_bio(before: Path, after: Path) -> list[str]:
    """The files of ``before`` that ``after`` lacks or holds differently (figures and markdown left out)."""
    differ = []
    for old in sorted(p for p in before.rglob("*") if p.is_file() and p.suffix not in (".md", ".png")):
        new = after / old.relative_to(before)
        if not new.is_file():
            differ.append(f"missing: {new}")
        elif old.suffix in (".json", ".jsonl"):
            if _without_clock(_records(old)) != _without_clock(_records(new)):
                differ.append(f"differs: {old.relative_to(before)}")
        elif old.read_bytes() != new.read_bytes():
            differ.append(f"differs: {old.relative_to(before)}")
    return differ


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    tuner = commands.add_parser("tuner", help="fingerprint a checkout's tuner into a JSON file")
    tuner.add_argument("checkout", type=Path)
    tuner.add_argument("out", type=Path)
    bio = commands.add_parser("compare-bio", help="compare two bio output folders")
    bio.add_argument("before", type=Path)
    bio.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "tuner":
        found = tuner_fingerprint(args.checkout.resolve())
        args.out.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
        print(f"{len(found)} cases written to {args.out}")
        return 0
    files = sum(1 for p in args.before.rglob("*") if p.is_file())
    if not files:  # nothing compared is no evidence of equality
        print(f"{args.before} holds no file: did the bio run fail?")
        return 1
    differ = compare_bio(args.before, args.after)
    print("\n".join(differ) or f"every file equal ({files} files)")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
