"""Theorem 3.1 on the one real pre-trained model available offline: SmolLM2-135M (GGUF)."""

from __future__ import annotations

import copy

import pytest
import torch

from exactness import assert_exact_to_rounding
from scale_cl import ScaleConfig, upscale
from scale_cl.models.smollm2 import INSTALL_HINT, load_smollm2, smollm2_gguf

pytestmark = [
    pytest.mark.slow,
    pytest.mark.smollm2,
    pytest.mark.exactness,
    pytest.mark.skipif(smollm2_gguf() is None, reason=f"SmolLM2-135M not installed ({INSTALL_HINT})"),
]

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = load_smollm2()
    tokenizer.padding_side = "left"
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits
        exact = copy.deepcopy(model).double()(**batch).logits  # what every comparison measures rounding from
        tokens = model.generate(**batch, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return model, batch, (logits, exact), tokens, tokenizer


def test_smollm2_is_the_expected_shape(smollm2):
    model = smollm2[0]
    config = model.config
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (576, 9, 3)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied embeddings


@pytest.mark.parametrize("method", ["preserve", "adapt", "route"])
def test_upscaled_smollm2_keeps_logits_and_greedy_generation(smollm2, method):
    base, batch, (base_logits, exact), base_tokens, tokenizer = smollm2
    cfg = ScaleConfig(hidden_up=192, ffn_up=64, method=method, preserve_layers=28, w21_init="random", w22_init="random")
    model = upscale(copy.deepcopy(base), cfg)
    assert model.config.hidden_size == 576 + 192 and model.config.num_key_value_heads == 4
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied, still frozen
    assert not model.lm_head.weight.requires_grad
    with torch.no_grad():
        logits = model(**batch).logits
        tokens = model.generate(**batch, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    mask = batch["attention_mask"].bool()
    # Logits of this model reach |z| ~ 30; fp32 kernels on sliced inputs may differ in the last bits: as close to the
    # base model's float64 logits as its own fp32 logits are.
    assert_exact_to_rounding(logits[mask], exact[mask], stock=base_logits[mask], what=f"SmolLM2 {method}")
    assert torch.equal(tokens, base_tokens)
