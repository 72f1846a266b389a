"""The biography continual-learning pipeline (paper Section 5, Fig. 8; the stages and their caching: docs/design.md §7).

Stage 1 pre-trains a GPT-NeoX model on biographies, stage 2 fine-tunes Task 0's QA, stage 3 applies each method and
fine-tunes Task 1's QA. What it writes (each file atomically; a re-run skips what is done)::

    <cache>/<stage>-<key>/                 stages 1-2, keyed by a hash of their settings (default cache: <out>/cache)
    <cache>/<stage>-<key>.logs             their TensorBoard events (with report_to naming TensorBoard)
    <out>/seed-<s>/<method>.json           each method's stage-3 result
    <out>/seed-<s>/<method>.checkpoints/   a long Task-1 run's resumable checkpoints, deleted when it finishes
    <out>/seed-<s>/<method>.logs           stage 3's TensorBoard events
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import GPTNeoXForCausalLM, PreTrainedTokenizerFast, Trainer

from scale_cl.data import (
    answer_first_token,
    bio_spec,
    biography_corpus,
    completion_probes,
    generate_people,
    qa_items,
    splits,
    train_bpe_tokenizer,
)
from scale_cl.data.pseudo_replay import cached_blocks, generate_blocks
from scale_cl.data.replay import ReplayMix, describe_share
from scale_cl.eval.first_token import QAExample, first_token_accuracy
from scale_cl.eval.mixture import MIXTURE_ROUTERS
from scale_cl.eval.route_separation import auroc, collect_base_weights, mixes_experts, routes_by_eq5
from scale_cl.experiments.bio.config import BioConfig, backbone_config
from scale_cl.experiments.bio.datasets import PackedText, PadCollator, QATraining
from scale_cl.experiments.bio.report import result_path
from scale_cl.experiments.method_run import GATE_RECIPE, MethodRun, ReadPlan, Training
from scale_cl.experiments.run_folder import check_output_folder, claim_output_folder
from scale_cl.files import write_json
from scale_cl.methods import method_spec
from scale_cl.train.arguments import training_arguments
from scale_cl.train.callbacks import PeriodicEval, SaveAtEvaluations
from scale_cl.train.config import StageConfig
from scale_cl.train.device import Placement, stage_placement, used_placement
from scale_cl.train.distill import Distillation, HeadTeacher
from scale_cl.train.recipe import train_model
from scale_cl.train.reporting import report_to_argument, result_settings
from scale_cl.train.route_calibration import RouteCalibration
from scale_cl.train.router_fit import spread_sample
from scale_cl.train.sharding import refuse_sharding

CONFIG_FILE = "config.json"
VERSION = 1  # bump when a stage's computation changes, so old caches are not reused
# A Task-1 run checkpoints at the first evaluation after this much wall time since its start or
# last checkpoint: short runs (micro, small: seconds to minutes per method) write none.
CHECKPOINT_MINUTES = 10.0
CHECKPOINTS_KEPT = 2


def _key(*parts: Any) -> str:
    text = json.dumps([VERSION, *parts], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _save_folder(directory: Path, save: Callable[[Path], Any]) -> None:
    """``save(folder)`` into ``<directory>.tmp``, then rename it to ``directory``: never a half-written cache folder
    (a save that fails or is interrupted removes its temporary folder; one a killed process left is removed here)."""
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save(tmp)
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _text_settings(cfg: BioConfig) -> dict[str, Any]:
    """The data settings the biographies and the tokenizer depend on (not which QA is asked or trained)."""
    return {k: v for k, v in asdict(cfg.data).items() if k not in ("attributes", "qa_people")}


@dataclass
class BioData:
    """Everything stages 1-3 read, tokenised once."""

    tokenizer: PreTrainedTokenizerFast
    pretrain: PackedText
    task0_train: QATraining
    task1_train: QATraining
    task0_test: list[QAExample]
    task0_trained: list[QAExample]
    task1_test: list[QAExample]
    task0_completion: list[QAExample]
    # a sequence of tasks (``sequence.tasks`` > 1): the cohorts after Task 1, each one's QA to train and to test
    later_train: list[QATraining] = field(default_factory=list)
    later_test: list[list[QAExample]] = field(default_factory=list)

    def task_train(self, task: int) -> QATraining:
        """The training questions of new-people task ``task`` (1 is Task 1)."""
        return self.task1_train if task == 1 else self.later_train[task - 2]

    def test_splits(self) -> dict[str, list[QAExample]]:
        """Every split `evaluate_tasks` reads: Task 0's two views and each new cohort (``task1``, ``task2``, ...)."""
        later = {f"task{j}": examples for j, examples in enumerate(self.later_test, start=2)}
        return {"task0": self.task0_test, "task0_trained": self.task0_trained, "task1": self.task1_test, **later}


def build_data(cfg: BioConfig, cache: Path) -> BioData:
    """Generate the people, train (or reuse, from ``cache``) the tokenizer, and tokenise every split."""
    spec = bio_spec(cfg.data.pools, people=cfg.data.people)
    people = generate_people(spec, cfg.data.seed)
    ranges = splits(len(people), cfg.sequence.tasks)
    if cfg.data.qa_people:
        ranges["task0_train"] = ranges["task0_train"][: cfg.data.qa_people]
    pretrain_people = (people[i] for i in ranges["pretrain"])
    texts = list(biography_corpus(pretrain_people, seed=cfg.data.seed, distinct=cfg.data.distinct_templates))
    tok_dir = cache / f"tokenizer-{_key(_text_settings(cfg))}"
    if tok_dir.is_dir():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    else:
        qa_text = [item.prompt + item.answer for person in people for item in qa_items(person)]
        tokenizer = train_bpe_tokenizer(texts + qa_text, cfg.data.vocab_size)
        _save_folder(tok_dir, tokenizer.save_pretrained)
    eos = tokenizer.eos_token_id

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def questions(people_range: range, items_of: Callable[[Any], list] = qa_items) -> list:
        return [q for i in people_range for q in items_of(people[i]) if q.attribute in cfg.data.attributes]

    def qa_pairs(people_range: range) -> list[tuple[list[int], list[int]]]:
        return [(encode(q.prompt), encode(q.answer)) for q in questions(people_range)]

    def examples(people_range: range, items_of: Callable[[Any], list] = qa_items) -> list[QAExample]:
        if cfg.eval_people:
            people_range = people_range[: cfg.eval_people]
        return [
            QAExample(tuple(encode(q.prompt)), answer_first_token(tokenizer, q.answer), q.attribute)
            for q in questions(people_range, items_of)
        ]

    def completion(person: Any) -> list:
        return completion_probes(person, seed=cfg.data.seed, distinct=cfg.data.distinct_templates)

    return BioData(
        tokenizer=tokenizer,
        pretrain=PackedText(
            [encode(t) for t in texts],
            eos,
            cfg.model.max_seq_len,
            shuffle_seed=cfg.data.seed if cfg.data.packing == "shuffled" else None,
        ),
        task0_train=QATraining(qa_pairs(ranges["task0_train"]), eos),
        task1_train=QATraining(qa_pairs(ranges["task1"]), eos, cfg.task1.qa_loss),
        task0_test=examples(ranges["task0_test"]),
        task0_trained=examples(ranges["task0_train"]),
        task1_test=examples(ranges["task1"]),
        task0_completion=examples(ranges["task0_test"], completion),
        later_train=[
            QATraining(qa_pairs(ranges[f"task{j}"]), eos, cfg.task1.qa_loss) for j in range(2, cfg.sequence.tasks + 1)
        ],
        later_test=[examples(ranges[f"task{j}"]) for j in range(2, cfg.sequence.tasks + 1)],
    )


def new_backbone(cfg: BioConfig, tokenizer: PreTrainedTokenizerFast, seed: int) -> GPTNeoXForCausalLM:
    config = backbone_config(
        cfg,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return GPTNeoXForCausalLM(config)


def _readable_stage(directory: Path) -> Path:
    """``directory``, once its cached weights are found whole (safetensors checks the header against the file's
    length); a damaged file (a copy cut short, a full disk) is named with what to delete."""
    path = directory / "model.safetensors"
    try:
        with safe_open(path, "pt") as weights:
            weights.keys()
    except Exception as err:  # safetensors raises its own SafetensorError (no public class) or an OSError
        raise ValueError(
            f"the cached stage model {path} is damaged ({err}); delete {directory} and run again (it is rebuilt)"
        ) from err
    return directory


def _cached_stage(directory: Path, build: Callable[[], GPTNeoXForCausalLM]) -> GPTNeoXForCausalLM:
    """Load the model cached in ``directory``, or ``build()`` it and cache it atomically."""
    if (directory / "model.safetensors").is_file():
        return GPTNeoXForCausalLM.from_pretrained(_readable_stage(directory))
    model = build()
    _save_folder(directory, model.save_pretrained)
    return model


def evaluate_tasks(model: torch.nn.Module, data: BioData) -> dict[str, dict[str, float]]:
    """Accuracy on Task 0 (held-out people, the paper's view), Task 0's QA-trained people and Task 1 (and in a
    sequence every later task, ``task2``, ...).

    A model read by a mixing router (a SCALE model with the likelihood, nested, confidence or hybrid router, or the
    two-model control) also records, under ``"likelihood_router"``, the base's mean weight where each split's
    answers are predicted and the AUROC of Task-0 questions against Task-1 questions by that weight
    (`scale_cl.eval.route_separation`): whether the router tells them apart. SCALE-Route read by Eq. 5
    records the same under ``"eq5_routing"``, its decision as the weight: the share of each split's answers it sends
    to the preserve path.
    """
    pad = data.tokenizer.pad_token_id
    questions = data.test_splits()
    eq5 = routes_by_eq5(model)
    if not (eq5 or mixes_experts(model)):
        return {name: first_token_accuracy(model, examples, pad) for name, examples in questions.items()}
    result, weights = {}, {}
    for name, examples in questions.items():
        with collect_base_weights(model) as collected:
            result[name] = first_token_accuracy(model, examples, pad)
        weights[name] = torch.cat(collected)
    result["eq5_routing" if eq5 else "likelihood_router"] = {
        **{f"{name}_base_weight": float(w.mean()) for name, w in weights.items()},
        "auroc": auroc(weights["task0"], weights["task1"]),
        "auroc_trained": auroc(weights["task0_trained"], weights["task1"]),
    }
    return result


def stage_keys(cfg: BioConfig, seed: int) -> tuple[str, str]:
    """The cache keys of stages 1 and 2: every setting each depends on (``report_to`` changes no result)."""
    key1 = _key(_text_settings(cfg), asdict(cfg.model), result_settings(asdict(cfg.pretrain)), seed)
    key2 = _key(key1, result_settings(asdict(cfg.task0)), cfg.data.attributes, cfg.data.qa_people or None, seed)
    return key1, key2


def stage_models(cfg: BioConfig, data: BioData, seed: int, cache: Path) -> tuple[Path, Path]:
    """Stages 1 and 2 (cached in ``cache``): the pre-trained model and the Task-0 model's directories."""
    collator = PadCollator(data.tokenizer.pad_token_id)
    key1, key2 = stage_keys(cfg, seed)
    dir1, dir2 = cache / f"stage1-{key1}", cache / f"stage2-{key2}"
    if (dir2 / "model.safetensors").is_file():
        return dir1, _readable_stage(dir2)

    def train(model: GPTNeoXForCausalLM, dataset: Any, stage: StageConfig, directory: Path) -> None:
        logs = directory.with_name(directory.name + ".logs")  # a stage always trains from its start
        args = training_arguments(stage, cache / "trainer", seed, logging_dir=logs)
        train_model(model, dataset, args, collator=collator, logging_dir=logs)

    def pretrain() -> GPTNeoXForCausalLM:
        print(f"[bio] stage 1 (seed {seed}): pre-training on {len(data.pretrain)} blocks of biographies")
        model = new_backbone(cfg, data.tokenizer, seed)
        train(model, data.pretrain, cfg.pretrain, dir1)
        return model

    base = _cached_stage(dir1, pretrain)

    def task0() -> GPTNeoXForCausalLM:
        print(f"[bio] stage 2 (seed {seed}): Task 0 QA on {len(data.task0_train)} questions")
        train(base, data.task0_train, cfg.task0, dir2)
        return base

    _cached_stage(dir2, task0)
    return dir1, dir2


def task1_placement(cfg: BioConfig) -> Placement:
    """Where Task 1 trains, and what is measured outside the stages' training runs on (docs/design.md §7)."""
    return stage_placement(cfg.task1)


def load_stage_model(directory: Path, device: str = "cpu") -> GPTNeoXForCausalLM:
    """A cached stage model, on ``device`` (`task1_placement`'s, where it is measured)."""
    return GPTNeoXForCausalLM.from_pretrained(directory).to(device)


def stage_accuracies(
    data: BioData, seed: int, stage_dirs: tuple[Path, Path], out: Path, device: str = "cpu"
) -> dict[str, Any]:
    """What stage 1 stored and stage 2 extracted, for the report (cached in ``<out>/seed-<s>/stages.json``).

    For the pre-trained and the Task-0 model, measured on ``device``: biography completion of the held-out
    Task-0 people (the facts as read in pre-training, the ceiling of extraction), and QA accuracy on them and
    on the QA-trained people.
    """
    path = out / f"seed-{seed}" / "stages.json"
    if path.is_file():
        return json.loads(path.read_text())
    pad = data.tokenizer.pad_token_id
    result = {}
    for stage, directory in zip(("pretrained", "task0_model"), stage_dirs, strict=True):
        model = load_stage_model(directory, device)
        result[stage] = {
            "completion": first_token_accuracy(model, data.task0_completion, pad),
            **evaluate_tasks(model, data),
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, result)
    return result


def task1_training_data(
    cfg: BioConfig, data: BioData, seed: int, mark: bool = False, pseudo_replay: list[dict] | None = None
) -> Any:
    """Task 1's training questions, or with ``task1.replay_ratio`` those with Task 0's training questions replayed
    at that share, in an order drawn from ``seed`` (`scale_cl.data.replay`); with ``task1.pseudo_replay_ratio``
    the Task-0 model's own text (``pseudo_replay``, `pseudo_replay_examples`) takes replay's place. ``mark``: each
    example says whether it is (pseudo-)replayed (for the distillation term)."""
    ratio = cfg.task1.replay_ratio or cfg.task1.pseudo_replay_ratio
    if not ratio:
        return data.task1_train
    if cfg.task1.pseudo_replay_ratio and pseudo_replay is None:
        raise ValueError("task1.pseudo_replay_ratio needs the sampled text (pseudo_replay_examples)")
    replay = pseudo_replay if cfg.task1.pseudo_replay_ratio else data.task0_train
    return ReplayMix(data.task1_train, replay, ratio, seed, cfg.task1.batch_size, mark=mark)


def pseudo_replay_examples(cfg: BioConfig, data: BioData, task0_dir: Path, seed: int) -> list[dict] | None:
    """Text the Task-0 model samples from a document start for ``task1.pseudo_replay_ratio`` (loss on every token),
    drawn once per Task-0 model and seed and cached beside it (`scale_cl.data.pseudo_replay`); None without."""
    t = cfg.task1
    if not t.pseudo_replay_ratio:
        return None
    placement = task1_placement(cfg)
    settings = {
        "task0_model": task0_dir.name,
        "seed": seed,
        "sequences": t.pseudo_replay_sequences,
        "tokens": t.pseudo_replay_tokens,
        "temperature": t.pseudo_replay_temperature,
        **({"bf16": True} if placement.bf16 else {}),  # sampled in bf16: another draw (fp32 keeps its old key)
    }

    def sample() -> torch.Tensor:
        print(f"[bio] pseudo-replay: the Task-0 model samples {t.pseudo_replay_sequences} sequences (seed {seed})")
        model = load_stage_model(task0_dir, placement.device)
        start, count, length = data.tokenizer.eos_token_id, t.pseudo_replay_sequences, t.pseudo_replay_tokens
        return generate_blocks(model, start, count, length, seed, t.pseudo_replay_temperature, bf16=placement.bf16)

    blocks = cached_blocks(task0_dir.parent, settings, sample)
    return [{"input_ids": row, "labels": row} for row in blocks.tolist()]


def gate_questions(train: Any, pad_id: int) -> list[dict[str, torch.Tensor]]:
    """The calibrated router's new side on the biography benchmark: a task's training questions, spread over them
    (no replay), padded as they train."""
    examples, size = spread_sample(train, GATE_RECIPE.sequences), GATE_RECIPE.batch_size
    collator = PadCollator(pad_id)
    return [collator(examples[i : i + size]) for i in range(0, len(examples), size)]


@dataclass
class Task1Run(MethodRun):
    """Stage 3 for one method (`run_method`): the Task-0 model prepared for it, trained on Task 1's questions."""

    cfg: BioConfig
    data: BioData
    task0_dir: Path
    method: str
    seed: int
    out: Path
    initial: dict[str, Any] | None = None
    checkpoint_minutes: float | None = None

    def __post_init__(self) -> None:
        t = self.cfg.task1
        self.options, self.lr = self.cfg.options, t.lr_of(self.method)
        self.result_path = result_path(self.out, self.seed, self.method)
        self.run_dir = self.result_path.with_suffix(".checkpoints")
        self.logging_dir = self.result_path.with_suffix(".logs")
        exact = method_spec(self.method).base_logits_exact  # read too with the routers it was not trained with
        self.read_plan = ReadPlan(
            frontier=t.reading_alphas if exact else None,
            routers=MIXTURE_ROUTERS,
            wise_ft=t.wise_ft_alphas,
            control=t.likelihood_control,
            gate_objectives=t.gate_objectives,
            frontier_key="readings",
            wise_ft_key="readings",
        )

    def start_model(self) -> torch.nn.Module:
        return GPTNeoXForCausalLM.from_pretrained(self.task0_dir)

    @property
    def bf16(self) -> bool:
        return task1_placement(self.cfg).bf16

    def training(self, model: torch.nn.Module, mark: bool) -> Training:
        t = self.cfg.task1
        pseudo_replay = pseudo_replay_examples(self.cfg, self.data, self.task0_dir, self.seed)
        train = task1_training_data(self.cfg, self.data, self.seed, mark=mark, pseudo_replay=pseudo_replay)
        tracker = PeriodicEval(
            lambda m: evaluate_tasks(m, self.data),
            every=t.eval_every,
            path=self.result_path.with_suffix(".jsonl"),
            initial=self.initial,
            early_every=t.early_eval_every,
            early_until=t.early_eval_until,
        )
        minutes = CHECKPOINT_MINUTES if self.checkpoint_minutes is None else self.checkpoint_minutes
        # A checkpoint of another Task-0 model, method or rate is refused (the run folder's config.json guards the rest)
        run_info = {"method": self.method, "lr": self.lr, "seed": self.seed, "task0_model": self.task0_dir.name}
        if t.replay_ratio:
            run_info["replay_ratio"] = t.replay_ratio
        if t.pseudo_replay_ratio:
            names = ("ratio", "sequences", "tokens", "temperature")
            run_info["pseudo_replay"] = {name: getattr(t, f"pseudo_replay_{name}") for name in names}
        collator = PadCollator(self.data.tokenizer.pad_token_id)

        def task0_questions(count: int) -> list[dict[str, torch.Tensor]]:  # the calibration sample
            sample = [self.data.task0_train[i] for i in range(min(count, len(self.data.task0_train)))]
            return [collator(sample[i : i + t.batch_size]) for i in range(0, len(sample), t.batch_size)]

        stage = replace(t, lr=self.lr)
        args = training_arguments(
            stage, self.run_dir, self.seed, save_total_limit=CHECKPOINTS_KEPT, logging_dir=self.logging_dir
        )
        options = {"collator": collator, "run_info": run_info}
        return Training(train, args, tracker, task0_questions, options, [SaveAtEvaluations(t.eval_every, minutes)])

    def gate_text(self) -> tuple[list[dict[str, torch.Tensor]], int]:
        """Task 1's training questions (`gate_questions`) and the EOS."""
        return gate_questions(self.data.task1_train, self.data.tokenizer.pad_token_id), self.data.tokenizer.eos_token_id

    def announce(self, trainable: int, distillation: Distillation | None, calibration: RouteCalibration | None) -> None:
        t, replay = self.cfg.task1, ""
        if t.replay_ratio:
            replay = f", {describe_share(t.replay_ratio, t.batch_size)} replayed from Task 0"
        if t.pseudo_replay_ratio:
            share = describe_share(t.pseudo_replay_ratio, t.batch_size)
            replay = f", {share} the Task-0 model's own text (pseudo-replay)"
        if distillation is not None:
            distill, own = distillation.config, isinstance(distillation.teacher, HeadTeacher)
            source = "its own head" if own else "a frozen copy of the Task-0 model"
            replay += f", distillation x{distill.weight:g} ({distill.new_tokens}; teacher logits from {source})"
        if calibration is not None:
            replay += f", tau routes {self.options.route_share:.0%} of Task-0 training questions to preserve"
        print(f"[bio] stage 3 (seed {self.seed}): {self.method}, lr {self.lr:g}, {trainable:,} trainable{replay}")

    def result(self, trainer: Trainer, tracker: PeriodicEval, trainable: int, seconds: float) -> dict[str, Any]:
        return {
            "method": self.method,
            "seed": self.seed,
            "lr": self.lr,
            "trainable": trainable,
            "seconds": seconds,
            "curve": tracker.records,
            **used_placement(trainer.args),  # device, precision (and the GPU) Task 1 trained on
        }


def run_method(
    cfg: BioConfig,
    data: BioData,
    task0_dir: Path,
    method: str,
    seed: int,
    out: Path,
    initial: dict[str, Any] | None = None,
    checkpoint_minutes: float | None = None,
) -> dict:
    """Stage 3 for one method: returns (and caches) its curve, parameter count and wall time.

    ``initial``: the Task-0 model's `evaluate_tasks`, used as the step-0 record (a sweep measures it once).
    ``checkpoint_minutes``: wall time between checkpoints (default `CHECKPOINT_MINUTES`; 0 = at every
    evaluation). Resumes from the method's last complete checkpoint, if a killed run left one (see
    module doc); ``seconds`` then counts this process's part of the training only. A SCALE model whose base logits
    are exact (Route, Preserve) is also read afterwards at each of ``task1.reading_alphas`` and with each mixing
    router, FFT and Freeze along ``task1.wise_ft_alphas`` (``readings``), a method that does not route mixed with the
    Task-0 model (``task1.likelihood_control``).
    """
    return Task1Run(cfg, data, task0_dir, method, seed, out, initial, checkpoint_minutes).run()


def validate(cfg: BioConfig) -> None:
    """Raise a ValueError for settings that cannot work, before anything is written: the settings' own checks (for
    settings built in Python; the command line ran them first), then the devices and logging backends."""
    cfg.check()
    for section, stage in (("pretrain.", cfg.pretrain), ("task0.", cfg.task0), ("task1.", cfg.task1)):
        report_to_argument(stage.report_to)  # its backends are installed
        stage_placement(stage, section)  # a device that is not there, bf16 on a GPU without it


def run_bio(
    cfg: BioConfig, out: Path, cache: Path | None = None, run_one: Callable[..., dict] | None = None
) -> dict[str, Any]:
    """Run (or resume) the whole benchmark into ``out``; returns the collected results.

    ``cache``: folder of the tokenizer and stage-1/2 models (default ``<out>/cache``). ``run_one``: what trains
    one method after the Task-0 model (`run_method`'s arguments; default `run_method`, Task 1); a sequence of tasks
    passes its own (`scale_cl.experiments.bio.sequence.run_bio_sequence`).
    """
    refuse_sharding("scale-cl bio", "its models fit one device")
    check_output_folder(Path(out), CONFIG_FILE, cfg.to_dict())  # before any data or model is built
    if run_one is None:
        if cfg.sequence.tasks > 1:
            raise ValueError(
                "sequence.tasks > 1 runs through scale_cl.experiments.bio.sequence.run_bio_sequence (as `scale-cl bio` "
                "does)"
            )
        run_one = run_method
    from scale_cl.experiments.bio.report import collect, write_report

    out = Path(out)
    cache = out / "cache" if cache is None else Path(cache)
    validate(cfg)
    claim_output_folder(out, CONFIG_FILE, cfg.to_dict())
    data = build_data(cfg, cache)
    for seed in cfg.seeds:
        if all(result_path(out, seed, method).is_file() for method in cfg.methods):
            continue  # finished: its stage models are not needed
        stage_dirs = stage_models(cfg, data, seed, cache)
        stage_accuracies(data, seed, stage_dirs, out, task1_placement(cfg).device)
        task0_dir = stage_dirs[1]
        for method in cfg.methods:
            run_one(cfg, data, task0_dir, method, seed, out)
    results = collect(cfg, out)
    write_report(results, out)
    return results


__all__ = [
    "BioData",
    "build_data",
    "evaluate_tasks",
    "result_path",
    "run_bio",
    "run_method",
    "stage_accuracies",
    "stage_keys",
    "stage_models",
    "task1_placement",
    "task1_training_data",
]
