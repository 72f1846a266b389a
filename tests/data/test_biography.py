"""The synthetic biography data: pools, people, biographies, QA, splits and the BPE tokenizer."""

from __future__ import annotations

import dataclasses
import datetime
import re

import pytest

from scale_cl.data import (
    ATTRIBUTES,
    MAJORS,
    PRESETS,
    QUESTIONS,
    TEMPLATES,
    BioSpec,
    answer_first_token,
    bio_spec,
    biographies,
    biography_corpus,
    build_pools,
    completion_probes,
    generate_people,
    prompt_answer_boundary_ok,
    qa_items,
    shared_first_tokens,
    splits,
    train_bpe_tokenizer,
)
from scale_cl.data.biography import render

POOL_FIELDS = ("first_names", "middle_names", "last_names", "cities", "universities", "majors", "employers")


@pytest.fixture(scope="module")
def micro_people():
    return generate_people(bio_spec("micro"), seed=0)


# ------------------------------------------------------------------------------------- pools


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_pools_have_exact_sizes_and_unique_values(preset):
    spec = bio_spec(preset)
    pools = build_pools(spec, seed=0)
    for name in POOL_FIELDS:
        pool = getattr(pools, name)
        assert len(pool) == getattr(spec, name), name
        assert len(set(pool)) == len(pool), f"{name} has duplicates"
    # No value is ambiguous: names and cities are words of their own, unique across pools, and no
    # two universities or employers share their first (distinctive) word.
    words = [w for name in ("first_names", "middle_names", "last_names", "cities") for w in getattr(pools, name)]
    words += [u.split()[0] for u in pools.universities] + [e.split()[0] for e in pools.employers]
    assert len(set(words)) == len(words)
    assert set(pools.majors) <= set(MAJORS)
    assert set(pools.employer_city) == set(pools.employers)
    assert set(pools.employer_city.values()) <= set(pools.cities)


def test_majors_have_distinct_first_words():
    assert len(MAJORS) == 100
    assert len({major.split()[0] for major in MAJORS}) == len(MAJORS)


def test_pools_are_fixed_by_sizes_and_seed():
    spec = bio_spec("small")
    assert build_pools(spec, 0) == build_pools(dataclasses.replace(spec, people=7), 0)  # people don't matter
    assert build_pools(spec, 0).last_names != build_pools(spec, 1).last_names
    from scale_cl.data.biography import _build_pools

    cached = build_pools(spec, 0)
    _build_pools.cache_clear()
    assert build_pools(spec, 0) == cached  # rebuilt from scratch: the same pools


# ------------------------------------------------------------------------------------ people


def test_people_are_deterministic_under_the_seed(micro_people):
    spec = bio_spec("micro")
    assert generate_people(spec, seed=0) == micro_people
    other = generate_people(spec, seed=1)
    assert [p.full_name for p in other] != [p.full_name for p in micro_people]


def test_people_have_unique_names_and_values_from_the_pools():
    spec = bio_spec("small")
    pools = build_pools(spec, seed=3)
    people = generate_people(spec, seed=3)
    assert [p.index for p in people] == list(range(spec.people))
    assert len({p.full_name for p in people}) == spec.people
    for p in people:
        assert p.full_name == f"{p.first} {p.middle} {p.last}"
        assert p.first in pools.first_names and p.middle in pools.middle_names and p.last in pools.last_names
        assert p.birth_city in pools.cities and p.university in pools.universities
        assert p.major in pools.majors and p.employer in pools.employers
        parsed = datetime.datetime.strptime(p.birth_date, "%B %d, %Y")  # "March 4, 1987"
        assert re.fullmatch(r"[A-Z][a-z]+ [1-9]\d?, \d{4}", p.birth_date)
        assert 1950 <= parsed.year <= 2005
    # Uniform draws: with 2,000 people, every city and every major shows up.
    assert {p.birth_city for p in people} == set(pools.cities)
    assert {p.major for p in people} == set(pools.majors)


def test_employer_city_is_a_function_of_the_employer():
    people = generate_people(bio_spec("small"), seed=0)
    city_of = build_pools(bio_spec("small"), 0).employer_city
    for p in people:
        assert p.employer_city == city_of[p.employer]
    # Employers differ in their city: the employer city is not one constant.
    assert len({p.employer_city for p in people}) > 10


def test_names_stay_unique_whepeople_fill_every_name():
    spec = bio_spec("micro", people=12, first_names=2, middle_names=2, last_names=3)
    people = generate_people(spec, seed=0)
    assert len({p.full_name for p in people}) == 12


# --------------------------------------------------------------------------------- templates


def test_templates_follow_the_rules():
    everything = [t for attribute in ATTRIBUTES for t in TEMPLATES[attribute]]
    assert len(everything) == len(set(everything)) >= 120
    pronouns = re.compile(r"\b(he|she|his|her|him|hers|they|them)\b", re.IGNORECASE)
    for attribute in ATTRIBUTES:
        assert len(TEMPLATES[attribute]) >= 20
        for template in TEMPLATES[attribute]:
            assert template.count("{name}") == 1 and template.count("{value}") == 1, template
            assert template.index("{name}") < template.index("{value}"), template  # name -> value
            assert " {value}" in template, template  # value tokens match the QA answer's
            assert template.endswith(".") and template.count(".") == 1, template
            assert not pronouns.search(template), template


def test_every_template_renders_the_name_and_value(micro_people):
    person = micro_people[0]
    for attribute in ATTRIBUTES:
        value = getattr(person, attribute)
        for template in TEMPLATES[attribute]:
            sentence = render(template, person, attribute)
            assert person.full_name in sentence and value in sentence
            assert "{" not in sentence and "}" not in sentence


# ------------------------------------------------------------------------------- biographies


def _attribute_of_sentences(person, bio: str) -> list[str]:
    """The attribute each sentence of ``bio`` states (it must match exactly one template rendering)."""
    renderings = {attribute: {render(t, person, attribute) for t in TEMPLATES[attribute]} for attribute in ATTRIBUTES}
    pieces = bio.split(". ")
    sentences = [piece + "." for piece in pieces[:-1]] + [pieces[-1]]
    found = []
    for sentence in sentences:
        matches = [attribute for attribute, rendered in renderings.items() if sentence in rendered]
        assert len(matches) == 1, sentence
        found.append(matches[0])
    return found


def test_biographies_state_all_six_attributes_in_varied_orders(micro_people):
    orders = set()
    for person in micro_people[:50]:
        bios = biographies(person, count=5, seed=0)
        assert len(bios) == 5 and len(set(bios)) == 5, "the five biographies of a person differ"
        for bio in bios:
            found = _attribute_of_sentences(person, bio)
            assert sorted(found) == sorted(ATTRIBUTES)
            orders.add(tuple(found))
    assert len(orders) > 100  # 250 biographies, 720 possible orders: shuffled, not fixed


def test_biographies_are_deterministic_and_per_person(micro_people):
    person = micro_people[7]
    assert biographies(person, 5, seed=0) == biographies(person, 5, seed=0)
    assert biographies(person, 5, seed=0) != biographies(person, 5, seed=1)
    assert biographies(person, 3, seed=0) == biographies(person, 5, seed=0)[:3]  # count only appends
    corpus = list(biography_corpus(micro_people[5:9], count=5, seed=0))
    assert corpus[10:15] == biographies(person, 5, seed=0)  # independent of who else is generated
    with pytest.raises(ValueError, match="count"):
        biographies(person, count=-1)


# -------------------------------------------------------------------------------- QA, splits


def test_qa_items_format(micro_people):
    person = micro_people[0]
    items = qa_items(person)
    assert [item.attribute for item in items] == list(ATTRIBUTES)
    for item in items:
        assert item.person_index == person.index
        assert item.prompt == QUESTIONS[item.attribute].format(name=person.full_name) + "\nAnswer:"
        assert item.answer == " " + getattr(person, item.attribute)
        assert item.text == item.prompt + item.answer
    city = next(item for item in items if item.attribute == "birth_city")
    assert city.prompt == f"What is the birth city of {person.full_name}?\nAnswer:"


def test_splits_of_the_paper():
    s = splits(200_000)
    assert {k: (r.start, r.stop) for k, r in s.items()} == {
        "pretrain": (0, 100_000),
        "task0_train": (0, 50_000),
        "task0_test": (50_000, 100_000),
        "task1": (100_000, 120_000),
    }


@pytest.mark.parametrize("n", [10, 11, 37, 200, 2_000, 123_457])
def test_splits_are_disjoint_proportional_and_non_empty(n):
    s = splits(n)
    assert all(len(r) > 0 for r in s.values())
    task0_train, task0_test, task1 = set(s["task0_train"]), set(s["task0_test"]), set(s["task1"])
    assert task0_train | task0_test == set(s["pretrain"])  # Task 0's people are in the pre-training data
    assert not task0_train & task0_test
    assert not task1 & set(s["pretrain"])  # Task 1's people are never seen in pre-training
    assert s["task1"].stop <= n
    assert (len(s["pretrain"]), len(s["task0_train"]), len(s["task1"])) == (n // 2, n // 4, n // 10)


@pytest.mark.parametrize("n", [0, 9, -5])
def test_splits_reject_too_few_people(n):
    with pytest.raises(ValueError, match="at least 10"):
        splits(n)


# ----------------------------------------------------------------------------------- presets


def test_presets_and_overrides():
    assert bio_spec("paper") == BioSpec()
    paper = bio_spec("paper")
    assert (paper.people, paper.bios_per_person) == (200_000, 5)
    assert paper.pool_sizes == (400, 400, 1000, 200, 300, 100, 263)
    assert bio_spec("small", people=1000).people == 1000
    for name in PRESETS:
        spec = bio_spec(name)
        assert spec.name_combinations >= 10 * spec.people  # names stay unique with room to spare


def test_unknown_preset_and_bad_overrides_are_clear_errors():
    with pytest.raises(ValueError, match="valid presets: paper, small, micro"):
        bio_spec("huge")
    with pytest.raises(ValueError, match="unknown BioSpec fields \\['persons'\\]"):
        bio_spec("micro", persons=5)
    with pytest.raises(ValueError, match="positive int"):
        bio_spec("micro", cities=0)
    with pytest.raises(ValueError, match="positive int"):
        bio_spec("micro", people=True)
    with pytest.raises(ValueError, match="at most 100"):
        bio_spec("micro", majors=101)
    with pytest.raises(ValueError, match="unique full names"):
        bio_spec("micro", people=20 * 20 * 50 + 1)


# --------------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def micro_corpus(micro_people):
    s = splits(len(micro_people))
    texts = list(biography_corpus((micro_people[i] for i in s["pretrain"]), count=5, seed=0))
    texts += [item.text for p in micro_people for item in qa_items(p)]
    return texts


@pytest.fixture(scope="module")
def micro_tokenizer(micro_corpus):
    return train_bpe_tokenizer(micro_corpus, vocab_size=1024)


def test_tokenizer_is_deterministic(micro_corpus, micro_tokenizer):
    again = train_bpe_tokenizer(iter(micro_corpus), vocab_size=1024)
    assert again.backend_tokenizer.to_str() == micro_tokenizer.backend_tokenizer.to_str()
    assert len(micro_tokenizer) <= 1024
    other = train_bpe_tokenizer(micro_corpus[: len(micro_corpus) // 3], vocab_size=1024)
    assert other.get_vocab() != micro_tokenizer.get_vocab()


def test_tokenizer_special_tokens_and_round_trip(micro_tokenizer, micro_people):
    tok = micro_tokenizer
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id == tok.unk_token_id == eos
    text = biographies(micro_people[0], 1)[0] + " Ünïcødé 🙂"  # every byte is in the vocabulary
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert eos not in ids
    assert tok.decode(ids) == text
    with pytest.raises(ValueError, match="at least 257"):
        train_bpe_tokenizer(["abc"], vocab_size=100)


@pytest.mark.parametrize("vocab_size", [300, 1024])
def test_prompt_answer_boundary_holds_for_every_micro_qa_item(micro_corpus, micro_people, vocab_size):
    tok = train_bpe_tokenizer(micro_corpus, vocab_size=vocab_size)  # 300: names split into many pieces
    for person in micro_people:
        for item in qa_items(person):
            assert prompt_answer_boundary_ok(tok, item.prompt, item.answer), item
            prompt_ids = tok(item.prompt, add_special_tokens=False)["input_ids"]
            full_ids = tok(item.text, add_special_tokens=False)["input_ids"]
            assert answer_first_token(tok, item.answer) == full_ids[len(prompt_ids)]


def test_boundary_check_detects_a_merge_across_the_boundary(micro_tokenizer):
    # Without a space the answer would merge into the prompt's last word: the check must say so.
    assert not prompt_answer_boundary_ok(micro_tokenizer, "What is the birth", "day")
    with pytest.raises(ValueError, match="leading space"):
        answer_first_token(micro_tokenizer, "Tormouth")


def test_shared_first_tokens_groups_dates_by_month(micro_tokenizer):
    shared = shared_first_tokens(micro_tokenizer, ["March 4, 1987", "March 9, 1990", "May 1, 1960"])
    assert list(shared.values()) == [["March 4, 1987", "March 9, 1990"]]


def test_tokenizer_survives_save_and_load(micro_tokenizer, micro_people, tmp_path):
    from transformers import PreTrainedTokenizerFast

    micro_tokenizer.save_pretrained(tmp_path)
    loaded = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    assert loaded.eos_token_id == micro_tokenizer.eos_token_id and loaded.pad_token == "<|endoftext|>"
    for person in micro_people[:20]:
        for item in qa_items(person):
            assert loaded(item.text)["input_ids"] == micro_tokenizer(item.text)["input_ids"]
            assert prompt_answer_boundary_ok(loaded, item.prompt, item.answer)


@pytest.mark.parametrize("distinct", [False, True])
def test_completion_probes_cut_a_sentence_the_person_was_read_in(micro_people, distinct):
    """Each probe is its person's name, then the words before the value in one of their biographies'
    sentences, and the value: prompt + answer is text the pre-training read."""
    covered = 0
    for person in micro_people[:40]:
        text = " ".join(biographies(person, 5, seed=3, distinct=distinct))
        probes = completion_probes(person, 5, seed=3, distinct=distinct)
        assert len({p.attribute for p in probes}) == len(probes)
        for probe in probes:
            assert person.full_name in probe.prompt
            assert probe.answer == " " + person.attribute(probe.attribute)
            assert probe.prompt + probe.answer in text and not probe.prompt.endswith(" ")
        covered += len(probes)
    assert covered >= 0.9 * 40 * len(ATTRIBUTES)  # nearly every attribute has a name-first sentence
