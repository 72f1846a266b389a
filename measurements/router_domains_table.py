"""Issue 40, part 4, read off `measurements/cpt_router_domains.sh`'s sweeps of one domain: every reading of the trained
models (each model alone; FFT's two-model control; SCALE-Route trained with Eq. 5 and SCALE-Preserve read with the
likelihood router, and with each router of --eval.routers (issue 50); SCALE-Route trained with the router), as shares
of FFT's gain and `en` loss, with the router's
separation (per-token AUROC of `en` against the held-out new domain by the base's weight) and the mixed documents
read per segment.

Per seed, as `frontier_table.py`: gain = ln(base new-domain ppl) - ln(the reading's), loss = ln(its `en` ppl) -
ln(base's), each divided by FFT's alone in the same seed; mean ± population std over the seeds. The mixed documents'
table gives each segment's perplexity (mean over seeds) and, for a reading with a router, the base's mean weight
there: "new+old" is a new-domain document with an `en` passage inside, "old+new" the reverse.

Usage:
    python measurements/router_domains_table.py outputs/sweep-router-DOMAIN [outputs/sweep-router-DOMAIN-route-router]
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

from target_table import reference, share, spread

SEGMENTS = ("before", "passage", "after")
WAYS = ("new+old", "old+new")


def readings(folder: Path, seeds: list[str]) -> dict[str, list[dict]]:
    """Label -> the seeds' records of every reading in a sweep folder (each method's point at its preset rate)."""
    found: dict[str, list[dict]] = {}
    for path in sorted((folder / "points").glob("*/point.json")):
        point = json.loads(path.read_text())
        if point["label"] or point["scale"] != 1.0 or not all(s in point["seeds"] for s in seeds):
            continue
        method = point["method"]
        results = [json.loads((path.parent / f"seed-{s}" / method / "result.json").read_text()) for s in seeds]
        trained_with = json.loads((folder / "sweep_config.json").read_text())
        router = trained_with.get("options", {}).get("scale", {}).get("router", "cosine")
        alone = f"{method}" + (f", trained with the {router} router" if router != "cosine" else "")
        found[alone] = [r["curve"][-1] for r in results]
        for index, control in enumerate(results[0].get("likelihood_control", [])):  # one per --eval.routers
            router = router_name(control)
            suffix = "" if router == "likelihood" else f", {router} router"
            label = f"{method} + its base (control, two models{suffix})"
            found[label] = [r["likelihood_control"][index] for r in results]
        for index, record in enumerate(results[0].get("up_logit_frontier", [])):
            if record.get("router") and record["alpha"] == 1.0:
                found[f"{method} read with the {router_name(record)} router"] = [
                    r["up_logit_frontier"][index] for r in results
                ]
    return found


def router_name(record: dict) -> str:
    """A reading's router, the calibrated one with the objective its gate was fitted by."""
    router = record.get("router", "likelihood")
    fit = record.get("gate_fit")
    return f"{router} ({fit['objective']} fit)" if fit else router


def gate_fits(folder: Path, seeds: list[str]) -> list[str]:
    """Each calibrated reading's fitted gate and its cost (the fit's seconds against the run's training seconds)."""
    rows = []
    for path in sorted((folder / "points").glob("*/point.json")):
        point = json.loads(path.read_text())
        if point["label"] or point["scale"] != 1.0 or not all(s in point["seeds"] for s in seeds):
            continue
        method = point["method"]
        results = [json.loads((path.parent / f"seed-{s}" / method / "result.json").read_text()) for s in seeds]
        records = [*results[0].get("likelihood_control", []), *results[0].get("up_logit_frontier", [])]
        for index, record in enumerate(records):
            if "gate_fit" not in record:
                continue
            per_seed = [[*r.get("likelihood_control", []), *r.get("up_logit_frontier", [])][index] for r in results]
            gates = [
                "/".join(f"{g[name]:.2g}" for name in ("router_prior", "router_prefix_weight",
                         "router_entropy_weight", "router_top_weight")) + f" d{g['router_decay']:g}"
                for g in per_seed
            ]  # fmt: skip
            cost = [g["gate_fit"]["seconds"] / r["seconds"] for g, r in zip(per_seed, results, strict=True)]
            kind = "control" if record.get("control") else "one pass"
            rows.append(
                f"| {method} ({kind}) | {record['gate_fit']['objective']} | {'; '.join(gates)} | "
                f"{mean([g['gate_fit']['seconds'] for g in per_seed]):.1f} s | {100 * mean(cost):.0f}% |"
            )
    return rows


def mean(values: list[float]) -> float:
    return statistics.fmean(values)


def main(folders: list[Path]) -> None:
    base = json.loads((folders[0] / "base_metrics.json").read_text())
    new0, en0 = math.log(base["learning_ppl"]), math.log(base["forgetting_ppl"]["en"])
    fft, seeds = reference(folders[0])
    ffts = [fft["seeds"][s] for s in seeds]
    found = {label: records for folder in folders for label, records in readings(folder, seeds).items()}

    def gain(records: list[dict]) -> str:
        pairs = zip(records, ffts, strict=True)
        return spread([share(new0 - math.log(r["learning_ppl"]), new0 - math.log(f["learning"])) for r, f in pairs],
                      100, 1)  # fmt: skip

    def loss(records: list[dict]) -> str:
        pairs = zip(records, ffts, strict=True)
        return spread([share(math.log(r["forgetting_ppl"]["en"]) - en0, math.log(f["old/en"]) - en0) for r, f in pairs],
                      100, 1)  # fmt: skip

    head = ["reading", "new-domain ppl", "`en` ppl", "% of FFT's gain", "% of FFT's `en` loss", "AUROC (`en` vs new)",
            "base weight: new / `en`"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for label, records in found.items():
        separation = [r.get("separation") for r in records]
        auroc = spread([s["auroc"]["en"] for s in separation], digits=3) if all(separation) else "—"
        weights = (
            f"{mean([s['base_weight']['heldout'] for s in separation]):.2f} / "
            f"{mean([s['base_weight']['en'] for s in separation]):.2f}"
            if all(separation)
            else "—"
        )
        cells = [
            label,
            spread([r["learning_ppl"] for r in records]),
            spread([r["forgetting_ppl"]["en"] for r in records], digits=1),
        ]
        print("| " + " | ".join([*cells, gain(records), loss(records), auroc, weights]) + " |")
    print(
        f"\nbase model: new-domain ppl {base['learning_ppl']:,.1f}, `en` {math.exp(en0):.2f}; "
        f"FFT at lr {fft['lr']:g}; {len(seeds)} seeds ({', '.join(seeds)})\n"
    )
    fits = [row for folder in folders for row in gate_fits(folder, seeds)]
    if fits:
        print(
            "The calibrated router's fitted gates (prior / prefix / entropy / top weights, decay; per seed) and cost:\n"
        )
        print("| model | objective | gate per seed | fit | of training time |")
        print("|---|---|---|---|---|")
        print("\n".join(fits) + "\n")
    if "mixed_documents" not in base and not any("mixed_documents" in r[0] for r in found.values()):
        return
    head = ["reading", *(f"{way}: {segment}" for way in WAYS for segment in SEGMENTS)]
    print("Mixed documents, perplexity per segment (base weight where a router reads it):\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    rows = {"base model": [base]} if "mixed_documents" in base else {}
    for label, records in {**rows, **found}.items():
        cells = [label]
        for way in WAYS:
            for segment in SEGMENTS:
                mixed = [r["mixed_documents"][way] for r in records]
                cell = f"{mean([m['perplexity'][segment] for m in mixed]):.1f}"
                if all("base_weight" in m for m in mixed):
                    cell += f" (w {mean([m['base_weight'][segment] for m in mixed]):.2f})"
                cells.append(cell)
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main([Path(arg) for arg in sys.argv[1:]])
