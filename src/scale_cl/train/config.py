"""The settings of one training stage (AdamW on the HF Trainer): what every experiment's stages are made of."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scale_cl.bounds import check_fields
from scale_cl.train.reporting import REPORT_NONE, check_report_to

SCHEDULES = ("constant", "linear", "cosine", "cosine_with_min_lr", "wsd")
# auto: the Trainer's own default, torch's fused AdamW (CUDA and CPU); 8-bit AdamW is bitsandbytes'
OPTIMIZERS = ("auto", "adamw_torch_fused", "adamw_torch", "adamw_8bit")
DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "bf16", "fp32")


@dataclass
class StageConfig:
    """Optimisation of one training stage (AdamW)."""

    lr: float = field(default=1e-3, metadata={"gt": 0, "help": "peak learning rate"})
    epochs: float = field(
        default=1.0, metadata={"gt": 0, "help": "passes over the stage's data (ignored if max_steps > 0)"}
    )
    max_steps: int = field(default=0, metadata={"ge": 0, "help": "optimizer steps; 0 = use epochs"})
    batch_size: int = field(default=32, metadata={"ge": 1, "help": "sequences per optimizer step"})
    warmup_steps: int = field(default=0, metadata={"ge": 0, "help": "linear warm-up steps"})
    weight_decay: float = field(default=0.0, metadata={"ge": 0, "help": "AdamW weight decay"})
    schedule: str = field(
        default="constant",
        metadata={
            "help": f"learning-rate schedule after the warm-up, one of {SCHEDULES}; wsd = warmup-stable-decay: the "
            "peak rate until the last decay_ratio of the steps, then a cosine decay to min_lr_ratio"
        },
    )
    min_lr_ratio: float = field(
        default=0.1, metadata={"ge": 0, "le": 1, "help": "final lr / peak lr for cosine_with_min_lr and wsd"}
    )
    decay_ratio: float = field(
        default=0.1, metadata={"gt": 0, "le": 1, "help": "wsd: the share of the steps that decay the rate"}
    )
    optim: str = field(
        default="auto",
        metadata={
            "help": "optimizer: auto (torch's fused AdamW, the Trainer's default), adamw_torch_fused, adamw_torch, "
            "adamw_8bit (bitsandbytes' 8-bit AdamW: a quarter of the optimizer state; pip install bitsandbytes)",
            "choices": OPTIMIZERS,
        },
    )
    max_grad_norm: float = field(
        default=1.0, metadata={"ge": 0, "help": "clip the gradient to this global norm; 0 = no clipping"}
    )
    run_name: str = field(
        default="",
        metadata={"help": "the run's name in the reporting integrations (wandb, mlflow, ...); empty = their own"},
    )
    args: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "any other transformers TrainingArguments setting, KEY=VALUE (e.g. torch_compile=true "
            "dataloader_pin_memory=false), checked against its type; settings scale-cl sets itself are refused, "
            "naming the option that sets them",
            "value_type": str,
        },
    )
    device: str = field(
        default="auto",
        metadata={
            "help": "where the stage trains and is evaluated: auto = cuda when torch sees a GPU, else cpu; cuda = one "
            "GPU per process (the first CUDA_VISIBLE_DEVICES leaves; several: torchrun / accelerate launch). Not part "
            "of the settings that identify a run",
            "choices": DEVICES,
        },
    )
    precision: str = field(
        default="auto",
        metadata={
            "help": "auto = bf16 on a GPU that has it, else fp32; bf16 = bf16 autocast over fp32 weights (also on "
            "a CPU); fp32",
            "choices": PRECISIONS,
        },
    )
    report_to: list[str] = field(
        default_factory=lambda: [REPORT_NONE],
        metadata={
            "help": "send the training loss and the run's own metrics (eval/...) to these transformers "
            "integrations: tensorboard (events in the run's folder), wandb (as its WANDB_* variables say), "
            "mlflow, ...; 'all' = every installed one, 'none' = only the run's own files. Not part of the "
            "settings that identify a run"
        },
    )

    def __post_init__(self) -> None:
        # 120 and 120.0 are one setting: stored as floats, so they hash (cache keys) and print alike
        for name in ("lr", "epochs", "weight_decay", "min_lr_ratio"):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(self, name, float(value))
        section = getattr(self, "section", "")  # a subclass's (train., task1.); bio's other stages share this class
        if self.schedule not in SCHEDULES:
            raise ValueError(f"{section}schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.optim not in OPTIMIZERS:
            raise ValueError(f"{section}optim must be one of {OPTIMIZERS}, got {self.optim!r}")
        for name in ("decay_ratio", "max_grad_norm"):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(self, name, float(value))  # a subclass's (train., task1.); bio's other stages share this class
        for name, valid in (("device", DEVICES), ("precision", PRECISIONS)):
            if getattr(self, name) not in valid:
                raise ValueError(f"{section}{name} must be one of {valid}, got {getattr(self, name)!r}")
        check_fields(self)
        if isinstance(self.report_to, str):  # a YAML file's ``report_to: tensorboard``
            self.report_to = [self.report_to]
        check_report_to(self.report_to)
        from scale_cl.train.extra_arguments import check_extra_arguments

        self.args = check_extra_arguments(self.args, section)
