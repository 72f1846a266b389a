"""Vocabulary extension (`scale_cl.tuner.vocab`): the tokenizer learns new tokens from new-domain text, the model grows
rows for them on every architecture and under every method, original rows stay frozen where the method freezes
the original, SCALE stays exact over the original vocabulary, and saved models keep the new rows.

Exact is to rounding where the two sides compute the same values in another way: as close to the float64 value as
the stock fp32 computation is (`exactness.assert_exact_to_rounding`); bitwise where they run the same products."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from scale_cl import load, upscale
from scale_cl.data.tokenizer import train_bpe_tokenizer
from scale_cl.methods import METHOD_NAMES, prepare
from scale_cl.tuner.layers import ScaleHead
from scale_cl.tuner.vocab import (
    EXTENSION_KEY,
    VocabEmbedding,
    VocabExtension,
    VocabHead,
    extend_tokenizer,
    extend_vocab,
    grow_embeddings,
    grow_for_adapter,
    merge_vocab,
    vocab_rows,
)
from tests.conftest import (
    SYLLABLES,
    VOCAB,
    WORDS,
    _documents,
    hidden_up_for,
    make_model,
    tiny_scale_config,
    token_batch,
)
from tests.exactness import assert_exact_to_rounding

pytestmark = pytest.mark.exactness

N = 5  # new tokens of the synthetic extension
SCALE_METHODS = ("scale_preserve", "scale_adapt", "scale_route")
FREEZES_ORIGINAL = {"freeze", "llama_pro", "lora", *SCALE_METHODS}


def synthetic_extension(count: int = N, first_id: int = VOCAB) -> VocabExtension:
    """New tokens for a tiny random model (no tokenizer): token k is made of the base ids k+1 and k+2."""
    return VocabExtension(first_id, tuple(f"new{k}" for k in range(count)), tuple((k + 1, k + 2) for k in range(count)))


def batch_with_new_ids(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded batch whose every row holds new ids as inputs and as labels."""
    ids, mask = token_batch(True, seed, rows=3, length=9, pads=(4,))
    ids[:, -3:] = torch.tensor([VOCAB, VOCAB + 2, VOCAB + N - 1])
    return ids, mask


def method_options(method: str, base) -> dict:
    if method in SCALE_METHODS:
        return {"scale": tiny_scale_config(base, preserve_layers=1)}
    return {"lora": {"rank": 2}, "freeze": {"layers": 1}, "llama_pro": {"blocks": 1}}.get(method, {})


def run(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, output_hidden_states=True, **kwargs)


def exact_run(model, ids, mask):
    """`run` of a float64 copy of ``model``: the values every fp32 comparison measures rounding from."""
    return run(copy.deepcopy(model).double(), ids, mask)


def assert_mean_of_rows(row: torch.Tensor, rows: torch.Tensor, what: str) -> None:
    """``row`` is the mean of ``rows`` (as exact as fp32's own mean of them)."""
    assert_exact_to_rounding(row, rows.double().mean(0), stock=rows.mean(0), what=what)


def tables(model, width: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The embedding and LM-head rows the model computes with (``rows x width`` each), read through its modules,
    so a wrapper (PEFT's trainable tokens, the split layers) shows the values it uses."""
    with torch.no_grad():
        embedding = model.get_input_embeddings()(torch.arange(rows))[..., :width]
        head = model.get_output_embeddings()
        eye = torch.eye(width)
        scale = isinstance(head, ScaleHead)
        logits = head.project(eye, torch.zeros(width, head.hidden_up))[0] if scale else head(eye)
    return embedding.clone(), logits.T.clone()


# --------------------------------------------------------------------------------------------
# Growing the model


def test_grow_plain_model_keeps_original_logits_bitwise(arch_name):
    base = make_model(arch_name)
    model = grow_embeddings(copy.deepcopy(base), synthetic_extension())
    assert isinstance(model.get_input_embeddings(), VocabEmbedding)
    assert isinstance(model.get_output_embeddings(), VocabHead)
    assert model.config.vocab_size == VOCAB + N and vocab_rows(model) == VOCAB + N
    assert getattr(model.config, EXTENSION_KEY) == {"base_rows": VOCAB, "new_rows": N}
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert embedding.weight is base.get_input_embeddings().weight or torch.equal(
        embedding.weight, base.get_input_embeddings().weight
    )
    if base.config.tie_word_embeddings:
        assert head.weight is embedding.weight and head.weight_new is embedding.weight_new
    # a new row starts as the mean of its pieces' rows
    assert_mean_of_rows(embedding.weight_new[0], base.get_input_embeddings().weight[[1, 2]].detach(), "new row 0")
    ids, mask = token_batch()
    out, ref = run(model, ids, mask), run(base, ids, mask)
    assert out.logits.shape[-1] == VOCAB + N
    assert torch.equal(out.logits[..., :VOCAB], ref.logits)
    assert all(torch.equal(a, b) for a, b in zip(out.hidden_states, ref.hidden_states, strict=True))
    new_ids, _ = batch_with_new_ids()
    assert torch.isfinite(run(model, new_ids, mask).logits).all()


@pytest.mark.parametrize("order", ["extend-then-upscale", "upscale-then-extend"])
@pytest.mark.parametrize("method", ["preserve", "adapt", "route"])
def test_scale_exact_over_the_original_vocabulary(arch_name, method, order):
    """Theorem 3.1 with an extended vocabulary: on original ids the original stream is the base model's and the
    logits over the original vocabulary are the base model's (the softmax, over V + N tokens, is not)."""
    base = make_model(arch_name)
    cfg = tiny_scale_config(base, method, preserve_layers=1, w21_init="random", w22_init="random")
    model = copy.deepcopy(base)
    if order == "extend-then-upscale":
        model = upscale(grow_embeddings(model, synthetic_extension()), cfg)
    else:
        model = grow_embeddings(upscale(model, cfg), synthetic_extension())
    assert model.config.vocab_size == VOCAB + N
    ids, mask = token_batch()
    out, ref, exact = run(model, ids, mask), run(base, ids, mask), exact_run(base, ids, mask)
    d, rows = base.config.hidden_size, ids.shape[0]
    assert out.logits.shape[-1] == VOCAB + N
    assert_exact_to_rounding(out.logits[..., :VOCAB], exact.logits, stock=ref.logits, what="original vocabulary")
    states = zip(out.hidden_states, ref.hidden_states, exact.hidden_states, strict=True)
    for index, (mine, theirs, exact_state) in enumerate(states):
        assert_exact_to_rounding(mine[:rows, ..., :d], exact_state, stock=theirs, what=f"hidden state {index}")

    # log p over V + N tokens = the base's log p minus one per-position normaliser (the model's float64 logits
    # give the exact normaliser; the fp32 formula on the base's and the model's fp32 logits is the stock one)
    def base_minus_normaliser(base_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        normaliser = torch.logsumexp(logits, -1) - torch.logsumexp(logits[..., :VOCAB], -1)
        return torch.log_softmax(base_logits, -1) - normaliser[..., None]

    model_exact = exact_run(model, ids, mask).logits
    assert_exact_to_rounding(
        torch.log_softmax(out.logits, -1)[..., :VOCAB],
        base_minus_normaliser(exact.logits, model_exact),
        stock=base_minus_normaliser(ref.logits, out.logits),
        what="log p over V + N",
    )
    assert (torch.logsumexp(out.logits, -1) > torch.logsumexp(out.logits[..., :VOCAB], -1)).all()


@pytest.mark.parametrize("arch", ["llama-gqa2-tied", "neox-parallel-rot0.25"])
def test_generate_with_an_extended_vocabulary(arch):
    """Greedy decoding (KV cache, merged inference form, route's stacked paths) can emit and read new tokens."""
    from tests.conftest import greedy

    base = make_model(arch)
    model = upscale(grow_embeddings(copy.deepcopy(base), synthetic_extension()), tiny_scale_config(base, "route"))
    with torch.no_grad():
        model.get_input_embeddings().weight_new.mul_(5)  # make the new tokens likely
        model.get_output_embeddings().weight_up[VOCAB:].normal_()
    ids, mask = batch_with_new_ids()
    out = greedy(model, ids, mask)
    assert out.shape == (3, 9 + 8) and out.max() < VOCAB + N
    assert (out[:, 9:] >= VOCAB).any(), "new tokens are generated"
    with torch.no_grad():  # the cached decoding reads the same logits as a full forward
        full = model(input_ids=out[:, :-1], attention_mask=torch.cat((mask, torch.ones(3, 7, dtype=mask.dtype)), 1))
    assert torch.equal(full.logits[:, -1].argmax(-1), out[:, -1])


def test_grow_checks_its_input():
    model = make_model("llama-gqa2-tied")
    with pytest.raises(ValueError, match="start at 90, but the model has 96"):
        grow_embeddings(model, synthetic_extension(first_id=90))
    with pytest.raises(ValueError, match="positive int"):
        grow_embeddings(model, 0)
    assert vocab_rows(model) == VOCAB and not hasattr(model.config, EXTENSION_KEY)


def test_grow_twice_and_by_count():
    base = make_model("llama-mha-untied")
    model = grow_embeddings(copy.deepcopy(base), synthetic_extension())
    grow_embeddings(model, 3)  # rows without pieces: the mean of the original rows
    assert getattr(model.config, EXTENSION_KEY) == {"base_rows": VOCAB, "new_rows": N + 3}
    head = model.get_output_embeddings()
    assert head.weight_new.shape[0] == N + 3
    assert_mean_of_rows(head.weight_new[-1], base.lm_head.weight.detach(), "a row without pieces")


@pytest.mark.parametrize("arch", ["llama-gqa2-tied", "llama-mha-untied"])
def test_resize_token_embeddings_on_an_upscaled_model(arch):
    """transformers' own call grows an upscaled model like `grow_embeddings` (original rows frozen, new rows
    trainable, exact over the original vocabulary) and refuses to shrink it."""
    base = make_model(arch)
    model = upscale(copy.deepcopy(base), tiny_scale_config(base, "preserve"))
    embedding = model.resize_token_embeddings(VOCAB + 3, pad_to_multiple_of=4)
    assert embedding is model.get_input_embeddings() and vocab_rows(model) == VOCAB + 4
    assert embedding.weight_new.requires_grad and not embedding.weight.requires_grad
    assert model.config.vocab_size == VOCAB + 4
    ids, mask = token_batch()
    expected, exact = run(base, ids, mask).logits, exact_run(base, ids, mask).logits
    assert_exact_to_rounding(run(model, ids, mask).logits[..., :VOCAB], exact, stock=expected, what="resized")
    assert model.resize_token_embeddings() is embedding and vocab_rows(model) == VOCAB + 4
    with pytest.raises(ValueError, match="cannot shrink"):
        model.resize_token_embeddings(VOCAB)


def test_scale_trainable_count_counts_the_added_width_of_new_rows(arch_name):
    from scale_cl.methods import scale_trainable_count, trainable_parameter_count
    from scale_cl.tuner.vocab import new_row_parameters

    base = make_model(arch_name)
    extended = grow_embeddings(copy.deepcopy(base), synthetic_extension())
    cfg = tiny_scale_config(base, "adapt", preserve_layers=1)
    model = upscale(copy.deepcopy(extended), cfg)
    rows = sum(p.numel() for p in new_row_parameters(model))
    assert scale_trainable_count(extended, cfg) + rows == trainable_parameter_count(model)


# --------------------------------------------------------------------------------------------
# Training under every method: original rows frozen where the method freezes the original, new rows train


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_training_keeps_original_rows_and_trains_new_rows(arch_name, method):
    base = make_model(arch_name)
    model = prepare(grow_embeddings(copy.deepcopy(base), synthetic_extension()), method, **method_options(method, base))
    d, rows = base.config.hidden_size, VOCAB + N
    embedding_before, head_before = tables(model, d, rows)
    ids, mask = batch_with_new_ids()
    model.train()
    # every parameter goes to the optimizer, with weight decay: only autograd keeps the frozen rows out
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        assert torch.isfinite(loss)
        loss.backward()
        optimizer.step()
    model.eval()
    embedding_after, head_after = tables(model, d, rows)
    assert not torch.equal(embedding_after[VOCAB:], embedding_before[VOCAB:]), "new embedding rows did not train"
    assert not torch.equal(head_after[VOCAB:], head_before[VOCAB:]), "new LM-head rows did not train"
    if method in FREEZES_ORIGINAL:
        assert torch.equal(embedding_after[:VOCAB], embedding_before[:VOCAB]), "original embedding rows changed"
    # Freeze trains an untied LM head (everything above its frozen layers); the others keep it
    keeps_head = method in FREEZES_ORIGINAL and (method != "freeze" or base.config.tie_word_embeddings)
    if keeps_head:
        assert torch.equal(head_after[:VOCAB], head_before[:VOCAB]), "original LM-head rows changed"


def new_row_gradients(method: str, mutate: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The new embedding rows' gradient as the model computes it, without any constant-stream shortcut (the stock
    computation), and without shortcuts in float64. ``mutate``: every module takes the original stream as the
    constant it would be without new rows (what `set_method` does for SCALE-Preserve on a plain vocabulary)."""
    from scale_cl.tuner.layers import SplitInput

    base = make_model("llama-gqa2-tied")
    model = prepare(grow_embeddings(copy.deepcopy(base), synthetic_extension()), method, **method_options(method, base))
    if mutate:
        for module in model.modules():
            if isinstance(module, SplitInput):
                module.constant_input = True
            if hasattr(module, "scale_heads"):
                module.scale_heads.constant = True
    ids, mask = batch_with_new_ids()
    labels = ids.masked_fill(mask == 0, -100)

    def gradient(model) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        model.train()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        return model.get_input_embeddings().weight_new.grad.clone()

    fast = gradient(model)
    for module in model.modules():  # the reference: no constant-stream shortcut anywhere
        if isinstance(module, SplitInput):
            module.constant_input = module.constant_half = False
        if hasattr(module, "scale_heads"):
            module.scale_heads.constant = module.scale_heads.constant_half = False
    return fast, gradient(model), gradient(copy.deepcopy(model).double())


@pytest.mark.parametrize("method", ["scale_preserve", "scale_route"])
def test_scale_new_embedding_rows_get_their_full_gradient(method):
    """The new rows feed the original stream, so it is no longer constant: the gradient reaches them through the
    frozen layers (and, in route mode, through both paths) exactly as autograd computes it without shortcuts."""
    fast, reference, exact = new_row_gradients(method)
    assert fast.abs().sum() > 0
    assert_exact_to_rounding(fast, exact, stock=reference, what="the new rows' gradient")


def test_a_gradient_stopped_at_the_constant_stream_is_outside_the_bound():
    """The mutation: SCALE-Preserve taking the original stream as constant although new rows feed it (the exception
    `set_method` makes for an extended vocabulary left out), so the new rows' gradient keeps only the tied head's
    term and loses every term through the frozen layers."""
    fast, reference, exact = new_row_gradients("scale_preserve", mutate=True)
    assert fast.abs().sum() > 0  # the head's term (tied embeddings) is still there
    with pytest.raises(AssertionError, match="from the float64 reference"):
        assert_exact_to_rounding(fast, exact, stock=reference, what="mutated: the stream taken as constant")


# --------------------------------------------------------------------------------------------
# Saving and loading keep the new rows


def trained_a_little(model, steps: int = 2):
    ids, mask = batch_with_new_ids(seed=3)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        optimizer.step()
    return model.eval()


@pytest.mark.parametrize("full", [False, True], ids=["new-weights", "full"])
@pytest.mark.parametrize("order", ["extend-then-upscale", "upscale-then-extend"])
@pytest.mark.parametrize("arch", ["llama-gqa2-tied", "neox-sequential-rot1.0"])
def test_scale_checkpoint_round_trip_keeps_new_rows(arch, order, full, tmp_path):
    base = make_model(arch)
    cfg = tiny_scale_config(base, "route", preserve_layers=1)
    model = copy.deepcopy(base)
    if order == "extend-then-upscale":
        model = upscale(grow_embeddings(model, synthetic_extension()), cfg)
    else:
        model = grow_embeddings(upscale(model, cfg), synthetic_extension())
    model = trained_a_little(model)
    model.save_pretrained(tmp_path, full=full)
    meta = json.loads((tmp_path / "scale_config.json").read_text())
    assert meta["vocab"] == {"base_rows": VOCAB, "new_rows": N}
    assert meta["base_model"]["config"]["vocab_size"] == VOCAB
    assert any(name.endswith("weight_new") for name in meta["tensors"])
    loaded = load(tmp_path, base_model=None if full else copy.deepcopy(base))
    ids, mask = batch_with_new_ids(seed=5)
    assert torch.equal(run(loaded, ids, mask).logits, run(model, ids, mask).logits)
    assert loaded.get_input_embeddings().weight_new.requires_grad
    assert not loaded.get_input_embeddings().weight.requires_grad


@pytest.mark.parametrize("arch", ["llama-gqa2-tied", "llama-mha-untied"])
def test_plain_model_saves_as_an_ordinary_checkpoint(arch, tmp_path):
    """A Freeze model with an extended vocabulary saves one embedding of V + N rows, reloads with transformers alone,
    and `split_vocab` gives it its frozen original rows back."""
    from transformers import AutoModelForCausalLM

    base = make_model(arch)
    model = trained_a_little(prepare(grow_embeddings(copy.deepcopy(base), synthetic_extension()), "freeze", layers=1))
    state = model.state_dict()
    assert state["model.embed_tokens.weight"].shape[0] == VOCAB + N
    assert not any(name.endswith("weight_new") for name in state)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert getattr(loaded.config, EXTENSION_KEY) == {"base_rows": VOCAB, "new_rows": N}
    reloaded = loaded.state_dict()
    assert all(torch.equal(value, reloaded[name]) for name, value in state.items())
    ids, mask = batch_with_new_ids(seed=5)
    expected, exact = run(model, ids, mask), exact_run(model, ids, mask)
    # one head of V + N rows rounds its products differently from two heads of V and N rows (BLAS blocking)
    assert_exact_to_rounding(run(loaded, ids, mask).logits, exact.logits, stock=expected.logits, what="reloaded")
    prepare(loaded, "freeze", layers=1)  # splits again: the original rows frozen, the new ones trainable
    embedding = loaded.get_input_embeddings()
    assert isinstance(embedding, VocabEmbedding) and embedding.weight.shape[0] == VOCAB
    assert not embedding.weight.requires_grad and embedding.weight_new.requires_grad
    assert torch.equal(run(loaded, ids, mask).logits, expected.logits)
    # and a state dict of either form loads back
    loaded.load_state_dict(model.state_dict())
    assert torch.equal(run(loaded, ids, mask).logits, expected.logits)


def test_lora_adapter_round_trip_keeps_new_rows(tmp_path):
    from peft import PeftModel

    base = make_model("llama-mha-untied")
    extended = grow_embeddings(copy.deepcopy(base), synthetic_extension())
    model = trained_a_little(prepare(copy.deepcopy(extended), "lora", rank=2))
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(merge_vocab(copy.deepcopy(extended)), tmp_path).eval()
    ids, mask = batch_with_new_ids(seed=5)
    assert torch.equal(run(loaded, ids, mask).logits, run(model, ids, mask).logits)
    assert not torch.equal(run(loaded, ids, mask).logits, run(extended, ids, mask).logits)


def test_trainer_checkpoint_holds_the_new_rows(tmp_path):
    from transformers import TrainingArguments

    from scale_cl.train.trainer import CheckpointingTrainer, load_trainable

    base = make_model("llama-gqa2-tied")
    options = method_options("scale_preserve", base)
    model = trained_a_little(
        prepare(grow_embeddings(copy.deepcopy(base), synthetic_extension()), "scale_preserve", **options)
    )
    args = TrainingArguments(output_dir=str(tmp_path / "run"), use_cpu=True, report_to=[])
    CheckpointingTrainer(model=model, args=args)._save(str(tmp_path / "checkpoint"))
    fresh = prepare(grow_embeddings(copy.deepcopy(base), synthetic_extension()), "scale_preserve", **options)
    load_trainable(fresh, tmp_path / "checkpoint")
    ids, mask = batch_with_new_ids(seed=5)
    assert torch.equal(run(fresh.eval(), ids, mask).logits, run(model, ids, mask).logits)


# --------------------------------------------------------------------------------------------
# The tokenizer: an English-only base learns a syllable language


def naive_merges(words: dict[tuple[str, ...], int], count: int, known: set[str]) -> list[tuple[str, str]]:
    """Continued BPE the slow, obvious way: recount every pair after every merge."""
    from collections import Counter
    from itertools import pairwise

    from scale_cl.tuner.vocab.merges import _merge_word

    words, known, merges = dict(words), set(known), []
    while len(merges) < count:
        counts = Counter()
        for word, n in words.items():
            for pair in pairwise(word):
                counts[pair] += n
        candidates = [(-n, pair) for pair, n in counts.items() if n >= 2 and "".join(pair) not in known]
        if not candidates:
            break
        best = min(candidates)[1]
        merges.append(best)
        known.add("".join(best))
        merged = Counter()
        for word, n in words.items():
            merged[tuple(_merge_word(list(word), best))] += n
        words = merged
    return merges


def test_learned_merges_match_the_naive_algorithm():
    import random
    from collections import Counter

    from scale_cl.tuner.vocab.merges import learn_merges

    rng = random.Random(0)
    for _ in range(40):
        alphabet = "abcde"[: rng.randint(2, 5)]
        lengths = [rng.randint(1, 8) for _ in range(rng.randint(5, 200))]
        words = Counter(tuple(rng.choice(alphabet) for _ in range(length)) for length in lengths)
        known = set(alphabet) | {"ab"}
        assert learn_merges(words, 30, known) == naive_merges(words, 30, known)
    # "aaaa" merges (a, a) left to right into "aa aa", and a pair making a known token is never taken
    assert learn_merges(Counter({("a", "a", "a", "a"): 3, ("a", "b"): 5}), 5, {"a", "b", "ab"}) == [
        ("a", "a"),
        ("aa", "aa"),
    ]


@pytest.fixture(scope="module")
def domains() -> tuple[list[str], list[str], list[str]]:
    """(new-domain training text, new-domain held-out text, old-domain text)."""
    new = _documents(0, 200, SYLLABLES, "")
    return new[:160], new[160:], _documents(1, 40, WORDS, " ")


@pytest.fixture(scope="module")
def english(domains):
    return train_bpe_tokenizer(domains[2], vocab_size=300)


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokens_per_character(tokenizer, texts: list[str]) -> float:
    return sum(len(ids_of(tokenizer, t)) for t in texts) / sum(map(len, texts))


def test_extension_compresses_the_new_domain_and_keeps_the_old_one(english, domains, tmp_path):
    from transformers import AutoTokenizer

    train, heldout, old = domains
    size = len(english)
    extended, added = extend_tokenizer(english, train, 48)
    assert len(english) == size, "the base tokenizer is not changed"
    assert len(extended) == size + 48 and added.ids == list(range(size, size + 48))
    assert tokens_per_character(extended, heldout) < 0.6 * tokens_per_character(english, heldout)
    assert all(ids_of(extended, t) == ids_of(english, t) for t in old), "old-domain text splits as before"
    assert set(added.ids) & {i for t in heldout for i in ids_of(extended, t)}, "new tokens fire on held-out text"
    assert all(extended.decode(ids_of(extended, t)) == t for t in heldout)
    for token, pieces in zip(added.tokens, added.pieces, strict=True):  # a new token is the text of its pieces
        assert "".join(english.convert_ids_to_tokens(list(pieces))) == token and len(pieces) >= 2
    assert extended.eos_token == english.eos_token and extended.eos_token_id == english.eos_token_id
    extended.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert all(ids_of(reloaded, t) == ids_of(extended, t) for t in heldout + old)


def test_new_ids_follow_a_padded_embedding(english, domains):
    """A model may have more rows than its tokenizer has tokens (Qwen2, Pythia): new ids start at its row count."""
    from transformers import LlamaForCausalLM

    from tests.conftest import tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(vocab_size=len(english) + 4, tie_word_embeddings=True))
    model, extended, added = extend_vocab(model, english, domains[0], 8)
    assert added.first_id == len(english) + 4 and vocab_rows(model) == len(english) + 12
    ids = torch.tensor([ids_of(extended, domains[1][0])])
    assert ids.max() >= added.first_id
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


def test_bad_extensions_are_refused_and_change_nothing(english, domains):
    from tokenizers import Tokenizer, models
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    from tests.conftest import tiny_llama_config

    model = LlamaForCausalLM(tiny_llama_config(vocab_size=len(english), tie_word_embeddings=True))
    small = make_model("llama-gqa2-tied")
    before = english.backend_tokenizer.to_str()
    with pytest.raises(ValueError, match=r"supports only \d+ new tokens .* not 100000"):
        extend_vocab(model, english, domains[0], 100_000)
    with pytest.raises(ValueError, match="already uses"):  # the tokenizer's 298 ids do not fit the model's 96 rows
        extend_vocab(small, english, domains[0], 8)
    with pytest.raises(ValueError, match="positive number"):
        extend_tokenizer(english, domains[0], 0)
    wordpiece = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordPiece({"[UNK]": 0}, unk_token="[UNK]")))
    with pytest.raises(ValueError, match="only BPE tokenizers"):
        extend_tokenizer(wordpiece, domains[0], 8)
    assert english.backend_tokenizer.to_str() == before
    for untouched in (model, small):
        assert not hasattr(untouched.config, EXTENSION_KEY)
        assert isinstance(untouched.get_input_embeddings(), torch.nn.Embedding)
    assert vocab_rows(model) == len(english) and vocab_rows(small) == VOCAB


# --------------------------------------------------------------------------------------------
# scale-cl cpt --data.extend_vocab


def test_extend_vocab_option_is_parsed_and_checked():
    from scale_cl.cli import parse_settings

    cfg = parse_settings(["cpt", "--data.extend_vocab", "16", "--data.train", "x.jsonl"]).cpt
    assert cfg.data.extend_vocab == 16 and cfg.data.train == ["x.jsonl"]
    assert parse_settings(["cpt"]).cpt.data.extend_vocab == 0
    from scale_cl.experiments.train.sections import DataSection

    with pytest.raises(ValueError, match=r"data\.extend_vocab"):
        DataSection(extend_vocab=-1)


def test_cpt_extend_vocab_larger_than_the_text_fails_before_anything_is_written(workspace, tmp_path):
    from dataclasses import replace

    from scale_cl.experiments.cpt.pipeline import run_cpt
    from tests.conftest import tiny_config

    cfg = tiny_config(workspace, ["freeze"])
    cfg = replace(cfg, data=replace(cfg.data, extend_vocab=100_000))
    with pytest.raises(ValueError, match=r"data.extend_vocab=100000: the new-domain text supports only"):
        run_cpt(cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cpt_with_an_extended_vocabulary(workspace, tmp_path):
    from dataclasses import replace

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scale_cl.experiments.cpt.pipeline import run_cpt
    from scale_cl.models import load_trained
    from tests.conftest import tiny_config

    methods = ["scale_preserve", "freeze", "lora"]
    cfg = tiny_config(workspace, methods, steps=2, save_every=0)
    cfg = replace(cfg, data=replace(cfg.data, extend_vocab=16))
    results = run_cpt(cfg, tmp_path)
    base_tokenizer = AutoTokenizer.from_pretrained(workspace / "base")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    record = json.loads((tmp_path / "tokenizer" / "vocab_extension.json").read_text())
    assert len(tokenizer) == len(base_tokenizer) + 16 and record["first_id"] == len(base_tokenizer)
    assert json.loads((tmp_path / "cpt_config.json").read_text())["data"]["extend_vocab"] == 16
    curves = {m: results["methods"][m]["curve"] for m in methods}
    assert len({c[0]["forgetting_ppl"]["toy"] for c in curves.values()}) == 1, "every method starts from one model"
    old = [json.loads(line)["text"] for line in (workspace / "old.jsonl").read_text().splitlines()]
    if all(ids_of(tokenizer, t) == ids_of(base_tokenizer, t) for t in old):  # no new merge fires on old text
        # Preserve's hidden states are then the base's, and fp32's cosine of a vector with itself is 1 within a few
        # eps (normalise, square, sum d terms: ~log2(d) eps at worst, less in practice); 1e-6 is ~8 fp32 eps.
        assert all(r["representation_similarity"] == pytest.approx(1.0, abs=1e-6) for r in curves["scale_preserve"])

    text = json.loads((workspace / "new.jsonl").read_text().splitlines()[0])["text"]
    ids = torch.tensor([ids_of(tokenizer, text)])
    assert ids.max() >= len(base_tokenizer), "the new-domain text uses new tokens"
    for method in ("scale_preserve", "freeze", "lora"):  # lora: the base is grown to the adapter's rows
        model, saved_tokenizer, _ = load_trained(tmp_path / method / "model")
        assert len(saved_tokenizer) == len(tokenizer)
        assert vocab_rows(model) == len(base_tokenizer) + 16
        assert torch.isfinite(model(input_ids=ids, labels=ids).loss)
    # LoRA's adapter holds the new rows: it loads onto the base grown by the same rows
    base = AutoModelForCausalLM.from_pretrained(workspace / "base")
    lora = PeftModel.from_pretrained(grow_for_adapter(base, tmp_path / "lora" / "model"), tmp_path / "lora" / "model")
    assert vocab_rows(base) == len(base_tokenizer) + 16
    assert torch.isfinite(lora(input_ids=ids, labels=ids).loss)


def test_upscale_of_a_reloaded_extended_model_trains_only_its_new_rows(tmp_path):
    """A plain extended model saved and reloaded has one V+N-row embedding; `upscale` splits it again."""
    from transformers import AutoModelForCausalLM

    from scale_cl import ScaleConfig

    base = make_model("llama-gqa2-tied", seed=0)
    rows = vocab_rows(base)
    grow_embeddings(base, 4)
    base.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    model = upscale(reloaded, ScaleConfig(hidden_up=hidden_up_for(reloaded), ffn_up=8))
    embedding = model.get_input_embeddings()
    assert embedding.weight.shape[0] == rows and not embedding.weight.requires_grad
    assert embedding.weight_new.shape[0] == 4 and embedding.weight_new.requires_grad


def test_cpt_sweep_with_an_extended_vocabulary(workspace, tmp_path):
    """The sweep packs its corpus once and evaluates the base once: both with the extended vocabulary."""
    from dataclasses import replace

    from scale_cl.experiments.sweep.experiments import BASE_FILE, CptExperiment
    from scale_cl.experiments.sweep.runner import SweepSettings, run_sweep
    from tests.conftest import tiny_config

    cfg = tiny_config(workspace, ["scale_preserve"], steps=2, save_every=0)
    cfg = replace(cfg, data=replace(cfg.data, extend_vocab=16))
    out = tmp_path / "sweep"
    run_sweep(CptExperiment(cfg), SweepSettings(lr_scales=(1.0,), reference="scale_preserve"), out)
    base = json.loads((out / BASE_FILE).read_text())
    (metrics,) = (out / "points").glob("*/*/metrics.jsonl")
    first = json.loads(metrics.read_text().splitlines()[0])
    assert first["learning_ppl"] == base["learning_ppl"] and first["forgetting_ppl"] == base["forgetting_ppl"]
