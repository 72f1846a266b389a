"""Training an upscaled model: what is frozen stays bitwise frozen, what should train gets gradients,
method switches reset trainability, and the model trains with HF Trainer and gradient checkpointing.

Values equal in exact arithmetic but computed another way are compared to rounding: as close to their float64 value
as the stock fp32 computation is (`exactness.assert_exact_to_rounding`).
"""

from __future__ import annotations

import copy
import math
import re
import warnings

import pytest
import torch
from transformers import Trainer, TrainingArguments

import scale_cl
from scale_cl import parameter_summary, set_method
from scale_cl.tuner.layers import ScaleLinear
from tests.conftest import VOCAB, hold_w12, make_model, token_batch, upscaled_copy
from tests.exactness import assert_exact_to_rounding

pytestmark = pytest.mark.exactness

METHODS = ("preserve", "adapt", "route")
NEW_NAMES = ("w21", "w22", "bias_up", "weight_up")


def batch(padded: bool = True, seed: int = 0, rows: int = 3, length: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(padded, seed, rows, length, pads=(4,))


def loss_of(model, ids, mask, **kwargs):
    return model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), **kwargs).loss


def upscaled(name: str, method: str, preserve_layers: int = 1, **fields):
    base = make_model(name)
    return base, upscaled_copy(base, method, preserve_layers=preserve_layers, **fields)


def layer_index(name: str) -> int | None:
    match = re.search(r"\.layers\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def intended_trainable(model, method: str, preserve_layers: int, collab: tuple[str, ...] = ("attn", "ffn")) -> set[str]:
    """The trainable set derived from parameter names alone (not from the implementation's flags)."""
    attn_words, ffn_words = ("self_attn.", "attention."), ("mlp.",)
    names = set()
    for name, _ in model.named_parameters():
        last = name.rsplit(".", 1)[-1]
        if last in NEW_NAMES:
            names.add(name)
        elif last == "w12" and method != "preserve" and layer_index(name) >= preserve_layers:
            is_attn, is_ffn = any(w in name for w in attn_words), any(w in name for w in ffn_words)
            assert is_attn != is_ffn, name
            if ("attn" if is_attn else "ffn") in collab:
                names.add(name)
    return names


def trainable_names(model) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def frozen_snapshot(model) -> dict[str, torch.Tensor]:
    """Clones of every original parameter under every name it has (a tied head and embedding both)."""
    return {
        name: p.detach().clone()
        for name, p in model.named_parameters(remove_duplicate=False)
        if name.rsplit(".", 1)[-1] in ("weight", "bias")
    }


def assert_frozen_unchanged(model, snapshot: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    assert set(snapshot) <= set(params)
    for name, before in snapshot.items():
        p = params[name]
        assert not p.requires_grad, f"{name} is trainable"
        assert p.grad is None, f"{name} got a gradient"
        assert torch.equal(p.detach(), before), f"{name} changed"


# --------------------------------------------------------------------------------------------
# Frozen stays frozen; everything intended trains.


@pytest.mark.parametrize("method", METHODS)
def test_frozen_parameters_bitwise_unchanged(arch_name, method):
    base, model = upscaled(arch_name, method)
    snapshot = frozen_snapshot(model)
    # upscale itself must not touch the originals: same values as the base model's, name for name
    base_params = dict(base.named_parameters(remove_duplicate=False))
    for name, value in snapshot.items():
        assert torch.equal(value, base_params[name].detach()), f"upscale changed {name}"
    assert len(snapshot) == len(base_params)
    if base.config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight

    ids, mask = batch()
    model.train()
    # All parameters go to the optimizer (weight decay too): only autograd keeps the originals out.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    new_before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model, ids, mask)
        assert torch.isfinite(loss)
        loss.backward()
        optimizer.step()
    assert_frozen_unchanged(model, snapshot)
    moved = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, new_before[n])]
    assert len(moved) > len(new_before) // 2, f"only {len(moved)} of {len(new_before)} new parameters moved"


@pytest.mark.parametrize("method", METHODS)
def test_every_intended_parameter_gets_gradient(arch_name, method):
    # default init: w21 svd, w22 zero, head weight_up zero -> most gradients only after a step
    _, model = upscaled(arch_name, method, preserve_layers=1)
    intended = intended_trainable(model, method, preserve_layers=1)
    assert trainable_names(model) == intended
    if method == "preserve":
        assert not any(n.endswith(".w12") for n in intended)
    else:
        assert any(n.endswith(".w12") for n in intended)

    ids, mask = batch()
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    had_grad: set[str] = set()
    # With W22 = 0 and the head's W_out_up = 0 the new stream opens one link per step: step 0 trains
    # W_out_up, step 1 the W22 of o_proj/down_proj, step 2 the W22 of q/k/v/gate/up, and only at step 3
    # do the layer norms' new gains (read through those W22) see a gradient. So: four backward passes.
    for _ in range(4):
        optimizer.zero_grad(set_to_none=True)
        loss_of(model, ids, mask).backward()
        for name, p in model.named_parameters():
            if p.grad is not None:
                assert name in intended, f"{name} got a gradient but should not train"
                if p.grad.abs().max() > 0:
                    had_grad.add(name)
        optimizer.step()
    missing = sorted(intended - had_grad)
    assert not missing, f"never got a non-zero gradient: {missing}"


# --------------------------------------------------------------------------------------------
# requires_grad bookkeeping and the parameter summary.


@pytest.mark.parametrize("arch", ["llama-gqa2-tied", "neox-parallel-rot0.25"])
def test_w12_trainability_follows_layers_modules_and_method(arch):
    _, model = upscaled(arch, "adapt", preserve_layers=2, collab_modules=("attn",))
    prefix = "model.layers.2.self_attn." if arch.startswith("llama") else "gpt_neox.layers.2.attention."
    linears = ("q_proj", "k_proj", "v_proj", "o_proj") if arch.startswith("llama") else ("query_key_value", "dense")
    expected_w12 = {f"{prefix}{lin}.w12" for lin in linears}

    def w12_trainable() -> set[str]:
        return {n for n in trainable_names(model) if n.endswith(".w12")}

    def check_rest() -> None:
        for name, p in model.named_parameters():
            last = name.rsplit(".", 1)[-1]
            if last in ("weight", "bias"):
                assert not p.requires_grad, name
            elif last != "w12":
                assert p.requires_grad, name

    assert w12_trainable() == expected_w12
    assert {n for n, m in model.named_modules() if isinstance(m, ScaleLinear) and m.collaborative} == {
        n.removesuffix(".w12") for n in expected_w12
    }
    check_rest()
    set_method(model, "preserve")
    assert w12_trainable() == set()
    check_rest()
    set_method(model, "adapt")
    assert w12_trainable() == expected_w12
    check_rest()
    model.set_method("route")
    assert w12_trainable() == expected_w12
    check_rest()
    assert scale_cl.scale_config_of(model).method == "route"


@pytest.mark.parametrize("method", METHODS)
def test_parameter_summary_counts(arch_name, method):
    base, model = upscaled(arch_name, method, preserve_layers=1)
    unique = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() for p in unique)
    trainable = sum(p.numel() for p in unique if p.requires_grad)
    summary = parameter_summary(model)
    assert (summary.total, summary.trainable) == (total, trainable)
    assert 0 < trainable < total
    assert f"{trainable:,}" in str(summary)
    # the originals are all still counted, once each
    assert total - sum(p.numel() for p in base.parameters()) == trainable + sum(
        p.numel() for n, p in model.named_parameters() if n.endswith(".w12") and not p.requires_grad
    )
    if base.config.tie_word_embeddings:
        with_duplicates = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
        assert summary.total < with_duplicates, "a tied weight was counted twice"
    assert summary.collaborative_layers == ([] if method == "preserve" else [1, 2])


# --------------------------------------------------------------------------------------------
# preserve really computes with W12 = 0, whatever W12 holds.


def test_preserve_ignores_w12_values(arch_name):
    base, model = upscaled(arch_name, "preserve", preserve_layers=0, w21_init="random", w22_init="random")
    hold_w12(model)  # as a model switched back to Preserve after training W12
    torch.manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, ScaleLinear):
                module.w12.copy_(0.2 * torch.randn_like(module.w12))
        model.get_output_embeddings().weight_up.normal_(0, 0.1)  # Z_up non-zero: compare Z via the stream

    ids, mask = batch()
    d = base.config.hidden_size
    with torch.no_grad():
        expected = base(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        exact = copy.deepcopy(base).double()(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        got = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        states = zip(got.hidden_states, expected.hidden_states, exact.hidden_states, strict=True)
        for i, (hs, hs_base, hs_exact) in enumerate(states):
            what = f"preserve with W12 != 0: original part of hidden state {i}"
            assert_exact_to_rounding(hs[..., :d], hs_exact, stock=hs_base, what=what)
        set_method(model, "adapt")
        adapted = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        set_method(model, "preserve")
        again = model(input_ids=ids, attention_mask=mask).logits
    assert (adapted.hidden_states[-1][..., :d] - expected.hidden_states[-1]).abs().max() > 1e-3
    assert (adapted.logits - got.logits).abs().max() > 1e-3, "adapt ignores W12 too"
    assert torch.equal(again, got.logits)  # the same products on the same values: switching back leaves nothing


def test_preserve_logits_ignore_w12_with_zero_head(arch_name):
    """With the head's new columns at zero, preserve gives the base logits for any W12."""
    base, model = upscaled(arch_name, "preserve", preserve_layers=0, w21_init="random", w22_init="random")
    hold_w12(model)
    torch.manual_seed(2)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, ScaleLinear):
                module.w12.copy_(0.2 * torch.randn_like(module.w12))
        ids, mask = batch()
        expected = base(input_ids=ids, attention_mask=mask).logits
        exact = copy.deepcopy(base).double()(input_ids=ids, attention_mask=mask).logits
        got = model(input_ids=ids, attention_mask=mask).logits
        assert_exact_to_rounding(got, exact, stock=expected, what="preserve logits with W12 != 0")
        set_method(model, "adapt")
        adapted = model(input_ids=ids, attention_mask=mask).logits
    assert (adapted - expected).abs().max() > 1e-3


# --------------------------------------------------------------------------------------------
# HF Trainer, unchanged.


def _dataset(n: int = 6, length: int = 8) -> list[dict]:
    """Plain Python lists (what a tokenizer returns); every second example is left-padded."""
    gen = torch.Generator().manual_seed(5)
    rows = []
    for i in range(n):
        ids = torch.randint(1, VOCAB, (length,), generator=gen)
        mask = torch.ones(length, dtype=torch.long)
        if i % 2:
            mask[:2] = 0
            ids[:2] = 0
        labels = ids.masked_fill(mask == 0, -100)
        rows.append({"input_ids": ids.tolist(), "attention_mask": mask.tolist(), "labels": labels.tolist()})
    return rows


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ["llama-gqa2-tied", "neox-sequential-rot1.0"])
def test_hf_trainer_trains_upscaled_model(arch, method, tmp_path):
    _, model = upscaled(arch, method, preserve_layers=1)
    snapshot = frozen_snapshot(model)
    new_before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    data = _dataset()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data)
    result = trainer.train()
    assert result.global_step == 3
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 3
    assert all(math.isfinite(x) for x in losses), losses

    assert_frozen_unchanged(model, snapshot)
    moved = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, new_before[n])]
    assert moved, "Trainer changed no new parameter"
    assert model.get_output_embeddings().weight_up.abs().max() > 0
    if method != "preserve":
        assert any(n.endswith(".w12") for n in moved)

    # evaluation and prediction (logits gathered) must not choke on route's extra output key
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"])
    prediction = trainer.predict(data)
    assert not isinstance(prediction.predictions, tuple), "an extra output leaked into the predictions"
    assert prediction.predictions.shape == (len(data), 8, VOCAB)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_stages_device_and_precision_reach_the_trainer(precision, tmp_path):
    """`training_arguments` hands a stage's ``device`` and ``precision`` to the Trainer: ``cpu`` trains on the CPU
    (on a GPU machine too), ``bf16`` under bf16 autocast; the run records what the Trainer used."""
    from scale_cl.train.arguments import training_arguments
    from scale_cl.train.config import StageConfig
    from scale_cl.train.device import used_placement

    stage = StageConfig(lr=1e-2, max_steps=2, batch_size=2, device="cpu", precision=precision)
    args = training_arguments(stage, tmp_path, 0)
    assert (args.use_cpu, args.bf16, args.device.type, args.n_gpu) == (True, precision == "bf16", "cpu", 0)
    _, model = upscaled("llama-gqa2-tied", "adapt")
    seen = []  # where the first decoder layer runs, and whether under bf16 autocast
    model.base_model.layers[0].register_forward_pre_hook(
        lambda module, inputs: seen.append((inputs[0].device.type, torch.is_autocast_enabled("cpu")))
    )
    Trainer(model=model, args=args, train_dataset=_dataset()).train()
    assert set(seen) == {("cpu", precision == "bf16")} and len(seen) == 2
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert used_placement(args) == {"device": "cpu", "precision": precision}


def test_one_process_trains_on_one_gpu(tmp_path):
    """A process that sees several GPUs trains on the first: the Trainer's ``n_gpu`` (which would wrap the model in
    ``nn.DataParallel`` and multiply the batch) is brought to 1, as under torchrun; a CPU run keeps 0."""
    from scale_cl.train.arguments import one_gpu_per_process, training_arguments
    from scale_cl.train.config import StageConfig

    args = training_arguments(StageConfig(device="cpu"), tmp_path, 0)
    assert one_gpu_per_process(args).n_gpu == 0
    args._n_gpu = 2  # what TrainingArguments sets when one process sees two GPUs
    assert one_gpu_per_process(args).n_gpu == 1 and args.train_batch_size == args.per_device_train_batch_size


# --------------------------------------------------------------------------------------------
# Gradient checkpointing gives the same gradients.


def _grads(model, ids, mask) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_of(model, ids, mask, use_cache=False).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _exact_grads(model, ids, mask) -> dict[str, torch.Tensor]:
    """`_grads` of a float64 copy of ``model``."""
    return _grads(copy.deepcopy(model).double().train(), ids, mask)


@pytest.mark.parametrize("method", ["adapt", "route"])
@pytest.mark.parametrize("arch", ["llama-gqa2-tied", "neox-parallel-rot0.25"])
def test_gradient_checkpointing_same_gradients(arch, method):
    _, model = upscaled(arch, method, preserve_layers=1, w21_init="random", w22_init="random")
    torch.manual_seed(4)
    with torch.no_grad():  # move away from W12 = 0 / zero head so that every gradient is non-trivial
        for module in model.modules():
            if isinstance(module, ScaleLinear) and module.collaborative:
                module.w12.normal_(0, 0.05)
        model.get_output_embeddings().weight_up.normal_(0, 0.05)
    ids, mask = batch()
    model.train()

    calls = []
    probe = next(m for m in model.base_model.layers[1].modules() if isinstance(m, ScaleLinear))
    handle = probe.register_forward_hook(lambda *a: calls.append(1))
    plain = _grads(model, ids, mask)
    plain_calls = len(calls)
    exact = _exact_grads(model, ids, mask)  # before checkpointing is enabled (the copy's forward calls the probe)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5.x: renamed activation checkpointing
        model.gradient_checkpointing_enable()
    model.train()
    calls.clear()
    checkpointed = _grads(model, ids, mask)
    handle.remove()
    assert plain_calls == 1
    assert len(calls) == 2, "gradient checkpointing did not recompute the layer"

    assert set(plain) == set(checkpointed)
    nonzero = [n for n, g in plain.items() if g.abs().max() > 0]
    assert len(nonzero) == len(plain), f"zero gradients: {sorted(set(plain) - set(nonzero))}"
    for name in plain:  # the same products recomputed, their gradients summed perhaps in another order
        assert_exact_to_rounding(checkpointed[name], exact[name], stock=plain[name], what=name)
