"""Export a trained model as a self-contained Hugging Face model folder (``scale-cl export``).

The folder loads with ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` where
scale-cl is not installed: a SCALE model as a stock transformers class with split norms (and route's two
paths) in `scale_cl.export.modeling_scale`, which travels inside the folder; a baseline (fft, freeze,
llama_pro, lora merged) as a plain checkpoint of its stock class, no custom code::

    from scale_cl.export import export_model
    export_model(model, "hf/my-model", tokenizer=tokenizer)   # a model in memory, any method

Modules: `modeling_scale` (the code that travels), `merge` (SCALE weights -> stock shapes), `source`
(which run or checkpoint a folder holds), `card` (README.md), `export` (writing the folder; the command).
"""

from scale_cl.export.config import ExportSettings
from scale_cl.export.export import export_model

__all__ = ["ExportSettings", "export_model"]
