"""What users of fast training expect to work: bf16 autocast keeps the original stream bitwise, torch.compile."""

from __future__ import annotations

import copy

import pytest
import torch

from scale_cl import ScaleConfig, upscale
from tests.conftest import ARCHS, hidden_up_for, make_model, token_batch
from tests.exactness import assert_exact_to_rounding

pytestmark = pytest.mark.exactness


def _original_parts(base_hidden: torch.Tensor, hidden: torch.Tensor) -> list[torch.Tensor]:
    """The original features of an upscaled hidden state (of both halves of route's stacked batch)."""
    halves = hidden.split(base_hidden.shape[0]) if hidden.shape[0] == 2 * base_hidden.shape[0] else (hidden,)
    return [half[..., : base_hidden.shape[-1]] for half in halves]


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("method", ["preserve", "adapt", "route"])
@pytest.mark.parametrize("mode", ["autocast", "bf16 weights"])
def test_bf16_keeps_the_original_stream_bitwise(arch, method, mode):
    base = make_model(arch)
    cfg = ScaleConfig(
        hidden_up=hidden_up_for(base), ffn_up=16, method=method, preserve_layers=1, w21_init="random", w22_init="random"
    )
    model = upscale(copy.deepcopy(base), cfg)
    if mode == "bf16 weights":
        base, model = base.to(torch.bfloat16), model.to(torch.bfloat16)
    ids, mask = token_batch()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
        expected = base(ids, attention_mask=mask, output_hidden_states=True)
        got = model(ids, attention_mask=mask, output_hidden_states=True)
    assert expected.logits.dtype == torch.bfloat16 or mode == "autocast"
    for layer, (a, b) in enumerate(zip(expected.hidden_states, got.hidden_states, strict=True)):
        for part in _original_parts(a, b):
            assert torch.equal(a, part), f"hidden state {layer} differs from the base model's"
    assert torch.equal(expected.logits, got.logits)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["preserve", "route"])  # route's adapt half runs SCALE-Adapt's W12 products
def test_torch_compile_matches_eager(method):
    base = make_model("llama-gqa2-tied")
    cfg = ScaleConfig(hidden_up=hidden_up_for(base), ffn_up=16, method=method, preserve_layers=1, w21_init="random")
    model = upscale(base, cfg)
    with torch.no_grad():
        model.get_output_embeddings().weight_up.normal_(std=0.1)  # new paths matter in the logits
    ids, mask = token_batch()
    with torch.no_grad():
        exact = copy.deepcopy(model).double()(ids, attention_mask=mask).logits
        eager = model(ids, attention_mask=mask).logits
        compiled = torch.compile(model)(ids, attention_mask=mask).logits
    # the compiled graph fuses and reorders the same arithmetic: as exact as eager's, to the float64 logits
    assert_exact_to_rounding(compiled, exact, stock=eager, what="compiled")
