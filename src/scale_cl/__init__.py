"""scale-cl: SCALE, width-upscaled continual learning of LLMs (arXiv 2511.03270).

from scale_cl import ScaleConfig, upscale, set_method, load
model = upscale(hf_model, ScaleConfig(hidden_up=256, ffn_up=1024, method="route", preserve_layers=3))
set_method(model, "route", tau=0.3)
model.save_pretrained("out"); model = load("out")

``import scale_cl`` loads the tuner (``scale_cl.tuner``: the config, the architectures, the layers, the routers,
upscaling and growing, saving and loading, vocab/'s new token rows) and its utilities (``bounds``, ``setting_types``,
``files``, ``remote_code``), and nothing else (docs/design.md §4).

``upscale`` on an upscaled model grows it again (`scale_cl.tuner.stages`): everything trained so far is the new base.
`prepare` and the other names of `scale_cl.methods` (the seven methods, PEFT among them) are imported when
first asked for; the experiments, training, data and evaluation code and the benchmark harness use the tuner
and are never imported by it.
"""

from scale_cl.tuner.config import METHODS, ScaleConfig
from scale_cl.tuner.io import save
from scale_cl.tuner.modes import set_method, set_up_logit_scale
from scale_cl.tuner.restore import load
from scale_cl.tuner.routing.state import ROUTE_SHARE_KEY
from scale_cl.tuner.scale_state import scale_config_of
from scale_cl.tuner.sliced_loss import use_sliced_loss
from scale_cl.tuner.summary import ParamSummary, parameter_summary
from scale_cl.tuner.upscale import upscale

__version__ = "0.1.0"

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
    "use_sliced_loss",
]
