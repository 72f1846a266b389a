"""BenchConfig: what `scale-cl bench` measures and how (one dataclass, shared with the child processes)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from scale_cl.methods import METHOD_NAMES

MATCH_TARGETS = ("preserve", "adapt", "route")


@dataclass
class BenchConfig:
    """Settings of one benchmark run; every field is a ``scale-cl bench`` option of the same name."""

    shapes: tuple[str, ...] = ("tiny", "smollm2", "llama-1b")
    methods: tuple[str, ...] = METHOD_NAMES
    batch: int = 4
    seq: int = 256
    warmup: int = 2  # untimed optimizer steps per method before timing (the first ones touch fresh memory)
    steps: int = 1  # timed optimizer steps per method per round
    rounds: int = 5  # rounds; each steps every method in turn
    lr: float = 1e-4
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | fp32 | bf16 (auto: bf16 on CUDA, fp32 on CPU)
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    adapt_top: int = 3  # scale_adapt: the top N layers are collaborative (preserve_layers = L - N)
    route_top: int = 1  # scale_route: the top N layers are collaborative
    match: str = "route"  # the SCALE config that LoRA's rank and LLaMA Pro's blocks are matched to
    w21_init: str = "svd"
    w22_init: str = "zero"
    upscale_only: tuple[str, ...] | None = None  # shapes measured for upscale cost only (None: auto)
    infer_rounds: int = 3  # timed inference rounds (after one warm-up round)
    gen_batch: int = 1
    gen_prompt: int = 32
    gen_tokens: int = 32
    skip_training: bool = False
    skip_memory: bool = False
    skip_inference: bool = False
    skip_flops: bool = False
    skip_upscale: bool = False
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        from scale_cl.bench.shapes import SHAPES

        self.shapes = tuple(self.shapes)
        self.methods = tuple(self.methods)
        unknown = [s for s in self.shapes if s not in SHAPES]
        if unknown or not self.shapes:
            raise ValueError(f"unknown shapes {unknown}; choose from {list(SHAPES)}")
        unknown = [m for m in self.methods if m not in METHOD_NAMES]
        if unknown or not self.methods:
            raise ValueError(f"unknown methods {unknown}; choose from {list(METHOD_NAMES)}")
        if self.upscale_only is not None:
            self.upscale_only = tuple(self.upscale_only)
            unknown = [s for s in self.upscale_only if s not in SHAPES]
            if unknown:
                raise ValueError(f"--upscale-only: unknown shapes {unknown}; choose from {list(SHAPES)}")
        for name in ("batch", "seq", "steps", "rounds", "adapt_top", "route_top", "gen_batch", "gen_prompt"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("warmup", "threads", "infer_rounds", "gen_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 or more, got {getattr(self, name)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "fp32", "bf16"):
            raise ValueError(f"dtype must be auto, fp32 or bf16, got {self.dtype!r}")
        if self.match not in MATCH_TARGETS:
            raise ValueError(f"match must be one of {MATCH_TARGETS}, got {self.match!r}")

    # -- resolved settings -------------------------------------------------------------------------

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

    def is_upscale_only(self, shape: str) -> bool:
        """Shapes timed for the upscale cost only: by default Llama-3.2-1B's on a CPU (too slow to train)."""
        if self.upscale_only is not None:
            return shape in self.upscale_only
        return shape == "llama-1b" and self.torch_device.type == "cpu"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for name in ("shapes", "methods", "upscale_only"):
            if data[name] is not None:
                data[name] = list(data[name])
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
