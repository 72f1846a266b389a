"""What a corpus run measures as it trains: learning and forgetting perplexity, the drift of the final hidden states
from the base's (`reference_hidden`), a router's share and separation, mixed documents (`evaluate_method`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from scale_cl.data.corpus import Corpus, eos_id
from scale_cl.eval.perplexity import final_hidden_original, mean_cosine_similarity, new_domain_tokens, perplexity
from scale_cl.eval.route_separation import base_weights, router_separation
from scale_cl.eval.segments import MixedSet, mixed_documents, segment_readings
from scale_cl.experiments.train.corpus import grown_base
from scale_cl.experiments.train.prepare import base_placement, process_state
from scale_cl.experiments.train.sections import RunSettings
from scale_cl.files import atomic_write

REFERENCE_FILE = "reference_hidden.safetensors"


def reference_hidden(cfg: RunSettings, base: PreTrainedModel, corpus: Corpus, out: Path) -> torch.Tensor:
    """Step-0 final hidden states on the first old-domain batch (or held-out if none), computed once per run."""
    grown_base(base, None, corpus)  # the probe may hold new tokens; the sweep evaluates this base at step 0 too
    path = out / REFERENCE_FILE
    if path.is_file():
        return load_file(path)["hidden"]
    probe = probe_batch(cfg, corpus)
    placement = base_placement(cfg)  # computed as the later evaluations are: on the run's device, in its precision
    hidden = final_hidden_original(base.to(placement.device), probe, base.config.hidden_size, placement.bf16)
    if process_state().is_main_process:
        atomic_write(path, lambda tmp: save_file({"hidden": hidden.contiguous()}, tmp))
    return hidden


def probe_batch(cfg: RunSettings, corpus: Corpus) -> torch.Tensor:
    sets = [*corpus.old_eval.values(), *([corpus.heldout] if corpus.heldout is not None else [])]
    return sets[0].blocks[: cfg.eval.representation_sequences]


def evaluate_method(cfg: RunSettings, corpus: Corpus, reference: torch.Tensor, original_width: int, bf16: bool) -> Any:
    """The callback's measurement: learning/forgetting perplexity, representation similarity, routing share."""
    from scale_cl.methods import trainable_parameter_count

    probe = probe_batch(cfg, corpus)
    new_tokens = None
    if cfg.eval.nll_split and corpus.heldout is not None and corpus.old_eval:
        old = torch.cat([data.blocks.flatten() for data in corpus.old_eval.values()])
        vocab = int(max(corpus.heldout.blocks.max(), old.max())) + 1
        new_tokens = new_domain_tokens(corpus.heldout.blocks, old, vocab)

    mixed = mixed_sets(cfg, corpus)

    def evaluate(model: torch.nn.Module) -> dict[str, Any]:
        record: dict[str, Any] = {"trainable": trainable_parameter_count(model)}
        share: dict[str, float] = {}
        weights: dict[str, torch.Tensor] = {}  # a router's base weight per token of each set
        if corpus.heldout is not None:
            with base_weights(model, weights, "heldout"):
                result = perplexity(model, corpus.heldout.blocks, cfg.eval.batch_size, bf16)
            record["learning_ppl"] = result.perplexity
            if result.route_preserve_share is not None:
                share["heldout"] = result.route_preserve_share
        record["forgetting_ppl"] = {}
        for name, data in corpus.old_eval.items():
            with base_weights(model, weights, name):
                result = perplexity(model, data.blocks, cfg.eval.batch_size, bf16, new_tokens)
            record["forgetting_ppl"][name] = result.perplexity
            if result.new_mass_nll is not None:
                record.setdefault("forgetting_new_mass_nll", {})[name] = result.new_mass_nll
            if result.route_preserve_share is not None:
                share[name] = result.route_preserve_share
        if weights:
            record["separation"] = router_separation(weights)
        if mixed:
            record["mixed_documents"] = {
                way: segment_readings(model, data, cfg.eval.batch_size) for way, data in mixed.items()
            }
        hidden = final_hidden_original(model, probe, original_width, bf16)
        record["representation_similarity"] = mean_cosine_similarity(reference, hidden)
        if share:
            record["route_preserve_share"] = share
        route = getattr(model, "scale_route", None)
        if route is not None and route.active:
            record["route_tau"] = route.tau  # fixed, or as last calibrated (options.route_share)
        return record

    return evaluate


def mixed_sets(cfg: RunSettings, corpus: Corpus) -> dict[str, MixedSet]:
    """``eval.mixed_documents``'s sequences: ``new+old`` (a held-out new-domain host, a passage of the first
    old-domain set) and ``old+new`` (the reverse); none when off or a side is missing."""
    count = cfg.eval.mixed_documents
    if not count or corpus.heldout is None or not corpus.old_eval:
        return {}
    old = next(iter(corpus.old_eval.values())).blocks
    eos = (eos_id(corpus.tokenizer),) if getattr(corpus, "tokenizer", None) is not None else ()
    return {
        "new+old": mixed_documents(corpus.heldout.blocks, old, eos, count),
        "old+new": mixed_documents(old, corpus.heldout.blocks, eos, count),
    }
