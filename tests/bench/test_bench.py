"""`scale-cl bench`: a smoke run on the tiny shape (structure, never timings) and the FLOP counter's counts."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import LlamaForCausalLM

from scale_cl import ScaleConfig, upscale
from scale_cl.bench import BenchConfig
from scale_cl.bench.floor import fft_floor, scale_floor
from scale_cl.bench.readings import READINGS
from scale_cl.bench.report import RATIO_METRICS, evaluate_targets
from scale_cl.bench.setup import scale_configs
from scale_cl.bench.shapes import SHAPES
from scale_cl.cli import main, parse_settings
from scale_cl.eval.cost import forward_flops_per_token, train_flops_per_token
from scale_cl.methods import METHOD_NAMES
from scale_cl.tuner.layers import ScaleLinear
from scale_cl.tuner.scale_state import decoder_layers
from tests.conftest import hidden_up_for, make_model, tiny_llama_config

READING_NAMES = tuple(READINGS)
SMOKE = ["--shapes", "tiny", "--batch", "2", "--seq", "16", "--warmup", "1", "--rounds", "1", "--threads", "1"]
SMOKE += ["--infer-rounds", "1", "--gen-prompt", "4", "--gen-tokens", "2", "--no-progress"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One run of every method on the tiny shape (memory children skipped here; see the next fixture)."""
    out = tmp_path_factory.mktemp("bench")
    assert main(["bench", *SMOKE, "--skip-memory", "--out", str(out)]) == 0
    return json.loads((out / "results.json").read_text()), (out / "results.md").read_text()


@pytest.mark.slow
def test_smoke_records_machine_torch_date_and_command(smoke):
    results, markdown = smoke
    meta = results["meta"]
    assert meta["torch"] == torch.__version__
    assert meta["cpu_cores"] >= 1 and meta["device"] == "cpu" and meta["dtype"] == "float32"
    assert meta["date"][:4].isdigit() and meta["date"] in markdown
    assert meta["command"].startswith("scale-cl bench --shapes tiny")
    assert f"torch {torch.__version__}" in markdown and meta["command"] in markdown
    assert results["config"]["methods"] == list(METHOD_NAMES)


@pytest.mark.slow
def test_smoke_has_every_method_with_ratios_against_fft(smoke):
    results, _ = smoke
    entry = results["shapes"]["tiny"]
    assert list(entry["methods"]) == list(METHOD_NAMES)
    fft = entry["methods"]["fft"]
    for method, record in entry["methods"].items():
        for metric in RATIO_METRICS:
            if metric in ("peak_train_mib", "peak_forward_mib"):  # skipped in this run (the second: readings')
                assert record.get(metric) is None and record["vs_fft"][metric] is None
                continue
            if metric == "train_floor_flops_per_token" and method in ("lora", "freeze", "llama_pro"):
                assert record[metric] is None  # the baselines' libraries decide what they run: no floor
                continue
            assert record[metric] > 0, (method, metric)
            assert math.isclose(record["vs_fft"][metric], record[metric] / fft[metric]), (method, metric)
        assert len(record["step_s_all"]) == 1
        assert record["setting"]
    assert all(v == 1.0 for k, v in fft["vs_fft"].items() if v is not None)
    for method in ("fft", "scale_preserve", "scale_adapt", "scale_route"):  # each runs exactly its floor
        assert (
            entry["methods"][method]["train_flops_per_token"] == entry["methods"][method]["train_floor_flops_per_token"]
        )
    # the matched baselines say what they are matched to
    assert "matched to scale_route" in entry["methods"]["lora"]["setting"]
    assert entry["preserve_layers"] == {"preserve": 1, "adapt": 1, "route": 3}


@pytest.mark.slow
def test_smoke_markdown_tables_and_upscale(smoke):
    results, markdown = smoke
    upscale_cost = results["shapes"]["tiny"]["upscale"]
    assert upscale_cost["wall_s"] > 0 and upscale_cost["upscaled_model_mib"] > upscale_cost["base_model_mib"]
    assert upscale_cost["peak_mib"] > 0
    assert "| method | setting | trainable params | fwd MFLOP/token |" in markdown
    assert "| method | forward tokens/s | generate() tokens/s |" in markdown
    assert "| wall s | peak MiB |" in markdown
    for method in METHOD_NAMES:
        assert sum(line.startswith(f"| {method} |") for line in markdown.splitlines()) == 2, method
    assert "| fft | every parameter trains | 1,055,488 (1.00x) |" in markdown
    targets = results["shapes"]["tiny"]["targets"]
    names = [t["target"] for t in targets]
    assert "scale_route step time / scale_adapt" in names and "upscale wall time (s)" in names
    assert all(isinstance(t["met"], bool) for t in targets)


@pytest.mark.slow
def test_smoke_peak_memory_in_fresh_processes(tmp_path):
    out = tmp_path / "mem"
    args = [*SMOKE, "--methods", "fft", "scale_preserve", "--skip-inference", "--skip-flops", "--skip-upscale"]
    assert main(["bench", *args, "--out", str(out)]) == 0
    methods = json.loads((out / "results.json").read_text())["shapes"]["tiny"]["methods"]
    for record in methods.values():
        assert "memory_error" not in record
        # the model stays resident while training, so the training peak is at least its size
        assert record["peak_train_mib"] >= record["resident_before_training_mib"] > 0
    assert methods["scale_preserve"]["vs_fft"]["peak_train_mib"] > 0


@pytest.mark.slow
def test_quantized_rows_beside_dense_ones(tmp_path):
    """METHOD+nf4 / +int8 rows (QLoRA, SCALE on a quantized base) in the same run as their dense rows: the same
    FLOPs (counted on the dense twin), the same trainable parameters, less stored state, a fresh-process peak."""
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "quant"
    rows = ["lora", "lora+nf4", "scale_route", "scale_route+nf4", "scale_route+int8"]  # a process per row's peak
    args = [*SMOKE, "--methods", *rows, "--skip-inference", "--skip-upscale"]
    assert main(["bench", *args, "--out", str(out)]) == 0
    methods = json.loads((out / "results.json").read_text())["shapes"]["tiny"]["methods"]
    assert list(methods) == rows
    for dense, quantized in [
        ("lora", "lora+nf4"),
        ("scale_route", "scale_route+nf4"),
        ("scale_route", "scale_route+int8"),
    ]:
        for key in ("fwd_flops_per_token", "train_flops_per_token", "trainable_params"):
            assert methods[quantized][key] == methods[dense][key], (quantized, key)
        assert methods[quantized]["state_mib"] < methods[dense]["state_mib"]
        assert methods[quantized]["peak_train_mib"] > 0 and methods[quantized]["step_s"] > 0
        assert "bitsandbytes" in methods[quantized]["setting"]
    assert methods["scale_route+nf4"]["state_mib"] < methods["scale_route+int8"]["state_mib"]  # 4 bits < 8 bits


def test_readings_are_inference_rows_of_the_methods_models(tmp_path):
    """--readings: each router reading of a method's model (and the two-model control) is timed with the methods,
    its forward FLOPs counted (the control's are FFT's twice), in a table of its own; the forward memory task
    measures the control with the base resident beside FFT's model."""
    from scale_cl.bench.child import forward_memory

    out = tmp_path / "readings"
    rows = ["--methods", "fft", "scale_preserve", "scale_route", "--readings", *READING_NAMES]
    assert main(["bench", *SMOKE, *rows, "--skip-memory", "--skip-upscale", "--skip-training", "--out", str(out)]) == 0
    entry = json.loads((out / "results.json").read_text())["shapes"]["tiny"]
    readings, methods = entry["readings"], entry["methods"]
    assert list(readings) == list(READING_NAMES)
    for name, record in readings.items():
        assert record["forward_tokens_per_s"] > 0 and record["generate_tokens_per_s"] > 0, name
        assert record["vs_fft"]["forward_tokens_per_s"] > 0, name
    # the models' own products; each router adds a few small ones of its own (the running ratio's 64 x 64 chunks,
    # Eq. 5's cosine), under 0.1% here
    fft = methods["fft"]["fwd_flops_per_token"]
    for control in ("control", "control-calibrated"):
        assert readings[control]["fwd_flops_per_token"] == pytest.approx(2 * fft, rel=1e-3)
    assert readings["control-nested"]["fwd_flops_per_token"] == pytest.approx(4 * fft, rel=1e-3)  # four models
    # the nested row reads SCALE-Preserve grown twice more: wider than the model it reads, less than four models
    nested = readings["preserve-nested"]["fwd_flops_per_token"]
    assert methods["scale_preserve"]["fwd_flops_per_token"] * 1.2 < nested < 4 * fft
    readings_of = (("route-likelihood", "scale_route"), ("preserve-likelihood", "scale_preserve"))
    for name, method in (*readings_of, ("preserve-calibrated", "scale_preserve")):
        assert readings[name]["fwd_flops_per_token"] == pytest.approx(methods[method]["fwd_flops_per_token"], rel=1e-3)
    assert "Inference read with the likelihood router" in (out / "results.md").read_text()
    cfg = BenchConfig(shapes=("tiny",), batch=2, seq=16, methods=("fft",), readings=("control",))
    alone, control = forward_memory(cfg, "tiny", "fft"), forward_memory(cfg, "tiny", "control")
    assert control["resident_before_mib"] > alone["resident_before_mib"] > 0


def test_options_and_yaml_reach_the_config(tmp_path):
    """The SMOKE options (dashed, as written in the docs) and a YAML file, before the options, give the BenchConfig."""
    config = tmp_path / "bench.yaml"
    config.write_text("rounds: 4\nmethods: [fft, lora]\nskip_flops: true\n")
    argv = [*SMOKE, "--config", str(config), "--rounds", "2", "--upscale-only", "--skip-memory"]
    settings = parse_settings(["bench", *argv])
    cfg = settings.bench
    assert (cfg.shapes, cfg.batch, cfg.seq, cfg.warmup, cfg.threads) == (("tiny",), 2, 16, 1, 1)
    assert (cfg.infer_rounds, cfg.gen_prompt, cfg.gen_tokens, cfg.progress) == (1, 4, 2, False)
    assert cfg.methods == ("fft", "lora") and cfg.skip_flops is True  # from the YAML
    assert cfg.rounds == 2  # the command line wins over the YAML
    assert cfg.upscale_only == () and cfg.skip_memory is True and cfg.skip_inference is False
    assert settings.out == "outputs/bench"


def test_bad_options_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--shapes", "gpt-5"])
    assert exit_info.value.code == 2 and "invalid choice: 'gpt-5'" in capsys.readouterr().err
    assert main(["bench", "--shapes", "tiny", "--batch", "-1"]) == 2  # checked before anything runs
    assert "scale-cl bench: error: batch must be >= 0, got -1" in capsys.readouterr().err


def test_config_refuses_bad_settings():
    with pytest.raises(ValueError, match="unknown shapes"):
        BenchConfig(shapes=("gpt-5",))
    with pytest.raises(ValueError, match="unknown methods"):
        BenchConfig(methods=("fft", "dora"))
    with pytest.raises(ValueError, match="fft trains them"):
        BenchConfig(methods=("fft+nf4",))
    with pytest.raises(ValueError, match="unknown base_quant"):
        BenchConfig(methods=("lora+int4",))
    with pytest.raises(ValueError, match="batch"):
        BenchConfig(batch=-1)
    assert (BenchConfig(device="cpu").batch, BenchConfig(device="cpu").seq) == (4, 256)  # 0: the device's batch
    assert (BenchConfig(device="cpu", batch=2, seq=8).batch, BenchConfig(device="cpu", seq=8).seq) == (2, 8)
    with pytest.raises(ValueError, match="compile must be one of"):
        BenchConfig(compile="fast")
    with pytest.raises(ValueError, match=r"route-likelihood \(needs scale_route\)"):
        BenchConfig(methods=("fft", "scale_preserve"), readings=("route-likelihood",))
    with pytest.raises(ValueError, match="keep fft in --methods"):
        BenchConfig(methods=("scale_route",), readings=("route-likelihood",))
    with pytest.raises(ValueError, match="drop --skip_inference"):
        BenchConfig(methods=("fft",), readings=("control",), skip_inference=True)
    with pytest.raises(ValueError, match="unknown readings"):
        BenchConfig(readings=("nested",))
    assert BenchConfig(device="cpu").is_upscale_only("llama-1b")
    assert not BenchConfig(device="cpu", upscale_only=()).is_upscale_only("llama-1b")


def test_targets_are_met_or_missed_from_the_measured_ratios():
    methods = {
        "fft": {"step_s": 10.0, "peak_train_mib": 1000.0, "fwd_flops_per_token": 100.0, "generate_tokens_per_s": 10.0},
        "lora": {"step_s": 9.0, "peak_train_mib": 500.0},
        "scale_adapt": {"step_s": 7.0, "peak_train_mib": 600.0, "fwd_flops_per_token": 125.0},
        "scale_route": {"step_s": 10.0, "peak_train_mib": 550.0, "fwd_flops_per_token": 150.0},
        "scale_preserve": {"step_s": 8.5, "generate_tokens_per_s": 7.5, "fwd_flops_per_token": 125.0},
    }
    methods["scale_adapt"]["generate_tokens_per_s"] = 6.0
    targets = {t["target"]: t for t in evaluate_targets({"methods": methods})}
    assert targets["scale_adapt step time / fft"]["met"] and targets["scale_adapt step time / fft"]["value"] == 0.7
    assert not targets["scale_preserve step time / fft"]["met"]
    route = targets["scale_route step time / scale_adapt"]
    assert route["value"] == pytest.approx(10 / 7) and not route["met"]
    flop = targets["|route/adapt step-time ratio / forward FLOP ratio - 1|"]
    assert flop["value"] == pytest.approx(abs((10 / 7) / 1.2 - 1)) and not flop["met"]
    assert not targets["scale_adapt peak training memory / lora"]["met"]  # 1.2 > 1.15
    assert targets["scale_route peak training memory / lora"]["met"]  # 1.1
    assert "scale_preserve peak training memory / lora" not in targets  # no measurement, no verdict
    gen = "generate tokens/s / (fft tokens/s x FLOP ratio fft/"
    preserve_gen = targets[f"scale_preserve {gen}scale_preserve)"]
    assert preserve_gen["value"] == pytest.approx(0.75 / 0.8) and preserve_gen["met"]  # 0.9375 >= 0.9
    assert not targets[f"scale_adapt {gen}scale_adapt)"]["met"]  # 0.6 / 0.8 = 0.75
    assert f"scale_route {gen}scale_route)" not in targets  # route's generation was not measured


# -- the FLOP counter -----------------------------------------------------------------------------------

T = 12


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config())


def _ids() -> torch.Tensor:
    return torch.randint(0, 96, (1, T), generator=torch.Generator().manual_seed(0))


def test_flops_count_every_linear_and_the_cpu_attention():
    model = _llama()
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    attention = model.config.num_hidden_layers * 4 * 4 * T * 16  # q k^T and p v: 2 T d FLOPs each, per head
    assert forward_flops_per_token(model, _ids()) == 2 * linears + attention


def _upscaled(method: str, preserve_layers: int) -> LlamaForCausalLM:
    return upscale(_llama(), ScaleConfig(hidden_up=32, ffn_up=32, method=method, preserve_layers=preserve_layers))


def test_preserve_never_computes_w12():
    adapt = _upscaled("adapt", preserve_layers=0)  # every layer collaborative
    preserve = _upscaled("preserve", preserve_layers=0)
    w12 = sum(m.w12.numel() for m in adapt.modules() if isinstance(m, ScaleLinear))
    assert w12 > 0
    difference = forward_flops_per_token(adapt, _ids()) - forward_flops_per_token(preserve, _ids())
    assert difference == 2 * w12


def test_route_counts_more_flops_than_adapt():
    adapt, route = _upscaled("adapt", preserve_layers=2), _upscaled("route", preserve_layers=2)
    adapt_flops, route_flops = forward_flops_per_token(adapt, _ids()), forward_flops_per_token(route, _ids())
    assert route_flops > adapt_flops
    # route runs the top layer for both paths and the original head twice: at least that much more
    head = route.get_output_embeddings().weight.numel()
    assert route_flops - adapt_flops >= 2 * head
    # and training skips the frozen products' backward only where the input is constant
    assert train_flops_per_token(route, _ids()) > train_flops_per_token(adapt, _ids())


# -- attention with grouped key/value heads (GQA) ------------------------------------------------------


def test_every_attention_kernel_torch_counts_is_counted_by_our_formula():
    """torch's own SDPA formulas refused grouped heads before 2.13 (the bench crashed on CUDA, where transformers
    calls SDPA with enable_gqa): every kernel torch's counter knows must be counted by ours instead."""
    from torch.utils.flop_counter import flop_registry

    from scale_cl.eval.cost import ATTENTION_OPS

    kernels = {op for op in flop_registry if "scaled_dot_product" in str(op)}  # the kernels SDPA dispatches to
    assert kernels and kernels <= set(ATTENTION_OPS)
    assert torch.ops.aten._scaled_dot_product_efficient_attention in ATTENTION_OPS  # CUDA's, on a CPU-only torch


def test_attention_formulas_take_grouped_heads():
    from scale_cl.eval.cost import attention_backward_flops, attention_flops

    query, grouped, value = (2, 8, 16, 64), (2, 2, 16, 64), (2, 2, 16, 64)
    forward = 2 * (2 * 2 * 8 * 16 * 16 * 64)  # q k^T and p v, 2 B T_q T_k d FLOPs each, for all 8 query heads
    assert attention_flops(query, grouped, value) == forward
    assert attention_backward_flops(query, query, grouped, value) == forward * 5 // 2  # torch's 5 products


def _strict_before_2_13(query_shape, key_shape, value_shape, *args):
    """torch's SDPA formula as it was before 2.13: key/value heads must equal query heads."""
    if query_shape[1] != key_shape[1]:
        raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")
    return 0


def test_a_gqa_model_is_counted_through_enable_gqa(monkeypatch):
    """Transformers' SDPA call with enable_gqa (CUDA's path, forced here on the CPU), with torch's own formulas made
    as strict as before 2.13: counted, every query head, forward and backward."""
    import torch.utils.flop_counter as flop_counter

    import scale_cl.eval.cost as cost

    monkeypatch.setattr(flop_counter, "sdpa_flop_count", _strict_before_2_13)
    monkeypatch.setattr(flop_counter, "sdpa_backward_flop_count", _strict_before_2_13)
    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    seen = []

    def recording(formula):
        def count(query, key, *args, **kwargs):
            seen.append((query[1], key[1]))
            return formula(query, key, *args, **kwargs)

        return count

    grouped = {op: recording(formula) for op, formula in cost.ATTENTION_OPS.items()}
    monkeypatch.setattr(cost, "ATTENTION_OPS", grouped)
    model = _llama()
    config = model.config
    assert config.num_key_value_heads < config.num_attention_heads
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    attention = config.num_hidden_layers * 4 * config.num_attention_heads * T * config.head_dim
    assert forward_flops_per_token(model, _ids()) == 2 * linears + attention
    assert seen and all(kv == config.num_key_value_heads < q for q, kv in seen), "SDPA ran on grouped heads"
    # full fine-tuning: every linear's input and weight gradients (2 x its forward); attention's backward 2.5x
    assert train_flops_per_token(model, _ids()) == 3 * 2 * linears + attention * 7 // 2


# -- the FLOP floor: what a method must compute, against what it runs ----------------------------------

FLOOR_ARCHS = [
    "llama-gqa2-tied",
    "llama-mha-untied",
    "qwen2-qkv-bias",
    "neox-parallel-rot0.25",
    "neox-sequential-rot1.0",
]
FLOOR_SETTINGS = [(0, ("attn", "ffn")), (2, ("attn", "ffn")), (1, ("ffn",)), (2, ("attn",)), (3, ("attn", "ffn"))]
# SCALE-Preserve uses no W12 anywhere: preserve_layers and collab_modules change neither its model's computation
# (`set_method`: no W12 used, the original stream constant in every layer) nor its floor, so one setting covers it.
FLOOR_CASES = [("preserve", *FLOOR_SETTINGS[0])] + [
    (method, *setting) for method in ("adapt", "route") for setting in FLOOR_SETTINGS
]


@pytest.mark.parametrize("arch", FLOOR_ARCHS)
def test_full_fine_tuning_runs_its_floor(arch):
    ids = _ids()
    assert train_flops_per_token(make_model(arch), ids) == fft_floor(make_model(arch).config, T).train
    assert forward_flops_per_token(make_model(arch), ids) == fft_floor(make_model(arch).config, T).forward


@pytest.mark.parametrize("arch", FLOOR_ARCHS)
@pytest.mark.parametrize(("method", "preserve_layers", "collab"), FLOOR_CASES)
def test_scale_runs_exactly_its_floor(arch, method, preserve_layers, collab):
    """Every product a SCALE training step runs is one its method needs: no backward through a constant original
    stream or constant original heads, no W12 where it is not used (the floor's own count, `scale_cl.bench.floor`)."""
    base = make_model(arch)
    cfg = ScaleConfig(
        hidden_up=hidden_up_for(base), ffn_up=16, method=method, preserve_layers=preserve_layers, collab_modules=collab
    )
    floor = scale_floor(make_model(arch).config, cfg, T)
    model = upscale(base, cfg)
    assert forward_flops_per_token(model, _ids()) == floor.forward
    assert train_flops_per_token(model, _ids()) == floor.train


def test_the_floor_counts_what_the_constant_heads_save():
    """The check can fail: with the original heads called with the new ones, Preserve runs their attention backward
    (3 layers x 4 heads x the counter's 10 T head_dim FLOPs) on top of its floor. The stock layer's: a layer keeping
    the streams apart (`scale_cl.tuner.streams`) computes the original heads from the constant ``x`` alone, so their
    queries, keys and values carry no gradient whatever the flag says."""
    base = make_model("llama-gqa2-tied")
    cfg = ScaleConfig(hidden_up=hidden_up_for(base), ffn_up=16, method="preserve")
    floor = scale_floor(make_model("llama-gqa2-tied").config, cfg, T)
    model = upscale(base, cfg)
    for module in model.modules():
        if hasattr(module, "scale_heads"):
            module.scale_heads.constant = False
    assert train_flops_per_token(model, _ids()) == floor.train  # streams apart: the heads are constant anyway
    for layer in decoder_layers(model):
        layer.keep_streams_apart = False
    assert train_flops_per_token(model, _ids()) - floor.train == 3 * 4 * 10 * T * 16


def test_preserve_backward_has_no_original_stream():
    """SCALE-Preserve's floor: the new blocks' backward only, a small share of full fine-tuning's at a real shape."""
    shape = SHAPES["llama-1b"]
    cfg = scale_configs(shape, BenchConfig(shapes=("llama-1b",)))["preserve"]
    fft, preserve = fft_floor(shape.make_config(), 256), scale_floor(shape.make_config(), cfg, 256)
    assert preserve.backward < 0.1 * fft.backward
    assert 0.4 < preserve.train / fft.train < 0.5  # the hand count: ~3.3 / 7.4 GFLOP per token


def test_peak_for_mfu_by_card_dtype_or_option():
    from scale_cl.bench.report import peak_tflops

    assert peak_tflops("NVIDIA H100 80GB HBM3", torch.bfloat16)[0] == 989.4
    assert peak_tflops("NVIDIA H100 PCIe", torch.bfloat16)[0] == 756.0
    assert peak_tflops("NVIDIA H200", torch.bfloat16)[0] == 989.4
    assert peak_tflops("NVIDIA L40S", torch.bfloat16)[0] == 362.05  # not the L4's
    assert peak_tflops("NVIDIA H100 80GB HBM3", torch.float32)[0] is None  # a bf16 peak says nothing of fp32
    assert peak_tflops(None, torch.float32) == (None, "no peak known: a CPU, or not bf16; --peak_tflops gives one")
    assert peak_tflops("Some Card", torch.bfloat16) == (None, "unknown card 'Some Card' (give --peak_tflops)")
    assert peak_tflops(None, torch.float32, given=2.5) == (2.5, "given (--peak_tflops)")


def test_gpu_targets_in_step_time_memory_and_counted_flops():
    methods = {
        "fft": {"step_s": 1.0, "peak_train_mib": 100.0, "train_flops_per_token": 100.0},
        "lora": {"step_s": 1.2, "train_flops_per_token": 80.0},
        "scale_preserve": {"step_s": 0.55, "peak_train_mib": 50.0, "train_flops_per_token": 45.0},
        "scale_route": {"step_s": 1.1, "peak_train_mib": 60.0, "train_flops_per_token": 64.0},
    }
    methods["scale_preserve"]["train_floor_flops_per_token"] = 44.0
    methods["scale_route"]["train_floor_flops_per_token"] = 50.0
    targets = {t["target"]: t for t in evaluate_targets({"methods": methods}) if t["issue"] == 38}
    assert targets["scale_preserve step time / fft (GPU)"]["met"]  # 0.55 <= 0.6
    assert not targets["scale_route step time / fft (GPU)"]["met"]  # 1.1 > 1.0
    assert targets["scale_preserve step time / lora (GPU)"]["value"] == pytest.approx(0.55 / 1.2)
    assert not targets["scale_route peak training memory / fft (GPU)"]["met"]  # 0.6 > 0.55
    assert targets["scale_preserve training FLOPs / fft"]["met"] and targets["scale_route training FLOPs / lora"]["met"]
    assert targets["scale_preserve training FLOPs counted / its floor"]["met"]  # 45 / 44
    assert not targets["scale_route training FLOPs counted / its floor"]["met"]  # 64 / 50 = 1.28 > 1.1
    assert "scale_adapt step time / fft (GPU)" not in targets  # not measured, no verdict


@pytest.mark.slow
def test_compiled_models_are_timed(tmp_path):
    """--compile: the timed steps run torch.compile'd models (compiled in the warm-up); the results say so."""
    out = tmp_path / "compiled"
    args = [*SMOKE, "--methods", "fft", "--skip-inference", "--skip-upscale", "--skip-memory"]
    assert main(["bench", *args, "--compile", "default", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["compile"] == "default"
    assert all(r["step_s"] > 0 for r in results["shapes"]["tiny"]["methods"].values())
    assert "torch.compile(mode='default') in the timed steps" in (out / "results.md").read_text()


def test_bench_refuses_an_out_of_other_settings_before_measuring(tmp_path, capsys, monkeypatch):
    """``--out`` holding another kind of run, or this command's results of other settings, is refused before anything
    is measured (as every command refuses it); nothing there is changed."""
    import scale_cl.bench.runner as runner

    monkeypatch.setattr(runner, "run_bench", lambda *a, **k: pytest.fail("measured despite a refused --out"))
    train_run = tmp_path / "train-run"
    train_run.mkdir()
    (train_run / "train_config.json").write_text("{}")
    assert main(["bench", "--shapes", "tiny", "--out", str(train_run)]) == 2
    assert "a scale-cl train run" in capsys.readouterr().err
    earlier = tmp_path / "bench"
    earlier.mkdir()
    (earlier / "bench_config.json").write_text(json.dumps({"shapes": ["tiny"], "rounds": 99}))
    (earlier / "results.json").write_text("{}")
    assert main(["bench", "--shapes", "tiny", "--out", str(earlier)]) == 2
    assert "holds results of another configuration" in capsys.readouterr().err
    assert (earlier / "results.json").read_text() == "{}"


def test_streams_apart_targets_a_cpu_row_and_a_gpu_row():
    methods = {
        "fft": {"step_s": 1.0, "peak_train_mib": 100.0, "mfu": 0.41},
        "lora": {"step_s": 0.8},
        "scale_preserve": {"step_s": 0.52, "peak_train_mib": 68.0},
        "scale_adapt": {"step_s": 0.66},
        "scale_route": {"step_s": 0.74},
    }
    readings = {
        "preserve-likelihood": {"vs_fft": {"forward_tokens_per_s": 1 / 1.4}},
        "preserve-calibrated": {"vs_fft": {"forward_tokens_per_s": 1 / 1.3}},
    }
    targets = {t["target"]: t for t in evaluate_targets({"methods": methods, "readings": readings}) if t["issue"] == 53}
    assert targets["scale_preserve step time / fft (CPU)"]["met"]  # 0.52 <= 0.55
    assert not targets["scale_preserve step time / fft (GPU)"]["met"]  # 0.52 > 0.50
    assert (
        targets["scale_adapt step time / fft (CPU)"]["met"] and not targets["scale_adapt step time / fft (GPU)"]["met"]
    )
    assert (
        targets["scale_route step time / fft (CPU)"]["met"] and not targets["scale_route step time / fft (GPU)"]["met"]
    )
    assert targets["scale_preserve step time / lora (GPU)"]["value"] == pytest.approx(0.65)  # 0.52 / 0.8 <= 0.7
    assert targets["scale_preserve step time / lora (GPU)"]["met"]
    assert not targets["scale_route step time / lora (GPU)"]["met"]  # 0.74 / 0.8 > 0.7
    assert targets["scale_preserve peak training memory / fft (CPU)"]["met"]  # 0.68 <= 0.7
    assert not targets["scale_preserve peak training memory / fft (GPU)"]["met"]  # 0.68 > 0.5
    assert not targets["fft MFU (GPU)"]["met"]  # 41% < 45%
    assert targets["preserve-likelihood forward time / fft"]["value"] == pytest.approx(1.4)
    assert not targets["preserve-likelihood forward time / fft"]["met"]  # 1.4 > 1.35
    calibrated = next(t for t in evaluate_targets({"methods": methods, "readings": readings}) if t["issue"] == 63)
    assert calibrated["value"] == pytest.approx(1.3) and calibrated["met"]  # 1.3 <= 1.35
