"""The one interface every SCALE-Route router implements, and the registry that names them.

A router receives what the LM head computed its logits from, `HeadPaths` (the two paths' inputs to the head and
the head's weights), never the head itself, plus the model's `RouteState` (its settings, the decision it records,
its memory across calls). It returns the logits. A new router is one file holding a `Router` subclass that calls
`register_router`, imported by ``scale_cl/tuner/routing/__init__.py``; ``ScaleConfig.router`` names it, and the
settings it reads (``settings``) join the route settings that are saved, reloaded, exported and swept.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from scale_cl.tuner.routing.state import RouteState


def original_logits(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, weight_new: torch.Tensor | None
) -> torch.Tensor:
    """``Z = W_out x`` (+ bias), with an extended vocabulary's new rows (``weight_new``) appended."""
    z = F.linear(x, weight, bias)
    return z if weight_new is None else torch.cat((z, F.linear(x, weight_new)), dim=-1)


@dataclass(frozen=True)
class HeadPaths:
    """What the LM head hands a router: its input on the two paths and its weights.

    ``x`` / ``x_up``: the original and added features of the head's input, ``[preserve path; adapt path]`` (2B
    rows) when ``stacked``, else one batch that both paths share (no collaborative layer: the paths are one
    network). ``alpha``: the new stream's logit weight (``Z + alpha Z_up``, `ScaleConfig.up_logit_scale`).
    ``vocab``: the head's output size; an extended vocabulary's new rows (``weight_new``) follow the original
    vocabulary's ``weight.shape[0]`` in every path's logits.
    """

    x: torch.Tensor
    x_up: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    weight_new: torch.Tensor | None
    weight_up: torch.Tensor
    alpha: float
    stacked: bool
    vocab: int

    def original_logits(self, x: torch.Tensor) -> torch.Tensor:
        """``Z = W_out x`` (+ bias), with an extended vocabulary's new rows appended."""
        return original_logits(x, self.weight, self.bias, self.weight_new)

    def up_logits(self, x_up: torch.Tensor) -> torch.Tensor:
        """``Z_up = W_out_up x_up``."""
        return F.linear(x_up, self.weight_up)

    def scaled_up_logits(self, x_up: torch.Tensor) -> torch.Tensor:
        """``alpha Z_up``: what the new stream adds to the logits ``Z`` on one path."""
        z_up = self.up_logits(x_up)
        return z_up if self.alpha == 1 else z_up.mul_(self.alpha)


class Router(ABC):
    """Combines SCALE-Route's two paths into the model's logits (module doc).

    Attributes:
        name: its ``ScaleConfig.router`` value.
        reads: the `ScaleConfig` fields it reads at every forward (besides ``router``): live settings of the
            model, saved, reloaded and exported with it.
        reads_tokens: it weighs the paths by the input token ids (a model pre-hook hands them over).
        one_path: it also reads SCALE-Preserve's one path, whose ``Z`` is the base's logits exactly
            (`ScaleConfig.routed`); Eq. 5 compares two paths and reads Route's alone.
    """

    name: ClassVar[str]
    reads: ClassVar[tuple[str, ...]] = ()
    reads_tokens: ClassVar[bool] = False
    one_path: ClassVar[bool] = False

    @abstractmethod
    def combine(self, paths: HeadPaths, state: RouteState) -> torch.Tensor:
        """The logits of the model: ``paths`` combined, the router's `Reading` kept in ``state.last``."""

    def mixture(self, setting: Callable[[str], Any]) -> dict[str, Any] | None:
        """How the exported model computes this router from the model's settings (``setting(name)``): the posterior
        mixture's form and settings (`scale_cl.tuner.routing.posterior.MixtureRouter`), or None for Eq. 5, which
        the export computes from ``route_tau`` and ``route_exact``. A router that declares neither is not exported."""
        raise ValueError(
            f"cannot export the {self.name} router (the exported model computes Eq. 5 and the posterior mixture of "
            "scale_cl.tuner.routing.posterior): export the model with another router (set_live_settings(model, "
            "router='likelihood') or 'cosine'), or use it through scale-cl"
        )


ROUTERS: dict[str, Router] = {}


def register_router(router: Router) -> Router:
    """Make ``router`` the one ``ScaleConfig.router`` = ``router.name`` selects; returns it."""
    if router.name in ROUTERS:
        raise ValueError(f"a router named {router.name!r} is registered already")
    ROUTERS[router.name] = router
    return router


def route_settings() -> tuple[str, ...]:
    """Every `ScaleConfig` field routing reads: ``router`` and each registered router's settings, once each."""
    names: dict[str, None] = {"router": None}
    for router in ROUTERS.values():
        names.update(dict.fromkeys(router.reads))
    return tuple(names)


def router_named(name: str) -> Router:
    """The registered router ``name`` (a model's ``ScaleConfig.router``), or a ValueError naming the registered."""
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; registered: {', '.join(ROUTERS)}")
    return ROUTERS[name]


__all__ = [
    "ROUTERS",
    "HeadPaths",
    "Router",
    "original_logits",
    "register_router",
    "route_settings",
    "router_named",
]
