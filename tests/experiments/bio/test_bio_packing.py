"""The original benchmark's pre-training data: global shuffle packed afresh per epoch, distinct templates per person."""

from __future__ import annotations

import statistics

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, Trainer, TrainingArguments

from scale_cl.data.biography import ATTRIBUTES, TEMPLATES, bio_spec, biographies, generate_people, render
from scale_cl.experiments.bio.datasets import PackedText, PadCollator

EOS, BLOCK, PEOPLE, PER_PERSON = 0, 64, 60, 5


def person_documents(seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Five documents per person of 15-40 tokens; every token of a document is its person's id (1..PEOPLE)."""
    gen = torch.Generator().manual_seed(seed)
    docs, owners = [], []
    for person in range(1, PEOPLE + 1):
        for _ in range(PER_PERSON):
            docs.append([person] * int(torch.randint(15, 41, (1,), generator=gen)))
            owners.append(person)
    return docs, owners


def blocks_with_a_repeated_person(blocks: torch.Tensor) -> int:
    """Blocks holding pieces of two or more documents of one person (documents are split at EOS)."""
    count = 0
    for block in blocks.tolist():
        pieces, current = [], []
        for token in block:
            if token == EOS:
                pieces.append(current)
                current = []
            else:
                current.append(token)
        pieces.append(current)
        people = [piece[0] for piece in pieces if piece]
        count += len(people) != len(set(people))
    return count


def test_shuffled_packing_mixes_people_as_a_global_shuffle_does():
    """A statistical bound: per epoch, no more blocks repeat a person than random orders of the same documents give."""
    docs, _ = person_documents()
    shuffled = PackedText(docs, EOS, BLOCK, shuffle_seed=0)
    observed = []
    for epoch in range(5):
        shuffled.set_epoch(epoch)
        observed.append(blocks_with_a_repeated_person(shuffled.blocks))
    reference = []
    for trial in range(200):  # independent global shuffles, packed the same way
        order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(10_000 + trial)).tolist()
        reference.append(blocks_with_a_repeated_person(PackedText([docs[i] for i in order], EOS, BLOCK).blocks))
    mean, sd = statistics.fmean(reference), statistics.pstdev(reference)
    assert max(observed) <= mean + 4 * sd
    # Person-by-person packing (the project's old default) puts a person's documents side by side:
    by_person = blocks_with_a_repeated_person(PackedText(docs, EOS, BLOCK).blocks)
    assert by_person > mean + 10 * sd


def test_a_new_packing_every_epoch_reproducible_and_of_constant_length():
    docs, _ = person_documents()
    packed = PackedText(docs, EOS, BLOCK, shuffle_seed=3)
    first = packed.blocks.clone()
    packed.set_epoch(1)
    second = packed.blocks.clone()
    assert len(packed) == first.shape[0] == second.shape[0] == sum(len(d) + 1 for d in docs) // BLOCK
    assert not torch.equal(first, second)
    packed.set_epoch(0)
    assert torch.equal(packed.blocks, first)  # a resumed run re-packs epoch 0 the same way
    assert not torch.equal(first, PackedText(docs, EOS, BLOCK, shuffle_seed=4).blocks)
    # every token is still there, in whole documents: the stream is a permutation of the documents
    order = packed.document_order(1).tolist()
    stream = [t for i in order for t in (*docs[i], EOS)]
    assert second.flatten().tolist() == stream[: second.numel()]


def test_unshuffled_packing_is_the_documents_in_order():
    docs, _ = person_documents()
    packed = PackedText(docs, EOS, BLOCK)
    stream = [t for doc in docs for t in (*doc, EOS)]
    assert packed.blocks.flatten().tolist() == stream[: len(packed) * BLOCK]
    packed.set_epoch(3)
    assert packed.blocks.flatten().tolist() == stream[: len(packed) * BLOCK]


def test_the_trainer_repacks_at_every_epoch(tmp_path):
    """HF Trainer (through accelerate's data loader) calls set_epoch, so each epoch trains on its own packing."""
    seen: list[int] = []

    class Spy(PackedText):
        def set_epoch(self, epoch: int) -> None:
            seen.append(epoch)
            super().set_epoch(epoch)

    docs, _ = person_documents()
    data = Spy([[t % 50 + 1 for t in d] for d in docs], EOS, 32, shuffle_seed=0)
    seen.clear()
    config = GPTNeoXConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=32, max_position_embeddings=32)  # fmt: skip
    args = TrainingArguments(str(tmp_path), num_train_epochs=3, per_device_train_batch_size=64, save_strategy="no",
                             report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=100)  # fmt: skip
    Trainer(GPTNeoXForCausalLM(config), args, train_dataset=data, data_collator=PadCollator(EOS)).train()
    assert [e for i, e in enumerate(seen) if i == 0 or seen[i - 1] != e] == [0, 1, 2]  # (called twice per epoch)


@pytest.mark.parametrize("seed", [0, 1])
def test_distinct_biographies_use_different_templates_and_orders(seed):
    people = generate_people(bio_spec("micro", people=20), seed)
    for person in people:
        texts = biographies(person, 5, seed=seed, distinct=True)
        rendered = {
            render(t, person, a): (a, t) for a in ATTRIBUTES for t in TEMPLATES[a]
        }  # every sentence the person's biographies could hold -> (attribute, template)
        # every template ends with "." and holds no ". ": a biography splits into its sentences exactly
        sentences = [[rendered[s if s.endswith(".") else s + "."] for s in text.split(". ")] for text in texts]
        orders = [tuple(a for a, _ in bio) for bio in sentences]
        assert all(sorted(order) == sorted(ATTRIBUTES) for order in orders)
        assert len(set(orders)) == 5, "five different sentence orders"
        for attribute in ATTRIBUTES:
            used = [t for bio in sentences for a, t in bio if a == attribute]
            assert len(set(used)) == 5, f"{attribute}: five different templates"
    assert biographies(people[0], 5, seed=seed, distinct=True) == biographies(people[0], 5, seed=seed, distinct=True)
