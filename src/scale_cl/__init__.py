"""scale-cl: SCALE, width-upscaled continual learning of LLMs (arXiv 2511.03270).

from scale_cl import ScaleConfig, upscale, set_method, load
model = upscale(hf_model, ScaleConfig(hidden_up=256, ffn_up=1024, method="route", preserve_layers=3))
set_method(model, "adapt")
model.save_pretrained("out"); model = load("out")
"""

from scale_cl.config import METHODS, ScaleConfig
from scale_cl.io import load, save
from scale_cl.methods import METHOD_NAMES, prepare, trainable_parameter_count
from scale_cl.summary import ParamSummary, parameter_summary
from scale_cl.upscale import ROUTE_SHARE_KEY, scale_config_of, set_method, upscale

__version__ = "0.1.0"

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
    "trainable_parameter_count",
    "upscale",
]
