"""Continual pre-training end to end on a tiny Llama: metrics, saved models, resuming after SIGKILL, bad input.

Where a reading computes the base model's function another way (every method at step 0, SCALE-Preserve at alpha 0,
WiSE-FT at alpha 0, a router mixing two copies of the base), its perplexities must be as close to the base's in
float64 as the base's own fp32 evaluation is (`exactness.assert_exact_to_rounding`).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from scale_cl.experiments.cpt.config import CptConfig
from scale_cl.experiments.cpt.pipeline import run_cpt
from scale_cl.experiments.train.corpus import load_run_corpus
from scale_cl.models import load_trained
from scale_cl.train.trainer import CHECKPOINT_META, TRAINABLE_WEIGHTS
from tests.conftest import cpt_argv, tiny_config
from tests.exactness import assert_exact_to_rounding, assert_within_noise, max_error


def _reading(record: dict) -> torch.Tensor:
    """A record's perplexities (learning, forgetting): fp32 computations, as fp32."""
    return torch.tensor([record["learning_ppl"], record["forgetting_ppl"]["toy"]])


def base_readings(model: str, sets: list[torch.Tensor], batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the perplexities of the base model in folder ``model`` on each of ``sets`` as a run evaluates them, in fp32;
    the same in float64: the cross-entropy by hand, as transformers' loss casts the logits to fp32)."""
    from scale_cl.eval.perplexity import perplexity

    base = AutoModelForCausalLM.from_pretrained(model).eval()
    stock = torch.tensor([perplexity(base, blocks, batch_size).perplexity for blocks in sets])
    base = base.double()
    with torch.no_grad():
        logits = [base(input_ids=blocks).logits[:, :-1] for blocks in sets]
    losses = [F.cross_entropy(z.flatten(0, 1), blocks[:, 1:].flatten()) for z, blocks in zip(logits, sets, strict=True)]
    return stock, torch.stack(losses).exp()


def _base_readings(cfg: CptConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """`base_readings` on the run's evaluation data (learning, forgetting)."""
    corpus = load_run_corpus(cfg, AutoTokenizer.from_pretrained(cfg.model))
    return base_readings(cfg.model, [corpus.heldout.blocks, corpus.old_eval["toy"].blocks], cfg.eval.batch_size)


def _assert_reads_the_base(record: dict, base: tuple[torch.Tensor, torch.Tensor], what: str) -> None:
    stock, exact = base
    assert_exact_to_rounding(_reading(record), exact, stock=stock, what=what)


@pytest.fixture
def no_figures(monkeypatch):
    """Skip drawing the figures (matplotlib: about a third of a tiny run's time) where a test checks none; the
    figures of every method's curve are checked on `finished_run`."""
    import scale_cl.experiments.cpt.report as report

    monkeypatch.setattr(report, "plot", lambda results, out: [])


@pytest.fixture(scope="module")
def finished_run(workspace, tmp_path_factory) -> tuple[CptConfig, Path, dict]:
    """One run read every way the tests look at (up-logit and WiSE-FT frontiers too): readings after training
    change no curve or saved model, so the tests share it instead of each training the same methods again."""
    cfg = tiny_config(workspace, ["scale_preserve", "scale_route", "freeze", "llama_pro", "fft"])
    cfg = replace(cfg, eval=replace(cfg.eval, up_logit_scales=(0.0, 0.5, 1.0), wise_ft_alphas=(0.0, 0.5, 1.0)))
    out = tmp_path_factory.mktemp("run")
    return cfg, out, run_cpt(cfg, out)


@pytest.mark.slow
@pytest.mark.exactness
def test_run_writes_metrics_tables_and_figures(finished_run):
    cfg, out, results = finished_run
    base = _base_readings(cfg)
    assert set(results["methods"]) == set(cfg.methods)
    for method in cfg.methods:
        records = [json.loads(line) for line in (out / method / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [0, 3, 6]
        for r in records:
            assert r["learning_ppl"] > 1 and r["forgetting_ppl"]["toy"] > 1
            assert -1 <= r["representation_similarity"] <= 1 + 1e-6
        assert all(r["train_tokens_per_s"] > 0 for r in records[1:])
        # Every method starts from the base model's function: its step-0 perplexities are the base's.
        _assert_reads_the_base(records[0], base, f"{method} at step 0")
        assert not (out / method / "run").exists(), "checkpoints are deleted once the method has finished"
        # train.device and train.precision auto: the GPU in bf16 where there is one, else the CPU in fp32; recorded
        where = ("cuda", "bf16") if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else ("cpu", "fp32")
        assert (results["methods"][method]["device"], results["methods"][method]["precision"]) == where
    assert "route_preserve_share" in results["methods"]["scale_route"]["curve"][-1]
    assert "route_preserve_share" not in results["methods"]["freeze"]["curve"][-1]
    table = (out / "results.md").read_text()
    assert all(f"| {m} |" in table for m in cfg.methods)
    assert (out / "perplexity.png").stat().st_size > 0 and (out / "representation.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.exactness
def test_scale_preserve_keeps_the_original_representation_exactly(finished_run):
    _, _, results = finished_run
    curve = results["methods"]["scale_preserve"]["curve"]
    # the cosine of bitwise equal hidden states (Theorem 3.1): 1 up to the cosine's own fp32 rounding (a few 1.2e-7)
    assert all(r["representation_similarity"] == pytest.approx(1.0, abs=1e-6) for r in curve)
    learning = [r["learning_ppl"] for r in curve]
    assert learning[-1] < learning[0], "SCALE-Preserve learns through its new LM-head columns"


@pytest.mark.slow
def test_saved_models_reload_with_frozen_weights_bitwise_unchanged(finished_run, workspace):
    _, out, _ = finished_run
    base = AutoModelForCausalLM.from_pretrained(workspace / "base")
    base_state = base.state_dict()

    freeze, _, method = load_trained(out / "freeze" / "model")
    assert method == "freeze"
    state = freeze.state_dict()
    frozen = [n for n in base_state if n.startswith(("model.embed_tokens", "model.layers.0."))]
    trained = [n for n in base_state if n.startswith("model.layers.2.")]
    assert frozen and trained
    assert all(torch.equal(state[n], base_state[n]) for n in frozen)
    assert not all(torch.equal(state[n], base_state[n]) for n in trained)

    llama_pro, _, _ = load_trained(out / "llama_pro" / "model")
    assert llama_pro.config.num_hidden_layers == 4
    originals = [n for n in llama_pro.state_dict() if ".layers." not in n]  # embedding, final norm
    assert all(torch.equal(llama_pro.state_dict()[n], base_state[n]) for n in originals)

    route, _, method = load_trained(out / "scale_route" / "model")
    assert method == "scale_route" and route.scale_config.method == "route"


def _trainable_weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model" / "model.safetensors")


@pytest.mark.slow
def test_resume_after_sigkill_gives_bitwise_the_same_weights(workspace, tmp_path, no_figures):
    """Only the killed run needs a process of its own: the uninterrupted run and the resume go through the same
    command in this process (each command started costs ~5 s of imports). The resume refuses a folder of another
    configuration, so it also shows that the command line and ``cfg`` are one run."""
    from scale_cl.cli import main

    cfg = tiny_config(workspace, ["scale_adapt"], steps=16, save_every=4)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}

    straight = tmp_path / "straight"
    assert main(cpt_argv(cfg, straight)[3:]) == 0

    killed = tmp_path / "killed"
    process = subprocess.Popen(cpt_argv(cfg, killed), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = killed / "scale_adapt" / "run" / "checkpoint-8" / CHECKPOINT_META
    deadline = time.monotonic() + 300
    while not target.is_file() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (killed / "scale_adapt" / "result.json").exists(), "the run must be killed before it finished"
    checkpoints = sorted((killed / "scale_adapt" / "run").glob("checkpoint-*"))
    assert checkpoints, "the killed run left at least one complete checkpoint"

    assert main(cpt_argv(cfg, killed)[3:]) == 0
    a, b = _trainable_weights(straight / "scale_adapt"), _trainable_weights(killed / "scale_adapt")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n], b[n]) for n in a), "resumed weights differ from the uninterrupted run"
    steps = [json.loads(x)["step"] for x in (killed / "scale_adapt" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 16, "metrics after the checkpoint are recorded once"


def test_checkpoints_hold_only_trainable_weights(workspace, tmp_path, monkeypatch, no_figures):
    import scale_cl.experiments.method_run as method_run

    cfg = tiny_config(workspace, ["scale_adapt"], steps=4, save_every=2)
    monkeypatch.setattr(method_run.shutil, "rmtree", lambda *a, **k: None)  # keep the checkpoints to look at
    run_cpt(cfg, tmp_path)
    checkpoint = tmp_path / "scale_adapt" / "run" / "checkpoint-4"
    weights = load_file(checkpoint / TRAINABLE_WEIGHTS)
    meta = json.loads((checkpoint / CHECKPOINT_META).read_text())
    assert meta["run"]["method"] == "scale_adapt" and meta["run"]["base"]["name_or_path"] == cfg.model
    assert weights and all(any(k in n for k in ("w12", "w21", "w22", "weight_up", "bias_up")) for n in weights)
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= {
        p.name for p in checkpoint.iterdir()
    }


@pytest.mark.slow
def test_output_folder_of_another_run_is_refused_untouched(finished_run):
    cfg, out, _ = finished_run
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    other = replace(cfg, train=replace(cfg.train, lr=5e-4))
    with pytest.raises(ValueError, match=r"another configuration \(differs in: train.lr\)"):
        run_cpt(other, out)
    assert before == {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_model_not_available_offline_is_a_clear_error(workspace, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # the hub library read the variable when it was imported: offline now, not after ~20 s of retries
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cfg = replace(tiny_config(workspace, ["fft"]), model="no-such-org/no-such-model")
    with pytest.raises(FileNotFoundError, match="cannot load the configuration of model 'no-such-org/no-such-model'"):
        run_cpt(cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_bad_data_fails_before_anything_is_written(workspace, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for train in ([str(empty)], [str(tmp_path / "missing.jsonl")], [str(tmp_path / "*.nothing")]):
        cfg = tiny_config(workspace, ["fft"])
        cfg = replace(cfg, data=replace(cfg.data, train=train))
        with pytest.raises((ValueError, FileNotFoundError)):
            run_cpt(cfg, tmp_path / "out")
        assert not (tmp_path / "out").exists()


def test_cli_reports_bad_input_with_exit_code_2(workspace, tmp_path, capsys):
    from scale_cl.cli import main

    code = main(["cpt", "--model", str(workspace / "base"), "--data.train", str(tmp_path / "none.jsonl")])
    assert code == 2
    assert "none.jsonl" in capsys.readouterr().err


def test_hidden_up_that_splits_a_gqa_group_is_refused_before_any_method_trains(workspace, tmp_path, capsys):
    """hidden_up must add whole kv heads (head_dim x GQA group = 16 x 2 here): 16 is a multiple of the head size
    only. The old settings check accepted it and the run failed at scale_route, after fft had trained."""
    from scale_cl.cli import main

    out = tmp_path / "out"
    argv = ["cpt", "--model", str(workspace / "base"), "--data.train", str(workspace / "new.jsonl")]
    argv += ["--methods", "fft", "scale_route", "--options.scale.hidden_up", "16", "--out", str(out)]
    assert main(argv) == 2
    assert "hidden_up=16 must add whole attention heads" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow
def test_saved_full_model_loads_with_transformers_alone(finished_run):
    _, out, _ = finished_run
    model = AutoModelForCausalLM.from_pretrained(out / "freeze" / "model")
    assert model.config.num_hidden_layers == 3


@pytest.mark.slow
@pytest.mark.exactness
def test_gradient_checkpointing_trains_the_same_weights(workspace, tmp_path, monkeypatch, no_figures):
    """The same weights as without it, to the plain run's own rounding: no farther from the plain run's weights than
    the plain run with each batch as one micro-batch (4 for 2 x 2: another order of the same sums) lies (the command
    trains in fp32 only; no float64 run to measure from). The recomputed forward pass is the same arithmetic, so
    the weights agree bitwise here; another order of summing the gradients would be admitted."""
    from transformers import PreTrainedModel

    plain = tiny_config(workspace, ["scale_adapt", "llama_pro", "lora"], steps=3, save_every=0)
    checkpointed = replace(plain, train=replace(plain.train, gradient_checkpointing=True))
    run_cpt(plain, tmp_path / "plain")
    run_cpt(replace(plain, train=replace(plain.train, micro_batch_size=plain.train.batch_size)), tmp_path / "other")
    switch = next(
        n for n in ("activation_checkpointing_enable", "gradient_checkpointing_enable") if hasattr(PreTrainedModel, n)
    )
    enable, enabled = getattr(PreTrainedModel, switch), []

    def record(self, *args, **kwargs):
        enabled.append(type(self).__name__)
        return enable(self, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, switch, record)
    run_cpt(checkpointed, tmp_path / "checkpointed")
    assert len(enabled) == 3, "gradient checkpointing was switched on for every method"
    files = {"scale_adapt": "model.safetensors", "llama_pro": "model.safetensors", "lora": "adapter_model.safetensors"}
    for method, file in files.items():
        got, want, other = (
            load_file(tmp_path / run / method / "model" / file) for run in ("checkpointed", "plain", "other")
        )
        assert got.keys() == want.keys() == other.keys()
        for name in want:
            noise = max_error(other[name], want[name])  # the plain run's own rounding noise
            assert_within_noise(got[name], want[name], noise=noise, what=f"{method} {name}")
    before = load_file(workspace / "base" / "model.safetensors")
    after = load_file(tmp_path / "checkpointed" / "llama_pro" / "model" / "model.safetensors")
    new_block = [n for n in after if n.startswith("model.layers.") and n not in before]
    assert new_block, "LLaMA Pro added a block"


@pytest.mark.slow
@pytest.mark.exactness
def test_up_logit_frontier_reevaluates_the_trained_model_at_each_alpha(finished_run):
    """--eval.up_logit_scales: alpha 1 is the run's own last record, alpha 0 is SCALE-Preserve's base model
    (its step-0 perplexities, Theorem 3.1), and the saved model keeps the alpha it trained with."""
    cfg, out, results = finished_run
    assert cfg.eval.up_logit_scales == (0.0, 0.5, 1.0)
    preserve = results["methods"]["scale_preserve"]
    frontier = {point["alpha"]: point for point in preserve["up_logit_frontier"] if "router" not in point}
    first, last = preserve["curve"][0], preserve["curve"][-1]
    assert sorted(frontier) == [0.0, 0.5, 1.0]
    # SCALE-Preserve is also read with the likelihood router (its Z is the base's logits exactly): at alpha 0 its
    # two distributions are one, the base's
    routed = {p["alpha"]: p for p in preserve["up_logit_frontier"] if p.get("router") == "likelihood"}
    assert sorted(routed) == [0.0, 0.5, 1.0]
    base = _base_readings(cfg)
    _assert_reads_the_base(routed[0.0], base, "the likelihood router at alpha 0")  # mixes the base with itself
    assert routed[1.0]["learning_ppl"] != pytest.approx(frontier[1.0]["learning_ppl"], rel=1e-6)
    assert 0 < routed[1.0]["route_preserve_share"]["heldout"] < 1
    # alpha 1 is the trained model as it is (Z + 1 Z_up), evaluated again by the same code: the same number
    assert frontier[1.0]["learning_ppl"] == last["learning_ppl"]
    _assert_reads_the_base(frontier[0.0], base, "SCALE-Preserve at alpha 0")
    assert last["learning_ppl"] < frontier[0.5]["learning_ppl"] < first["learning_ppl"]
    assert "up_logit_frontier" not in results["methods"]["freeze"]  # not a SCALE model: nothing to weigh
    assert "### The new stream's weight (Z + alpha Z_up)" in (out / "results.md").read_text()
    model, _, _ = load_trained(out / "scale_preserve" / "model")
    assert model.scale_config.up_logit_scale == 1.0
    # SCALE-Route is also read with route_exact (an evaluation option: trained with it, Route cannot learn) and with
    # the likelihood router.
    route = results["methods"]["scale_route"]["up_logit_frontier"]
    readings = [(p["alpha"], p.get("route_exact", False), p.get("router", "cosine")) for p in route]
    assert readings == [
        (alpha, exact, router)
        for exact, router in ((False, "cosine"), (True, "cosine"), (False, "likelihood"))
        for alpha in (0.0, 0.5, 1.0)
    ]
    assert route[2]["learning_ppl"] == results["methods"]["scale_route"]["curve"][-1]["learning_ppl"]  # as above
    assert len({p["learning_ppl"] for p in route}) == len(route), "each reading is its own evaluation"
    assert 0 < route[-1]["route_preserve_share"]["heldout"] < 1, "the likelihood router's share is the mean w"
    model, _, _ = load_trained(out / "scale_route" / "model")
    assert model.scale_config.route_exact is False and model.scale_config.up_logit_scale == 1.0
    assert model.scale_config.router == "cosine"


@pytest.mark.slow
def test_the_two_model_control_reads_fft_with_its_base(workspace, tmp_path, monkeypatch, no_figures):
    """--eval.likelihood_control: FFT's trained model mixed with the base by the likelihood router, evaluated as
    one model (scale_cl.eval.mixture) and shown in results.md; a routing method reads its own router instead. The
    calibrated router's gate is fitted on both (the same recipe) from the training text and the base's samples: no
    held-out or old-domain evaluation text is read by the fit."""
    from scale_cl.train import router_fit

    read: list[torch.Tensor] = []  # every sequence the fits read
    collect = router_fit.collect_evidence

    def collect_and_record(model, text, batch_size=8):
        read.extend(text.unbind() if isinstance(text, torch.Tensor) else [r for b in text for r in b["input_ids"]])
        return collect(model, text, batch_size)

    monkeypatch.setattr(router_fit, "collect_evidence", collect_and_record)
    cfg = tiny_config(workspace, ["fft", "scale_route"])
    routers = ("likelihood", "confidence", "calibrated")
    evaluation = replace(cfg.eval, likelihood_control=True, mixed_documents=2, up_logit_scales=(1.0,), routers=routers)
    evaluation = replace(evaluation, gate_objectives=("likelihood", "classification"))
    results = run_cpt(replace(cfg, eval=evaluation), tmp_path / "run")
    fft = results["methods"]["fft"]
    control, confident, calibrated, classified = fft["likelihood_control"]  # eval.routers: each reads the pair
    assert (control["router"], confident["router"], calibrated["router"]) == routers and "separation" in confident
    frontier = results["methods"]["scale_route"]["up_logit_frontier"]
    assert [r.get("router") for r in frontier if r.get("router")] == [*routers, "calibrated"]  # one per objective
    for record, objective in (
        (calibrated, "likelihood"),
        (classified, "classification"),
        (frontier[-1], "classification"),
    ):
        fit = record["gate_fit"]
        assert fit["objective"] == objective and fit["old_base_weight"] > fit["new_base_weight"], fit
        assert str(record["router_decay"]) in fit["by_decay"]
    assert calibrated["gate_fit"]["value"] != classified["gate_fit"]["value"]  # two fits, each its own objective
    corpus = load_run_corpus(cfg, AutoTokenizer.from_pretrained(cfg.model))
    train = {tuple(corpus.train[i]["input_ids"].tolist()) for i in range(len(corpus.train))}
    evaluated = {tuple(row.tolist()) for data in (corpus.heldout, *corpus.old_eval.values()) for row in data.blocks}
    rows = {tuple(row.tolist()) for row in read}
    eos = AutoTokenizer.from_pretrained(cfg.model).eos_token_id
    new_side = {row for row in rows if row in train}
    sampled = {row for row in rows - new_side if row[0] == eos}  # the base's samples, from a document start
    assert new_side and sampled and not rows & evaluated  # the training text is read, no evaluation text
    for row in rows - new_side - sampled:  # the rest: a training row and a sample spliced at one cut
        assert any(
            any(row[:cut] == a[:cut] for a in first) and any(row[cut:] == b[cut:] for b in second)
            for cut in range(1, len(row))
            for first, second in ((new_side, sampled), (sampled, new_side))
        ), row
    # every reading by token likelihoods records the router's separation; a model alone records none
    route_read = next(r for r in results["methods"]["scale_route"]["up_logit_frontier"] if r.get("router"))
    for record in (control["separation"], route_read["separation"]):
        assert set(record["base_weight"]) == {"heldout", "toy"} and 0 <= record["auroc"]["toy"] <= 1
    assert "separation" not in fft["curve"][-1]
    # eval.mixed_documents: each way's segments read apart, with the base's weight where a router reads them
    for record in (control, fft["curve"][-1], route_read):
        for way in ("new+old", "old+new"):
            assert all(math.isfinite(v) and v > 1 for v in record["mixed_documents"][way]["perplexity"].values())
    assert set(control["mixed_documents"]["old+new"]["base_weight"]) == {"before", "passage", "after"}
    assert "base_weight" not in fft["curve"][-1]["mixed_documents"]["new+old"]
    assert control["router"] == "likelihood" and control["control"] == "two models"
    assert control["trainable"] == fft["curve"][-1]["trainable"]  # the base beside it trains nothing
    first, last = fft["curve"][0], fft["curve"][-1]
    for value in (control["learning_ppl"], control["forgetting_ppl"]["toy"]):
        assert math.isfinite(value) and value > 1
    assert control["learning_ppl"] not in (first["learning_ppl"], last["learning_ppl"])  # neither model alone
    assert "likelihood_control" not in results["methods"]["scale_route"]
    assert (
        "| fft + its base (two-model control) (likelihood router) | 1 |"
        in (tmp_path / "run" / "results.md").read_text()
    )


@pytest.mark.slow
@pytest.mark.exactness
def test_wise_ft_frontier_interpolates_fft_towards_the_base(finished_run, workspace):
    """--eval.wise_ft_alphas: alpha 1 is FFT's own last record, alpha 0 the base model (step 0), and the saved
    model is the trained one."""
    cfg, out, results = finished_run
    assert cfg.eval.wise_ft_alphas == (0.0, 0.5, 1.0)
    fft = results["methods"]["fft"]
    frontier = {point["alpha"]: point for point in fft["wise_ft_frontier"]}
    first, last = fft["curve"][0], fft["curve"][-1]
    # torch.lerp at weight 1 is the trained weights themselves (end - diff * 0), evaluated again: the same number
    assert frontier[1.0]["learning_ppl"] == last["learning_ppl"]
    _assert_reads_the_base(frontier[0.0], _base_readings(cfg), "WiSE-FT at alpha 0")
    assert frontier[0.5]["learning_ppl"] not in (first["learning_ppl"], last["learning_ppl"])
    assert "wise_ft_frontier" not in results["methods"]["scale_preserve"]
    model, _, _ = load_trained(out / "fft" / "model")
    base = AutoModelForCausalLM.from_pretrained(workspace / "base")
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, base.model.layers[0].mlp.up_proj.weight)
