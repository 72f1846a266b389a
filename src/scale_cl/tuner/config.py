"""ScaleConfig: what to add to a model and how the added blocks train (docs/design.md §1).

Only checks that need no model live here; checks against a model's shapes (head size, GQA
group, number of layers) are made by `scale_cl.tuner.widths.check_fits`, which `upscale` and the
experiments' settings both call.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from scale_cl.bounds import check_fields
from scale_cl.tuner.routing.mixing import CONFIDENCES
from scale_cl.tuner.routing.router import ROUTERS

METHODS = ("preserve", "adapt", "route")
INITS = ("zero", "random", "svd")
MODULES = ("attn", "ffn")
EMBED_UP_INITS = ("random", "zero")
UP_NORMS = ("own", "original", "joint")


@dataclass
class ScaleConfig:
    """How to width-upscale a causal LM with SCALE. Each field is described once, by its ``metadata["help"]``: what
    ``--options.scale.<field> --help`` prints, and the ``Attributes`` below (written from them after the class)."""

    hidden_up: int = field(
        metadata={
            "gt": 0,
            "help": "width added to the residual stream (u; a positive multiple of head_dim x GQA group): u / head_dim "
            "new query heads",
        }
    )
    ffn_up: int = field(metadata={"ge": 0, "help": "width added to every FFN's hidden layer (f; 0 or more)"})
    # method and seed are each run's own in the experiments ("cli": False: no command-line option there)
    method: str = field(
        default="preserve",
        metadata={
            "help": f"one of {METHODS}: preserve (W12 frozen at zero everywhere), adapt (W12 trains in the "
            "collaborative layers and modules) or route (each token routed between the two, Eq. 5)",
            "cli": False,
        },
    )
    preserve_layers: int = field(
        default=0,
        metadata={
            "help": "L_fp: W12 frozen at zero below this decoder layer, the layers from it on collaborative (adapt, "
            "route); negative counts from the top like a Python index (-1: only the last), recorded as the concrete "
            "layer by upscale"
        },
    )
    collab_modules: tuple[str, ...] = field(
        default=("attn", "ffn"), metadata={"help": f"where W12 trains in collaborative layers: a subset of {MODULES}"}
    )
    w21_init: str = field(
        default="svd",
        metadata={"help": f"initialiser of W21 (the new rows reading the original stream), one of {INITS}"},
    )
    w22_init: str = field(
        default="zero", metadata={"help": f"initialiser of W22 (the new rows reading the new stream), one of {INITS}"}
    )
    route_tau: float = field(
        default=0.5,
        metadata={
            "ge": -1,
            "le": 1,
            "help": "SCALE-Route: cosine threshold of Eq. 5, in [-1, 1]: a token whose preserve and adapt logits agree "
            "above it goes to the preserve path",
        },
    )
    seed: int = field(
        default=0,
        metadata={
            "ge": 0,
            "le": 4294967295,
            "help": "seed of the random and randomised-SVD initialisers (upscaling is deterministic)",
            "cli": False,
        },
    )

    embed_up_init: str = field(
        default="random",
        metadata={
            "help": f"E_up at start, one of {EMBED_UP_INITS}: random (E's standard deviation, the paper's) or zero "
            "(the new stream starts silent and speaks only where W21 and training make it)"
        },
    )
    up_norm: str = field(
        default="own",
        metadata={
            "help": f"what normalises x_up, one of {UP_NORMS}: own (its own RMS / mean and variance, the paper's), "
            "original (the original stream's RMS / standard deviation) or joint (the whole [x; x_up]'s); with the last "
            "two x_up is as loud, relative to x, as the model makes it; joint is bounded where x_up outgrows x, "
            "original is not and can diverge (docs/design.md §2); Theorem 3.1 holds with each"
        },
    )
    up_logit_scale: float = field(
        default=1.0,
        metadata={
            "ge": 0,
            "help": "alpha in Z + alpha Z_up: the new stream's weight in the logits (1: the paper's; 0: the base "
            "model's logits under SCALE-Preserve); for evaluation after training, a frontier over alpha from one model",
        },
    )
    route_exact: bool = field(
        default=False,
        metadata={
            "help": "SCALE-Route: a token routed to the preserve path gets the base's logits Z_p exactly, instead "
            "of Eq. 5's (Z_p + Z_a) / 2 + Z_p_up"
        },
    )
    router: str = field(
        default="cosine",
        metadata={
            "help": f"SCALE-Route's router, one of {tuple(ROUTERS)}: Eq. 5's cosine, or p = w p_base + (1 - w) "
            "p_new with w from the document's running log-likelihood ratio under the two paths (likelihood; nested: "
            "the same over a grown SCALE-Preserve model's base and stages), from each path's confidence at the "
            "position (confidence), both (hybrid), or both weighed by a gate fitted to the model (calibrated); "
            "SCALE-Preserve reads every router but cosine (its base logits are exact)"
        },
    )
    router_prior: float = field(
        default=0.0,
        metadata={
            "ge": -20,
            "le": 20,
            "help": "likelihood router: prior log-odds of the base path at a document start (w = sigmoid(prior); "
            "sigmoid(20) is 1 in fp32)",
        },
    )
    router_decay: float = field(
        default=0.95,
        metadata={
            "gt": 0,
            "le": 1,
            "help": "likelihood router: decay of past evidence per token (1: the whole document weighs "
            "alike; 0.95: about the last 20 tokens)",
        },
    )
    router_confidence: str = field(
        default="entropy",
        metadata={
            "help": f"confidence and hybrid routers: an expert's confidence at a position, one of {CONFIDENCES} "
            "(its distribution's negative entropy, or the log of its top probability)"
        },
    )
    router_temperature: float = field(
        default=1 / 3,
        metadata={
            "gt": 0,
            "le": 100,
            "help": "confidence and hybrid routers: T in w ~ exp(confidence / T); 1 counts the confidence as one "
            "token's evidence, smaller trusts it more (1/3: exp(-3 x entropy))",
        },
    )
    router_prefix_weight: float = field(
        default=1.0,
        metadata={
            "ge": 0,
            "le": 10,
            "help": "calibrated router: weight on the prefix's running log-likelihood ratio (1: the posterior's)",
        },
    )
    router_entropy_weight: float = field(
        default=3.0,
        metadata={
            "ge": -100,
            "le": 100,
            "help": "calibrated router: weight on each expert's negative entropy at the position (3: the hybrid's "
            "default 1 / T)",
        },
    )
    router_top_weight: float = field(
        default=0.0,
        metadata={
            "ge": -100,
            "le": 100,
            "help": "calibrated router: weight on each expert's log top probability at the position",
        },
    )

    def __post_init__(self) -> None:
        check_fields(self)  # every field's type (collab_modules a tuple, preserve_layers whole) and declared range
        check_method(self.method)
        for name, allowed in (("w21_init", INITS), ("w22_init", INITS), ("embed_up_init", EMBED_UP_INITS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"ScaleConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.up_norm not in UP_NORMS:
            raise ValueError(f"ScaleConfig.up_norm must be one of {UP_NORMS}, got {self.up_norm!r}")
        if self.router not in ROUTERS:  # the registered routers (scale_cl.tuner.routing)
            raise ValueError(f"ScaleConfig.router must be one of {tuple(ROUTERS)}, got {self.router!r}")
        if self.router_confidence not in CONFIDENCES:
            raise ValueError(
                f"ScaleConfig.router_confidence must be one of {CONFIDENCES}, got {self.router_confidence!r}"
            )
        unknown = [m for m in self.collab_modules if m not in MODULES]
        if unknown or not self.collab_modules:
            raise ValueError(
                f"ScaleConfig.collab_modules must be a non-empty subset of {MODULES}, got {self.collab_modules!r}"
            )
        if len(set(self.collab_modules)) != len(self.collab_modules):
            raise ValueError(f"ScaleConfig.collab_modules has duplicates: {self.collab_modules!r}")
        self.route_tau, self.up_logit_scale = float(self.route_tau), float(self.up_logit_scale)
        self.router_prior, self.router_decay = float(self.router_prior), float(self.router_decay)
        self.router_temperature = float(self.router_temperature)

    @property
    def routed(self) -> bool:
        """Whether a router makes the logits: SCALE-Route's always; SCALE-Preserve's with a router that reads one path
        (the likelihood or the nested router: its base logits are exact, so it mixes them with its own; Eq. 5
        compares two paths and is Route's alone)."""
        return self.method == "route" or (self.method == "preserve" and ROUTERS[self.router].one_path)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["collab_modules"] = list(self.collab_modules)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ScaleConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ScaleConfig fields {unknown}; known fields: {sorted(known)}")
        return cls(**data)


ScaleConfig.__doc__ = f"{ScaleConfig.__doc__}\n\n    Attributes:\n" + "".join(
    f"        {f.name}: {f.metadata['help']}\n" for f in fields(ScaleConfig)
)


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return method
