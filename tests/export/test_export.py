"""``scale-cl export``: an exported folder loads where scale-cl is not installed, and computes the trained model.

Every export is loaded in a fresh Python (``-I``, the repository's ``src`` removed from ``sys.path``, a
check that ``import scale_cl`` fails) with ``AutoModelForCausalLM.from_pretrained``: ``trust_remote_code``
for SCALE models, without it for the baselines (plain checkpoints of their stock class). Its logits on a
left-padded batch must match the in-library model's within 1e-5 and its greedy tokens (KV cache, route's
two paths in it) must be equal. One subprocess loads every export of the two module fixtures, to keep this file
fast.

The exported logits (and a router's weights) must be as close to the in-library model's float64 logits as the
in-library fp32 model's are (`exactness.assert_exact_to_rounding`): the export merges the blocks into one weight and
sums in another order, so it rounds differently, as far as the library does and no farther, whatever the CPU's kernels.

The real SmolLM2-135M's export is checked in tests/models/test_smollm2.py, which loads that model once for all its
checks.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import scale_cl
from scale_cl import ScaleConfig, set_method, upscale
from scale_cl.cli import main
from scale_cl.eval.route_separation import mixes_experts
from scale_cl.export import modeling_scale
from scale_cl.export.card import CardInfo, model_card
from scale_cl.export.export import export_model
from scale_cl.export.merge import FAMILIES
from scale_cl.methods import REGISTRY, prepare
from scale_cl.models import BaseModelRef, load_base, save_trained
from scale_cl.train.trainer import CHECKPOINT_META
from scale_cl.tuner.arch import SPECS
from scale_cl.tuner.io import CONFIG_NAME
from scale_cl.tuner.modes import set_live_settings
from scale_cl.tuner.vocab import grow_embeddings, new_row_parameters
from tests.conftest import ARCHS, VOCAB, hidden_up_for, make_model, randomize_new_weights, upscaled_copy
from tests.conftest import greedy as generate_greedy
from tests.exactness import assert_exact_to_rounding, weight_floor
from tests.tuner.test_generate import padded_prompts  # three rows, left-padded by 0, 3 and 5 tokens

pytestmark = pytest.mark.exactness

METHODS = ("preserve", "adapt", "route")
SCALE_CASES = [(arch, method) for arch in sorted(ARCHS) for method in METHODS]
# Route's two paths from the first layer on, and no collaborative layer at all (both paths one network).
ROUTE_EDGES = {"route-from-layer-0": ("llama-mqa", 0), "route-no-collaborative-layer": ("neox-parallel-rot0.25", 3)}
BEAM_CASES = {("llama-gqa2-tied", "route"), ("neox-parallel-rot0.25", "route")}
# The quiet-stream options (docs/design.md §2): the norms' statistic, E_up at zero, alpha merged into W_out_up,
# and route_exact in the exported RouteHead.
QUIET_CASES = {
    "quiet-route-llama": ("llama-gqa2-tied", "route", {"up_norm": "joint", "up_logit_scale": 0.5, "route_exact": True}),
    "quiet-route-neox": ("neox-parallel-rot0.25", "route", {"up_norm": "original", "route_exact": True}),
    # W22 at zero: with a random W22, x_up over x's RMS grows without bound through the layers (design.md §2)
    "quiet-preserve-qwen2": (
        "qwen2-qkv-bias",
        "preserve",
        {"up_norm": "original", "up_logit_scale": 2.0, "w22_init": "zero"},
    ),
    "quiet-adapt-neox": ("neox-sequential-rot1.0", "adapt", {"up_norm": "joint", "embed_up_init": "zero"}),
}
# Models grown more than once: each stage's (method, options); the norms' groups with their statistics.
GROWN_CASES = {
    "grown-llama-adapt-route": ("llama-gqa2-tied", [("adapt", {"up_norm": "joint"}), ("route", {})]),
    "grown-neox-preserve-adapt-route": (
        "neox-parallel-rot0.25",
        [("preserve", {}), ("adapt", {"up_norm": "original", "w22_init": "zero"}), ("route", {"up_logit_scale": 0.5})],
    ),
    "grown-qwen2-adapt-preserve": ("qwen2-qkv-bias", [("adapt", {}), ("preserve", {"up_norm": "joint"})]),
    "grown-llama-biases-preserve-adapt": (
        "llama-biases",
        [("preserve", {"up_norm": "original", "w22_init": "zero"}), ("adapt", {})],
    ),
}
# The likelihood router: the two paths' mixture by the running likelihood ratio, with a KV cache and beams.
LIKELIHOOD = {"router": "likelihood", "router_prior": 0.3, "router_decay": 0.9}
LIKELIHOOD_CASES = {  # name: (architecture, method, preserve_layers)
    "likelihood-route-llama": ("llama-gqa2-tied", "route", 1),
    "likelihood-route-neox": ("neox-parallel-rot0.25", "route", 1),
    "likelihood-route-no-collaborative-layer": ("llama-mqa", "route", 3),
    "likelihood-preserve": ("llama-gqa4-untied", "preserve", 1),  # its Z is the base's: one path
}
# The nested router: SCALE-Preserve grown twice, its base's and each stage's logits mixed in one pass.
NESTED_CASE = "nested-preserve-grown-twice"
NESTED = {"router": "nested", "router_prior": 0.3, "router_decay": 0.9}
# The confidence routers: each expert weighed by its confidence (and the hybrid's prefix posterior), in
# Route's two paths, Preserve's one and a grown model's nested experts. name: (architecture, method, grown, settings)
CONFIDENCE = {"router_prior": 0.3, "router_decay": 0.9, "router_temperature": 0.05}
CONFIDENCE_CASES = {
    "confidence-route-llama": ("llama-gqa2-tied", "route", False, {"router": "confidence"}),
    "hybrid-route-neox": ("neox-parallel-rot0.25", "route", False, {"router": "hybrid", "router_confidence": "top"}),
    "confidence-preserve": ("llama-gqa4-untied", "preserve", False, {"router": "confidence"}),
    "hybrid-preserve-grown-twice": ("llama-gqa4-untied", "preserve", True, {"router": "hybrid"}),
}
# The calibrated router: a fitted gate over the same evidence. name: (architecture, method, grown)
CALIBRATED = {
    "router": "calibrated",
    "router_prior": 0.3,
    "router_decay": 0.8,
    "router_prefix_weight": 0.6,
    "router_entropy_weight": 8.0,
    "router_top_weight": -3.0,
}
CALIBRATED_CASES = {
    "calibrated-route-neox": ("neox-parallel-rot0.25", "route", False),
    "calibrated-preserve": ("llama-gqa4-untied", "preserve", False),
    "calibrated-preserve-grown-twice": ("llama-gqa2-tied", "preserve", True),
}
NEW_TOKENS = 8
SRC = Path(scale_cl.__file__).resolve().parents[1]

# The clean Python: no PYTHON* variables, no user site (-I), and the editable install of scale-cl
# (a .pth entry pointing at the repository's src) taken out of sys.path before anything is imported.
CHILD = r"""
import json, os, sys
hidden = os.path.realpath(sys.argv[1])
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != hidden]
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
try:
    import scale_cl
except ModuleNotFoundError:
    pass
else:
    raise SystemExit(f"scale_cl is importable in the clean environment: {scale_cl.__file__}")
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

torch.set_num_threads(1)
classes = {}
for job in json.loads(open(sys.argv[2]).read()):
    dtype = torch.float64 if job["float64"] else torch.float32
    model = AutoModelForCausalLM.from_pretrained(job["path"], trust_remote_code=job["remote"], dtype=dtype)
    model.eval()
    ids, mask = torch.tensor(job["ids"]), torch.tensor(job["mask"])
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    kwargs = {"attention_mask": mask, "do_sample": False, "pad_token_id": 0}
    out = {}
    with torch.no_grad():
        out["logits"] = model(ids, attention_mask=mask, position_ids=position_ids).logits
        head = model.get_output_embeddings()
        routed = getattr(head, "last_mask", None)  # route: Eq. 5's choice per token
        if routed is not None:
            out["routed"], out["tau"] = routed, torch.tensor(head.tau, dtype=torch.float64)
        weight = getattr(head, "last_weight", None)  # the likelihood router's base weight per token
        if weight is not None:
            out["weight"] = weight
        new = job["new_tokens"]
        out["greedy"] = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kwargs)
        if job["beams"]:
            out["beams"] = model.generate(ids, max_new_tokens=6, num_beams=3, **kwargs)
    if job["tokenizer"]:
        tokenizer = AutoTokenizer.from_pretrained(job["path"], trust_remote_code=True)  # it reads the config
        out["tokenized"] = torch.tensor(tokenizer("ka to mi")["input_ids"])
    save_file({k: v.contiguous() for k, v in out.items()}, job["output"])
    classes[job["name"]] = f"{type(model).__module__}.{type(model).__name__}"
leaked = sorted(m for m in sys.modules if m.split(".")[0] == "scale_cl")
json.dump({"classes": classes, "leaked": leaked}, open(sys.argv[3], "w"))
"""


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def forward_readings(model, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The logits on the padded batch and what the head read on the way: a mixing router's base weight per token,
    or Eq. 5's choice per token."""
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    out = {"logits": model(ids, attention_mask=mask, position_ids=position_ids).logits}
    route = getattr(model, "scale_route", None)
    if mixes_experts(model):
        out["weight"] = route.last.base_weight  # the base path's weight per token
    elif route is not None and route.stacked:  # without a collaborative layer every token routes alike
        out["routed"] = route.last.routed
    return out


def mixing_weight_ulps(model, exact_logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> float:
    """The floor of a mixing router's weights' rounding (`exactness.weight_floor`) from the model's settings: its
    prior, decay, whether it reads the prefix, and its confidence over the temperature (|-H| and |ln max p| are at most
    ln V)."""
    config = scale_cl.scale_config_of(model)
    prior, decay, log_v = config.router_prior, config.router_decay, math.log(exact_logits.shape[-1])
    if config.router == "calibrated":  # the gate's weights on the prefix and the two confidences
        confidence = (abs(config.router_entropy_weight) + abs(config.router_top_weight)) * log_v
        prefix_weight = config.router_prefix_weight
        return weight_floor(
            exact_logits, ids, mask.bool(), prior, decay, confidence=confidence, prefix_weight=prefix_weight
        )
    prefix = config.router in ("likelihood", "nested", "hybrid")
    confident = config.router in ("confidence", "hybrid")
    confidence = log_v / config.router_temperature if confident else 0.0
    return weight_floor(exact_logits, ids, mask.bool(), prior, decay, prefix=prefix, confidence=confidence)


def reference(model, ids: torch.Tensor, mask: torch.Tensor, beams: bool = False) -> dict[str, torch.Tensor]:
    """What the in-library model computes: logits on the padded batch, greedy tokens (and beam search); and, as
    ``exact``, the same model's logits (and base weight) in float64, which every comparison measures rounding from.

    On one thread, as the clean Python computes (``OMP_NUM_THREADS=1``): a CPU matrix product's rounding can depend
    on how many threads split it (on SmolLM2, 3e-5 in the logits between 1 and 2 threads of the same model)."""
    with torch.no_grad(), one_thread():
        out = forward_readings(model, ids, mask)
        exact = forward_readings(copy.deepcopy(model).double(), ids, mask)
        if "routed" in out:  # the float64 model takes Eq. 5's branches the fp32 one takes, or it is no reference
            assert torch.equal(exact.pop("routed"), out["routed"]), "a cosine this close to tau flips with rounding"
        out.update({f"exact_{key}": value for key, value in exact.items()})
        if "weight" in out:
            out["weight_ulps"] = torch.tensor(mixing_weight_ulps(model, exact["logits"], ids, mask))
        out["greedy"] = generate_greedy(model, ids, mask, NEW_TOKENS)
        if beams:
            kwargs = {"attention_mask": mask, "do_sample": False, "pad_token_id": 0}
            out["beams"] = model.generate(ids, max_new_tokens=6, num_beams=3, **kwargs)
    return out


def job(name: str, path: Path, remote: bool, ids: torch.Tensor, mask: torch.Tensor, **flags: bool) -> dict:
    return {
        "name": name,
        "path": str(path),
        "remote": remote,
        "ids": ids.tolist(),
        "mask": mask.tolist(),
        "new_tokens": NEW_TOKENS,
        "beams": flags.get("beams", False),
        "tokenizer": flags.get("tokenizer", False),
        "float64": flags.get("float64", False),
        "output": str(path.parent / f"{name}.out.safetensors"),
    }


def load_in_clean_python(jobs: list[dict], folder: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """Run every job in one fresh Python that cannot import scale_cl; (outputs per job, classes and leaks)."""
    spec, summary = folder / "jobs.json", folder / "summary.json"
    spec.write_text(json.dumps(jobs))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    # Remote code is copied into HF_HOME's module cache: a private one, offline.
    env.update(HF_HOME=str(folder / "hf_home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    argv = [sys.executable, "-I", "-c", CHILD, str(SRC), str(spec), str(summary)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900, cwd=folder)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {j["name"]: load_file(j["output"]) for j in jobs}, json.loads(summary.read_text())


def assert_matches(
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    mask: torch.Tensor,
    logits: bool = True,
    greedy: bool = True,
) -> None:
    """Logits (unless ``logits`` is false) and a router's base weight as exact as the in-library model's, to its
    float64 values; the same greedy tokens (unless ``greedy`` is false), routing and beams."""
    real = mask.bool()
    if logits:
        assert_exact_to_rounding(
            got["logits"][real], want["exact_logits"][real], stock=want["logits"][real], what="logits"
        )
    if greedy:
        assert torch.equal(got["greedy"], want["greedy"])
    if "routed" in want:
        assert torch.equal(got["routed"], want["routed"])
    if "weight" in want:
        ulps = float(want["weight_ulps"])
        exact, stock = want["exact_weight"][real], want["weight"][real]
        assert_exact_to_rounding(got["weight"][real], exact, stock=stock, ulps=ulps, what="base weight")
    if "beams" in want:
        assert torch.equal(got["beams"], want["beams"])


def lively_scale_model(arch: str, method: str, preserve_layers: int = 1, **options):
    """An upscaled tiny model whose new weights all matter (random W21/W22, W12 and the head's new columns
    non-zero) and whose greedy tokens vary: larger embeddings than conftest's 0.02 std (whose NeoX biases
    would make every position predict one token), less so where the head is the embedding (tied), so that
    logits stay below ~10."""
    base = make_model(arch, seed=0)
    with torch.no_grad():
        base.get_input_embeddings().weight.mul_(5.0 if base.config.tie_word_embeddings else 25.0)
    fields = {"ffn_up": 16, "w21_init": "random", "w22_init": "random", "seed": 1, **options}
    model = upscaled_copy(base, method, preserve_layers=preserve_layers, **fields).eval()
    model = randomize_new_weights(model, seed=4, w12_scale=0.3)
    eq5 = model.scale_route.stacked and options.get("router", "cosine") == "cosine"
    return balance_route(model) if eq5 else model


def grown_scale_model(arch: str, stages: list[tuple[str, dict]]):
    """`lively_scale_model` grown once per later stage (`scale_cl.tuner.stages`), every stage's new weights
    lively too."""
    (method, options), *later = stages
    model = lively_scale_model(arch, method, **options)
    for seed, (method, options) in enumerate(later, start=5):
        fields = {"ffn_up": 16, "w21_init": "random", "w22_init": "random", "seed": seed, **options}
        model = upscale(model, ScaleConfig(hidden_up=hidden_up_for(model), method=method, preserve_layers=1, **fields))
        model = randomize_new_weights(model.eval(), seed=seed, w12_scale=0.3)
    return balance_route(model) if model.scale_route.stacked else model


def balance_route(model):
    """Route with the tau (from a grid) that sends the share of tokens closest to half to each branch of Eq. 5,
    so that the comparison covers both; kept by the model, as a trained model's tau is."""
    ids, mask = padded_prompts()
    shares = {}
    for tau in torch.linspace(-0.9, 0.9, 19).tolist():
        set_method(model, "route", tau=tau)
        with torch.no_grad():
            model(ids, attention_mask=mask)
        shares[tau] = model.scale_route.last.routed[mask.bool()].float().mean().item()
    tau = min(shares, key=lambda t: abs(shares[t] - 0.5))
    assert 0.1 < shares[tau] < 0.9, shares
    return set_method(model, "route", tau=tau)


def perturb_trainable(model, seed: int = 3):
    """Move every trainable parameter (LoRA's B starts at zero, LLaMA Pro's copies are the identity)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(0.05 * torch.randn(param.shape, generator=gen))
    return model.eval()


# ----------------------------------------------------------------------------------- SCALE exports
def build_scale_exports(root: Path) -> tuple[list[dict], dict[str, dict[str, torch.Tensor]]]:
    """Every tiny architecture x preserve/adapt/route (and the routers, grown models, quiet options), exported into
    ``root``: (their jobs for the clean Python, the in-library readings)."""
    ids, mask = padded_prompts()
    jobs, expected = [], {}
    for arch, method in SCALE_CASES:
        name = f"{arch}-{method}"
        model = lively_scale_model(arch, method)
        beams = (arch, method) in BEAM_CASES
        expected[name] = reference(model, ids, mask, beams)
        assert len(torch.unique(expected[name]["greedy"][:, ids.shape[1] :])) > 1, name  # not one repeated token
        export_model(model, root / name)
        jobs.append(job(name, root / name, True, ids, mask, beams=beams))
    for name, (arch, preserve_layers) in ROUTE_EDGES.items():
        model = lively_scale_model(arch, "route", preserve_layers)
        expected[name] = reference(model, ids, mask, beams=True)
        export_model(model, root / name)
        jobs.append(job(name, root / name, True, ids, mask, beams=True))
    for name, (arch, method, options) in QUIET_CASES.items():
        model = lively_scale_model(arch, method, **options)
        expected[name] = reference(model, ids, mask)
        export_model(model, root / name)
        jobs.append(job(name, root / name, True, ids, mask))
    for name, (arch, method, preserve_layers) in LIKELIHOOD_CASES.items():
        model = lively_scale_model(arch, method, preserve_layers, **LIKELIHOOD)
        expected[name] = reference(model, ids, mask, beams=True)
        export_model(model, root / name)
        jobs.append(job(name, root / name, True, ids, mask, beams=True))
    for name, (arch, stages) in GROWN_CASES.items():
        model = grown_scale_model(arch, stages)
        expected[name] = reference(model, ids, mask, beams=True)
        export_model(model, root / name)
        jobs.append(job(name, root / name, True, ids, mask, beams=True))
    model = grown_scale_model("llama-gqa4-untied", [("preserve", {}), ("preserve", {}), ("preserve", NESTED)])
    expected[NESTED_CASE] = reference(model, ids, mask, beams=True)
    export_model(model, root / NESTED_CASE)
    jobs.append(job(NESTED_CASE, root / NESTED_CASE, True, ids, mask, beams=True))
    for name, (arch, method, grown, settings) in CONFIDENCE_CASES.items():
        if grown:
            model = grown_scale_model(arch, [(method, {}), (method, {}), (method, {**CONFIDENCE, **settings})])
        else:
            model = lively_scale_model(arch, method, **CONFIDENCE, **settings)
        expected[name] = reference(model, ids, mask, beams=True)
        export_model(model, root / name)
        jobs.append(job(name, root / name, True, ids, mask, beams=True))
    for name, (arch, method, grown) in CALIBRATED_CASES.items():
        if grown:
            model = grown_scale_model(arch, [(method, {}), (method, {}), (method, CALIBRATED)])
        else:
            model = lively_scale_model(arch, method, **CALIBRATED)
        expected[name] = reference(model, ids, mask, beams=True)
        export_model(model, root / name)
        jobs.append(job(name, root / name, True, ids, mask, beams=True))
    model = tau_saved_and_reloaded(root / "tau-checkpoint")  # set, saved, loaded, then exported
    expected[TAU_CASE] = reference(model, ids, mask)
    export_model(model, root / TAU_CASE)
    jobs.append(job(TAU_CASE, root / TAU_CASE, True, ids, mask))
    return jobs, expected


@pytest.fixture(scope="module")
def clean_loads(tmp_path_factory, workspace) -> dict[str, tuple]:
    """This file's two batches of exports (`build_scale_exports`, `build_other_exports`), loaded in one clean Python:
    its start (torch, transformers) is most of a batch's loading time. Per batch: (its folder, the in-library
    readings, the clean Python's, the summary, the mask)."""
    roots = {name: tmp_path_factory.mktemp(name) for name in ("other_exports", "scale_exports")}
    other_jobs, other_expected = build_other_exports(roots["other_exports"], workspace)
    scale_jobs, scale_expected = build_scale_exports(roots["scale_exports"])
    got, summary = load_in_clean_python(other_jobs + scale_jobs, tmp_path_factory.mktemp("clean_loads"))
    mask = padded_prompts()[1]
    return {
        "other_exports": (roots["other_exports"], other_expected, got, summary, mask),
        "scale_exports": (roots["scale_exports"], scale_expected, got, summary, mask),
    }


@pytest.fixture(scope="module")
def scale_exports(clean_loads):
    """Every tiny architecture x preserve/adapt/route, exported and loaded in the clean Python."""
    return clean_loads["scale_exports"]


TAU_CASE = "route-tau-set-saved-loaded"
TAU = -0.0625  # exact in binary: the same number in the route state, JSON and float64


def tau_saved_and_reloaded(directory: Path):
    """A route model whose tau was set on the live model (both spellings of its one setter), saved with it and
    loaded back."""
    model = lively_scale_model("llama-gqa2-tied", "route")
    set_method(model, "route", tau=0.3)
    assert model.scale_route.tau == scale_cl.scale_config_of(model).route_tau == 0.3
    set_live_settings(model, route_tau=TAU)
    assert scale_cl.scale_config_of(model).route_tau == TAU
    with pytest.raises(AttributeError, match="tau is set in one way"):
        model.scale_route.tau = 0.1
    with pytest.raises(ValueError, match=r"route_tau must be in \[-1, 1\]"):
        set_method(model, "route", tau=1.5)
    assert model.scale_route.tau == TAU and model.scale_route.active  # a refused tau changes nothing
    model.save_pretrained(directory, full=True)
    assert json.loads((directory / CONFIG_NAME).read_text())["scale_config"]["route_tau"] == TAU
    loaded = scale_cl.load(directory).eval()
    assert loaded.scale_route.tau == TAU
    ids, mask = padded_prompts()
    with torch.no_grad():
        model(ids, attention_mask=mask)
        loaded(ids, attention_mask=mask)
    assert torch.equal(loaded.scale_route.last.routed, model.scale_route.last.routed)
    return loaded


def test_tau_set_on_the_live_model_is_the_saved_loaded_and_exported_one(scale_exports):
    """One value from `set_method(model, "route", tau=...)` to the exported model: its config and its routing."""
    root, expected, got, _, mask = scale_exports
    assert json.loads((root / TAU_CASE / "config.json").read_text())["scale_route_tau"] == TAU
    assert got[TAU_CASE]["tau"].item() == TAU
    routed = expected[TAU_CASE]["routed"][mask.bool()]
    assert routed.any() and not routed.all()
    assert_matches(got[TAU_CASE], expected[TAU_CASE], mask)


@pytest.mark.parametrize("exact", [False, True], ids=["eq5", "exact"])
@pytest.mark.parametrize("new_rows", [0, 5], ids=["vocabulary", "extended"])
@pytest.mark.parametrize("tau", [-1.0, 0.2, 1.0])
def test_exported_route_head_is_the_packages_eq5(new_rows, tau, exact):
    """modeling_scale.RouteHead (a standalone copy, the exported file imports nothing of scale-cl) computes what
    scale_cl.tuner.routing.cosine.route_logits does:
    the same routing, and logits equal up to the order of the halves' sums."""
    from types import SimpleNamespace

    from scale_cl.tuner.routing.cosine import route_logits

    gen = torch.Generator().manual_seed(0)
    batch, length, d, u, vocab = 2, 7, 24, 8, 40
    weight = torch.randn(vocab, d, generator=gen) / d**0.5
    weight_new = torch.randn(new_rows, d, generator=gen) / d**0.5 if new_rows else None
    weight_up = torch.randn(vocab + new_rows, u, generator=gen)
    hidden = torch.randn(2 * batch, length, d + u, generator=gen)
    noise = torch.linspace(0.05, 3.0, length)[None, :, None]  # adapt near preserve for some tokens, not others
    hidden[batch:, :, :d] = hidden[:batch, :, :d] + noise * torch.randn(batch, length, d, generator=gen)

    config = SimpleNamespace(
        scale_hidden_size=d,
        scale_route_tau=tau,
        scale_route_vocab_size=vocab if new_rows else 0,
        scale_route_exact=exact,
        scale_router="cosine",
        scale_mixture=None,
    )
    head = modeling_scale.RouteHead(d + u, vocab + new_rows, config)
    with torch.no_grad():
        original = weight if weight_new is None else torch.cat((weight, weight_new))
        head.weight.copy_(torch.cat((original, weight_up), dim=1))
        exported = head(hidden)
        x, x_up = hidden[..., :d], hidden[..., d:]
        ours, cosine = route_logits(x, x_up, weight, None, weight_up, tau, weight_new, exact=exact)
        double = [t.double() if t is not None else None for t in (x, x_up, weight, weight_up, weight_new)]
        (x64, x_up64, weight64, weight_up64, weight_new64) = double
        ours64, cosine64 = route_logits(x64, x_up64, weight64, None, weight_up64, tau, weight_new64, exact=exact)
    assert torch.equal(head.last_mask, cosine > tau) and torch.equal(cosine64 > tau, cosine > tau)
    assert_exact_to_rounding(exported, ours64, stock=ours, what="exported RouteHead")
    config.scale_route_tau = tau - 0.5  # the head reads its config's tau at every forward
    assert head.tau == tau - 0.5


@pytest.mark.parametrize(("arch", "method"), SCALE_CASES)
def test_scale_export_loads_without_scale_cl_and_matches(scale_exports, arch, method):
    root, expected, got, summary, mask = scale_exports
    name = f"{arch}-{method}"
    assert summary["leaked"] == []
    (architecture,) = json.loads((root / name / "config.json").read_text())["architectures"]
    module, _, cls = summary["classes"][name].rpartition(".")
    assert module.startswith("transformers_modules.") and module.endswith(".modeling_scale") and cls == architecture
    assert_matches(got[name], expected[name], mask)


def test_an_export_with_alpha_rounded_to_half_precision_falls_outside_the_bound(tmp_path):
    """The bound is tight enough for a real mistake: alpha (``up_logit_scale``) passed through fp16 on its way into
    the exported head (0.3 becomes 0.2998..., a relative error of 2e-4) moves the logits outside it, where the
    export as written stays inside."""
    from transformers import AutoModelForCausalLM

    model = lively_scale_model("llama-gqa2-tied", "adapt", up_logit_scale=0.3)
    ids, mask = padded_prompts()
    want = reference(model, ids, mask)
    export_model(model, tmp_path / "export")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export", trust_remote_code=True).eval()
    d = model.config.hidden_size - hidden_up_for(model)
    with torch.no_grad(), one_thread():
        assert_matches(forward_readings(exported, ids, mask), want, mask, greedy=False)
        head = exported.get_output_embeddings().weight
        head[:, d:] *= torch.tensor(0.3, dtype=torch.float16).item() / 0.3
        with pytest.raises(AssertionError, match="more than the bound"):
            assert_matches(forward_readings(exported, ids, mask), want, mask, greedy=False)


@pytest.mark.parametrize("name", sorted(QUIET_CASES))
def test_quiet_stream_options_are_exported(scale_exports, name):
    _, expected, got, _, mask = scale_exports
    assert_matches(got[name], expected[name], mask)
    if QUIET_CASES[name][2].get("route_exact"):
        assert expected[name]["routed"][mask.bool()].any()  # some tokens do take the exact preserve branch


def test_route_exact_without_a_collaborative_layer_is_refused(tmp_path):
    model = lively_scale_model("llama-gqa2-tied", "preserve", preserve_layers=3, route_exact=True)
    set_method(model, "route")
    with pytest.raises(ValueError, match="route_exact and no collaborative layer"):
        export_model(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", sorted(LIKELIHOOD_CASES))
def test_the_likelihood_router_is_exported(scale_exports, name):
    """Its mixture, its base weight per token, greedy generation with a KV cache and beam search (the memory
    reordered with the beams) equal the in-library model's; both paths really carry weight."""
    root, expected, got, _, mask = scale_exports
    assert json.loads((root / name / "config.json").read_text())["scale_router"] == "likelihood"
    assert_matches(got[name], expected[name], mask)
    weight = expected[name]["weight"][mask.bool()]
    assert float(weight.max() - weight.min()) > 0.2, "the weight moves with the evidence (not one constant mix)"


def test_the_nested_router_is_exported(scale_exports):
    """A SCALE-Preserve model grown twice, read with the nested router: the three experts' mixture (the base's, the
    first stage's and its own logits from the head's stage columns), the base's weight, greedy generation with a KV
    cache and beam search (the experts' memory reordered with the beams) equal the in-library model's."""
    root, expected, got, _, mask = scale_exports
    config = json.loads((root / NESTED_CASE / "config.json").read_text())
    assert config["scale_router"] == "nested" and len(config["scale_norm_groups"]) == 2
    assert_matches(got[NESTED_CASE], expected[NESTED_CASE], mask)
    weight = expected[NESTED_CASE]["weight"][mask.bool()]
    assert float(weight.max() - weight.min()) > 0.2, "the base's weight moves with the evidence"


@pytest.mark.parametrize("name", sorted(CONFIDENCE_CASES))
def test_the_confidence_routers_are_exported(scale_exports, name):
    """Their mixture, the base's weight per token, greedy generation with a KV cache and beam search (the hybrid's
    memory reordered with the beams) equal the in-library model's."""
    root, expected, got, _, mask = scale_exports
    config = json.loads((root / name / "config.json").read_text())
    settings = CONFIDENCE_CASES[name][3]
    assert config["scale_router"] == settings["router"]
    assert config["scale_mixture"]["confidence"] == settings.get("router_confidence", "entropy")
    assert config["scale_mixture"]["temperature"] == CONFIDENCE["router_temperature"]
    assert config["scale_mixture"]["prefix"] is (settings["router"] == "hybrid")
    assert_matches(got[name], expected[name], mask)
    assert "weight" in got[name], "the exported head keeps the base's weight per token"


@pytest.mark.parametrize("name", sorted(CALIBRATED_CASES))
def test_the_calibrated_router_is_exported(scale_exports, name):
    """Its gate (the mixture's settings in the config), the base's weight per token, greedy generation with a KV cache
    and beam search equal the in-library model's."""
    root, expected, got, _, mask = scale_exports
    config = json.loads((root / name / "config.json").read_text())
    assert config["scale_router"] == "calibrated"
    gate = {name: value for name, value in CALIBRATED.items() if name != "router"}
    assert {f"router_{key}": value for key, value in config["scale_mixture"].items()}.items() >= gate.items()
    assert_matches(got[name], expected[name], mask)
    weight = expected[name]["weight"][mask.bool()]
    assert float(weight.max() - weight.min()) > 0.2, "the gate moves the base's weight"


@pytest.mark.parametrize("name", sorted(GROWN_CASES))
def test_grown_models_are_exported(scale_exports, name):
    """A model grown two or three times: its norms' groups (each with its statistic), the merged earlier stages
    and the last stage's method, with a KV cache and beams, as the in-library model computes them."""
    root, expected, got, _, mask = scale_exports
    config = json.loads((root / name / "config.json").read_text())
    assert len(config["scale_norm_groups"]) == len(GROWN_CASES[name][1]) - 1
    assert_matches(got[name], expected[name], mask)


@pytest.mark.parametrize("name", sorted(ROUTE_EDGES))
def test_route_export_from_layer_0_and_without_collaborative_layers(scale_exports, name):
    _, expected, got, _, mask = scale_exports
    assert_matches(got[name], expected[name], mask)


def test_route_export_really_routes(scale_exports):
    """Guard: both branches of Eq. 5 are taken, and route's logits are neither adapt's nor preserve's."""
    got, mask = scale_exports[2], scale_exports[4]
    real = mask.bool()
    for arch in sorted(ARCHS):
        routed = got[f"{arch}-route"]["routed"][real]
        assert routed.any() and not routed.all(), arch
        route = got[f"{arch}-route"]["logits"][real]
        for other in ("adapt", "preserve"):
            assert (route - got[f"{arch}-{other}"]["logits"][real]).abs().max() > 1e-3, (arch, other)


def test_scale_export_folder_is_a_hub_model_folder(scale_exports):
    root = scale_exports[0]
    folder = root / "qwen2-qkv-bias-route"
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "modeling_scale.py", "README.md"} <= names
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "scale_qwen2"
    assert config["architectures"] == ["ScaleQwen2ForCausalLM"]
    assert config["auto_map"] == {
        "AutoConfig": "modeling_scale.ScaleQwen2Config",
        "AutoModel": "modeling_scale.ScaleQwen2Model",
        "AutoModelForCausalLM": "modeling_scale.ScaleQwen2ForCausalLM",
    }
    assert config["tie_word_embeddings"] is False and "scale_cl" not in config
    assert config["scale_method"] == "route" and config["scale_preserve_layers"] == 1
    assert config["scale_hidden_size"] == 64 and config["hidden_size"] == 64 + 32
    weights = load_file(folder / "model.safetensors")
    assert not any(k.rsplit(".", 1)[-1] in ("w12", "w21", "w22", "weight_up", "bias_up") for k in weights)
    assert weights["lm_head.weight"].shape == (VOCAB, 96)
    card = (folder / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n") and "scale-route" in card
    assert "trust_remote_code=True" in card


def test_every_supported_architecture_has_an_exported_class():
    assert set(FAMILIES) == set(SPECS)


def test_modeling_file_imports_only_torch_and_transformers():
    tree = ast.parse(Path(modeling_scale.__file__).read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    top = {m.split(".")[0] for m in modules}
    assert top <= {
        "__future__",
        "collections",
        "dataclasses",
        "functools",
        "itertools",
        "typing",
        "torch",
        "transformers",
    }, top


# ------------------------------------------------ baselines, shards, a run through the command line
def cpt_run(workspace: Path, root: Path, method: str, **options) -> tuple[Path, object]:
    """A finished cpt method folder (``<run>/<method>``: model/, result.json; cpt_config.json beside it)."""
    base, tokenizer = load_base(BaseModelRef(str(workspace / "base")))
    model = perturb_trainable(prepare(base, method, **options))
    if method.startswith("scale_"):
        randomize_new_weights(model, seed=5, w12_scale=0.3)
    run = root / "run"
    save_trained(model, tokenizer, method, BaseModelRef(str(workspace / "base")), run / method / "model")
    curve = [
        {"step": 0, "learning_ppl": 310.5, "forgetting_ppl": {"toy": 120.25}, "representation_similarity": 1.0},
        {"step": 6, "learning_ppl": 41.75, "forgetting_ppl": {"toy": 133.5}, "representation_similarity": 0.9812},
    ]
    result = {"method": method, "lr": 1e-3, "trainable": 1234, "steps": 6, "seconds": 1.0, "curve": curve}
    (run / method / "result.json").write_text(json.dumps(result))
    settings = {"model": str(workspace / "base"), "data": {"train": ["new.jsonl"], "old_eval": ["toy=old.jsonl"]}}
    (run / "cpt_config.json").write_text(json.dumps(settings))
    return run / method, model


def build_other_exports(root: Path, workspace: Path) -> tuple[list[dict], dict[str, dict[str, torch.Tensor]]]:
    """Baselines (in memory and a LoRA run), a sharded SCALE export and a SCALE run, exported into ``root``: (their
    jobs for the clean Python, the in-library readings)."""
    ids, mask = padded_prompts()
    jobs, expected = [], {}

    def add(name: str, model, remote: bool, **export_kwargs) -> None:
        expected[name] = reference(model, ids, mask)
        export_model(model, root / name, **export_kwargs)
        jobs.append(job(name, root / name, remote, ids, mask))

    add("fft", perturb_trainable(make_model("llama-gqa2-tied")), False)
    add("freeze", perturb_trainable(prepare(make_model("neox-parallel-rot0.25"), "freeze", layers=1)), False)
    add("llama_pro", perturb_trainable(prepare(make_model("qwen2-qkv-bias"), "llama_pro", blocks=1)), False)
    add("lora-in-memory", perturb_trainable(prepare(make_model("mistral-gqa2"), "lora", rank=4)), False)
    add("sharded", lively_scale_model("llama-gqa2-tied", "route"), True, max_shard_size="20KB")

    # An extended vocabulary: E and W_out gain rows, and route's cosine reads the original vocabulary only.
    extended = grow_embeddings(lively_scale_model("qwen2-qkv-bias", "route"), 6)
    with torch.no_grad():
        for param in new_row_parameters(extended):
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(6)))
    new_ids = ids.clone()
    new_ids[:, -3:] = torch.tensor([VOCAB, VOCAB + 3, VOCAB + 5])
    expected["extended"] = reference(extended, new_ids, mask)
    export_model(extended, root / "extended")
    jobs.append(job("extended", root / "extended", True, new_ids, mask))

    # A SCALE checkpoint (model.save_pretrained(dir, full=True): the base weights inside) through the command line.
    checkpoint = lively_scale_model("mistral-gqa2", "adapt")
    checkpoint.save_pretrained(root / "checkpoint", full=True)
    expected["checkpoint"] = reference(checkpoint, ids, mask)
    assert main(["export", str(root / "checkpoint"), str(root / "checkpoint-export")]) == 0
    jobs.append(job("checkpoint", root / "checkpoint-export", True, ids, mask))

    run_ids = torch.randint(3, 300, ids.shape, generator=torch.Generator().manual_seed(1)).masked_fill(mask == 0, 0)
    for method, options in (("scale_route", {"hidden_up": 32, "ffn_up": 16, "preserve_layers": 1}), ("lora", {})):
        method_dir, model = cpt_run(workspace, root / method, method, **options)
        expected[method] = reference(model, run_ids, mask)
        assert main(["export", str(method_dir), str(root / f"{method}-export")]) == 0
        jobs.append(job(method, root / f"{method}-export", method == "scale_route", run_ids, mask, tokenizer=True))
    return jobs, expected


@pytest.fixture(scope="module")
def other_exports(clean_loads):
    """Baselines (in memory and a LoRA run), a sharded SCALE export and a SCALE run, loaded in the clean Python."""
    return clean_loads["other_exports"]


@pytest.mark.parametrize("name", ["fft", "freeze", "llama_pro", "lora-in-memory", "lora"])
def test_baseline_exports_are_plain_checkpoints(other_exports, name):
    root, expected, got, summary, mask = other_exports
    folder = root / ("lora-export" if name == "lora" else name)
    config = json.loads((folder / "config.json").read_text())
    assert "auto_map" not in config and not (folder / "modeling_scale.py").exists()
    assert not (folder / "adapter_config.json").exists()  # LoRA merged into the weights
    assert summary["classes"][name].startswith("transformers.models.")  # loaded without trust_remote_code
    assert_matches(got[name], expected[name], mask)


def test_extended_vocabulary_route_export_matches(other_exports):
    root, expected, got, _, mask = other_exports
    config = json.loads((root / "extended" / "config.json").read_text())
    assert config["vocab_size"] == VOCAB + 6 and config["scale_route_vocab_size"] == VOCAB
    assert got["extended"]["logits"].shape[-1] == VOCAB + 6
    assert_matches(got["extended"], expected["extended"], mask)


def test_checkpoint_export_matches(other_exports):
    root, expected, got, summary, mask = other_exports
    assert summary["classes"]["checkpoint"].endswith(".ScaleMistralForCausalLM")
    assert_matches(got["checkpoint"], expected["checkpoint"], mask)
    assert "- method: `scale_adapt`" in (root / "checkpoint-export" / "README.md").read_text()


def test_sharded_export_writes_an_index_and_loads(other_exports):
    root, expected, got, _, mask = other_exports
    index = json.loads((root / "sharded" / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((root / "sharded" / s).is_file() for s in shards)
    assert not (root / "sharded" / "model.safetensors").exists()
    assert_matches(got["sharded"], expected["sharded"], mask)


def test_run_export_brings_tokenizer_and_model_card(other_exports, workspace):
    root, expected, got, summary, mask = other_exports
    folder = root / "scale_route-export"
    assert summary["classes"]["scale_route"].endswith(".ScaleLlamaForCausalLM")
    assert_matches(got["scale_route"], expected["scale_route"], mask)
    _, tokenizer = load_base(BaseModelRef(str(workspace / "base")))
    assert got["scale_route"]["tokenized"].tolist() == tokenizer("ka to mi")["input_ids"]
    card = (folder / "README.md").read_text()
    for fact in ("scale_route", "hidden_up: `32`", "preserve_layers: `1`", "310.50", "41.75", "133.50", "`toy`"):
        assert fact in card, fact
    assert "new.jsonl" in card and str(workspace / "base") in card
    assert "base_model:" not in card  # a local path is no hub id
    lora_card = (root / "lora-export" / "README.md").read_text()
    assert "trust_remote_code" not in lora_card and "- method: `lora`" in lora_card


@pytest.mark.parametrize("method", ["scale_preserve", "scale_adapt", "scale_route"])
def test_the_card_states_every_scale_setting_the_method_reads(method):
    """Every ``scale.*`` setting the method's declaration reads (the sweep's list), with the saved ScaleConfig's value,
    in the declaration's order; the rows the card always had read as they did."""
    spec = REGISTRY[method]
    scale = ScaleConfig(hidden_up=32, ffn_up=16, method=spec.scale_method, preserve_layers=1, route_tau=0.25)
    card = model_card(CardInfo(method=method, custom_code=True, scale=scale))
    rows = [line for line in card.splitlines() if line.startswith("- ") and line.endswith("`") and ": `" in line]
    names = [s.removeprefix("scale.") for s in spec.reads if s.startswith("scale.")]
    assert [row[2:].split(":")[0] for row in rows[1:]] == names  # after "- method: ..."
    assert {"- hidden_up: `32`", "- ffn_up: `16`", "- up_norm: `own`"} <= set(rows)
    adapts = spec.scale_method != "preserve"
    assert ("- preserve_layers: `1`" in rows) == ("- collab_modules: `attn, ffn`" in rows) == adapts
    assert ("- route_tau: `0.25`" in rows) == ("- router: `cosine`" in rows) == spec.two_paths


def test_dtype_option_casts_the_weights(tmp_path, workspace):
    method_dir, _ = cpt_run(workspace, tmp_path, "scale_preserve", hidden_up=32, ffn_up=0)
    out = tmp_path / "bf16"
    assert main(["export", str(method_dir / "model"), str(out), "--dtype", "bfloat16"]) == 0
    weights = load_file(out / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


# ------------------------------------------------------------------------------------ bad input
def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_bad_sources_are_refused_before_anything_is_written(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    run_root = tmp_path / "cpt-run"
    (run_root / "fft" / "run").mkdir(parents=True)
    (run_root / "cpt_config.json").write_text("{}")
    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    (checkpoint / CHECKPOINT_META).write_text("{}")
    no_model = tmp_path / "sweep-run"
    no_model.mkdir()
    (no_model / "result.json").write_text("{}")
    cases = {
        empty: "not a finished run or checkpoint",
        run_root: "cpt run folder in which no method has finished",
        checkpoint: "resumable training checkpoint",
        no_model: "without saving its model",
        tmp_path / "missing": "does not exist",
    }
    for source, why in cases.items():
        out = tmp_path / "out"
        assert main(["export", str(source), str(out)]) == 2
        err = capsys.readouterr().err
        assert why in err and CONFIG_NAME in err, err
        assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left


def test_a_cpt_run_folder_names_its_finished_methods(tmp_path, capsys):
    for method in ("fft", "scale_route"):
        (tmp_path / method / "model").mkdir(parents=True)
        (tmp_path / method / "model" / "scale_cl_run.json").write_text("{}")
    (tmp_path / "cpt_config.json").write_text("{}")
    assert main(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "pass one of them (fft, scale_route)" in capsys.readouterr().err


def test_a_non_empty_out_is_refused_and_left_as_it_was(tmp_path, capsys):
    model = lively_scale_model("llama-mqa", "adapt")
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "sub" / "keep.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    before = _snapshot(tmp_path)
    for target in (out, tmp_path / "file"):
        with pytest.raises(ValueError, match="exists and is"):
            export_model(model, target)
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    assert main(["export", str(empty), str(out)]) == 2  # OUT is checked first
    assert "is not empty" in capsys.readouterr().err
    assert _snapshot(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "not-a-run", "out"]


def test_an_empty_out_folder_is_used(tmp_path):
    model = lively_scale_model("neox-sequential-rot1.0", "preserve")
    before = copy.deepcopy(model.state_dict())
    (tmp_path / "out").mkdir()
    export_model(model, tmp_path / "out")
    assert (tmp_path / "out" / "config.json").is_file()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the SCALE model is left as it was


def test_a_failed_export_leaves_nothing(tmp_path, monkeypatch):
    from scale_cl.export import export as export_module

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(export_module, "model_card", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        export_model(lively_scale_model("llama-mqa", "route"), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_export_source_settings_are_options():
    from scale_cl.cli import parse_settings

    settings = parse_settings(["export", "runs/x", "hf/x", "--dtype", "float16", "--max-shard-size", "1GB"])
    assert (settings.source, settings.out, settings.dtype, settings.max_shard_size) == (
        "runs/x",
        "hf/x",
        "float16",
        "1GB",
    )
