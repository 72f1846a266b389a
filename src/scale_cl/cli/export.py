"""``scale-cl export``: a trained model as a self-contained Hugging Face folder (`ExportSettings`)."""

from __future__ import annotations

from scale_cl.cli.command import Command
from scale_cl.export.config import DTYPES, ExportSettings


def run(settings: ExportSettings) -> int:
    from scale_cl.export.export import export

    export(settings)
    return 0


COMMAND = Command(
    name="export",
    help="write a trained model (any method) as a Hugging Face model folder that loads without scale-cl",
    description=(
        "Export a finished run's model or a SCALE checkpoint as a self-contained Hugging Face model folder: "
        "config.json, safetensors weights (sharded with an index above --max_shard_size), generation_config.json, "
        "the tokenizer and a README.md model card with the run's learning and forgetting numbers. A SCALE model "
        "(scale_preserve, scale_adapt, scale_route) has its blocks merged into a stock transformers class and "
        "brings its modeling code (modeling_scale.py): load it with AutoModelForCausalLM.from_pretrained(OUT, "
        "trust_remote_code=True) in any environment with torch and transformers. A baseline (fft, freeze, "
        "llama_pro, lora with its adapter merged) is a plain checkpoint of its stock class. OUT must not exist "
        "or be empty; nothing is written when the input is refused. Runs on the CPU (no GPU needed, whatever the "
        "run trained on)."
    ),
    epilog=(
        "examples:\n"
        "  scale-cl export runs/cpt/scale_route hf/scale-route\n"
        "  scale-cl export runs/cpt/lora/model hf/lora-merged --dtype bfloat16\n"
        "  scale-cl export my_checkpoint/ hf/my-model --max_shard_size 500MB"
    ),
    usage=(
        f"scale-cl export RUN_OR_CHECKPOINT OUT [--dtype {'|'.join(DTYPES)}] [--max_shard_size SIZE] "
        "[--config FILE.yaml]"
    ),
    settings=ExportSettings,
    run=run,
    config_example="{dtype: bfloat16, max_shard_size: 2GB}",
)
