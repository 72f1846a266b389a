"""Perplexity and the split of an old-domain loss into mass on new-domain tokens and ranking."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from scale_cl.eval.perplexity import new_domain_tokens, perplexity
from tests.conftest import tiny_llama_config
from tests.exactness import assert_exact_to_rounding

pytestmark = pytest.mark.exactness


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config()).eval()


def test_perplexity_is_the_exponent_of_the_token_mean_loss():
    model = _model()
    ids = torch.randint(0, model.config.vocab_size, (5, 9), generator=torch.Generator().manual_seed(1))
    result = perplexity(model, ids, batch_size=2)

    def loss(model):  # the whole batch's token-mean loss at once, the stock computation of what batches of 2 average
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, :-1]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    assert result.tokens == 5 * 8
    # fp32 losses of batches averaged in Python floats, compared as fp32: its rounding to fp32 (half an epsilon) is
    # inside the floor of 8
    got = torch.tensor(result.loss, dtype=torch.float32)
    assert_exact_to_rounding(got, loss(copy.deepcopy(model).double()), stock=loss(model), what="loss")
    # the same number twice: exp in Python floats, 1e-9 is 1e7 float64 epsilons
    assert math.isclose(result.perplexity, math.exp(result.loss), rel_tol=1e-9) and result.new_mass_nll is None


def test_the_split_is_the_mass_the_model_gives_the_new_domain_tokens():
    model = _model()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab // 2, (4, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[vocab // 2 :] = True
    result = perplexity(model, ids, batch_size=3, new_tokens=mask)

    def mass_nll(model):  # by the softmax's probabilities summed (`perplexity` sums log-probabilities: logsumexp)
        with torch.no_grad():
            p = model(input_ids=ids).logits[:, :-1].softmax(-1)
        return -torch.log1p(-p[..., mask].sum(-1)).mean()

    got = torch.tensor(result.new_mass_nll, dtype=torch.float32)  # as the loss above
    assert_exact_to_rounding(got, mass_nll(copy.deepcopy(model).double()), stock=mass_nll(model), what="new mass")
    assert 0 < result.new_mass_nll < result.loss, "both parts of the loss are positive"
    none = perplexity(model, ids, batch_size=3, new_tokens=torch.zeros(vocab, dtype=torch.bool))
    assert none.new_mass_nll == 0.0


def test_new_domain_tokens_are_the_relatively_more_frequent_ones():
    new = torch.tensor([[5, 5, 5, 1, 2]])
    old = torch.tensor([[1, 1, 2, 2, 3, 5]])
    mask = new_domain_tokens(new, old, 8)
    assert mask.tolist() == [False, False, False, False, False, True, False, False]


@pytest.mark.slow
def test_cpt_records_the_split_at_every_evaluation(workspace, tmp_path):
    import json
    from dataclasses import replace

    from scale_cl.experiments.cpt.pipeline import run_cpt
    from tests.conftest import tiny_config

    cfg = tiny_config(workspace, ["fft"], steps=3, save_every=0)
    cfg = replace(cfg, eval=replace(cfg.eval, nll_split=True))
    run_cpt(cfg, tmp_path / "run")
    curve = json.loads((tmp_path / "run" / "fft" / "result.json").read_text())["curve"]
    for record in curve:
        mass = record["forgetting_new_mass_nll"]["toy"]
        assert 0 <= mass < math.log(record["forgetting_ppl"]["toy"])
