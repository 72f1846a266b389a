"""``scale-cl eval``'s settings (`EvalSettings`) and the task presets of the paper's Table 2 (`TASK_PRESETS`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from scale_cl.bounds import check_fields

TASK_PRESETS: dict[str, tuple[str, ...]] = {
    "english": ("arc_challenge", "hellaswag", "mmlu", "truthfulqa_mc2", "winogrande"),
    "korean": ("kobest_boolq", "kobest_copa", "kobest_hellaswag"),
}

DTYPES = ("float32", "bfloat16", "float16")
LIST_TASKS_HINT = "list the available names with `lm-eval ls tasks` (add `--include_path DIR` for local tasks)"


@dataclass
class EvalSettings:
    """What ``scale-cl eval`` evaluates, and how (`run_eval`); every field is an option of the same name."""

    section: ClassVar[str] = ""  # where its settings are given (messages name them so)

    model_dir: str | None = field(
        default=None,
        metadata={
            "help": "a folder written by scale_cl.models.save_trained (the 'model' folder of a finished run; "
            "it holds scale_cl_run.json)",
            "positional": True,
            "type": str,
            "metavar": "MODEL_DIR",
        },
    )
    base: str | None = field(
        default=None,
        metadata={
            "help": "evaluate an untrained base model instead, for comparison: a hub id (from the local cache when "
            "offline), a local folder with config.json, a .gguf file, smollm2, or clean-en (the base `scale-cl base` "
            "builds)",
            "type": str,
            "metavar": "MODEL",
        },
    )
    tasks: list[str] = field(
        default_factory=list,
        metadata={
            "help": f"lm-eval task, group or tag names, task YAML files, or presets ({', '.join(TASK_PRESETS)}); "
            "mixed freely, space- or comma-separated. Unknown names are refused with close matches; "
            f"{LIST_TASKS_HINT}",
            "metavar": "TASK",
            "show_default": False,
        },
    )
    include_path: list[str] = field(
        default_factory=list,
        metadata={
            "help": "folder of extra lm-eval task YAMLs (repeatable). A relative data_files in a YAML is resolved "
            "against the current directory, not the YAML's folder",
            "action": "append",
            "metavar": "DIR",
            "show_default": False,
        },
    )
    num_fewshot: int | None = field(
        default=None,
        metadata={
            "ge": 0,
            "help": "few-shot examples per prompt (default: each task's own default, 0 for the presets as in the "
            "paper)",
            "type": int,
            "metavar": "N",
        },
    )
    limit: float | None = field(
        default=None,
        metadata={
            "gt": 0,
            "help": "evaluate at most N documents per task (a fraction of each task if < 1): quick checks only, "
            "the numbers are not comparable with full runs",
            "type": float,
            "metavar": "N",
        },
    )
    batch_size: str = field(default="8", metadata={"help": "lm-eval batch size, or 'auto'", "metavar": "N"})
    device: str | None = field(
        default="auto",
        metadata={
            "help": "auto (cuda when torch sees a GPU, else cpu: the training commands' device setting), cpu, cuda "
            "or cuda:N; the model is moved there",
            "type": str,
            "metavar": "DEVICE",
        },
    )
    dtype: str = field(
        default="float32",
        metadata={"help": "weights dtype for evaluation (bfloat16 is faster on a GPU)", "choices": DTYPES},
    )
    max_length: int | None = field(
        default=None,
        metadata={
            "ge": 1,
            "help": "longest input in tokens (default: from the model config)",
            "type": int,
            "metavar": "N",
        },
    )
    merge_lora: bool = field(
        default=False,
        metadata={"help": "merge a LoRA adapter into the base weights before evaluating (faster; false: unmerged)"},
    )
    bootstrap_iters: int = field(
        default=100_000,
        metadata={
            "ge": 0,
            "help": "bootstrap iterations for the stderr of non-mean metrics, 0 for none (lm-eval's default)",
            "metavar": "N",
        },
    )
    seed: int = field(default=0, metadata={"ge": 0, "le": 4294967295, "help": "random seed"})
    out: str | None = field(
        default=None,
        metadata={
            "help": "write the results here (default: MODEL_DIR/eval.json; with --base, print only)",
            "type": str,
            "metavar": "FILE.json",
        },
    )

    def __post_init__(self) -> None:
        check_fields(self)
