"""BenchConfig: what `scale-cl bench` measures and how (one dataclass, shared with the child processes)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

import torch

from scale_cl.bench.readings import READINGS
from scale_cl.bench.shapes import SHAPES, Shape
from scale_cl.bounds import check_fields
from scale_cl.methods import METHOD_NAMES, QUANTIZABLE_METHODS, check_quantizable
from scale_cl.train.chunked_loss import LOSSES
from scale_cl.tuner.config import INITS

MATCH_TARGETS = ("preserve", "adapt", "route")
COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune")
# The batch when --batch / --seq are 0: a CPU's is the one the CPU targets were measured at; a GPU's gives about
# 16k tokens a step, which keeps an H100 busy at Llama-3.2-1B's shape (at 1k tokens it waits on launches).
AUTO_BATCH = {"cpu": (4, 256), "cuda": (16, 1024)}
# the row every ratio is against: full fine-tuning of the same base
REFERENCE = "fft"
# a row of a method on a quantized base: METHOD+KIND (lora+nf4 is QLoRA)
QUANTIZED_ROWS = tuple(f"{method}+{kind}" for method in QUANTIZABLE_METHODS for kind in ("int8", "nf4"))


def split_method(name: str) -> tuple[str, str]:
    """A bench row's method and its base's quantization: ``"lora+nf4"`` -> ("lora", "nf4"); ``"fft"`` -> ("fft",
    "none")."""
    method, _, kind = name.partition("+")
    return method, kind or "none"


@dataclass
class BenchConfig:
    """Settings of one benchmark run; every field is a ``scale-cl bench`` option of the same name."""

    section: ClassVar[str] = ""  # where its settings are given (messages name them so)

    shapes: tuple[str, ...] = field(
        default=("tiny", "smollm2", "llama-1b"), metadata={"help": "model shapes to measure", "choices": list(SHAPES)}
    )
    methods: tuple[str, ...] = field(
        default=METHOD_NAMES,
        metadata={
            "help": "methods (keep fft: ratios); METHOD+int8 or METHOD+nf4 measures LoRA or a SCALE method on the "
            "base quantized by bitsandbytes (--options.base_quant; lora+nf4 is QLoRA)",
            "choices": [*METHOD_NAMES, *QUANTIZED_ROWS],
            "metavar": "METHOD",
        },
    )
    batch: int = field(
        default=0,
        metadata={
            "ge": 0,
            "help": "training / forward batch size in sequences; 0: 4 on a CPU, 16 on a GPU (with --seq 0: 16 x 1024 "
            "tokens a step)",
        },
    )
    seq: int = field(default=0, metadata={"ge": 0, "help": "tokens per sequence; 0: 256 on a CPU, 1024 on a GPU"})
    warmup: int = field(
        default=2,
        metadata={
            "ge": 0,
            "help": "untimed optimizer steps per method before timing (the first ones touch fresh memory)",
        },
    )
    steps: int = field(default=1, metadata={"ge": 1, "help": "timed optimizer steps per method in each round"})
    rounds: int = field(
        default=5, metadata={"ge": 1, "help": "timed rounds; each runs --steps steps of every method in turn"}
    )
    lr: float = field(default=1e-4, metadata={"gt": 0, "help": "AdamW learning rate (timing does not depend on it)"})
    device: str = field(
        default="auto", metadata={"help": "auto: cuda when available", "choices": ["auto", "cpu", "cuda"]}
    )
    dtype: str = field(
        default="auto", metadata={"help": "auto: bf16 on CUDA, fp32 on CPU", "choices": ["auto", "fp32", "bf16"]}
    )
    threads: int = field(default=0, metadata={"ge": 0, "help": "torch intra-op threads (0: torch's default)"})
    peak_tflops: float = field(
        default=0.0,
        metadata={
            "ge": 0,
            "help": "the device's peak dense bf16 TFLOP/s, for MFU (model FLOPs utilisation: counted training FLOPs "
            "per second over it); 0: known GPUs by name (H100, H200, A100, L40S, L4), none on a CPU",
        },
    )
    compile: str = field(
        default="none",
        metadata={
            "help": "time torch.compile'd models in this mode (reduce-overhead: with CUDA graphs); compiling happens "
            "in the warm-up steps; FLOPs and memory are those of the eager model",
            "choices": list(COMPILE_MODES),
        },
    )
    loss: str = field(
        default="sliced",
        metadata={
            "help": "the training loss: sliced (the logits a slice of positions at a time, never whole: what every "
            "training command uses, scale_cl.train.chunked_loss) or whole (transformers' loss over every logit); "
            "compiled models (--compile) take whole",
            "choices": list(LOSSES),
        },
    )
    vocab: int = field(
        default=0,
        metadata={
            "ge": 0,
            "help": "every shape's vocabulary; 0: its own (128256 is Llama-3's: the logits dominate a step's memory)",
        },
    )
    adapt_top: int = field(
        default=3,
        metadata={
            "ge": 1,
            "help": "scale_adapt: how many top layers are collaborative (preserve_layers = layers - N); the smollm2 "
            "cpt preset's setting is 24 (L_fp 6 of 30)",
        },
    )
    route_top: int = field(
        default=1,
        metadata={
            "ge": 1,
            "help": "scale_route: how many top layers are collaborative (the smollm2 cpt preset's setting: 24); "
            "each runs twice, as the [preserve; adapt] pair of Eq. 5",
        },
    )
    match: str = field(
        default="route",
        metadata={
            "help": "the SCALE config (scale_<match>) whose trainable parameters LoRA's rank and LLaMA Pro's blocks "
            "match",
            "choices": list(MATCH_TARGETS),
        },
    )
    w21_init: str = field(default="svd", metadata={"help": "SCALE W21 initialiser", "choices": list(INITS)})
    w22_init: str = field(default="zero", metadata={"help": "SCALE W22 initialiser", "choices": list(INITS)})
    upscale_only: tuple[str, ...] | None = field(
        default=None,
        metadata={
            "help": "shapes measured for upscale's cost only (default: llama-1b on CPU, none on CUDA; give the "
            "option with no shape to measure everything everywhere)",
            "type": str,
            "nargs": "*",
            "choices": list(SHAPES),
            "metavar": "SHAPE",
        },
    )
    readings: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "inference-only rows, each a method's model read with a mixing router: route-likelihood "
            "(SCALE-Route), preserve-likelihood (SCALE-Preserve: its Z is the base's), preserve-calibrated (the "
            "same with the calibrated router: its gate's cost, whatever its values), control (FFT's model and the "
            "base, two models mixed by the likelihood router; control-calibrated by the calibrated one), "
            "preserve-nested (SCALE-Preserve after three tasks: grown twice more, the nested router's four experts "
            "in one pass), control-nested (the base and three FFT models mixed alike); each needs its method in "
            "--methods",
            "choices": list(READINGS),
            "metavar": "READING",
        },
    )
    infer_rounds: int = field(default=3, metadata={"ge": 0, "help": "timed inference rounds (after one warm-up round)"})
    gen_batch: int = field(default=1, metadata={"ge": 1, "help": "generate(): prompts per call"})
    gen_prompt: int = field(default=32, metadata={"ge": 1, "help": "generate(): prompt length in tokens"})
    gen_tokens: int = field(default=32, metadata={"ge": 0, "help": "generate(): new tokens (greedy; 0 skips generate)"})
    skip_training: bool = field(default=False, metadata={"help": "do not time training"})
    skip_memory: bool = field(
        default=False, metadata={"help": "do not measure peak training memory (one process per method)"}
    )
    skip_inference: bool = field(default=False, metadata={"help": "do not time forward passes and generate()"})
    skip_flops: bool = field(default=False, metadata={"help": "do not count FLOPs"})
    skip_upscale: bool = field(default=False, metadata={"help": "do not measure upscale's cost"})
    seed: int = field(default=0, metadata={"ge": 0, "le": 4294967295, "help": "seed of the random weights and inputs"})
    progress: bool = field(default=True, metadata={"help": "progress bars", "negative": "no_progress"})

    def __post_init__(self) -> None:
        check_fields(self)  # every field's type (the lists tuples) and declared range
        self.methods = tuple(dict.fromkeys(self.methods))  # each once, in the order given
        unknown = [s for s in self.shapes if s not in SHAPES]
        if unknown or not self.shapes:
            raise ValueError(f"unknown shapes {unknown}; choose from {list(SHAPES)}")
        unknown = [m for m in self.methods if split_method(m)[0] not in METHOD_NAMES]
        if unknown or not self.methods:
            raise ValueError(f"unknown methods {unknown}; choose from {list(METHOD_NAMES)} (or METHOD+int8/nf4)")
        for name in self.methods:
            method, kind = split_method(name)
            check_quantizable(method, kind)  # e.g. fft+nf4: FFT trains the weights a quantized base keeps frozen
        self.readings = tuple(dict.fromkeys(self.readings))
        unknown = [r for r in self.readings if r not in READINGS]
        if unknown:
            raise ValueError(f"unknown readings {unknown}; choose from {list(READINGS)}")
        missing = [f"{r} (needs {READINGS[r].method})" for r in self.readings if READINGS[r].method not in self.methods]
        if missing:
            raise ValueError(f"readings {missing} read a method's model: add the method to --methods")
        if self.readings and REFERENCE not in self.methods:
            raise ValueError("--readings are compared with fft's model alone: keep fft in --methods")
        if self.readings and self.skip_inference:
            raise ValueError("--readings are inference rows: drop --skip_inference, or the readings")
        if self.upscale_only is not None:
            unknown = [s for s in self.upscale_only if s not in SHAPES]
            if unknown:
                raise ValueError(f"upscale_only: unknown shapes {unknown}; choose from {list(SHAPES)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "fp32", "bf16"):
            raise ValueError(f"dtype must be auto, fp32 or bf16, got {self.dtype!r}")
        if self.match not in MATCH_TARGETS:
            raise ValueError(f"match must be one of {MATCH_TARGETS}, got {self.match!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, got {self.compile!r}")
        batch, seq = AUTO_BATCH[self.torch_device.type]
        self.batch, self.seq = self.batch or batch, self.seq or seq  # resolved here: results record what ran

    # -- resolved settings -------------------------------------------------------------------------

    def use_training_kernels(self) -> None:
        """The attention kernels the training commands use on this device (`avoid_cudnn_attention` on CUDA), so
        that what is timed is what trains."""
        if self.torch_device.type == "cuda":
            from scale_cl.train.device import avoid_cudnn_attention

            avoid_cudnn_attention()

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device=cuda but torch sees no CUDA device")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return {"fp32": torch.float32, "bf16": torch.bfloat16}[self.dtype]

    def shape(self, name: str) -> Shape:
        """The shape ``name`` as measured: with ``vocab``'s vocabulary where one is given."""
        return SHAPES[name].with_vocab(self.vocab) if self.vocab else SHAPES[name]

    def is_upscale_only(self, shape: str) -> bool:
        """Shapes timed for the upscale cost only: by default Llama-3.2-1B's on a CPU (too slow to train)."""
        if self.upscale_only is not None:
            return shape in self.upscale_only
        return shape == "llama-1b" and self.torch_device.type == "cpu"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for name in ("shapes", "methods", "readings", "upscale_only"):
            if data[name] is not None:
                data[name] = list(data[name])
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class BenchCommand:
    """``scale-cl bench``: what to measure (`BenchConfig`) and where the results go."""

    out: str = field(
        default="outputs/bench", metadata={"help": "output folder for results.md and results.json", "metavar": "DIR"}
    )
    command: str | None = field(
        default=None, metadata={"help": "how the run was started, recorded in the results", "cli": False}
    )
    bench: BenchConfig = field(default_factory=BenchConfig, metadata={"inline": True})
