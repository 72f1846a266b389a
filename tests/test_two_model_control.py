"""The two-model control (issue 40): a trained model and its base mixed by the likelihood router's posterior is the
same mixture SCALE-Route's likelihood reading computes of its two paths, normalised and causal."""

from __future__ import annotations

import copy

import torch

from conftest import make_model, randomize_new_weights, token_batch, upscaled_copy
from scale_cl import set_method
from scale_cl.eval.mixture import TwoModelMixture
from scale_cl.tuner.modes import set_live_settings


def _route_and_its_paths(prior: float = 0.0, decay: float = 0.95):
    """A SCALE-Route model read with the likelihood router, and its two paths as two models: the base (its
    preserve path, exactly) and the same upscaled weights in adapt mode (its adapt path)."""
    base = make_model("llama-gqa2-tied").eval()
    route = upscaled_copy(base, "route", preserve_layers=1)
    randomize_new_weights(route, seed=5, w12_scale=0.3, head_scale=0.3)
    set_live_settings(route, router="likelihood", router_prior=prior, router_decay=decay)
    adapt = set_method(copy.deepcopy(route), "adapt")
    return base, route.eval(), adapt.eval()


def test_the_control_of_route_s_own_paths_is_route_s_likelihood_reading():
    base, route, adapt = _route_and_its_paths(prior=0.5, decay=0.9)
    ids, mask = token_batch()
    with torch.no_grad():
        ours = TwoModelMixture(adapt, base, prior=0.5, decay=0.9)(input_ids=ids, attention_mask=mask).logits
        routed = route(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(ours[real], routed[real], rtol=0, atol=2e-5)


def test_the_mixture_is_normalised_causal_and_the_base_where_both_agree():
    base, _, adapt = _route_and_its_paths()
    mixture = TwoModelMixture(adapt, base)
    ids, _ = token_batch(padded=False)
    changed = ids.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % 50 + 1
    with torch.no_grad():
        logits = mixture(input_ids=ids).logits
        later = mixture(input_ids=changed).logits
        same = TwoModelMixture(base, base)(input_ids=ids).logits
        own = torch.log_softmax(base(input_ids=ids).logits.float(), dim=-1)
    torch.testing.assert_close(torch.logsumexp(logits.float(), dim=-1), torch.zeros(ids.shape), rtol=0, atol=5e-6)
    torch.testing.assert_close(logits[:, :5], later[:, :5], rtol=0, atol=0)  # position t reads tokens <= t only
    assert not torch.allclose(logits[:, 5:], later[:, 5:])
    torch.testing.assert_close(same.float(), own, rtol=0, atol=1e-5)  # the same model twice: itself


def test_the_loss_is_the_mixture_s_next_token_loss_and_new_rows_get_no_mass_from_the_base():
    base, _, adapt = _route_and_its_paths()
    grown = copy.deepcopy(adapt)
    grown.resize_token_embeddings(grown.get_input_embeddings().weight.shape[0] + 3)  # rows the base lacks
    ids, _ = token_batch(padded=False)
    with torch.no_grad():
        out = TwoModelMixture(grown, base, prior=30.0)(input_ids=ids, labels=ids)  # w ~ 1 at a document start
    logp = out.logits.float()
    expected = -logp[:, :-1].gather(-1, ids[:, 1:, None]).mean()
    torch.testing.assert_close(out.loss, expected, rtol=1e-6, atol=1e-6)
    assert logp[:, 0, -3:].exp().max() < 1e-6  # the base's weight ~ 1 and it gives the new rows nothing
