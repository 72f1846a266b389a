"""An upscaled model stays an ordinary HF causal LM: `generate()` and padded batches work.

With untrained new weights (W12 = 0, W_out_up = 0, but random W21/W22) Theorem 3.1 says the
logits are the base model's, so greedy decoding must produce the base model's tokens, whatever
the method. Left padding must not change the logits of the real tokens. Equal logits are equal to
rounding: as close to the float64 values as the stock fp32 computation (the base model; the row
alone, unpadded) is (`exactness.assert_exact_to_rounding`).
"""

from __future__ import annotations

import copy

import pytest
import torch

from scale_cl import ROUTE_SHARE_KEY, set_method
from scale_cl.tuner.layers import ScaleLinear
from tests.conftest import VOCAB, make_model, randomize_new_weights, upscaled_copy
from tests.conftest import greedy as generate_greedy
from tests.exactness import assert_exact_to_rounding

pytestmark = pytest.mark.exactness

NEW_TOKENS = 8
PADS = [0, 3, 5]  # left padding per row


def padded_prompts(length: int = 7, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (len(PADS), length), generator=gen)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(PADS):
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    return ids, mask


def lively_base(arch: str):
    """A tiny base model whose tokens matter: conftest's NeoX biases (0.1) swamp its 0.02-std embeddings,
    so every position would predict the same token; larger embeddings make greedy decoding vary."""
    base = make_model(arch, seed=0)
    with torch.no_grad():
        base.get_input_embeddings().weight.mul_(25.0)
    return base


def untrained(base, method: str):
    fields = {"ffn_up": 16, "preserve_layers": 1, "w21_init": "random", "w22_init": "random", "seed": 1}
    return upscaled_copy(base, method, **fields).eval()


def greedy(model, ids, mask) -> torch.Tensor:
    return generate_greedy(model, ids, mask, NEW_TOKENS)


@pytest.mark.parametrize("method", ["preserve", "adapt", "route"])
def test_greedy_generate_untrained_equals_base(arch_name, method):
    base = lively_base(arch_name)
    ids, mask = padded_prompts()
    expected = greedy(base, ids, mask)
    assert expected.shape == (len(PADS), ids.shape[1] + NEW_TOKENS)
    # Guard: greedy decoding of a random model must not be one repeated token, or equality is cheap.
    assert len(torch.unique(expected[:, ids.shape[1] :])) > 1

    model = untrained(base, method)
    assert all(m.w12 is None or not m.w12.any() for m in model.modules() if isinstance(m, ScaleLinear))
    assert any(m.w22.abs().sum() > 0 for m in model.modules() if isinstance(m, ScaleLinear))
    out = greedy(model, ids, mask)
    assert torch.equal(out, expected)

    # The logits themselves, not only their argmax, are the base model's at every real token.
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        got = model(ids, attention_mask=mask, position_ids=position_ids).logits
        want = base(ids, attention_mask=mask, position_ids=position_ids).logits
        exact = copy.deepcopy(base).double()(ids, attention_mask=mask, position_ids=position_ids).logits
    real = mask.bool()
    assert_exact_to_rounding(got[real], exact[real], stock=want[real], what="the base model's logits")


def test_generate_route_with_trained_like_weights_runs():
    """Route with W12 != 0 generates (the KV cache holds both paths above preserve_layers)."""
    base = make_model("llama-gqa2-tied", seed=0)
    model = untrained(base, "route")
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, ScaleLinear) and module.collaborative:
                module.w12.copy_(0.5 * torch.randn(module.w12.shape, generator=gen))
    ids, mask = padded_prompts()
    out = greedy(model, ids, mask)
    assert out.shape == (len(PADS), ids.shape[1] + NEW_TOKENS)
    assert torch.equal(out[:, : ids.shape[1]], ids)

    # Incremental decoding with the cache equals recomputing the whole sequence at every step.
    full_mask = torch.cat((mask, torch.ones(len(PADS), NEW_TOKENS, dtype=mask.dtype)), dim=1)
    position_ids = (full_mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = model(out, attention_mask=full_mask, position_ids=position_ids).logits
    recomputed = logits[:, ids.shape[1] - 1 : -1].argmax(-1)
    assert torch.equal(recomputed, out[:, ids.shape[1] :])


def nontrivial(arch: str, method: str):
    """An upscaled model whose new weights all matter (W12 and W_out_up non-zero)."""
    base = make_model(arch, seed=0)
    return randomize_new_weights(untrained(base, method), seed=4, w12_scale=0.3)


@pytest.mark.parametrize("method", ["preserve", "adapt", "route"])
def test_left_padding_does_not_change_real_token_logits(arch_name, method):
    model = nontrivial(arch_name, method)
    ids, mask = padded_prompts()
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    exact_model = copy.deepcopy(model).double()
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, position_ids=position_ids)
        rows = [ids[row : row + 1, pad:] for row, pad in enumerate(PADS)]  # each row alone, unpadded
        alone = torch.cat([model(row).logits[0] for row in rows])
        exact = torch.cat([exact_model(row).logits[0] for row in rows])
    got = torch.cat([padded.logits[row, pad:] for row, pad in enumerate(PADS)])
    assert_exact_to_rounding(got, exact, stock=alone, what="the real tokens of a left-padded batch")
    if method == "route":
        assert ROUTE_SHARE_KEY in padded

    # Guard: the methods really differ here, so the padding check covers the method's own path.
    if method != "preserve":
        with torch.no_grad():
            other = set_method(copy.deepcopy(model), "preserve")(ids, attention_mask=mask, position_ids=position_ids)
        real = mask.bool()
        assert (other.logits[real] - padded.logits[real]).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ["llama-gqa2-tied", "neox-parallel-rot0.25"])
@pytest.mark.parametrize("method", ["preserve", "adapt", "route"])
def test_beam_search_untrained_equals_base(arch, method):
    """Beam search reorders the KV cache between steps; route's cache holds both paths above preserve_layers."""
    base = lively_base(arch)
    ids, mask = padded_prompts()
    kwargs = {"attention_mask": mask, "max_new_tokens": 6, "num_beams": 3, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        expected = base.generate(ids, **kwargs)
        out = untrained(base, method).generate(ids, **kwargs)
    assert torch.equal(out, expected)
