"""The two-model control: a trained model and its base mixed by the likelihood router's posterior is the
same mixture SCALE-Route's likelihood reading computes of its two paths, normalised and causal.

Equal in exact arithmetic: each fp32 result lies as close to the float64 value (of the control of float64 copies) as
the stock fp32 computation does (`exactness.assert_exact_to_rounding`)."""

from __future__ import annotations

import copy

import pytest
import torch

from scale_cl import set_method
from scale_cl.eval.mixture import ModelMixture
from scale_cl.tuner.modes import set_live_settings
from tests.conftest import make_model, randomize_new_weights, token_batch, upscaled_copy
from tests.exactness import assert_exact_to_rounding

pytestmark = pytest.mark.exactness


def _route_and_its_paths(prior: float = 0.0, decay: float = 0.95):
    """A SCALE-Route model read with the likelihood router, and its two paths as two models: the base (its
    preserve path, exactly) and the same upscaled weights in adapt mode (its adapt path)."""
    base = make_model("llama-gqa2-tied").eval()
    route = upscaled_copy(base, "route", preserve_layers=1)
    randomize_new_weights(route, seed=5, w12_scale=0.3, head_scale=0.3)
    set_live_settings(route, router="likelihood", router_prior=prior, router_decay=decay)
    adapt = set_method(copy.deepcopy(route), "adapt")
    return base, route.eval(), adapt.eval()


def _control(models, ids, mask, **settings) -> tuple[torch.Tensor, torch.Tensor]:
    """The control's logits on ``ids``: of ``models`` in fp32 (the stock computation) and of float64 copies (exact)."""
    copies = [copy.deepcopy(m).double() for m in models]
    with torch.no_grad():
        return tuple(ModelMixture(ms, **settings)(input_ids=ids, attention_mask=mask).logits for ms in (models, copies))


def test_the_control_of_route_s_own_paths_is_route_s_likelihood_reading():
    base, route, adapt = _route_and_its_paths(prior=0.5, decay=0.9)
    ids, mask = token_batch()
    ours, exact = _control([base, adapt], ids, mask, prior=0.5, decay=0.9)
    with torch.no_grad():
        routed = route(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert_exact_to_rounding(routed[real], exact[real], stock=ours[real], what="route against the control")


def test_route_with_its_prior_slightly_off_is_outside_the_rounding_bound():
    """Mutation: route read with the base's prior log-odds 0.51 where the control mixes with 0.5 (a prior off by
    0.01, as a stale setting would give): farther from the float64 control than rounding allows."""
    base, route, adapt = _route_and_its_paths(prior=0.51, decay=0.9)
    ids, mask = token_batch()
    ours, exact = _control([base, adapt], ids, mask, prior=0.5, decay=0.9)
    with torch.no_grad():
        routed = route(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    with pytest.raises(AssertionError, match="from the float64 reference"):
        assert_exact_to_rounding(routed[real], exact[real], stock=ours[real], what="route at prior 0.51")


def test_the_mixture_is_normalised_causal_and_the_base_where_both_agree():
    base, _, adapt = _route_and_its_paths()
    mixture = ModelMixture([base, adapt])
    ids, _ = token_batch(padded=False)
    changed = ids.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % 50 + 1
    with torch.no_grad():
        logits = mixture(input_ids=ids).logits
        later = mixture(input_ids=changed).logits
        same = ModelMixture([base, base])(input_ids=ids).logits
        own = torch.log_softmax(base(input_ids=ids).logits, dim=-1)
        exact_experts = [copy.deepcopy(m).double()(input_ids=ids).logits for m in (base, adapt)]
    exact_own = torch.log_softmax(exact_experts[0], dim=-1)
    # Normalised: the total probability as near 1 as the stock log_softmax's (of one model). The mixture adds each
    # expert's shift log w_j - norm_j, rounded at the normaliser's size (~4 here), to its logits, so its
    # log-probabilities move by up to two half-ulps of that size, where log_softmax rounds the likely ones at their own
    # size (~1): the floor is 4 eps of the largest normaliser (tests/tuner/routing/test_mixing.py measures the same).
    ones = torch.ones(ids.shape, dtype=torch.float64)
    floor = 4 * max(torch.logsumexp(z, -1).abs().max().item() for z in exact_experts)
    total = logits.exp().sum(-1)
    assert_exact_to_rounding(total, ones, stock=own.exp().sum(-1), ulps=floor, what="total probability")
    torch.testing.assert_close(logits[:, :5], later[:, :5], rtol=0, atol=0)  # position t reads tokens <= t only
    assert not torch.allclose(logits[:, 5:], later[:, 5:])
    assert_exact_to_rounding(same, exact_own, stock=own, what="the same model twice: itself")


def test_the_loss_is_the_mixture_s_next_token_loss_and_new_rows_get_no_mass_from_the_base():
    base, _, adapt = _route_and_its_paths()
    grown = copy.deepcopy(adapt)
    grown.resize_token_embeddings(grown.get_input_embeddings().weight.shape[0] + 3)  # rows the base lacks
    ids, _ = token_batch(padded=False)
    with torch.no_grad():
        out = ModelMixture([base, grown], prior=30.0)(input_ids=ids, labels=ids)  # w ~ 1 at a document start
        copies = [copy.deepcopy(m).double() for m in (base, grown)]
        exact_logp = ModelMixture(copies, prior=30.0)(input_ids=ids).logits

    def loss(logp):
        return -logp[:, :-1].gather(-1, ids[:, 1:, None]).mean()

    logp = out.logits
    assert_exact_to_rounding(out.loss, loss(exact_logp), stock=loss(logp), what="loss")
    assert logp[:, 0, -3:].exp().max() < 1e-6  # the base's weight ~ 1 and it gives the new rows nothing


def _preserve_and_its_base():
    """A trained-looking SCALE-Preserve model (new weights random, the head's new columns speaking) and its base."""
    base = make_model("llama-gqa2-tied").eval()
    preserve = upscaled_copy(base, "preserve", w21_init="random", w22_init="random")
    randomize_new_weights(preserve, seed=6, w12_scale=0.3, head_scale=0.3)
    return base, preserve.eval()


def test_preserve_read_by_the_likelihood_router_is_its_own_two_model_control_in_one_pass():
    """SCALE-Preserve's Z is the base's logits exactly, so its one-pass reading with the likelihood router equals
    the control (the same trained model and its base as two models), and switching the router off gives the
    paper's Preserve back bitwise."""
    base, preserve = _preserve_and_its_base()
    ids, mask = token_batch()
    real = mask.bool()
    control, exact = _control([base, preserve], ids, mask, prior=0.5, decay=0.9)
    with torch.no_grad():
        plain = preserve(input_ids=ids, attention_mask=mask).logits
        set_live_settings(preserve, router="likelihood", router_prior=0.5, router_decay=0.9)
        assert preserve.scale_route.active and not preserve.scale_route.stacked
        routed = preserve(input_ids=ids, attention_mask=mask)
        set_live_settings(preserve, router="cosine")
        again = preserve(input_ids=ids, attention_mask=mask).logits
    assert_exact_to_rounding(routed.logits[real], exact[real], stock=control[real], what="preserve against the control")
    assert (routed.logits - plain).abs().max() > 1e-2, "the router changes the reading"
    weight = routed["route_preserve_share"]
    assert 0 < float(weight) < 1, "both the base and the new logits carry weight"
    assert not preserve.scale_route.active and torch.equal(again, plain)


def test_preserve_with_the_likelihood_router_is_saved_reloaded_and_trains_the_new_weights_only(tmp_path):
    from scale_cl import load

    base, preserve = _preserve_and_its_base()
    set_live_settings(preserve, router="likelihood")
    ids, _ = token_batch(padded=False)
    preserve.save_pretrained(tmp_path / "saved")
    reloaded = load(tmp_path / "saved", base_model=copy.deepcopy(base)).eval()
    assert reloaded.scale_config.router == "likelihood" and reloaded.scale_route.active
    with torch.no_grad():
        # the same weights read back and the same kernels on the same input: bitwise
        torch.testing.assert_close(reloaded(input_ids=ids).logits, preserve(input_ids=ids).logits, rtol=0, atol=0)
    frozen = {name: p.detach().clone() for name, p in preserve.named_parameters() if not p.requires_grad}
    preserve.train()
    optimizer = torch.optim.SGD([p for p in preserve.parameters() if p.requires_grad], lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        preserve(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    assert preserve.get_output_embeddings().weight_up.grad.abs().sum() > 0
    assert all(torch.equal(p, frozen[name]) for name, p in preserve.named_parameters() if name in frozen)


def test_the_control_generates_with_both_caches_as_recomputing_the_whole_sequence_would():
    """Greedy generate() with each model's KV cache and the router's memory carried over equals the argmax of the
    mixture recomputed on the whole sequence at every step; a left-padded row generates what it does alone."""
    base, _, adapt = _route_and_its_paths(prior=0.5, decay=0.9)
    mixture = ModelMixture([base, adapt], prior=0.5, decay=0.9)
    mixture.eos_ids = ()  # no early stop: every row runs the whole length
    ids, mask = token_batch()
    with torch.no_grad():
        out = mixture.generate(ids, attention_mask=mask, max_new_tokens=5)
        full_mask = torch.cat((mask, torch.ones(mask.shape[0], 5, dtype=mask.dtype)), 1)
        positions = (full_mask.cumsum(-1) - 1).clamp_min(0)
        logits = mixture(input_ids=out, attention_mask=full_mask, position_ids=positions).logits
        alone = mixture.generate(ids[2:][:, mask[2].bool()], max_new_tokens=5)
    assert torch.equal(logits[:, ids.shape[1] - 1 : -1].argmax(-1), out[:, ids.shape[1] :])
    assert torch.equal(alone[0, -5:], out[2, -5:])
    assert len(set(out[:, ids.shape[1] :].flatten().tolist())) > 1, "not one token repeated"
    # the same model twice is that model whatever w is, so a row's tokens do not depend on where documents start:
    # made an EOS token, row 0's first new token ends it there, and it pads after it
    same = ModelMixture([adapt, adapt])
    same.eos_ids = ()
    with torch.no_grad():
        free = same.generate(ids, attention_mask=mask, max_new_tokens=4)[:, ids.shape[1] :]
        same.eos_ids = (int(free[0, 0]),)
        stopped = same.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0)[:, ids.shape[1] :]
    assert stopped[0].tolist() == [int(free[0, 0]), 0, 0, 0]
