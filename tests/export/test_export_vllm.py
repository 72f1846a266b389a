"""An exported SCALE model keeps vLLM's Transformers-backend contract, checked without vLLM.

vLLM's Transformers backend (``vllm serve FOLDER --model-impl transformers --trust-remote-code``) sets
``config._attn_implementation`` to the attention function it registered ("vllm"), builds the *base* model with
``AutoModel.from_config(config, trust_remote_code=True)`` (the config's ``auto_map["AutoModel"]``), loads the weights
under the base model's prefix, calls the base model's forward on one unpadded row with its own keyword arguments
(``attention_instances``, ``position_ids``, ``use_cache=False``) and computes the logits with its own LM head, loaded
from ``lm_head.weight``. Here the same steps run with a recording attention function registered under vLLM's name,
delegating to sdpa: every layer's attention must go through it, with vLLM's keyword arguments, and one plain linear of
the exported head over the base model's output must give the exported model's and the in-library model's logits, for
every exported architecture and for SCALE-Preserve and SCALE-Adapt (``up_logit_scale`` != 1, folded into the head).
SCALE-Route and SCALE-Preserve with a mixing router mix at the logits: their export says it is not servable there,
their base model refuses vLLM's attention, and transformers still loads and runs them. Logits are compared with the
in-library model's float64 logits, as close as the in-library fp32 model's (`exactness.assert_exact_to_rounding`).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AttentionInterface, AutoConfig, AutoModel, AutoModelForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from scale_cl.export import modeling_scale
from scale_cl.export.card import CardInfo, model_card
from scale_cl.export.export import export_model
from scale_cl.export.merge import FAMILIES
from scale_cl.tuner.config import ScaleConfig
from scale_cl.tuner.routing import ROUTERS
from tests.conftest import VOCAB
from tests.exactness import assert_exact_to_rounding
from tests.export.test_export import LIKELIHOOD, lively_scale_model
from tests.tuner.test_generate import padded_prompts  # three rows, left-padded by 0, 3 and 5 tokens

pytestmark = pytest.mark.exactness

ARCHITECTURES = {  # every exported family, one tiny shape each (conftest.ARCHS)
    "llama": ("llama-gqa2-tied", "ScaleLlamaModel"),
    "mistral": ("mistral-gqa2", "ScaleMistralModel"),
    "qwen2": ("qwen2-qkv-bias", "ScaleQwen2Model"),
    "gpt-neox": ("neox-parallel-rot0.25", "ScaleGPTNeoXModel"),
}
ALPHA = {"preserve": 0.5, "adapt": 2.0}  # up_logit_scale: Z + alpha Z_up, folded into the exported head
SERVABLE = [f"{family}-{method}" for family in ARCHITECTURES for method in ALPHA]
# Mixing at the logits: Route's two paths (Eq. 5) and SCALE-Preserve's base and own logits mixed by a router.
NOT_SERVABLE = {
    "route": ("llama-gqa2-tied", "route", {}),
    "preserve-likelihood": ("llama-gqa4-untied", "preserve", LIKELIHOOD),
}
HEAD = "lm_head.weight"  # what vLLM's TransformersForCausalLM loads its LM head from
LENGTH = 12  # vLLM's one row of tokens


class RecordingAttention:
    """An attention function that records each call (the layer and the keyword arguments) and delegates to sdpa."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, dict]] = []

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        self.calls.append((module.layer_idx, kwargs))
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)


@pytest.fixture(scope="module")
def vllm_attention():
    """The recording attention function, registered under the name vLLM's Transformers backend registers its own."""
    name = modeling_scale.VLLM_ATTENTION
    before = AttentionInterface._global_mapping.get(name)
    recorder = RecordingAttention()
    AttentionInterface.register(name, recorder)
    yield recorder
    if before is None:
        AttentionInterface._global_mapping.pop(name, None)
    else:
        AttentionInterface.register(name, before)


def vllm_row() -> tuple[torch.Tensor, torch.Tensor]:
    """One unpadded row of token ids and its positions, as vLLM hands them to the base model."""
    ids = torch.randint(3, VOCAB, (1, LENGTH), generator=torch.Generator().manual_seed(11))
    return ids, torch.arange(LENGTH)[None]


class Logits(NamedTuple):
    """The in-library model's logits on one input: fp32 (``stock``) and float64 (``exact``)."""

    stock: torch.Tensor
    exact: torch.Tensor

    def check(self, got: torch.Tensor, where: torch.Tensor | None = None, what: str = "logits") -> None:
        """``got`` as close to the float64 logits as the in-library fp32 model's (at ``where``'s positions)."""
        stock, exact = (self.stock, self.exact) if where is None else (self.stock[where], self.exact[where])
        assert_exact_to_rounding(got if where is None else got[where], exact, stock=stock, what=what)


def library_logits(model, ids: torch.Tensor, mask: torch.Tensor | None = None) -> Logits:
    """The in-library model's logits on ``ids`` (left-padded by ``mask``), in fp32 and in float64."""
    kwargs = {} if mask is None else {"attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp_min(0)}
    with torch.no_grad():
        return Logits(model(ids, **kwargs).logits, copy.deepcopy(model).double()(ids, **kwargs).logits)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Every case exported: name -> (folder, the in-library model's `Logits` on `vllm_row` and on `padded_prompts`,
    the in-library head's W_out and W_out_up)."""
    root = tmp_path_factory.mktemp("vllm_exports")
    cases = {name: (ARCHITECTURES[name.rsplit("-", 1)[0]][0], name.rsplit("-", 1)[1]) for name in SERVABLE}
    options = {name: {"up_logit_scale": ALPHA[method]} for name, (_, method) in cases.items()}
    cases.update({name: (arch, method) for name, (arch, method, _) in NOT_SERVABLE.items()})
    options.update({name: settings for name, (_, _, settings) in NOT_SERVABLE.items()})
    (ids, _), (padded, mask) = vllm_row(), padded_prompts()
    out = {}
    for name, (arch, method) in cases.items():
        model = lively_scale_model(arch, method, **options[name])
        row, batch = library_logits(model, ids), library_logits(model, padded, mask)
        head = model.get_output_embeddings()
        export_model(model, root / name)
        out[name] = (root / name, row, batch, head.weight.detach().clone(), head.weight_up.detach().clone())
    return out


def vllm_base_model(folder: Path) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """What vLLM's Transformers backend builds: ``AutoModel.from_config`` with its attention implementation set on the
    config first, given the checkpoint's weights under the base model's prefix; and the weights left over."""
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    config._attn_implementation = modeling_scale.VLLM_ATTENTION
    base = AutoModel.from_config(config, trust_remote_code=True)
    weights = load_file(folder / "model.safetensors")
    prefix = f"{base.base_model_prefix}."
    result = base.load_state_dict({k.removeprefix(prefix): v for k, v in weights.items() if k.startswith(prefix)})
    assert not result.missing_keys and not result.unexpected_keys, result
    return base.eval(), {k: v for k, v in weights.items() if not k.startswith(prefix)}


def assert_split_norms(base: torch.nn.Module, config) -> None:
    """The base model's norms are the split ones (one per layer norm and the final one), and none is named like an
    RMSNorm, which vLLM's Transformers backend swapped for a whole-width RMSNorm by its class name."""
    split = [m for m in base.modules() if type(m).__name__ in ("SplitRMSNormGroups", "SplitLayerNorm")]
    assert len(split) == 2 * config.num_hidden_layers + 1
    assert all(m.groups[0][:2] == (0, config.scale_hidden_size) for m in split)  # x normalised on its own
    assert not [type(m).__name__ for m in base.modules() if type(m).__name__.endswith("RMSNorm")]


# ------------------------------------------------------------------------------------- servable exports
@pytest.mark.parametrize("name", SERVABLE)
def test_attention_runs_through_the_registered_function_with_the_forwards_kwargs(exports, vllm_attention, name):
    """vLLM's way: every layer's attention goes through the function named by ``config._attn_implementation``, once
    per layer per forward, with the keyword arguments given to the base model's forward; the exported head over its
    output is the exported model's (eager attention) and the in-library model's logits."""
    folder, reference, _, _, _ = exports[name]
    base, rest = vllm_base_model(folder)
    assert type(base).__name__ == ARCHITECTURES[name.rsplit("-", 1)[0]][1]
    assert base.config._attn_implementation == modeling_scale.VLLM_ATTENTION
    assert list(rest) == [HEAD]  # all but vLLM's own head is the base model's
    assert_split_norms(base, base.config)
    ids, positions = vllm_row()
    layers = base.config.num_hidden_layers
    marker = object()  # what vLLM passes as attention_instances (its Attention modules per layer)
    for _ in range(2):  # one call per layer in each forward
        vllm_attention.calls.clear()
        with torch.no_grad():
            hidden = base(input_ids=ids, position_ids=positions, use_cache=False, attention_instances=marker)[0]
        assert sorted(layer for layer, _ in vllm_attention.calls) == list(range(layers))
        assert all(kwargs.get("attention_instances") is marker for _, kwargs in vllm_attention.calls)
    logits = F.linear(hidden, rest[HEAD])
    eager = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = eager(ids).logits
    reference.check(expected, what="the export's eager logits")
    reference.check(logits, what="vLLM's head over the base model")
    assert (expected - expected.mean(-1, keepdim=True)).abs().max() > 0.5  # logits that say something


@pytest.mark.parametrize("name", SERVABLE)
def test_automodel_loads_the_base_model_and_the_head_is_one_linear(exports, name):
    """``AutoModel.from_pretrained`` loads the Scale base class with every weight but the head (vLLM's own), and
    ``F.linear(last_hidden_state, lm_head.weight)`` is ``AutoModelForCausalLM``'s logits: the head is ``[W_out, alpha
    W_out_up]``, one plain linear."""
    folder, _, reference, w_out, w_up = exports[name]
    family, method = name.rsplit("-", 1)
    config = json.loads((folder / "config.json").read_text())
    causal_class = config["architectures"][0]
    assert config["auto_map"] == {
        "AutoConfig": f"modeling_scale.{causal_class.removesuffix('ForCausalLM')}Config",
        "AutoModel": f"modeling_scale.{ARCHITECTURES[family][1]}",
        "AutoModelForCausalLM": f"modeling_scale.{causal_class}",
    }
    assert config["scale_vllm_servable"] is True and config["scale_method"] == method
    base, info = AutoModel.from_pretrained(folder, trust_remote_code=True, output_loading_info=True)
    assert type(base).__name__ == ARCHITECTURES[family][1] and type(base).is_backend_compatible()
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), {HEAD}, set())
    assert_split_norms(base, base.config)
    causal = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(getattr(causal, causal.base_model_prefix)) is type(base)  # the causal LM is built on the Scale base
    assert type(causal.get_output_embeddings()) is torch.nn.Linear
    head = load_file(folder / "model.safetensors")[HEAD]
    d = config["scale_hidden_size"]
    assert torch.equal(head[:, :d], w_out) and torch.equal(head[:, d:], ALPHA[method] * w_up)  # alpha folded in
    ids, mask = padded_prompts()
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        hidden = base.eval()(ids, attention_mask=mask, position_ids=positions).last_hidden_state
        out = causal(ids, attention_mask=mask, position_ids=positions, output_hidden_states=True)
    assert torch.equal(F.linear(hidden, head), out.logits)  # the causal LM's head is this linear, on this input
    assert len(out.hidden_states) == config["num_hidden_layers"] + 1  # transformers' output capture sees the base
    assert torch.equal(out.hidden_states[-1], hidden)
    reference.check(out.logits, mask.bool())


def test_a_head_that_lost_alpha_falls_outside_the_bound(exports):
    """The check above can fail: vLLM's head over the base model, with the new columns at ``alpha`` 1 (``alpha`` not
    folded into ``lm_head.weight``, where vLLM reads the head), is not the in-library model's logits."""
    folder, _, reference, w_out, w_up = exports["qwen2-preserve"]
    base, _ = AutoModel.from_pretrained(folder, trust_remote_code=True, output_loading_info=True)
    ids, mask = padded_prompts()
    with torch.no_grad():
        hidden = base.eval()(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0))[0]
    reference.check(F.linear(hidden, torch.cat((w_out, ALPHA["preserve"] * w_up), dim=1)), mask.bool())
    with pytest.raises(AssertionError, match="more than the bound"):
        reference.check(F.linear(hidden, torch.cat((w_out, w_up), dim=1)), mask.bool())


def test_every_exported_class_declares_the_attention_backend():
    """``_supports_attention_backend`` set by the exported module itself (vLLM reads it through
    ``is_backend_compatible``) on each causal LM and its base model class, which is what ``auto_map`` names."""
    for _, causal in FAMILIES.values():
        for cls in (causal, causal.base_class):
            assert "_supports_attention_backend" in vars(cls), cls.__name__
            assert cls.is_backend_compatible() is True
        assert issubclass(causal.base_class, modeling_scale.ScaleModelMixin)
    assert {causal.base_class.__name__ for _, causal in FAMILIES.values()} == {c for _, c in ARCHITECTURES.values()}


def test_what_mixes_at_the_logits():
    """Route always, Preserve with a mixing router, never Adapt (its router is not used): the same as the library's
    `ScaleConfig.routed`, the settings whose logits a router makes."""
    routers = ("cosine", "likelihood", "nested", "confidence", "hybrid")
    for method in ("preserve", "adapt", "route"):
        for router in routers:
            expected = method == "route" or (method == "preserve" and router != "cosine")
            library = ScaleConfig(hidden_up=32, ffn_up=0, method=method, router=router)
            assert library.routed is expected, (method, router)
            mixture = ROUTERS[router].mixture(lambda name, c=library: getattr(c, name)) if library.routed else None
            assert modeling_scale.mixes_logits(method, mixture) is expected, (method, router)


# ------------------------------------------------------------------------------------- not servable
@pytest.mark.parametrize("name", sorted(NOT_SERVABLE))
def test_exports_that_mix_at_the_logits_are_marked_and_still_run_in_transformers(exports, vllm_attention, name):
    """Route's and a mixing router's exports: ``scale_vllm_servable`` false and the card says so; their base model
    refuses vLLM's attention implementation (rather than serve other logits); transformers loads and runs them."""
    folder, _, reference, _, _ = exports[name]
    config = json.loads((folder / "config.json").read_text())
    assert config["scale_vllm_servable"] is False
    assert config["auto_map"]["AutoModel"].startswith("modeling_scale.Scale")
    card = (folder / "README.md").read_text()
    assert "`scale_vllm_servable: true`" in card  # exported from memory: the card points at the config's marker
    with pytest.raises(ValueError, match=r"mixes at the logits.*serve it with transformers' generate"):
        vllm_base_model(folder)
    causal = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(causal.get_output_embeddings()).__name__ == "RouteHead"
    ids, mask = padded_prompts()
    with torch.no_grad():
        logits = causal(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits
        tokens = causal.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    reference.check(logits, mask.bool())
    assert tokens.shape == (ids.shape[0], ids.shape[1] + 4)


def test_the_model_card_says_where_it_can_be_served():
    def card(method: str, router: str) -> str:
        scale = ScaleConfig(hidden_up=32, ffn_up=0, method=method, router=router)
        info = CardInfo(method=f"scale_{method}", custom_code=True, scale=scale)
        return model_card(info)

    command = "vllm serve path/to/this/folder --model-impl transformers --trust-remote-code"
    for method, router in (("preserve", "cosine"), ("adapt", "cosine"), ("adapt", "likelihood")):
        assert command in card(method, router) and "not servable" not in card(method, router)
    for method, router in (("route", "cosine"), ("route", "likelihood"), ("preserve", "nested")):
        text = card(method, router)
        assert "not servable by vLLM's Transformers backend" in text and "`generate`" in text and command not in text
    assert "vllm serve" not in model_card(CardInfo(method="lora", custom_code=False))  # a stock checkpoint
