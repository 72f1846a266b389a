"""Mixed documents: the layout of a passage inside a host, the loss read per segment, and the router's
separation of old tokens from new ones."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from scale_cl.eval.mixture import ModelMixture
from scale_cl.eval.route_separation import base_weights, router_separation
from scale_cl.eval.segments import SEGMENTS, mixed_documents, segment_readings
from scale_cl.tuner.modes import set_live_settings
from tests.conftest import make_model, randomize_new_weights, upscaled_copy
from tests.exactness import assert_exact_to_rounding

EOS = 0


def _blocks(start: int, rows: int = 3, length: int = 16) -> torch.Tensor:
    """Distinct token ids (never EOS) per row, so that the layout can be read back."""
    return torch.arange(start, start + rows * length).reshape(rows, length)


def test_the_passage_sits_in_the_middle_of_the_host_and_eos_tokens_are_dropped():
    host, guest = _blocks(100), _blocks(500)
    host[1, 3] = EOS  # a document boundary inside a host block: dropped, the host text closes up
    mixed = mixed_documents(host, guest, (EOS,), count=2)
    assert mixed.input_ids.shape == (2, 16) and mixed.segment.shape == (2, 16)
    # 16 tokens: 6 of the host, 4 of the guest (a quarter), the host's next 6
    assert mixed.segment[0].tolist() == [0] * 6 + [1] * 4 + [2] * 6
    assert mixed.input_ids[0].tolist() == [*range(100, 106), *range(500, 504), *range(106, 112)]
    row = host[1][host[1] != EOS]
    assert mixed.input_ids[1].tolist() == [*row[:6].tolist(), *range(516, 520), *row[6:12].tolist()]


def test_a_block_without_enough_text_is_skipped_and_none_at_all_is_refused():
    host, guest = _blocks(100), _blocks(500)
    host[0, :8] = EOS  # half of it EOS: too little host text for the layout
    assert len(mixed_documents(host, guest, (EOS,), count=3).input_ids) == 2
    with pytest.raises(ValueError, match="no block holds enough text"):
        mixed_documents(torch.full((2, 16), EOS), guest, (EOS,), count=2)


def _mixture_and_ids():
    base = make_model("llama-gqa2-tied").eval()
    trained = upscaled_copy(base, "preserve")
    randomize_new_weights(trained, seed=3, w12_scale=0.3, head_scale=0.5)
    generator = torch.Generator().manual_seed(0)
    host = torch.randint(1, 50, (3, 16), generator=generator)
    guest = torch.randint(50, 90, (3, 16), generator=generator)
    return base, trained.eval(), mixed_documents(host, guest, (EOS,), count=3)


@pytest.mark.exactness
def test_each_segment_s_perplexity_is_the_mean_loss_of_the_tokens_its_positions_predict():
    """Batches of 2 read per segment: as close to the float64 perplexity of the whole batch's losses as the fp32 one
    (the stock computation: one forward pass, the losses masked by hand) is."""
    base, _, mixed = _mixture_and_ids()
    readings = segment_readings(base, mixed, batch_size=2)
    which = mixed.segment[:, 1:]

    def perplexities(model) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=mixed.input_ids).logits
        losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), mixed.input_ids[:, 1:], reduction="none")
        return torch.stack([losses[which == index].mean().exp() for index in range(len(SEGMENTS))])

    got = torch.tensor([readings["perplexity"][name] for name in SEGMENTS])  # Python floats of fp32 sums, as fp32
    assert_exact_to_rounding(got, perplexities(copy.deepcopy(base).double()), stock=perplexities(base), what="ppl")
    assert "base_weight" not in readings  # a model alone has no router


def test_a_mixture_reports_the_base_s_weight_per_segment_and_per_set():
    base, trained, mixed = _mixture_and_ids()
    for model in (ModelMixture([base, trained], prior=0.5, decay=0.9), set_live_settings(trained, router="likelihood")):
        readings = segment_readings(model, mixed, batch_size=3)
        assert set(readings["base_weight"]) == set(SEGMENTS)
        assert all(0 <= w <= 1 for w in readings["base_weight"].values())
        assert readings["base_weight"]["before"] < 0.95  # the prior's 0.5 moves as the host is read
        weights: dict[str, torch.Tensor] = {}
        with base_weights(model, weights, "heldout"), torch.no_grad():
            model(input_ids=mixed.input_ids)
        assert weights["heldout"].shape == (mixed.input_ids.numel(),)
    with base_weights(base, weights := {}, "heldout"), torch.no_grad():
        base(input_ids=mixed.input_ids)  # no router: nothing is collected
    assert weights == {}


def test_the_separation_is_the_auroc_of_old_tokens_against_new_ones_by_the_base_s_weight():
    weights = {"heldout": torch.tensor([0.1, 0.2, 0.6]), "en": torch.tensor([0.5, 0.9]), "doc": torch.tensor([0.2])}
    record = router_separation(weights)
    assert record["base_weight"]["en"] == pytest.approx(0.7)
    # en: 0.5 beats 0.1 and 0.2, 0.9 beats all three: 5 of 6 pairs; doc: 0.2 beats 0.1, ties 0.2: 1.5 of 3
    assert record["auroc"] == {"en": pytest.approx(5 / 6), "doc": pytest.approx(0.5)}
    assert "auroc" not in router_separation({"en": torch.tensor([0.5])})  # no new-domain set to compare with
