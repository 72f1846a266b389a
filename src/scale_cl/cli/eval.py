"""``scale-cl eval``: lm-evaluation-harness tasks on a trained checkpoint or a base model (`EvalSettings`)."""

from __future__ import annotations

from dataclasses import replace

from scale_cl.cli.command import Command
from scale_cl.eval.config import DTYPES, TASK_PRESETS, EvalSettings
from scale_cl.experiments.base.name import resolve_model_name

PRESETS = "\n".join(f"  {name:8s} {' '.join(tasks)}" for name, tasks in TASK_PRESETS.items())


def run(settings: EvalSettings) -> int:
    from scale_cl.eval.harness import format_markdown, run_eval

    if settings.base:  # the experiments' own model names (clean-en) are theirs to resolve
        settings = replace(settings, base=resolve_model_name(settings.base))
    results, out = run_eval(settings)
    print(format_markdown(results))
    if out is not None:
        print(f"[eval] wrote {out}")
    return 0


COMMAND = Command(
    name="eval",
    help="run lm-evaluation-harness tasks on a trained checkpoint (any method) or a base model",
    description=(
        "Evaluate a model saved by scale-cl (any method: scale_*, lora, fft, freeze, llama_pro) or an untrained "
        "base model (--base) with EleutherAI's lm-evaluation-harness, print a markdown table (task | metric | "
        "value | ± stderr) and write every metric as JSON. The paper evaluates zero-shot, which is each preset "
        f"task's default.\n\npresets (paper Table 2):\n{PRESETS}"
    ),
    epilog=(
        "examples:\n"
        "  scale-cl eval runs/scale_route/model --tasks english korean --device cuda --dtype bfloat16\n"
        "  scale-cl eval --base meta-llama/Llama-3.2-1B --tasks english korean --out base.json\n"
        "  scale-cl eval runs/lora/model --tasks arc_easy,hellaswag --limit 100 --merge_lora\n"
        "  scale-cl eval runs/fft/model --tasks my_task --include_path my_tasks/"
    ),
    usage=(
        "scale-cl eval (MODEL_DIR | --base MODEL) --tasks TASK [TASK ...] [--include_path DIR] "
        f"[--num_fewshot N] [--limit N] [--batch_size N] [--device auto|cpu|cuda|cuda:N] [--dtype {'|'.join(DTYPES)}] "
        "[--merge_lora] [--config FILE.yaml] [--out FILE.json]"
    ),
    settings=EvalSettings,
    run=run,
    config_example="{tasks: [english, korean], dtype: bfloat16, limit: 100}",
)
