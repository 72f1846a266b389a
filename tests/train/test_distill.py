"""The base as a teacher: the KL term, its free teacher in SCALE-Preserve/Route, pseudo-replay."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM, TrainingArguments

from scale_cl import upscale
from scale_cl.data.pseudo_replay import cached_blocks, generate_blocks
from scale_cl.data.replay import REPLAY_KEY
from scale_cl.experiments.settings import MethodSettings
from scale_cl.methods import prepare
from scale_cl.train.distill import (
    CopyTeacher,
    Distillation,
    DistillConfig,
    HeadTeacher,
    distill_sum,
    free_teacher,
    position_weights,
    shifted_labels,
    teacher_for,
)
from scale_cl.train.trainer import CheckpointingTrainer
from tests.conftest import randomize_new_weights, tiny_config, tiny_llama_config, tiny_scale_config, token_batch
from tests.exactness import assert_exact_to_rounding

pytestmark = pytest.mark.exactness


def _base(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config()).eval()


def _reference_kl(student: torch.Tensor, teacher: torch.Tensor, t: float) -> torch.Tensor:
    """KL(p_teacher^T || p_student^T) per position by `F.kl_div`, the textbook form."""
    s, q = F.log_softmax(student / t, -1), F.log_softmax(teacher / t, -1)
    return F.kl_div(s, q, log_target=True, reduction="none").sum(-1)


def test_the_term_is_the_weighted_kl_with_replay_at_one_and_new_tokens_by_the_base_confidence():
    gen = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(3, 6, 11, generator=gen), 3 * torch.randn(3, 6, 11, generator=gen)
    labels = torch.randint(0, 11, (3, 6), generator=gen)
    labels[1, :3] = -100  # a masked prompt
    replay = torch.tensor([1, 0, 0])

    def textbook(student, teacher, new_tokens):
        kl = _reference_kl(student[:, :-1], teacher[:, :-1], 2.0)
        p = F.softmax(teacher[:, :-1], -1)
        entropy = -(p * p.log()).sum(-1)
        new = {"confidence": torch.exp(-entropy), "all": torch.ones_like(entropy), "none": torch.zeros_like(entropy)}
        weights = torch.where(replay[:, None].bool(), 1.0, new[new_tokens]) * (labels[:, 1:] != -100)
        return 4.0 * (weights * kl).sum()

    for new_tokens in ("confidence", "all", "none"):
        config = DistillConfig(0.5, temperature=2.0, new_tokens=new_tokens)
        got = distill_sum(student, teacher, labels, replay, config)
        # the textbook form in float64 the reference, in fp32 the stock computation (`kl_sum` sums other terms)
        exact, stock = textbook(student.double(), teacher.double(), new_tokens), textbook(student, teacher, new_tokens)
        assert_exact_to_rounding(got, exact, stock=stock, what=new_tokens)
    assert position_weights(teacher, shifted_labels(labels), replay, "none")[1:].sum() == 0
    assert position_weights(teacher, shifted_labels(labels), None, "all").sum() == (labels[:, 1:] != -100).sum()


def test_the_base_gives_confident_positions_more_weight():
    teacher = torch.zeros(1, 3, 5)
    teacher[0, 0, 2] = 20.0  # sure of the next token at position 0, uniform at position 1
    weights = position_weights(teacher, shifted_labels(torch.zeros(1, 3, dtype=torch.long)), None, "confidence")
    # exp(-ln 5) against the number itself: exp of a 5-term fp32 sum, a few fp32 epsilons (1.2e-7) off at most
    assert weights[0, 0] > 0.99 and weights[0, 1] == pytest.approx(1 / 5, rel=1e-5)


@pytest.mark.parametrize("method", ["scale_preserve", "scale_route"])
def test_the_free_teacher_equals_a_separate_copy_of_the_base_and_adds_no_forward_pass(method):
    base = _base()
    model = prepare(copy.deepcopy(base), method, scale=tiny_scale_config(base, preserve_layers=1))
    randomize_new_weights(model, seed=1, w12_scale=0.3)  # trained-looking: W12 and W_out_up matter
    assert free_teacher(model)
    loaded = []
    teacher = teacher_for(model, lambda: loaded.append(1))
    assert isinstance(teacher, HeadTeacher) and not loaded, "no copy of the base is loaded"
    ids, mask = token_batch(padded=False, rows=2, length=7)
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    calls = []
    hook = model.model.layers[0].register_forward_hook(lambda *a: calls.append(1))
    outputs, free = teacher.run(lambda: model(**inputs), inputs)
    hook.remove()
    assert len(calls) == 1, "the teacher's logits come out of the model's one forward pass"
    assert model.scale_route.base_logits is None and not model.scale_route.capture_base, "nothing is kept after"
    # the base's logits in float64 the reference; a separate fp32 copy of the base (LwF's teacher) the stock
    _, reference = CopyTeacher(copy.deepcopy(base)).run(lambda: None, inputs)
    _, exact = CopyTeacher(copy.deepcopy(base).double()).run(lambda: None, inputs)
    assert_exact_to_rounding(free, exact, stock=reference, what="free teacher")
    assert not torch.allclose(outputs.logits, reference, atol=1e-3), "the model itself differs from the base"
    config = DistillConfig(1.0, new_tokens="all")
    assert_exact_to_rounding(
        distill_sum(outputs.logits, free, ids, None, config),
        distill_sum(outputs.logits.double(), exact, ids, None, config),
        stock=distill_sum(outputs.logits, reference, ids, None, config),
        what="the KL term to the free teacher",
    )


@pytest.mark.parametrize("method", ["fft", "scale_adapt", "lora"])
def test_other_methods_distill_from_a_frozen_copy(method):
    base = _base()
    model = prepare(copy.deepcopy(base), method, **MethodSettings().prepare_options(method))
    teacher = teacher_for(model, lambda: copy.deepcopy(base))
    assert isinstance(teacher, CopyTeacher) and not any(p.requires_grad for p in teacher.model.parameters())


def test_the_frozen_copy_runs_in_the_stages_precision():
    """With the stage in bf16 the copy of the base runs under bf16 autocast, as the student does (the Trainer's
    autocast covers the student's forward pass only); in fp32 it runs in fp32."""
    base = _base()
    ids, mask = token_batch(padded=False, rows=2, length=7)
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    _, fp32 = CopyTeacher(copy.deepcopy(base)).run(lambda: None, inputs)
    _, bf16 = teacher_for(prepare(copy.deepcopy(base), "fft"), lambda: copy.deepcopy(base), bf16=True).run(
        lambda: None, inputs
    )
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = base(input_ids=ids, attention_mask=mask).logits
    assert fp32.dtype == torch.float32 and torch.equal(bf16, expected) and not torch.equal(bf16.float(), fp32)


@pytest.mark.parametrize("method", ["preserve", "adapt", "route"])
def test_the_free_teacher_is_preserve_and_route_in_route_mode_whatever_the_router(method):
    """The decision by the declared trait is the one by the method's name: SCALE-Preserve always, SCALE-Route while
    its paths run (``scale_route.active``), SCALE-Adapt never; the router changes none of it."""
    from scale_cl.tuner.modes import set_live_settings
    from scale_cl.tuner.routing import ROUTERS

    base = _base()
    model = upscale(copy.deepcopy(base), tiny_scale_config(base, method, preserve_layers=1))
    for router in ROUTERS:
        set_live_settings(model, router=router)
        for active in (True, False):
            model.scale_route.active = active
            expected = method == "preserve" or (method == "route" and active)
            assert free_teacher(model) == expected, (router, active)
    assert not free_teacher(base)


def test_an_extended_vocabulary_falls_back_to_the_copy():
    from scale_cl.tuner.vocab import VocabExtension, grow_embeddings

    base = _base()
    grow_embeddings(base, VocabExtension(first_id=base.config.vocab_size, tokens=("xy",), pieces=((3, 4),)))
    model = prepare(base, "scale_preserve", scale=tiny_scale_config(base))
    assert not free_teacher(model)


def _trainer_losses(tmp_path):
    """(the Trainer's fp32 loss with the term, its plain fp32 loss, the stock fp32 term, the same loss in float64, the
    KL sum in fp32, its divisor) of SCALE-Preserve with its free teacher, on a batch half replay."""
    base = _base()
    model = upscale(copy.deepcopy(base), tiny_scale_config(base, "preserve")).train()
    randomize_new_weights(model, seed=2, w12_scale=0.0)
    ids, mask = token_batch(padded=False, rows=2, length=7)
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": ids, REPLAY_KEY: torch.tensor([1, 0])}
    config = DistillConfig(0.7, new_tokens="confidence")
    args = TrainingArguments(str(tmp_path), report_to=[], use_cpu=True)
    plain = CheckpointingTrainer(model=model, args=args)
    with_term = CheckpointingTrainer(model=model, args=args, distillation=Distillation(config, HeadTeacher(model)))
    ce = plain.compute_loss(model, dict(inputs))
    total = with_term.compute_loss(model, dict(inputs))
    count = ids.numel() - 2  # the labelled positions: each row's last predicts nothing
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        kl = distill_sum(logits, base(input_ids=ids).logits, ids, inputs[REPLAY_KEY], config)
        model64, base64 = copy.deepcopy(model).double(), copy.deepcopy(base).double()
        logits64 = model64(input_ids=ids, attention_mask=mask).logits
        ce64 = F.cross_entropy(logits64[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        kl64 = distill_sum(logits64, base64(input_ids=ids).logits, ids, inputs[REPLAY_KEY], config)
    exact = ce64 + 0.7 * kl64 / count
    return (total, ce, ce + 0.7 * kl / count, exact, kl, count), (model, with_term, plain, inputs)


def test_the_trainer_adds_the_term_to_the_language_modelling_loss(tmp_path):
    """The Trainer's loss (sliced, the free teacher) is the plain cross-entropy plus the KL term: as close to the
    float64 sum as the stock fp32 sum (the Trainer's plain loss and the term to a separate copy of the base) is."""
    (total, ce, stock, exact, _, _), (model, with_term, plain, inputs) = _trainer_losses(tmp_path)
    assert_exact_to_rounding(total, exact, stock=stock, what="cross-entropy + KL term")
    assert total > ce
    model.eval()
    assert torch.equal(with_term.compute_loss(model, dict(inputs)), plain.compute_loss(model, dict(inputs))), (
        "evaluation is the plain loss"
    )


def test_a_kl_term_over_the_wrong_count_is_outside_the_bound(tmp_path):
    """The mutation: the KL sum divided by every position (14) instead of the 12 labelled ones (each row's last
    predicts nothing), as a Trainer that averaged the term over the sequence length would: the loss the Trainer
    returns with the term 0.7 KL (1/12 - 1/14) off. The bound that holds the right division must refuse it."""
    (total, _, stock, exact, kl, count), _ = _trainer_losses(tmp_path)
    wrong = total - 0.7 * kl / count + 0.7 * kl / (count + 2)
    assert_exact_to_rounding(total, exact, stock=stock, what="the Trainer's loss")
    with pytest.raises(AssertionError, match="over every position"):
        assert_exact_to_rounding(wrong, exact, stock=stock, what="over every position")


def test_distill_settings_are_checked():
    with pytest.raises(ValueError, match="distill_new_tokens must be one of"):
        MethodSettings(distill_new_tokens="most")
    with pytest.raises(ValueError, match="distill_weight must be >= 0"):
        MethodSettings(distill_weight=-1)
    with pytest.raises(ValueError, match="distill_temperature must be > 0"):
        MethodSettings(distill_temperature=0)
    assert MethodSettings().distill_config("fft") is None
    assert MethodSettings(distill_weight=1).distill_config("scale_route") == DistillConfig(1.0)


def test_pseudo_replay_is_the_base_model_s_own_text_fixed_by_the_seed_and_cached(tmp_path):
    base = _base()
    blocks = generate_blocks(base, start_id=5, count=5, length=9, seed=3, batch_size=2)
    assert blocks.shape == (5, 9) and bool((blocks[:, 0] == 5).all())
    assert torch.equal(blocks, generate_blocks(base, 5, 5, 9, seed=3, batch_size=2)), "the seed fixes the draw"
    assert not torch.equal(blocks, generate_blocks(base, 5, 5, 9, seed=4, batch_size=2))
    autocast = []  # the run's precision: sampled under bf16 autocast with bf16, in fp32 without
    hook = base.register_forward_pre_hook(lambda module, args: autocast.append(torch.is_autocast_enabled("cpu")))
    generate_blocks(base, 5, 2, 4, seed=3, bf16=True)
    generate_blocks(base, 5, 2, 4, seed=3)
    hook.remove()
    assert autocast == [True] * 3 + [False] * 3  # a forward pass per new token
    calls = []

    def sample():
        calls.append(1)
        return blocks

    first = cached_blocks(tmp_path, {"seed": 3}, sample)
    again = cached_blocks(tmp_path, {"seed": 3}, sample)
    assert torch.equal(first, again) and len(calls) == 1, "sampled once, then read from the cache"
    cached_blocks(tmp_path, {"seed": 4}, sample)
    assert len(calls) == 2, "other settings, another draw"


@pytest.mark.slow
def test_cpt_trains_with_distillation_and_pseudo_replay_and_keeps_frozen_weights(workspace, tmp_path):
    from scale_cl.experiments.cpt.pipeline import run_cpt

    cfg = tiny_config(workspace, ["scale_preserve", "fft"], steps=4, save_every=2)
    data = replace(cfg.data, pseudo_replay_ratio=0.25, pseudo_replay_sequences=6)
    options = replace(cfg.options, distill_weight=1.0, distill_new_tokens="confidence")
    cfg = replace(cfg, data=data, options=options)
    run_cpt(cfg, tmp_path / "run")
    cached = list((tmp_path / "run").glob("pseudo_replay-*.safetensors"))
    assert len(cached) == 1, "one draw, shared by the methods"
    for method in ("scale_preserve", "fft"):
        result = json.loads((tmp_path / "run" / method / "result.json").read_text())
        assert result["curve"][-1]["step"] == 4
    with pytest.raises(ValueError, match="share one schedule"):
        replace(cfg, data=replace(data, replay=[f"toy={workspace / 'old.jsonl'}"], replay_ratio=0.25))


@pytest.mark.slow
def test_bio_distills_replayed_questions_from_the_task0_model(tmp_path):
    from scale_cl.experiments.bio.config import preset
    from scale_cl.experiments.bio.pipeline import run_bio

    cfg = preset("micro")
    cfg = replace(
        cfg,
        methods=["scale_route", "fft"],
        task1=replace(cfg.task1, replay_ratio=0.25),
        options=replace(cfg.options, distill_weight=1.0, distill_new_tokens="none"),
    )
    seen = []
    step = CheckpointingTrainer.compute_loss

    def recording(self, model, inputs, *args, **kwargs):
        if model.training and self.distillation is not None:  # stage 3 (stages 1-2 train without)
            seen.append((type(self.distillation.teacher).__name__, inputs[REPLAY_KEY].tolist()))
        return step(self, model, inputs, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CheckpointingTrainer, "compute_loss", recording)
        run_bio(cfg, tmp_path / "run")
    teachers = {name for name, _ in seen}
    assert teachers == {"HeadTeacher", "CopyTeacher"}, "Route's own head, FFT's frozen copy"
    assert all(sum(marks) == len(marks) // 4 for _, marks in seen), "a quarter of every batch is marked replay"
