"""Replay: old-domain text mixed into continual pre-training at an exact share of every batch."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from scale_cl.data.corpus import CorpusConfig, build_corpus, is_stream, read_documents
from scale_cl.data.replay import REPLAY_KEY, ReplayMix, ReplayStream, is_replay, replay_before, whole_per_batch
from scale_cl.experiments.cpt.config import CptConfig
from scale_cl.experiments.cpt.pipeline import run_cpt
from scale_cl.experiments.train.corpus import load_run_corpus
from scale_cl.experiments.train.prepare import training_data
from tests.conftest import tiny_config


def _blocks(rows: int, start: int, width: int = 4) -> torch.Tensor:
    """``rows`` distinct blocks whose first token tells them apart (``start`` + row)."""
    return (torch.arange(rows)[:, None] + start).repeat(1, width)


@pytest.mark.parametrize(("ratio", "batch"), [(0.25, 4), (0.125, 8), (0.5, 2), (0.05, 20), (0.75, 4)])
def test_every_batch_holds_exactly_ratio_times_batch_replay_sequences(ratio, batch):
    assert whole_per_batch(ratio, batch)
    flags = [is_replay(i, ratio) for i in range(50 * batch)]
    assert all(sum(flags[b : b + batch]) == round(ratio * batch) for b in range(0, len(flags), batch))
    assert all(sum(flags[:n]) == replay_before(n, ratio) for n in range(len(flags)))


@pytest.mark.parametrize(("ratio", "batch"), [(0.05, 8), (0.01, 8), (0.3, 4)])
def test_a_share_that_is_not_whole_in_a_batch_runs_on_the_global_schedule(ratio, batch):
    """1% or 5% of a batch of 8: batches hold floor or ceil of r B, and the share is exact over the run."""
    assert not whole_per_batch(ratio, batch)
    new, replay = _blocks(400, 0), _blocks(7, 1000)
    mix = ReplayMix(new, replay, ratio, seed=0, batch_size=batch, mark=True)
    assert len(mix) % batch == 0 and len(mix) - replay_before(len(mix), ratio) <= 400
    assert len(mix) + batch - replay_before(len(mix) + batch, ratio) > 400, "the most whole batches the text fills"
    items = [mix[i] for i in range(len(mix))]
    flags = [int(item["input_ids"][0]) >= 1000 for item in items]
    assert [item[REPLAY_KEY] for item in items] == [int(f) for f in flags], "each example marked by its source"
    assert all(sum(flags[:n]) == replay_before(n, ratio) for n in range(len(flags) + 1))
    per_batch = {sum(flags[b : b + batch]) for b in range(0, len(flags), batch)}
    assert per_batch <= {int(ratio * batch), int(ratio * batch) + 1}
    news = sorted(int(item["input_ids"][0]) for item, f in zip(items, flags, strict=True) if not f)
    assert len(set(news)) == len(news), "no new-domain sequence twice in an epoch"


def test_mix_is_exact_per_batch_uses_each_new_sequence_once_per_epoch_and_cycles_replay():
    new, replay = _blocks(30, 0), _blocks(7, 1000)
    mix = ReplayMix(new, replay, 0.25, seed=3, batch_size=4)
    assert len(mix) == 40  # 30 new-domain sequences, 3 per batch: 10 batches of 4
    for epoch in range(3):
        mix.set_epoch(epoch)
        firsts = [int(mix[i]["input_ids"][0]) for i in range(len(mix))]
        for b in range(0, len(firsts), 4):
            assert sum(f >= 1000 for f in firsts[b : b + 4]) == 1
        news = [f for f in firsts if f < 1000]
        assert sorted(news) == list(range(30)), "each new-domain sequence once per epoch"
        replays = [f - 1000 for f in firsts if f >= 1000]
        assert sorted(replays[:7]) == list(range(7)), "every replay sequence is used before any repeats"
    mix.set_epoch(0)
    again = ReplayMix(new, replay, 0.25, seed=3, batch_size=4)
    assert [mix.source(i) for i in range(40)] == [again.source(i) for i in range(40)], "the seed fixes the order"
    other = ReplayMix(new, replay, 0.25, seed=4, batch_size=4)
    assert [mix.source(i) for i in range(40)] != [other.source(i) for i in range(40)]
    mix.set_epoch(1)
    assert [mix.source(i) for i in range(40)] != [again.source(i) for i in range(40)], "each epoch reshuffles"


def test_stream_places_replay_by_the_same_schedule_and_ends_with_the_new_domain_stream():
    new = [{"input_ids": row, "labels": row} for row in _blocks(9, 0)]
    items = list(ReplayStream(new, _blocks(2, 1000), 0.25, seed=0))
    firsts = [int(item["input_ids"][0]) for item in items]
    assert [f >= 1000 for f in firsts] == [is_replay(i, 0.25) for i in range(len(firsts))]
    assert [f for f in firsts if f < 1000] == list(range(9)), "new-domain blocks in corpus order, all of them"


def test_replay_leaves_out_every_document_an_old_domain_set_evaluates(workspace):
    old = workspace / "old.jsonl"
    tokenizer = AutoTokenizer.from_pretrained(workspace / "base")
    config = CorpusConfig(
        train=[str(workspace / "new.jsonl")],
        old_eval=[f"toy={old}"],
        replay=[f"toy={old}"],  # the same file: the evaluated documents must not come back as replay
        replay_ratio=0.25,
        seq_len=32,
        max_eval_sequences=6,
    )
    corpus = build_corpus(config, tokenizer)
    documents = list(read_documents(str(old)))
    tokens = [[*tokenizer(d, add_special_tokens=False).input_ids, tokenizer.eos_token_id] for d in documents]
    evaluated_tokens = corpus.old_eval["toy"].blocks.numel()
    in_eval = next(k for k in range(len(tokens) + 1) if sum(map(len, tokens[:k])) >= evaluated_tokens)
    skipped = corpus.stats["replay"].skipped_evaluated
    assert skipped >= in_eval > 0, "every document with tokens in the evaluation set is left out of replay"
    rest = torch.tensor([t for doc in tokens[skipped:] for t in doc])
    replayed = corpus.replay.blocks.flatten()
    assert torch.equal(replayed, rest[: len(replayed)]), "replay packs the remaining documents, in order"
    assert 0 < len(corpus.replay) <= len(corpus.train)


def test_replay_settings_are_checked(workspace):
    with pytest.raises(ValueError, match="needs old-domain text to replay"):
        CorpusConfig(train=["x.jsonl"], replay_ratio=0.25)
    with pytest.raises(ValueError, match=r"replay_ratio must be in \[0, 1\)"):
        CorpusConfig(train=["x.jsonl"], replay=["x.jsonl"], replay_ratio=1.0)
    with pytest.raises(ValueError, match="needs max_train_tokens"):
        CorpusConfig(train=["x.jsonl"], replay=["x.jsonl"], streaming=True)


def _cfg(workspace: Path, ratio: float, **train) -> CptConfig:
    cfg = tiny_config(workspace, ["scale_adapt"], steps=6, save_every=2)
    data = replace(cfg.data, replay=[f"toy={workspace / 'old.jsonl'}"], replay_ratio=ratio)
    return replace(cfg, data=data, train=replace(cfg.train, **train))


def _record_batches(monkeypatch) -> list[torch.Tensor]:
    """The input ids of every micro-batch the Trainer trains on, in order (recorded in ``training_step``: the
    collator also sees the one batch accelerate's data loader reads ahead)."""
    from scale_cl.train.trainer import CheckpointingTrainer

    seen: list[torch.Tensor] = []
    step = CheckpointingTrainer.training_step

    def recording(self, model, inputs, *args, **kwargs):
        seen.append(inputs["input_ids"].detach().cpu().clone())
        return step(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(CheckpointingTrainer, "training_step", recording)
    return seen


def _is_replay_row(rows: torch.Tensor, replay: torch.Tensor) -> list[bool]:
    return [bool((replay == row).all(-1).any()) for row in rows]


@pytest.mark.slow
def test_training_batches_hold_the_exact_share_and_a_resumed_run_sees_the_same_batches(
    workspace, tmp_path, monkeypatch
):
    from scale_cl.train.trainer import CheckpointingTrainer

    step = CheckpointingTrainer.training_step
    cfg = _cfg(workspace, 0.25)
    corpus = load_run_corpus(cfg, AutoTokenizer.from_pretrained(workspace / "base"))
    straight = _record_batches(monkeypatch)
    run_cpt(cfg, tmp_path / "straight")
    steps = [torch.cat(straight[i : i + 2]) for i in range(0, len(straight), 2)]  # 2 micro-batches per step
    assert len(steps) == 6 and all(sum(_is_replay_row(s, corpus.replay.blocks)) == 1 for s in steps)

    def crash_after_step_four(self, *args, **kwargs):
        if self.state.global_step == 4:
            raise KeyboardInterrupt("interrupted after checkpoint-4")
        return step(self, *args, **kwargs)

    monkeypatch.setattr(CheckpointingTrainer, "training_step", crash_after_step_four)
    with pytest.raises(KeyboardInterrupt):
        run_cpt(cfg, tmp_path / "resumed")
    monkeypatch.setattr(CheckpointingTrainer, "training_step", step)
    resumed = _record_batches(monkeypatch)
    run_cpt(cfg, tmp_path / "resumed")
    assert len(resumed) == 4 and all(torch.equal(a, b) for a, b in zip(resumed, straight[8:], strict=True))
    curves = [
        json.loads((tmp_path / r / "scale_adapt" / "result.json").read_text())["curve"] for r in ("straight", "resumed")
    ]
    assert curves[0][-1]["learning_ppl"] == curves[1][-1]["learning_ppl"], (
        "resumed run ends where the straight one does"
    )


def test_each_seed_draws_its_own_mix_and_no_replay_keeps_the_training_split(workspace):
    cfg = _cfg(workspace, 0.25)
    corpus = load_run_corpus(cfg, AutoTokenizer.from_pretrained(workspace / "base"))
    a, b = training_data(cfg, corpus), training_data(replace(cfg, seed=1), corpus)
    assert isinstance(a, ReplayMix) and [a.source(i) for i in range(len(a))] != [b.source(i) for i in range(len(b))]
    assert training_data(replace(cfg, data=replace(cfg.data, replay_ratio=0.0)), corpus) is corpus.train
    streamed = replace(cfg, data=replace(cfg.data, streaming=True, max_train_tokens=32 * 20))
    stream_corpus = load_run_corpus(streamed, AutoTokenizer.from_pretrained(workspace / "base"))
    assert is_stream(stream_corpus.train) and len(stream_corpus.replay) == 20
    assert isinstance(training_data(streamed, stream_corpus), ReplayStream)


def test_a_ratio_that_is_not_whole_per_batch_mixes_on_the_global_schedule(workspace):
    cfg = _cfg(workspace, 0.125)  # batch 4: half a sequence per batch, one every other batch
    corpus = load_run_corpus(cfg, AutoTokenizer.from_pretrained(workspace / "base"))
    mix = training_data(cfg, corpus)
    flags = [mix.source(i)[0] == "replay" for i in range(len(mix))]
    assert sum(flags) == replay_before(len(mix), 0.125) > 0


# The biography benchmark: Task 0's training questions replayed during Task 1.


def _bio_micro(tmp_path: Path, ratio: float, **task1):
    from scale_cl.experiments.bio.config import preset
    from scale_cl.experiments.bio.pipeline import build_data

    cfg = preset("micro")
    cfg = replace(cfg, methods=["scale_route"], task1=replace(cfg.task1, replay_ratio=ratio, **task1))
    return cfg, build_data(cfg, tmp_path / "cache")


def _questions(dataset) -> set[tuple[int, ...]]:
    return {tuple(dataset[i]["input_ids"]) for i in range(len(dataset))}


def test_bio_replays_task0_training_questions_at_the_exact_share_and_never_a_held_out_person(tmp_path):
    from scale_cl.experiments.bio.datasets import IGNORE
    from scale_cl.experiments.bio.pipeline import task1_training_data

    cfg, data = _bio_micro(tmp_path, 0.25)
    mix = task1_training_data(cfg, data, seed=0)
    assert isinstance(mix, ReplayMix)
    task0, task1 = _questions(data.task0_train), _questions(data.task1_train)
    assert not task0 & task1
    batch = cfg.task1.batch_size
    for epoch in range(2):
        mix.set_epoch(epoch)
        items = [mix[i] for i in range(len(mix))]
        kinds = [tuple(item["input_ids"]) in task0 for item in items]
        assert all(tuple(item["input_ids"]) in task0 | task1 for item in items)
        assert all(sum(kinds[b : b + batch]) == batch // 4 for b in range(0, len(items), batch))
        replayed = [item for item, old in zip(items, kinds, strict=True) if old]
        assert all(item["labels"][0] == IGNORE for item in replayed), "replayed questions keep their answer-only loss"
    held_out_prompts = {example.prompt_ids for example in data.task0_test}
    replay_prompts = {
        tuple(t for t, label in zip(item["input_ids"], item["labels"], strict=True) if label == IGNORE)
        for item in (data.task0_train[i] for i in range(len(data.task0_train)))
    }
    assert held_out_prompts and not held_out_prompts & replay_prompts, "no held-out Task-0 question is replayed"
    assert task1_training_data(replace(cfg, task1=replace(cfg.task1, replay_ratio=0.0)), data, 0) is data.task1_train


def test_bio_replay_ratio_that_is_not_whole_per_batch_runs_on_the_global_schedule(tmp_path):
    from scale_cl.experiments.bio.pipeline import task1_training_data

    cfg, data = _bio_micro(tmp_path, 0.1)  # batch 16: 1.6 questions on average
    mix = task1_training_data(cfg, data, 0, mark=True)
    marks = [mix[i][REPLAY_KEY] for i in range(len(mix))]
    assert sum(marks) == replay_before(len(mix), 0.1) > 0
    with pytest.raises(ValueError, match=r"task1\.replay_ratio must be in \[0, 1\)"):
        replace(cfg.task1, replay_ratio=1.0)


def _rows(batch: torch.Tensor, mask: torch.Tensor) -> list[tuple[int, ...]]:
    return [tuple(row[m.bool()].tolist()) for row, m in zip(batch, mask, strict=True)]


@pytest.mark.slow
def test_bio_training_batches_hold_the_exact_share_and_a_resumed_run_sees_the_same_batches(tmp_path, monkeypatch):
    import scale_cl.experiments.bio.pipeline as bio
    from scale_cl.train.trainer import CheckpointingTrainer

    cfg, data = _bio_micro(tmp_path, 0.25)
    task0 = _questions(data.task0_train)
    step, seen = CheckpointingTrainer.training_step, []

    def recording(self, model, inputs, *args, **kwargs):
        if self.args.train_sampling_strategy == "sequential":  # Task 1 (stages 1-2 shuffle)
            seen.append(_rows(inputs["input_ids"], inputs["attention_mask"]))
        return step(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(CheckpointingTrainer, "training_step", recording)
    bio.run_bio(cfg, tmp_path / "straight")
    straight, seen[:] = list(seen), []
    assert len(straight) == cfg.task1.max_steps
    assert all(sum(row in task0 for row in batch) == cfg.task1.batch_size // 4 for batch in straight)

    def crash_at_step_three(self, model, inputs, *args, **kwargs):
        if self.args.train_sampling_strategy == "sequential" and self.state.global_step == 3:
            raise KeyboardInterrupt("interrupted after checkpoint-2")
        return recording(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(bio, "CHECKPOINT_MINUTES", 0.0)  # a checkpoint at every evaluation
    monkeypatch.setattr(CheckpointingTrainer, "training_step", crash_at_step_three)
    with pytest.raises(KeyboardInterrupt):
        bio.run_bio(cfg, tmp_path / "resumed")
    assert (tmp_path / "resumed" / "seed-0" / "scale_route.checkpoints" / "checkpoint-2").is_dir()
    monkeypatch.setattr(CheckpointingTrainer, "training_step", recording)
    seen[:] = []
    bio.run_bio(cfg, tmp_path / "resumed")
    assert seen == straight[2:], "the resumed run trains on the batches the straight run trained on after step 2"
    ends = [
        json.loads((tmp_path / r / "seed-0" / "scale_route.json").read_text())["curve"][-1]
        for r in ("straight", "resumed")
    ]
    assert ends[0]["task0"] == ends[1]["task0"] and ends[0]["task1"] == ends[1]["task1"]
    report = (tmp_path / "straight" / "results.md").read_text()
    assert "25% of every Task-1 batch is their training questions" in report
