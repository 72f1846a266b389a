"""An upscaled model under the stock transformers ``Trainer`` and TRL's ``SFTTrainer`` (`ScaleSFTTrainer`).

Each trainer is interrupted after its first checkpoint and resumed from it with ``resume_from_checkpoint`` in a
fresh process state (a new model upscaled from the same base, a new trainer); the result must be bitwise the
uninterrupted run's, every frozen weight bitwise the base's, and the checkpoint must hold SCALE's new weights only.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments, default_data_collator

from scale_cl import ScaleConfig, load, upscale
from scale_cl.data.corpus import PackedDataset
from scale_cl.tuner.io import CONFIG_NAME, V1_WEIGHTS_NAME, WEIGHTS_NAME
from scale_cl.tuner.layers import is_new_parameter
from tests.conftest import VOCAB, hidden_up_for, make_model, tiny_llama_config
from tests.exactness import assert_exact_to_rounding

STEPS, SAVE_AT = 6, 3


class StopAt(TrainerCallback):
    """Stops training after step ``step`` (its checkpoint written), as a crash or a pre-emption would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def _arguments(out: Path, cls: type = TrainingArguments, **extra) -> TrainingArguments:
    settings = {"max_steps": STEPS, "save_strategy": "steps", "save_steps": SAVE_AT, **extra}
    return cls(
        output_dir=str(out),
        learning_rate=1e-3,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        **settings,
    )


def _interrupted_and_resumed(make_trainer, tmp_path: Path) -> tuple[torch.nn.Module, torch.nn.Module, Path]:
    """(the uninterrupted run's model, the resumed run's model, the checkpoint it resumed from)."""
    straight = make_trainer(tmp_path / "straight", ())
    straight.train()
    make_trainer(tmp_path / "resumed", (StopAt(SAVE_AT),)).train()
    checkpoint = tmp_path / "resumed" / f"checkpoint-{SAVE_AT}"
    resumed = make_trainer(tmp_path / "resumed", ())
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == STEPS
    return straight.model, resumed.model, checkpoint


def _assert_bitwise(
    straight: torch.nn.Module, resumed: torch.nn.Module, base: torch.nn.Module, initial: torch.nn.Module
) -> None:
    a, b = straight.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys()
    differ = [name for name in a if not torch.equal(a[name], b[name])]
    assert not differ, f"the resumed run differs from the uninterrupted one in {differ[:5]}"
    trained = [name for name, p in straight.named_parameters() if p.requires_grad]
    original = dict(base.named_parameters())
    start = dict(initial.named_parameters())
    assert any(not torch.equal(a[n], start[n]) for n in trained), "no trainable weight moved"
    for name, param in straight.named_parameters():
        if not is_new_parameter(name):
            assert torch.equal(param, original[name]), f"the frozen {name} changed"


def _assert_new_weights_only(checkpoint: Path, model: torch.nn.Module) -> None:
    saved = load_file(checkpoint / WEIGHTS_NAME)
    assert (checkpoint / CONFIG_NAME).is_file()
    assert saved and all(is_new_parameter(name) for name in saved), "a frozen weight was written into a checkpoint"
    assert set(saved) == {n for n, _ in model.named_parameters() if is_new_parameter(n)}
    assert not (checkpoint / "base_model.safetensors").exists()


# ---------------------------------------------------------------------------------------------------------------
# The stock Trainer


def _dataset() -> PackedDataset:
    gen = torch.Generator().manual_seed(0)
    return PackedDataset(torch.randint(1, VOCAB, (32, 12), generator=gen))


@pytest.mark.parametrize(
    ("arch", "method"),
    [
        ("llama-gqa2-tied", "preserve"),
        ("llama-gqa2-tied", "adapt"),
        ("llama-mha-untied", "route"),
        ("qwen2-qkv-bias", "adapt"),
        ("neox-sequential-rot1.0", "adapt"),
    ],
)
def test_the_stock_trainer_resumes_an_upscaled_model_bitwise(arch, method, tmp_path, monkeypatch):
    base = make_model(arch)
    config = ScaleConfig(method=method, hidden_up=hidden_up_for(base, 2), ffn_up=16, preserve_layers=1)
    loads = []
    original = Trainer._issue_warnings_after_load
    monkeypatch.setattr(Trainer, "_issue_warnings_after_load", lambda self, r: (loads.append(r), original(self, r)))

    def make_trainer(out: Path, callbacks) -> Trainer:
        model = upscale(copy.deepcopy(base), config).train()
        return Trainer(
            model=model,
            args=_arguments(out),
            train_dataset=_dataset(),
            data_collator=default_data_collator,
            callbacks=list(callbacks),
        )

    straight, resumed, checkpoint = _interrupted_and_resumed(make_trainer, tmp_path)
    _assert_bitwise(straight, resumed, base, upscale(copy.deepcopy(base), config))
    _assert_new_weights_only(checkpoint, resumed)
    assert len(loads) == 1, "the Trainer did not load the checkpoint's weights"
    assert not loads[0].unexpected_keys
    # the keys it lacks are exactly the frozen ones the model declares unsaved, so the Trainer does not warn
    assert set(loads[0].missing_keys) == resumed._keys_to_ignore_on_save
    assert not any(is_new_parameter(k) for k in loads[0].missing_keys if k in dict(resumed.named_parameters()))


@pytest.mark.parametrize("method", ["preserve", "route"])
def test_the_stock_trainer_resumes_a_scale_cl_train_checkpoint_bitwise(method, tmp_path):
    """`scale-cl train`'s checkpoints (`CheckpointingTrainer`: what trains, under the live names, in
    ``model.safetensors``, and the Trainer's own optimizer, scheduler and RNG files) resume under the stock Trainer,
    bitwise the run that never stopped."""
    from scale_cl.train.trainer import CHECKPOINT_META, CheckpointingTrainer

    base = make_model("llama-gqa2-tied")
    config = ScaleConfig(method=method, hidden_up=hidden_up_for(base, 2), ffn_up=16, preserve_layers=1)

    def make_trainer(out: Path, callbacks, cls: type = CheckpointingTrainer) -> Trainer:
        own = {"slice_positions": None} if cls is CheckpointingTrainer else {}  # the loss the stock Trainer computes
        model = upscale(copy.deepcopy(base), config).train()
        data = {"train_dataset": _dataset(), "data_collator": default_data_collator}
        return cls(model=model, args=_arguments(out), callbacks=list(callbacks), **data, **own)

    straight = make_trainer(tmp_path / "straight", ())
    straight.train()
    make_trainer(tmp_path / "stopped", (StopAt(SAVE_AT),)).train()
    checkpoint = tmp_path / "stopped" / f"checkpoint-{SAVE_AT}"
    assert (checkpoint / CHECKPOINT_META).is_file() and not (checkpoint / CONFIG_NAME).exists(), "train's own format"
    resumed = make_trainer(tmp_path / "stock", (), cls=Trainer)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == STEPS
    _assert_bitwise(straight.model, resumed.model, base, upscale(copy.deepcopy(base), config))


def test_a_trainer_checkpoint_loads_with_scale_cl_load(tmp_path):
    """A stock Trainer's checkpoint folder is also a `scale_cl.load` folder (SCALE's format plus the optimizer)."""
    base = make_model("llama-gqa2-tied")
    model = upscale(copy.deepcopy(base), ScaleConfig(method="adapt", hidden_up=32, ffn_up=16, preserve_layers=1))
    args = _arguments(tmp_path, max_steps=SAVE_AT)
    Trainer(model=model.train(), args=args, train_dataset=_dataset(), data_collator=default_data_collator).train()
    loaded = load(tmp_path / f"checkpoint-{SAVE_AT}", base_model=copy.deepcopy(base)).eval()
    ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model.eval()(ids).logits)


def test_a_format_1_checkpoint_still_loads(tmp_path):
    """Version 1 named the new weights ``scale_model.safetensors``; such a folder loads as it did."""
    base = make_model("llama-gqa2-tied")
    model = upscale(copy.deepcopy(base), ScaleConfig(method="adapt", hidden_up=32, ffn_up=16, preserve_layers=1))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_new_parameter(name):
                param.normal_(0, 0.05)
    model.save_pretrained(tmp_path)
    (tmp_path / WEIGHTS_NAME).rename(tmp_path / V1_WEIGHTS_NAME)
    meta = json.loads((tmp_path / CONFIG_NAME).read_text())
    meta["version"] = 1
    meta["sha256"][V1_WEIGHTS_NAME] = meta["sha256"].pop(WEIGHTS_NAME)
    (tmp_path / CONFIG_NAME).write_text(json.dumps(meta))
    loaded = load(tmp_path, base_model=copy.deepcopy(base))
    ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model.eval()(ids).logits)
    model.save_pretrained(tmp_path)  # saved again: the current format, the old file gone
    assert json.loads((tmp_path / CONFIG_NAME).read_text())["version"] == 2
    assert not (tmp_path / V1_WEIGHTS_NAME).exists()


# ---------------------------------------------------------------------------------------------------------------
# TRL's SFTTrainer on a chat dataset

trl = pytest.importorskip("trl")

QUESTIONS = [(f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.") for a in range(6) for b in range(6)]
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% else %}Assistant: {{ m['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def chat():
    """(tokenizer with a chat template, prompt-completion conversations, a tiny Llama of the tokenizer's size)."""
    from datasets import Dataset

    from scale_cl.data.tokenizer import EOS_TOKEN, train_bpe_tokenizer

    texts = [f"User: {q}\nAssistant: {a}" for q, a in QUESTIONS] * 3
    tokenizer = train_bpe_tokenizer(texts, 300)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.eos_token = tokenizer.pad_token = EOS_TOKEN
    conversations = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": q}], "completion": [{"role": "assistant", "content": a}]}
            for q, a in QUESTIONS
        ]
    )
    torch.manual_seed(0)
    config = tiny_llama_config(vocab_size=len(tokenizer), max_position_embeddings=128, tie_word_embeddings=True)
    config.eos_token_id = config.bos_token_id = config.pad_token_id = tokenizer.eos_token_id
    return tokenizer, conversations, LlamaForCausalLM(config).eval()


def _sft_trainer(model, out: Path, chat, callbacks=()):
    from trl import SFTConfig

    from scale_cl.train.sft import ScaleSFTTrainer

    tokenizer, conversations, _ = chat
    args = _arguments(out, SFTConfig, max_length=64, dataset_num_proc=None)
    return ScaleSFTTrainer(
        model=model, args=args, train_dataset=conversations, processing_class=tokenizer, callbacks=list(callbacks)
    )


@pytest.mark.parametrize("method", ["preserve", "adapt"])
def test_sft_trainer_resumes_an_upscaled_model_bitwise(method, chat, tmp_path):
    base = chat[2]
    config = ScaleConfig(method=method, hidden_up=32, ffn_up=16, preserve_layers=1)

    def make_trainer(out: Path, callbacks):
        return _sft_trainer(upscale(copy.deepcopy(base), config).train(), out, chat, callbacks)

    straight, resumed, checkpoint = _interrupted_and_resumed(make_trainer, tmp_path)
    _assert_bitwise(straight, resumed, base, upscale(copy.deepcopy(base), config))
    _assert_new_weights_only(checkpoint, resumed)
    assert (checkpoint / "chat_template.jinja").is_file() or "chat_template" in json.loads(
        (checkpoint / "tokenizer_config.json").read_text()
    )


@pytest.mark.exactness
def test_sft_loss_is_on_the_answers_only_and_is_the_models_own(chat, tmp_path):
    """The labels mask the question and the chat markup before the answer; the loss is the model's cross-entropy
    on the answer tokens (SCALE's head: ``Z + Z_up``), which the stock SFTTrainer's fused head cannot compute: as close
    to the float64 cross-entropy as the fp32 cross-entropy of the whole logits is."""
    tokenizer, _, base = chat
    model = upscale(copy.deepcopy(base), ScaleConfig(method="adapt", hidden_up=32, ffn_up=16, preserve_layers=1))
    with torch.no_grad():
        model.get_output_embeddings().weight_up.normal_(0, 0.1)  # Z_up matters: a head reading W alone is wrong
    trainer = _sft_trainer(model, tmp_path, chat)
    batch = next(iter(trainer.get_train_dataloader()))
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    answer = tokenizer.decode([i for i, label in zip(ids, labels, strict=True) if label != -100])
    assert answer.strip().split(" plus ")[0].isdigit() and answer.rstrip().endswith(tokenizer.eos_token), answer
    assert "User:" not in answer and "?" not in answer
    model.eval()
    loss = trainer.compute_loss(model, dict(batch))

    def cross_entropy(model):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())

    with torch.no_grad():
        exact = cross_entropy(copy.deepcopy(model).double())
    assert_exact_to_rounding(loss, exact, stock=cross_entropy(model), what="SFT loss")
