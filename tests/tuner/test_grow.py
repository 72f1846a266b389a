"""Repeated upscaling (`scale_cl.tuner.stages`): an upscaled, trained model grown again equals itself at start, on every
architecture and for each method; Theorem 3.1 holds at every stage after training with non-zero blocks; frozen
weights stay bitwise unchanged; checkpoints, the summary and refusals say what each stage added.

"Equals" is to rounding: the grown model multiplies by each earlier linear's merged block matrix, which rounds unlike
its split blocks, so its values must be as close to the earlier model's float64 values as the earlier model's own fp32
values are (`exactness.assert_exact_to_rounding`)."""

from __future__ import annotations

import copy

import pytest
import torch

from scale_cl import load, set_method, upscale
from scale_cl.tuner import stages
from scale_cl.tuner.layers import ScaleLinear, SplitNorm
from scale_cl.tuner.modes import set_live_settings
from scale_cl.tuner.stages import FrozenMLP, stage_count
from tests.conftest import VOCAB, make_model, randomize_new_weights, tiny_scale_config, token_batch, upscaled_copy
from tests.exactness import assert_exact_to_rounding

pytestmark = pytest.mark.exactness

LATER_METHODS = ("preserve", "adapt", "route")


def lively(model, seed: int):
    """Every new weight of the current stage matters: W12 and the head's new columns random, norm gains moved."""
    randomize_new_weights(model, seed, w12_scale=0.05)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad and "norm" in name:
                param.add_(0.1 * torch.randn(param.shape, generator=gen))
    return model


def grown(model, method: str, **fields):
    """``model`` grown once more by its smallest valid width (random W21/W22: a busy new stream)."""
    cfg = tiny_scale_config(model, method, w21_init="random", w22_init="random", preserve_layers=1, **fields)
    return upscale(model, cfg)


def logits(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, **kwargs)


def exact_logits(model, ids, mask, **kwargs):
    """`logits` of a float64 copy of ``model``."""
    return logits(copy.deepcopy(model).double(), ids, mask, **kwargs)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, exact: torch.Tensor, what: str) -> None:
    """``actual`` is the earlier model's value to rounding: as close to its float64 value ``exact`` as its fp32
    value ``expected`` is."""
    assert actual.shape == expected.shape, what
    assert_exact_to_rounding(actual, exact, stock=expected, what=what)


def train_steps(model, steps: int = 3, seed: int = 0) -> None:
    """A few AdamW steps on random tokens (no weight decay: only gradients move parameters)."""
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    for step in range(steps):
        ids, mask = token_batch(seed=seed + step)
        model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


@pytest.mark.parametrize("first", ("preserve", "adapt"))
@pytest.mark.parametrize("later", LATER_METHODS)
def test_grown_model_equals_the_trained_one(arch_name, first, later):
    """Theorem 3.1 across a stage: the grown model's logits are the earlier model's (whose every new weight is
    non-zero), under each method of the new stage."""
    model = lively(upscaled_copy(make_model(arch_name), first, w21_init="random", w22_init="random"), seed=1)
    ids, mask = token_batch()
    before, exact = logits(model, ids, mask).logits, exact_logits(model, ids, mask).logits
    model = grown(model, later)
    assert stage_count(model) == 2 and model.scale_config.method == later
    assert_close(logits(model, ids, mask).logits, before, exact, f"{arch_name}: {first} grown under {later}")
    for method in LATER_METHODS:  # the same at start whichever method the new stage switches to
        assert_close(logits(set_method(model, method), ids, mask).logits, before, exact, f"switched to {method}")


@pytest.mark.parametrize("arch", ("llama-gqa3-tied", "llama-biases", "neox-sequential-rot1.0"))
def test_theorem_holds_at_every_stage_after_training(arch):
    """Three stages, each trained with non-zero blocks: at each growth the model is the trained one; under
    preserve the earlier width's hidden states are the earlier model's exactly, also after training; the frozen
    weights (every earlier stage's) are bitwise unchanged by training. (To rounding: the frozen base multiplies by
    each earlier linear's merged block matrix, which rounds unlike its split blocks.)"""
    ids, mask = token_batch(seed=7)
    model = upscaled_copy(make_model(arch), "adapt", w21_init="random", w22_init="random", preserve_layers=1)
    train_steps(model, seed=0)
    for stage, method in enumerate(("preserve", "route"), start=2):
        earlier = copy.deepcopy(model)
        width = earlier.config.hidden_size
        reference = logits(earlier, ids, mask, output_hidden_states=True)
        exact = exact_logits(earlier, ids, mask, output_hidden_states=True)
        model = grown(model, method)
        assert_close(logits(model, ids, mask).logits, reference.logits, exact.logits, f"stage {stage} at start")
        frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        train_steps(model, seed=10 * stage)
        for name, param in model.named_parameters():
            if name in frozen:
                assert torch.equal(param, frozen[name]), f"stage {stage}: frozen {name} moved"
        moved = logits(model, ids, mask, output_hidden_states=True)
        assert (moved.logits - reference.logits).abs().max() > 1e-3, "training changed nothing"
        if method == "preserve":
            states = zip(moved.hidden_states, reference.hidden_states, exact.hidden_states, strict=True)
            for index, (got, want, exact_state) in enumerate(states):
                what = f"stage {stage}: hidden state {index} of the earlier width"
                assert_close(got[..., :width], want, exact_state, what)


def test_a_head_frozen_without_its_scale_is_outside_the_bound(monkeypatch):
    """The mutation: growing a model whose ``up_logit_scale`` is 0.99 with a head frozen as ``[W_out, W_out_up]``,
    the scale left out (Z_up weighted 1% too much)."""

    def unscaled_head(module):
        head = torch.nn.Linear(module.in_features, module.out_features, bias=False)
        head.weight = torch.nn.Parameter(torch.cat((module.weight, module.weight_up), dim=1).detach(), False)
        return head

    model = lively(upscaled_copy(make_model("llama-mha-untied"), "adapt", w21_init="random"), seed=1)
    set_live_settings(model, up_logit_scale=0.99)
    ids, mask = token_batch()
    before, exact = logits(model, ids, mask).logits, exact_logits(model, ids, mask).logits
    assert_close(logits(grown(copy.deepcopy(model), "adapt"), ids, mask).logits, before, exact, "grown")  # control
    monkeypatch.setattr(stages, "_plain_head", unscaled_head)
    with pytest.raises(AssertionError, match="from the float64 reference"):
        assert_close(logits(grown(model, "adapt"), ids, mask).logits, before, exact, "mutated: alpha left out")


def test_norms_split_into_groups_and_linears_freeze_into_the_base():
    model = upscaled_copy(make_model("llama-gqa2-tied"), "adapt")
    d, u = 64, model.scale_config.hidden_up
    model = grown(grown(model, "adapt"), "preserve")
    norm = model.model.layers[0].input_layernorm
    assert isinstance(norm, SplitNorm) and norm.groups == (d, u, u, u)
    assert all(not p.requires_grad for m in norm.earlier_stages() for p in m.parameters(recurse=False))
    assert norm.weight_up.requires_grad
    q_proj = model.model.layers[1].self_attn.q_proj
    assert isinstance(q_proj, ScaleLinear) and type(q_proj.weight) is torch.nn.Parameter
    assert q_proj.weight.shape == (d + 2 * u, d + 2 * u) and not q_proj.weight.requires_grad
    assert isinstance(model.model.layers[0].mlp.gate_proj, ScaleLinear)
    assert not any(isinstance(m, FrozenMLP) for m in model.modules())  # the next stage's ScaleMLP took its parts
    assert model.config.hidden_size == d + 3 * u and stage_count(model) == 3


def test_refused_before_anything_changes():
    base = make_model("llama-gqa2-tied")
    route = lively(upscaled_copy(base, "route"), seed=2)
    adapt = lively(upscaled_copy(base, "adapt"), seed=2)
    for model, cfg, message in (
        (route, tiny_scale_config(route), "cannot grow a SCALE-Route model"),
        (adapt, tiny_scale_config(adapt, hidden_up=16), "hidden_up=16 must add whole attention heads"),
        (adapt, tiny_scale_config(adapt, preserve_layers=7), "preserve_layers=7 does not fit"),
    ):
        state = {k: v.clone() for k, v in model.state_dict().items()}
        config, cls = copy.deepcopy(model.config.to_dict()), type(model)
        with pytest.raises(ValueError, match=message):
            upscale(model, cfg)
        assert type(model) is cls and model.config.to_dict() == config
        assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_extended_vocabulary_is_refused():
    """Growing a model with new token rows, and new rows on a grown model (neither checkpoint could record them)."""
    model = upscaled_copy(make_model("llama-gqa2-tied"), "adapt")
    model.resize_token_embeddings(VOCAB + 4)
    with pytest.raises(ValueError, match="cannot grow a model with an extended vocabulary"):
        upscale(model, tiny_scale_config(model))
    model = grown(upscaled_copy(make_model("llama-gqa2-tied"), "adapt"), "adapt")
    with pytest.raises(ValueError, match="extending the vocabulary of a model grown more than once"):
        model.resize_token_embeddings(VOCAB + 4)
    assert model.get_input_embeddings().weight_new is None


@pytest.mark.parametrize("full", (False, True))
@pytest.mark.parametrize("arch", ("llama-gqa2-tied", "qwen2-qkv-bias", "neox-parallel-rot0.25"))
def test_grown_checkpoint_reloads_bitwise(arch, full, tmp_path):
    """Saved with only what the stages added (the frozen tensors' added blocks apart), reloaded by replaying the
    stages on the original base: the logits are bitwise the saved model's."""
    base = make_model(arch)
    model = lively(upscaled_copy(base, "adapt", w21_init="random", w22_init="random", up_norm="joint"), seed=1)
    model = lively(grown(model, "adapt", up_norm="original"), seed=2)
    model = lively(grown(model, "route"), seed=3)
    ids, mask = token_batch()
    want = logits(model, ids, mask).logits
    model.save_pretrained(tmp_path, full=full)
    loaded = load(tmp_path) if full else load(tmp_path, base_model=copy.deepcopy(base))
    assert torch.equal(logits(loaded, ids, mask).logits, want)
    assert loaded.scale_state.stages == model.scale_state.stages
    assert loaded.scale_summary().stages == model.scale_summary().stages


def test_summary_says_what_each_stage_added():
    base = make_model("llama-gqa2-tied")
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    model = upscaled_copy(base, "adapt")
    first = count(model) - count(base)
    model = grown(model, "route")
    summary = model.scale_summary()
    second = summary.total - first - count(base)
    assert [(s[0], s[3]) for s in summary.stages] == [("adapt", first), ("route", second)]
    text = str(summary)
    assert "stage 1 (adapt, +32 wide, +8 FFN, frozen)" in text and "stage 2 (route, +32 wide, +8 FFN, now)" in text
    assert summary.total == sum(p.numel() for p in model.parameters())
