"""The routers behind one interface: a router is a `Router` subclass plus its registration, the route
settings are what the routers declare, and a registered router is selected, saved and checked like the built-in
ones."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from scale_cl import scale_config_of, set_method
from scale_cl.tuner.config import ScaleConfig
from scale_cl.tuner.modes import live_settings, set_live_settings
from scale_cl.tuner.routing import ROUTERS, HeadPaths, Router, register_router, route_settings
from scale_cl.tuner.routing.calibrated import CalibratedRouter
from scale_cl.tuner.routing.confidence import ConfidenceRouter, HybridRouter
from scale_cl.tuner.routing.cosine import CosineRouter
from scale_cl.tuner.routing.likelihood import LikelihoodRouter
from scale_cl.tuner.routing.nested import NestedRouter
from scale_cl.tuner.routing.posterior import MixtureRouter
from tests.conftest import make_model, randomize_new_weights, token_batch, upscaled_copy
from tests.exactness import assert_exact_to_rounding

pytestmark = pytest.mark.exactness


class AdaptPathRouter(Router):
    """A router as a user would add one: every token takes the adapt path, ``Z_a + alpha Z_a_up``."""

    name = "adapt_path"
    reads = ()

    def combine(self, paths: HeadPaths, state) -> torch.Tensor:
        x, x_up = (
            (paths.x[paths.x.shape[0] // 2 :], paths.x_up[paths.x_up.shape[0] // 2 :])
            if paths.stacked
            else (
                paths.x,
                paths.x_up,
            )
        )
        return torch.add(paths.original_logits(x), paths.up_logits(x_up), alpha=paths.alpha)


@pytest.fixture
def adapt_path_router():
    router = register_router(AdaptPathRouter())
    try:
        yield router
    finally:
        del ROUTERS[router.name]


def test_the_built_in_routers_are_registered_and_declare_the_route_settings():
    assert isinstance(ROUTERS["cosine"], CosineRouter) and isinstance(ROUTERS["likelihood"], LikelihoodRouter)
    assert isinstance(ROUTERS["nested"], NestedRouter)
    assert isinstance(ROUTERS["confidence"], ConfidenceRouter) and isinstance(ROUTERS["hybrid"], HybridRouter)
    assert isinstance(ROUTERS["calibrated"], CalibratedRouter)
    assert route_settings() == (
        "router",
        "route_tau",
        "route_exact",
        "router_prior",
        "router_decay",
        "router_confidence",
        "router_temperature",
        "router_prefix_weight",
        "router_entropy_weight",
        "router_top_weight",
    )
    assert set(route_settings()) <= set(live_settings())


def test_a_registered_router_is_one_class_and_selects_like_the_built_in_ones(adapt_path_router):
    """Registered, it is a valid ScaleConfig.router and a live setting; it routes: every token on the adapt path
    equals Eq. 5 with a tau no cosine exceeds."""
    assert ScaleConfig(hidden_up=32, ffn_up=8, router="adapt_path").router == "adapt_path"
    base = make_model("llama-gqa2-tied")
    model = upscaled_copy(base, "route", preserve_layers=1)
    randomize_new_weights(model, seed=3, w12_scale=0.1)
    ids, mask = token_batch()
    model.eval()
    with torch.no_grad():
        set_live_settings(model, route_tau=1.0)  # cos > 1 never holds: Eq. 5 sends every token to the adapt path
        eq5 = model(input_ids=ids, attention_mask=mask).logits
        exact = copy.deepcopy(model).double()(input_ids=ids, attention_mask=mask).logits
        set_live_settings(model, router="adapt_path")
        ours = model(input_ids=ids, attention_mask=mask).logits
    assert scale_config_of(model).router == "adapt_path"
    # two separate products added here, Eq. 5's one accumulating onto the other: the same sum, to rounding
    assert_exact_to_rounding(ours, exact, stock=eq5, what="adapt_path against Eq. 5 at tau 1")
    with pytest.raises(ValueError, match="registered already"):
        register_router(AdaptPathRouter())


def test_an_unregistered_router_is_refused_with_the_registered_ones():
    registered = r"\('cosine', 'likelihood', 'nested', 'confidence', 'hybrid', 'calibrated'\)"
    with pytest.raises(ValueError, match=rf"router must be one of {registered}"):
        ScaleConfig(hidden_up=32, ffn_up=8, router="adapt_path")


def test_set_method_takes_tau_with_route_only():
    """tau is Eq. 5's threshold: given with a method that does not route it is refused, and nothing
    changes, so a later switch to route does not pick it up."""
    model = upscaled_copy(make_model("llama-gqa2-tied"), "route", preserve_layers=1)
    before = scale_config_of(model).route_tau
    for method in ("preserve", "adapt"):
        with pytest.raises(ValueError, match=f"set_method\\(model, '{method}'\\) does not route; drop tau"):
            set_method(model, method, tau=0.9)
    assert scale_config_of(set_method(model, "route")).route_tau == before
    assert scale_config_of(set_method(model, "route", tau=0.3)).route_tau == 0.3


class FixedMixRouter(MixtureRouter):
    """A mixing router as a user would add one, in this one file: the base and the model mixed with a fixed weight,
    ``p = w p_base + (1 - w) p_new``, ``w = sigmoid(router_prior)`` (no evidence read)."""

    name = "fixed_mix"
    reads = ("router_prior",)
    prefix = False


def textbook_mix(base_logits: torch.Tensor, new_logits: torch.Tensor, prior: float) -> torch.Tensor:
    """``log(w p_base + (1 - w) p_new)``, ``w = sigmoid(prior)``, in the logits' dtype."""
    w = torch.sigmoid(torch.tensor(prior, dtype=base_logits.dtype))
    return torch.log(w * base_logits.softmax(-1) + (1 - w) * new_logits.softmax(-1))


@pytest.fixture
def fixed_mix_router():
    router = register_router(FixedMixRouter())
    try:
        yield router
    finally:
        del ROUTERS[router.name]


@pytest.mark.parametrize("method", ["preserve", "route"])
def test_a_mixing_router_is_added_in_one_file_and_exported_from_its_declaration(fixed_mix_router, method, tmp_path):
    """The router file (here, the class above), its registration (the fixture) and this test are all it takes: the
    model computes its mixture (SCALE-Preserve's one path, Route's two), and the export, which names no router,
    computes the same from the router's declaration (`MixtureRouter.mixture`)."""
    from scale_cl import load
    from scale_cl.export import export_model

    model = upscaled_copy(make_model("llama-gqa2-tied"), method, preserve_layers=1, w21_init="random", seed=1)
    randomize_new_weights(model, seed=3, w12_scale=0.3)
    set_live_settings(model.eval(), router="fixed_mix", router_prior=0.4)
    assert ROUTERS["fixed_mix"].reads_tokens is False  # no prefix: no token ids read
    ids, mask = token_batch()
    base = set_method(copy.deepcopy(model), "preserve")  # at alpha 0 the base's logits (Theorem 3.1)
    base = set_live_settings(base, router="cosine", up_logit_scale=0.0)
    new = set_method(copy.deepcopy(model), "adapt" if method == "route" else "preserve")
    new = set_live_settings(new, router="cosine")
    with torch.no_grad():
        mixed = model(input_ids=ids, attention_mask=mask).logits
        base_logits, new_logits = (m(ids, attention_mask=mask).logits for m in (base, new))
        exact_logits = [copy.deepcopy(m).double()(ids, attention_mask=mask).logits for m in (base, new)]
    stock = textbook_mix(base_logits, new_logits, 0.4)  # the textbook mixture of the two models run apart, in fp32
    exact = textbook_mix(*exact_logits, 0.4)  # and on float64 copies
    assert_exact_to_rounding(mixed, exact, stock=stock, what="the model's mixture")
    assert (new_logits - base_logits).abs().max() > 1e-2, "the experts differ, so the mixture is not trivial"
    export_model(model, tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["scale_mixture"] == {"prefix": False, "prior": 0.4, "decay": 1.0, "confidence": None}
    with torch.no_grad():
        exported = load(tmp_path / "export")(input_ids=ids, attention_mask=mask).logits
    assert_exact_to_rounding(exported, exact, stock=stock, what="the export's mixture")


def test_a_router_with_no_export_form_is_refused_before_anything_is_written(adapt_path_router, tmp_path):
    from scale_cl.export import export_model

    model = upscaled_copy(make_model("llama-gqa2-tied"), "route", preserve_layers=1)
    set_live_settings(model, router="adapt_path")
    with pytest.raises(ValueError, match="cannot export the adapt_path router"):
        export_model(model, tmp_path / "export")
    assert not (tmp_path / "export").exists() or not any((tmp_path / "export").iterdir())
