"""The one real pre-trained model available offline, SmolLM2-135M (GGUF): Theorem 3.1 and a clean-Python export.

Both checks share one load of the model (the GGUF's de-quantisation is most of this file's time). Each runs SCALE-Route,
whose two paths are SCALE-Preserve's stream and SCALE-Adapt's beside it; every method, on every tiny architecture (its
3:1 grouped heads among them), is checked in tests/tuner/test_preservation.py and tests/export/test_export.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from scale_cl import ScaleConfig, upscale
from scale_cl.export.export import export_model
from scale_cl.models.smollm2 import INSTALL_HINT, load_smollm2, smollm2_gguf
from tests.conftest import randomize_new_weights
from tests.exactness import assert_exact_to_rounding
from tests.export.test_export import assert_matches, job, load_in_clean_python, reference

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


@pytest.mark.parametrize("method", ["route"])  # both of its paths: preserve's and adapt's (the others: tiny models')
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


@pytest.mark.parametrize("method", ["route"])  # its adapt path is SCALE-Adapt's (every method: the tiny models')
def test_smollm2_export_matches(smollm2, tmp_path, method):
    """SmolLM2-135M (tied embeddings, 9 query / 3 kv heads, 30 layers) upscaled, exported and loaded clean
    (tests/export/test_export.py's clean Python)."""
    base, batch, _, _, tokenizer = smollm2
    ids, mask = batch["input_ids"], batch["attention_mask"]
    config = ScaleConfig(hidden_up=192, ffn_up=192, method=method, preserve_layers=-4, w21_init="random")
    model = upscale(copy.deepcopy(base), config).eval()
    model = randomize_new_weights(model, seed=4, w12_scale=0.02, head_scale=0.02)
    expected = reference(model, ids, mask)
    export_model(model, tmp_path / "export", tokenizer=tokenizer, max_shard_size="200MB")
    jobs = [
        job(method, tmp_path / "export", True, ids, mask),
        job("fp64", tmp_path / "export", True, ids, mask, float64=True),
    ]
    got, _ = load_in_clean_python(jobs, tmp_path)
    # In fp32, 30 layers round each of the two models' logits ~6e-5 away from their exact (fp64) value on the
    # project's CPU (measured 2026-11-25; another CPU stayed under 1e-5): the export is bounded by the library's own
    # distance (assert_matches), and the arithmetic compared in fp64 too, where the two agree to ~5e-14 (1e-10 is
    # ~1.5e4 float64 epsilons of logits ~30, where 30 layers' rounding is ~1e2 of them; a missing term is far outside).
    assert_matches(got[method], expected, mask)
    diff = (got["fp64"]["logits"][mask.bool()] - expected["exact_logits"][mask.bool()]).abs().max().item()
    assert diff <= 1e-10, f"fp64 logits differ by {diff}"
