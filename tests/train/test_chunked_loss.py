"""The training loss with the logits never whole (`scale_cl.train.chunked_loss`): equal to the plain loss.

The loss and every gradient are compared with the cross-entropy of the whole logits, on every architecture, for full
fine-tuning and the three SCALE methods (tied and untied heads, an extended vocabulary, route's stacked paths), with
the distillation term of both teachers, and through the Trainer: in float64, to a few float64 epsilons, and in fp32,
as close to the float64 whole loss as the fp32 whole loss is (`exactness.assert_exact_to_rounding`): the slices sum the
head's weight gradient and the loss in another order, so they round differently, as far as the whole loss does.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import TrainingArguments

from scale_cl.train.chunked_loss import LossTargets, sliced_head
from scale_cl.train.distill import CopyTeacher, DistillConfig, HeadTeacher, distill_sum
from scale_cl.train.trainer import CheckpointingTrainer
from scale_cl.tuner.layers import is_new_parameter
from scale_cl.tuner.modes import set_live_settings
from scale_cl.tuner.sliced_loss import chunkable, slice_positions, use_sliced_loss
from tests.conftest import ARCHS, VOCAB, make_model, randomize_new_weights, token_batch, upscaled_copy
from tests.exactness import assert_exact_to_rounding

pytestmark = pytest.mark.exactness

METHODS = ("fft", "preserve", "adapt", "route")


def _model(arch: str, method: str, new_tokens: int = 0):
    base = make_model(arch, seed=0)
    if method == "fft":
        model = base
    else:
        model = upscaled_copy(base, method, preserve_layers=1, ffn_up=16)
        randomize_new_weights(model, seed=3, w12_scale=0.3)
        model.set_method(method)
    if new_tokens:
        model.resize_token_embeddings(VOCAB + new_tokens)
    return model.double().train()


def _batch(vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, mask = token_batch(rows=3, length=9)
    ids[0, -1] = vocab - 1  # a new token where the vocabulary is extended
    labels = ids.masked_fill(mask == 0, -100)
    labels[2, 5] = -100  # an ignored position inside a row
    return ids, mask, labels


def _step(model, loss_of) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = loss_of()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _whole(model, ids, mask, labels, count):
    logits = model(input_ids=ids, attention_mask=mask).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="sum") / count


def _sliced(model, ids, mask, targets, count, positions=2):
    targets.divisor = count
    with sliced_head(model.get_output_embeddings(), targets, positions):
        return model(input_ids=ids, attention_mask=mask).logits


def _assert_same(plain, sliced) -> None:
    """Equal in float64: the two orders of summing (the 27 positions at once, or slices of them) differ by a few float64
    epsilons (2.2e-16) of the loss (~4.6) and of each gradient; 1e-12 absolute and 1e-10 relative are 1e3 to 1e5 times
    that, while a dropped or misweighted term (one position of 20: 5% of the loss) lies 1e10 times outside."""
    (loss, grads), (sliced_loss, sliced_grads) = plain, sliced
    torch.testing.assert_close(sliced_loss, loss, rtol=1e-12, atol=1e-12)
    assert set(sliced_grads) == set(grads)
    for name, grad in grads.items():
        torch.testing.assert_close(sliced_grads[name], grad, rtol=1e-10, atol=1e-12, msg=name)


# The fp32 gradients' margin over the stock's distance. The slices round the head's products on their own (2-row
# products for the logits and the hidden states' gradient, not one 27-row product), so the sliced gradients carry a
# second rounding error of the stock's size, which the backward pass takes through every layer; where a gradient is a
# small difference of larger terms (Route's layer-1 key projection: errors of 1e-10), the maxima of two errors of one
# size differ by more than 2x: measured up to 2.6x over ~2,800 gradients under the 4 kernel settings of
# scripts/test_kernels.sh (2026-12-03), so 5 (worst use of the bound 0.56). The loss keeps the default 2 (used <= 0.13).
GRADIENT_MARGIN = 5.0


def _assert_exact_in_fp32(exact, stock, got) -> None:
    """The fp32 sliced loss and gradients (``got``) as close to the float64 whole loss's (``exact``) as the fp32 whole
    loss's (``stock``: the plain cross-entropy of the whole logits) are."""
    (loss, grads), (stock_loss, stock_grads), (got_loss, got_grads) = exact, stock, got
    assert set(got_grads) == set(stock_grads) == set(grads)
    assert_exact_to_rounding(got_loss, loss, stock=stock_loss, what="loss")
    for name, grad in grads.items():
        assert_exact_to_rounding(got_grads[name], grad, stock=stock_grads[name], margin=GRADIENT_MARGIN, what=name)


def _assert_sliced_is_whole(model, whole_of, sliced_of) -> None:
    """``whole_of(model)`` and ``sliced_of(model)`` (a loss function of a model) give the same loss and gradients:
    in float64 (``model``) to a few epsilons, and in fp32 (a copy) as exact as the whole loss, to the float64 one."""
    exact = _step(model, whole_of(model))
    _assert_same(exact, _step(model, sliced_of(model)))
    fp32 = copy.deepcopy(model).float()
    _assert_exact_in_fp32(exact, _step(fp32, whole_of(fp32)), _step(fp32, sliced_of(fp32)))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_the_sliced_loss_and_its_gradients_equal_the_whole_logits(arch, method):
    model = _model(arch, method)
    ids, mask, labels = _batch()
    count = (labels[:, 1:] != -100).sum()
    _assert_sliced_is_whole(
        model,
        lambda m: lambda: _whole(m, ids, mask, labels, count),
        lambda m: lambda: _sliced(m, ids, mask, LossTargets(labels), count),
    )


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ["llama-gqa2-tied", "llama-mha-untied"])
def test_an_extended_vocabulary_is_sliced_alike(arch, method):
    model = _model(arch, method, new_tokens=4)
    ids, mask, labels = _batch(VOCAB + 4)
    count = (labels[:, 1:] != -100).sum()
    plain = _step(model, lambda: _whole(model, ids, mask, labels, count))
    assert any(name.endswith("weight_new") for name in plain[1]) or method == "fft"
    _assert_sliced_is_whole(
        model,
        lambda m: lambda: _whole(m, ids, mask, labels, count),
        lambda m: lambda: _sliced(m, ids, mask, LossTargets(labels), count, positions=4),
    )


@pytest.mark.parametrize("method", ["preserve", "route"])
def test_the_frozen_weights_take_no_gradient_and_routes_reading_covers_every_position(method):
    model = _model("llama-gqa2-tied", method)
    ids, mask, labels = _batch()
    count = (labels[:, 1:] != -100).sum()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    whole_reading = model.scale_route.last
    _step(model, lambda: _sliced(model, ids, mask, LossTargets(labels), count, positions=4))
    frozen = [n for n, p in model.named_parameters() if not is_new_parameter(n)]
    assert frozen and all(model.get_parameter(n).grad is None for n in frozen)
    if method == "route":
        assert torch.equal(model.scale_route.last.base_weight, whole_reading.base_weight)  # (3, 9): every slice


@pytest.mark.parametrize("method", ["fft", "preserve"])
def test_the_distillation_term_is_sliced_with_its_teacher(method):
    """Preserve's free teacher (its own head's ``Z``, kept slice by slice) and a frozen copy's logits."""
    model = _model("llama-gqa2-tied", method)
    ids, mask, labels = _batch()
    count = (labels[:, 1:] != -100).sum()
    config = DistillConfig(weight=0.7, temperature=2.0, new_tokens="confidence")
    replay = torch.tensor([True, False, False])
    inputs = {"input_ids": ids, "attention_mask": mask}

    def teacher_of(model):  # in the model's precision: the fp32 copy's teacher is the stock fp32 computation
        return (
            HeadTeacher(model) if method == "preserve" else CopyTeacher(make_model("llama-gqa2-tied").to(model.dtype))
        )

    def whole_of(model):
        teacher = teacher_of(model)

        def whole():
            outputs, base = teacher.run(lambda: model(**inputs), inputs)
            logits = outputs.logits
            ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")
            return (ce + config.weight * distill_sum(logits, base, labels, replay, config)) / count

        return whole

    def sliced_of(model):
        teacher = teacher_of(model)

        def sliced():
            with teacher.slices(inputs) as kept:
                return _sliced(model, ids, mask, LossTargets(labels, count, config, kept, replay), count)

        return sliced

    _assert_sliced_is_whole(model, whole_of, sliced_of)


def test_the_trainer_slices_by_default_and_matches_its_plain_loss(tmp_path):
    """The Trainer's sliced fp32 loss as close to the float64 loss as its plain fp32 loss (transformers' own) is."""
    model = _model("llama-gqa2-tied", "preserve")
    ids, mask, labels = _batch()
    with torch.no_grad():
        exact = _whole(model, ids, mask, labels, (labels[:, 1:] != -100).sum())  # transformers' loss casts to fp32
    model = model.float()
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    args = TrainingArguments(tmp_path, report_to=[], use_cpu=True)
    losses = {}
    for positions in (0, None):
        trainer = CheckpointingTrainer(model=model, args=args, slice_positions=positions)
        losses[positions], outputs = trainer.compute_loss(model, dict(inputs), return_outputs=True)
        assert (outputs.logits is None) == (positions is not None)  # the model's sliced loss: no logits
    assert_exact_to_rounding(losses[None], exact, stock=losses[0], what="the Trainer's sliced loss")


def test_a_loss_divided_by_the_wrong_count_is_outside_the_bound():
    """The mutation: the sliced fp32 loss divided by the count of real next tokens by the attention mask, which counts
    the ignored label inside row 2 (21 for 20): the loss and every gradient 5% small. The bound that holds the right
    division (`test_the_sliced_loss_and_its_gradients_equal_the_whole_logits`) must refuse it."""
    model = _model("llama-gqa2-tied", "preserve")
    ids, mask, labels = _batch()
    count, by_mask = (labels[:, 1:] != -100).sum(), mask[:, 1:].sum()
    assert by_mask == count + 1
    exact = _step(model, lambda: _whole(model, ids, mask, labels, count))
    fp32 = copy.deepcopy(model).float()
    stock = _step(fp32, lambda: _whole(fp32, ids, mask, labels, count))
    _assert_exact_in_fp32(exact, stock, _step(fp32, lambda: _sliced(fp32, ids, mask, LossTargets(labels), count)))
    wrong = _step(fp32, lambda: _sliced(fp32, ids, mask, LossTargets(labels), by_mask))
    with pytest.raises(AssertionError, match=r"^loss: .* from the float64 reference"):
        _assert_exact_in_fp32(exact, stock, wrong)
    head = "lm_head.weight_up"
    with pytest.raises(AssertionError, match=head):  # the gradients alone refuse it too
        assert_exact_to_rounding(
            wrong[1][head], exact[1][head], stock=stock[1][head], margin=GRADIENT_MARGIN, what=head
        )


def test_a_head_that_reads_the_documents_tokens_keeps_the_plain_loss():
    model = _model("llama-gqa2-tied", "preserve")
    set_live_settings(model, router="likelihood")  # a mixing router reading the document's token ids
    assert not chunkable(model.get_output_embeddings())
    with (
        pytest.raises(ValueError, match="cannot be sliced"),
        sliced_head(model.get_output_embeddings(), LossTargets(_batch()[2])),
    ):
        pass


def test_a_slice_holds_about_the_hidden_states_worth_of_logits_and_at_least_half_the_hidden_widths_rows():
    assert slice_positions(16, 1024, 2048, 128256) * 16 == 1024  # Llama-3.2-1B: 16,384 / 63 = 261 rows; hidden / 2
    assert slice_positions(64, 1024, 2048, 128256) * 64 == 2048  # 65,536 / 63 = 1,041 rows -> 2,048
    assert slice_positions(4, 256, 576, 49152) * 4 == 512  # SmolLM2: 1,024 / 86 -> 16 rows, but hidden / 2 -> 512
    assert slice_positions(1, 8, 64, 96) == 8  # a tiny model: one slice


@pytest.mark.parametrize("method", METHODS)
def test_one_slice_is_transformers_loss_bitwise(method):
    """Divided before its gradients are taken, one slice's loss and gradients are transformers' own, bitwise (fp32)."""
    model = _model("llama-gqa2-tied", method).float()
    ids, mask, labels = _batch()
    count = (labels[:, 1:] != -100).sum()
    if method != "fft":
        use_sliced_loss(model, None)  # the model's own loss: transformers'
    plain = _step(model, lambda: model(input_ids=ids, attention_mask=mask, labels=labels).loss)
    sliced = _step(model, lambda: _sliced(model, ids, mask, LossTargets(labels), count, positions=ids.shape[1]))
    assert torch.equal(sliced[0], plain[0])
    assert all(torch.equal(sliced[1][name], grad) for name, grad in plain[1].items())


# The model's own forward: a SCALE model returns the sliced loss whenever it trains on labels


def _own_loss(model, ids, mask, labels, **kwargs):
    outputs = model(input_ids=ids, attention_mask=mask, labels=labels, **kwargs)
    assert outputs.logits is None  # the sliced loss holds no logits
    return outputs.loss


@pytest.mark.parametrize("method", METHODS[1:])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_scale_models_forward_returns_the_sliced_loss_when_it_trains_on_labels(arch, method):
    """Upscaling turns it on: the stock Trainer, TRL and a user's own loop get it (here, slices of 2 positions)."""
    model = _model(arch, method)
    use_sliced_loss(model, 2)
    ids, mask, labels = _batch()
    count = (labels[:, 1:] != -100).sum()
    _assert_sliced_is_whole(
        model,
        lambda m: lambda: _whole(m, ids, mask, labels, count),
        lambda m: lambda: _own_loss(m, ids, mask, labels),
    )


def test_the_models_sliced_loss_divides_by_the_trainers_count_and_keeps_the_logits_where_it_does_not_train():
    model = _model("llama-gqa2-tied", "preserve")
    ids, mask, labels = _batch()
    with torch.no_grad():
        total = _whole(model, ids, mask, labels, 1)
    loss = _own_loss(model, ids, mask, labels, num_items_in_batch=torch.tensor(7))  # accumulated batches' count
    torch.testing.assert_close(loss, total / 7, rtol=1e-12, atol=0)
    for training, grad in ((False, True), (True, False)):  # evaluation, or no gradient: the model's own forward
        with torch.set_grad_enabled(grad):
            outputs = model.train(training)(input_ids=ids, attention_mask=mask, labels=labels)
        assert outputs.logits is not None
        # transformers' loss casts the logits to fp32 (float64 ones too)
        torch.testing.assert_close(outputs.loss.double(), total / (labels[:, 1:] != -100).sum(), rtol=1e-6, atol=0)
    loss_first, logits, *_ = model.train()(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False)
    assert logits is not None  # a tuple asked for: transformers' own (loss, logits, ...)
    torch.testing.assert_close(loss_first.double(), total / (labels[:, 1:] != -100).sum(), rtol=1e-6, atol=0)
    use_sliced_loss(model, None)  # turned off: transformers' loss and logits while training
    assert model(input_ids=ids, attention_mask=mask, labels=labels).logits is not None


def test_the_stock_trainer_takes_the_models_sliced_loss(tmp_path):
    from transformers import Trainer

    model = _model("llama-gqa2-tied", "route")
    ids, mask, labels = _batch()
    with torch.no_grad():
        exact = _whole(model, ids, mask, labels, (labels[:, 1:] != -100).sum())
    trainer = Trainer(model=model, args=TrainingArguments(tmp_path, report_to=[], use_cpu=True))
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    loss, outputs = trainer.compute_loss(model, inputs, return_outputs=True)
    assert outputs.logits is None
    torch.testing.assert_close(loss, exact, rtol=1e-12, atol=1e-12)


def test_a_flop_count_of_a_training_step_runs_the_models_own_loss():
    """torch's FlopCounterMode tracks modules with gradient hooks that cannot follow a gradient taken inside the
    forward pass: under it the model computes transformers' loss (what `count_flops` counts)."""
    from scale_cl.eval.cost import train_flops_per_token

    model = _model("llama-gqa2-tied", "preserve").float()
    ids = _batch()[0]
    counted = train_flops_per_token(model, ids)
    use_sliced_loss(model, None)
    assert counted == train_flops_per_token(model, ids) > 0


def test_a_forward_that_raises_gives_the_head_back():
    model = _model("llama-gqa2-tied", "preserve")
    ids, mask, labels = _batch()
    with pytest.raises(IndexError):
        model(input_ids=ids + VOCAB, attention_mask=mask, labels=labels)  # no such token
    assert "forward" not in vars(model.get_output_embeddings())  # its own forward again
    assert model(input_ids=ids, attention_mask=mask).logits.shape == (*ids.shape, VOCAB)
