"""scale-cl: SCALE, width-upscaled continual learning of LLMs (arXiv 2511.03270).

from scale_cl import ScaleConfig, upscale, set_method, load
model = upscale(hf_model, ScaleConfig(hidden_up=256, ffn_up=1024, method="route", preserve_layers=3))
set_method(model, "route", tau=0.3)
model.save_pretrained("out"); model = load("out")

``import scale_cl`` loads the tuner and nothing else (docs/design.md §4): config, bounds, shapes, arch/,
layers, init, route, upscale, grow, model, io, restore, summary, provenance, files, and vocab/'s new token rows.

``upscale`` on an upscaled model grows it again (`scale_cl.tuner.stages`): everything trained so far is the new base.
`prepare` and the other names of `scale_cl.methods` (the seven methods, PEFT among them) are imported when
first asked for; the experiments, training, data and evaluation code and the benchmark harness use the tuner
and are never imported by it.
"""

import importlib.abc
import sys

from scale_cl.tuner.config import METHODS, ScaleConfig, scale_config_of
from scale_cl.tuner.io import save
from scale_cl.tuner.modes import set_method, set_up_logit_scale
from scale_cl.tuner.restore import load
from scale_cl.tuner.routing.state import ROUTE_SHARE_KEY
from scale_cl.tuner.summary import ParamSummary, parameter_summary
from scale_cl.tuner.upscale import upscale

__version__ = "0.1.0"

# Modules that moved (issue 39: the tuner into one folder): importing an old path says where it went.
MOVED_MODULES = {
    **{
        f"scale_cl.{name}": f"scale_cl.tuner.{name}"
        for name in ("config", "layers", "attention", "init", "upscale", "io", "restore", "summary", "quant")
    },
    "scale_cl.provenance": "scale_cl.tuner.provenance",
    "scale_cl.shapes": "scale_cl.tuner.widths",
    "scale_cl.model": "scale_cl.tuner.modes",
    "scale_cl.grow": "scale_cl.tuner.stages",
    "scale_cl.route": "scale_cl.tuner.routing.state",
    "scale_cl.likelihood_router": "scale_cl.tuner.routing.likelihood",
    "scale_cl.arch": "scale_cl.tuner.arch",
    "scale_cl.vocab": "scale_cl.tuner.vocab",
    "scale_cl.eval.router": "scale_cl.eval.route_separation",  # beside the tuner's routers, a name of its own
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Last on ``sys.meta_path``: asked only for a module no file provides, it names a moved module's new path."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> None:
        prefix = next((old for old in MOVED_MODULES if fullname == old or fullname.startswith(old + ".")), None)
        if prefix is not None:
            new = MOVED_MODULES[prefix] + fullname[len(prefix) :]
            raise ModuleNotFoundError(
                f"{fullname} moved to {new}: import it from there (the public names also from scale_cl itself)",
                name=fullname,
            )
        return None


if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())

# The baselines (PEFT's LoRA, LLaMA Pro, ...) are imported only when asked for.
_FROM_METHODS = ("METHOD_NAMES", "prepare", "trainable_parameter_count")


def __getattr__(name: str):
    if name in _FROM_METHODS:
        import scale_cl.methods

        return getattr(scale_cl.methods, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "METHODS",
    "METHOD_NAMES",
    "ROUTE_SHARE_KEY",
    "ParamSummary",
    "ScaleConfig",
    "load",
    "parameter_summary",
    "prepare",
    "save",
    "scale_config_of",
    "set_method",
    "set_up_logit_scale",
    "trainable_parameter_count",
    "upscale",
]
