"""One GPU: every command end to end on CUDA in bf16 and in fp32, Theorem 3.1 on CUDA for every
architecture and SCALE method, and bf16-autocast training that leaves the frozen weights bitwise.

Every CUDA case is skipped, with the reason, where torch sees no CUDA device; its ids hold ``cuda`` (``pytest
tests/e2e/test_gpu.py -k cuda`` runs exactly those). Each case's body is a helper taking the device, and the same helper
also runs on the CPU (ids ``cpu``: the cheap checks in the fast suite, the end-to-end runs as ``slow``), so the code
a GPU runs has run here too.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from scale_cl.cli import main
from scale_cl.models import load_trained
from scale_cl.train.device import CUDNN_ATTENTION_ENV, avoid_cudnn_attention, resolve_device
from tests.conftest import ARCHS, cpt_argv, make_model, randomize_new_weights, tiny_config, token_batch, upscaled_copy
from tests.train.test_training import assert_frozen_unchanged, frozen_snapshot, loss_of
from tests.train.test_training import upscaled as upscaled_for_training

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device: torch.cuda.is_available() is False here")
METHODS = ("preserve", "adapt", "route")
MODES = ("fp32", "bf16-weights", "bf16-autocast")  # fp32 with TF32 off; the model in bf16; fp32 weights, bf16 autocast

# Units of rounding: a value rounded to p significant bits moves by up to 2^-p of itself (fp32: 24 bits, bf16: 8).
FP32_UNIT, BF16_UNIT = 2.0**-24, 2.0**-8


def on(device: str, *marks: pytest.MarkDecorator) -> list:
    """``device`` as a parameter: ``cuda`` gated on a CUDA device."""
    return [*marks, needs_cuda] if device == "cuda" else list(marks)


@contextlib.contextmanager
def exact_fp32() -> Iterator[None]:
    """fp32 products computed in fp32: TF32 off for cuBLAS and cuDNN (as they were, afterwards)."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


# --------------------------------------------------------------------------------------------
# Theorem 3.1: right after upscale, the upscaled model's log-probabilities are the base model's.


def logprob_bound(config, logits: torch.Tensor, bf16: bool) -> float:
    """How far the upscaled model's log-probabilities may be from the base model's when both compute the same
    function but some products run as GEMMs of other shapes (the merged block matrix of an Adapt/Route linear with
    W12, Route's stacked [preserve; adapt] batch), which sum in another order and so round differently.

    Per value: bf16 GEMMs accumulate in fp32 and round their output once to 8 significant bits, so another shape
    moves an output by up to ``2^-8`` of itself; an fp32 sum of ``n`` products taken in another order differs by
    about ``sqrt(n)`` units of ``2^-24`` (``n``: the longest reduction, the widened hidden or FFN width). Each
    layer's output and the head's may carry such an error, which the norms carry to the logits at about their
    scale, hence ``(layers + 1)`` times ``max |z|`` (the measured logits of the test's own base model); and a
    log-probability ``z - logsumexp(z)`` carries the error of ``z`` and of the logsumexp: times 2. (Measured on an
    H200 at Llama-3.2-1B's shape upscaled by 256 / 1024, random weights: fp32 within 1.5e-5, bf16 within 0.08; with
    max |z| about 4.4 at that initialisation's scale this bound is about 9e-4 and 0.6 there. On the tiny models
    here it is about 4e-6 and 0.03, and a W12 of 1e-3 already exceeds the bf16 one: see the control below.)
    """
    layers = config.num_hidden_layers
    longest = max(config.hidden_size, config.intermediate_size)
    per_value = BF16_UNIT if bf16 else math.sqrt(longest) * FP32_UNIT
    return 2 * (layers + 1) * per_value * float(logits.abs().max())


def check_theorem_3_1(arch: str, method: str, mode: str, device: str) -> None:
    """Right after upscale (W12 = 0, W_out_up = 0, random W21/W22 so the new stream is busy) the log-probabilities
    equal the base model's within `logprob_bound`; SCALE-Preserve in fp32 bitwise, and so its original stream at
    every layer (it computes the base model's own products on the same values, W12 never)."""
    base = make_model(arch)
    model = upscaled_copy(base, method, preserve_layers=1, w21_init="random", w22_init="random")
    dtype = torch.bfloat16 if mode == "bf16-weights" else torch.float32
    base, model = base.to(device, dtype), model.to(device, dtype)
    ids, mask = (t.to(device) for t in token_batch())
    real = mask.bool()  # left padding: only real tokens are compared
    with exact_fp32(), torch.no_grad(), torch.autocast(device, torch.bfloat16, enabled=mode == "bf16-autocast"):
        want = base(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        got = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    want_lp, got_lp = (out.logits.float().log_softmax(-1)[real] for out in (want, got))
    assert torch.isfinite(want_lp).all(), "the base model's log-probabilities are not finite"
    bitwise = method == "preserve" and mode == "fp32"
    bound = 0.0 if bitwise else logprob_bound(model.config, want.logits[real].float(), bf16=mode != "fp32")
    diff = float((got_lp - want_lp).abs().max())
    assert diff <= bound, f"{arch}/{method}/{mode} on {device}: log-probabilities differ by {diff:.3e} > {bound:.3e}"
    if bitwise:
        d = base.config.hidden_size
        for layer, (a, b) in enumerate(zip(want.hidden_states, got.hidden_states, strict=True)):
            assert torch.equal(b[..., :d][real], a[real]), f"{arch}: original stream of hidden state {layer} differs"
    if method == "route":  # both paths agree at init: every real token goes to the preserve path
        assert got["route_preserve_share"].item() == 1.0


@needs_cuda
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_theorem_3_1_on_cuda(arch, method, mode):
    check_theorem_3_1(arch, method, mode, "cuda")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ["llama-gqa2-tied", "qwen2-qkv-bias", "neox-parallel-rot0.25"])
def test_theorem_3_1_check_on_cpu(arch, method, mode):
    check_theorem_3_1(arch, method, mode, "cpu")


def test_the_bound_refuses_a_leak_of_the_new_stream():
    """The control: W12 at 1e-2 (the original stream reads x_up a little) moves the log-probabilities by about ten
    times the bf16 bound (and far beyond the fp32 one), so the bounds above would see a leak."""
    base = make_model("llama-gqa2-tied")
    model = randomize_new_weights(upscaled_copy(base, "adapt", preserve_layers=1), seed=0, w12_scale=1e-2, head_scale=0)
    ids, mask = token_batch()
    with torch.no_grad():
        want, got = base(input_ids=ids, attention_mask=mask).logits, model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    diff = float((got.log_softmax(-1) - want.log_softmax(-1))[real].abs().max())
    assert (
        diff > 5 * logprob_bound(model.config, want[real], bf16=True) > logprob_bound(model.config, want[real], False)
    )


# --------------------------------------------------------------------------------------------
# bf16-autocast training: the frozen original weights stay bitwise, the loss falls.


def check_bf16_autocast_training(arch: str, method: str, device: str, steps: int = 20) -> None:
    """AdamW over every parameter (weight decay too: only autograd keeps the originals out) for ``steps`` steps under
    bf16 autocast: every frozen original weight bitwise unchanged, finite losses, the last below the first. The
    attention kernels are those the commands train with (`resolve_device`: cuDNN attention off on CUDA)."""
    resolve_device(device)
    _, model = upscaled_for_training(arch, method)
    model.to(device).train()
    snapshot = frozen_snapshot(model)
    ids, mask = (t.to(device) for t in token_batch(pads=(4,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = loss_of(model, ids, mask)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], f"{arch}/{method}: the loss did not fall: {losses}"
    assert_frozen_unchanged(model, snapshot)


@needs_cuda
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_bf16_autocast_training_keeps_frozen_weights_on_cuda(arch, method):
    check_bf16_autocast_training(arch, method, "cuda")


@pytest.mark.parametrize("method", METHODS)
def test_bf16_autocast_training_check_on_cpu(method):
    check_bf16_autocast_training("llama-gqa2-tied", method, "cpu")


@pytest.fixture
def cudnn_attention_flag() -> Iterator[None]:
    """torch's global cuDNN-attention switch, as it was, afterwards."""
    was = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


def test_cuda_training_switches_cudnn_attention_off(cudnn_attention_flag, monkeypatch):
    """Its backward gave Route's bf16 training NaN gradients on an H200 (torch 2.11, train/device.py's doc); the
    environment variable keeps it for those who want it."""
    monkeypatch.delenv(CUDNN_ATTENTION_ENV, raising=False)
    torch.backends.cuda.enable_cudnn_sdp(True)
    assert avoid_cudnn_attention() is True
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert avoid_cudnn_attention() is False  # once: already off
    torch.backends.cuda.enable_cudnn_sdp(True)
    monkeypatch.setenv(CUDNN_ATTENTION_ENV, "1")
    assert avoid_cudnn_attention() is False
    assert torch.backends.cuda.cudnn_sdp_enabled()


# --------------------------------------------------------------------------------------------
# Every command end to end, on one device, in one precision (the CPU twin trains in bf16: CPU autocast).

CPT_METHODS = ["freeze", "scale_preserve", "scale_route"]
BIO_METHODS = ["fft", "scale_route"]
RUNS = [
    pytest.param("cpu", "bf16", marks=on("cpu", pytest.mark.slow), id="cpu-bf16"),
    pytest.param("cuda", "bf16", marks=on("cuda", pytest.mark.slow), id="cuda-bf16"),
    pytest.param("cuda", "fp32", marks=on("cuda", pytest.mark.slow), id="cuda-fp32"),
]
BIO_STAGES = ("pretrain", "task0", "task1")
# On the CPU, bio's micro preset shorter (every stage still trains and is measured): one pre-training epoch of two, two
# Task-1 steps of four. The GPU's runs keep the preset.
BIO_CPU_SHORTER = ["--pretrain.epochs", "1", "--task1.max_steps", "2"]


def placement_options(sections: tuple[str, ...], device: str, precision: str) -> list[str]:
    """``--<section>.device D --<section>.precision P`` for each stage section."""
    return [option for s in sections for option in (f"--{s}.device", device, f"--{s}.precision", precision)]


def assert_recorded(result: dict, device: str, precision: str) -> None:
    """A finished run's result says where it trained and in which precision (and, on a GPU, which one)."""
    assert (result["device"], result["precision"]) == (device, precision), result
    assert ("gpu" in result) == (device == "cuda")


def run_cpt_command(workspace: Path, out: Path, device: str, precision: str) -> Path:
    cfg = tiny_config(workspace, CPT_METHODS)
    assert main([*cpt_argv(cfg, out)[3:], *placement_options(("train",), device, precision)]) == 0
    return out


@pytest.fixture(scope="module")
def cpt_runs(workspace, tmp_path_factory):
    """``get(device, precision)``: the folder of a finished tiny cpt run (`CPT_METHODS`), run once per module."""
    runs: dict[tuple[str, str], Path] = {}

    def get(device: str, precision: str) -> Path:
        if (device, precision) not in runs:
            out = tmp_path_factory.mktemp(f"cpt-{device}-{precision}")
            runs[device, precision] = run_cpt_command(workspace, out, device, precision)
        return runs[device, precision]

    return get


@pytest.mark.parametrize(("device", "precision"), RUNS)
def test_cpt_end_to_end(cpt_runs, workspace, device, precision):
    out = cpt_runs(device, precision)
    for method in CPT_METHODS:
        result = json.loads((out / method / "result.json").read_text())
        assert_recorded(result, device, precision)
        assert [r["step"] for r in result["curve"]] == [0, 3, 6]
        for record in result["curve"]:
            assert math.isfinite(record["learning_ppl"]) and math.isfinite(record["forgetting_ppl"]["toy"])
    assert f"Trained on {device}" in (out / "results.md").read_text()
    # SCALE-Preserve keeps the original representation (the reference is computed on the same device and precision)
    tolerance = 1e-6 if precision == "fp32" else 1e-3  # bf16: a hidden state rounded to 8 bits, cosine ~ 1 - 2^-16
    curve = json.loads((out / "scale_preserve" / "result.json").read_text())["curve"]
    assert all(abs(r["representation_similarity"] - 1) <= tolerance for r in curve)
    # Freeze: the embedding and the bottom layer stay bitwise the base model's, the top layer trained
    base = AutoModelForCausalLM.from_pretrained(workspace / "base").state_dict()
    state = load_trained(out / "freeze" / "model")[0].state_dict()
    frozen = [n for n in base if n.startswith(("model.embed_tokens", "model.layers.0."))]
    trained = [n for n in base if n.startswith("model.layers.2.")]
    assert frozen and trained and all(torch.equal(state[n], base[n]) for n in frozen)
    assert not all(torch.equal(state[n], base[n]) for n in trained)


def check_export(run: Path, out: Path, device: str) -> None:
    """``scale-cl export`` of a run trained on ``device`` (the export itself runs on the CPU) loads on the CPU and,
    on ``device`` in fp32, computes the in-library model's log-probabilities (within `logprob_bound`)."""
    assert main(["export", str(run / "scale_route"), str(out)]) == 0
    exported = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert {p.device.type for p in exported.parameters()} == {"cpu"}
    model, tokenizer, method = load_trained(run / "scale_route" / "model")
    assert method == "scale_route"
    batch = tokenizer(["ka to mi ra ne su", "the cat sat on the mat"], return_tensors="pt", padding=True)
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    with exact_fp32(), torch.no_grad():
        want = model.to(device)(input_ids=ids, attention_mask=mask).logits
        got = exported.to(device)(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    diff = float((got.log_softmax(-1) - want.log_softmax(-1))[real].abs().max())
    assert diff <= logprob_bound(model.config, want[real], bf16=False), diff


@pytest.mark.parametrize(("device", "precision"), RUNS)
def test_export_of_a_run_trained_there(cpt_runs, tmp_path, device, precision):
    check_export(cpt_runs(device, precision), tmp_path / "export", device)


def check_eval(model_dir: Path, out: Path, device: str, dtype: str, monkeypatch) -> None:
    """``scale-cl eval --device D --dtype T`` on a trained model with the offline tiny task: it ran there, in that
    dtype, and every number is finite."""
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = Path(__file__).parents[1] / "fixtures" / "lm_eval_tasks"
    argv = ["eval", str(model_dir), "--tasks", "scale_cl_tiny", "--include-path", str(tasks), "--out", str(out)]
    assert main([*argv, "--device", device, "--dtype", dtype, "--batch-size", "4", "--bootstrap-iters", "0"]) == 0
    results = json.loads(out.read_text())
    assert results["settings"]["device"].startswith(device) and results["settings"]["dtype"] == dtype
    values = [m["value"] for metrics in results["results"].values() for m in metrics.values()]
    assert values and all(v is not None and math.isfinite(v) for v in values), results["results"]
    assert 0 <= results["results"]["scale_cl_tiny_mc"]["acc"]["value"] <= 1


@pytest.mark.parametrize(("device", "precision"), RUNS)
def test_eval_of_a_run_trained_there(cpt_runs, tmp_path, monkeypatch, device, precision):
    dtype = "bfloat16" if precision == "bf16" else "float32"
    check_eval(
        cpt_runs(device, precision) / "scale_preserve" / "model", tmp_path / "eval.json", device, dtype, monkeypatch
    )


@pytest.mark.parametrize(("device", "precision"), RUNS)
def test_bio_micro_end_to_end(tmp_path, device, precision):
    out = tmp_path / "bio"
    argv = ["bio", "--preset", "micro", "--methods", *BIO_METHODS, "--out", str(out)]
    shorter = BIO_CPU_SHORTER if device == "cpu" else []
    assert main([*argv, *shorter, *placement_options(BIO_STAGES, device, precision)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["methods"]) == set(BIO_METHODS)
    for method in BIO_METHODS:
        run = results["methods"][method]["runs"][0]
        assert_recorded(run, device, precision)
        for record in run["curve"]:
            assert all(0 <= record[task]["overall"] <= 1 for task in ("task0", "task0_trained", "task1")), record
    stages = json.loads((out / "seed-0" / "stages.json").read_text())
    assert 0 <= stages["task0_model"]["task0_trained"]["overall"] <= 1
    if device == "cuda":
        assert torch.cuda.get_device_name() in (out / "results.md").read_text()


@pytest.mark.parametrize(("device", "precision"), RUNS)
def test_cpt_sweep_one_point(workspace, tmp_path, device, precision):
    out = tmp_path / "sweep"
    cfg = tiny_config(workspace, ["fft"], steps=3, save_every=0)
    argv = ["sweep", *cpt_argv(cfg, out)[3:], "--lr-scales", "1", *placement_options(("train",), device, precision)]
    assert main(argv) == 0
    (point,) = (out / "points").iterdir()
    metrics = json.loads((point / "point.json").read_text())["metrics"]
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    result = json.loads((point / "fft" / "result.json").read_text())
    assert_recorded(result, device, precision)
    base = json.loads((out / "base_metrics.json").read_text())  # step 0 measured once, where the runs train
    assert result["curve"][0]["learning_ppl"] == base["learning_ppl"] and math.isfinite(base["learning_ppl"])


@pytest.mark.parametrize(("device", "precision"), RUNS)
def test_bio_sweep_one_point(tmp_path, device, precision):
    out = tmp_path / "sweep"
    argv = ["sweep", "bio", "--methods", "fft", "--lr-scales", "1", "--out", str(out)]
    shorter = BIO_CPU_SHORTER if device == "cpu" else []
    assert main([*argv, *shorter, *placement_options(BIO_STAGES, device, precision)]) == 0
    (point,) = (out / "points").iterdir()
    metrics = json.loads((point / "point.json").read_text())["metrics"]
    assert all(0 <= v <= 1 for v in metrics.values()), metrics
    assert_recorded(json.loads((point / "seed-0" / "fft.json").read_text()), device, precision)
    first = json.loads((point / "seed-0" / "fft.jsonl").read_text().splitlines()[0])  # step 0: measured once, there
    assert first == {"step": 0, **json.loads((out / "base_metrics.json").read_text())["0"]}
