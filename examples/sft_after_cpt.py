"""Instruction-tune a continually pre-trained model with TRL: the second stage of a CPT -> SFT recipe.

    scale-cl train --model Qwen/Qwen2.5-0.5B --data.train 'ko/*.jsonl.gz' --out outputs/qwen-ko        # stage 1
    python examples/sft_after_cpt.py outputs/qwen-ko/model chat.jsonl outputs/qwen-ko-sft              # stage 2
    python examples/sft_after_cpt.py outputs/qwen-ko/model chat.jsonl outputs/qwen-ko-sft --grow 256   # or: grown

``chat.jsonl`` holds one conversation per line in TRL's conversational prompt-completion format,
``{"prompt": [{"role": "user", "content": ...}], "completion": [{"role": "assistant", "content": ...}]}``: the
tokenizer's chat template writes it, and the loss is on the completion (the answer) only.

Which weights train in stage 2 (docs/usage.md, "Instruction tuning after continual pre-training"):

* without ``--grow``, the same ones as in stage 1: SCALE's new weights (for SCALE-Preserve W21, W22, the new heads,
  norms and LM-head columns); the base's weights stay frozen, bitwise. SCALE-Preserve's original stream, so the
  base's logits ``Z``, are still exactly the base's (Theorem 3.1), but stage 1's model is not kept: SFT changes it.
* with ``--grow N``, the stage-1 model is frozen whole and grown by N more features (a new stage,
  `scale_cl.tuner.stages`); only the new stage trains. At the start it computes stage 1's model exactly (Theorem 3.1
  with stage 1's model as the base), and stage 1's weights stay bitwise as they were.

The run resumes from its last checkpoint when run again (the stock Trainer's checkpoints, SCALE's new weights only);
the model is saved in ``OUT/model``, which ``scale-cl eval`` and ``scale-cl export`` take.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from datasets import load_dataset
from transformers.trainer_utils import get_last_checkpoint
from trl import SFTConfig

from scale_cl import ScaleConfig, upscale
from scale_cl.models import BaseModelRef, load_trained, read_run_file, save_trained
from scale_cl.train.device import resolve_device, resolve_precision
from scale_cl.train.sft import ScaleSFTTrainer


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="the stage-1 model folder (a `scale-cl train` or `cpt` run's model/)")
    parser.add_argument("data", help="a JSONL file of prompt-completion conversations (see above)")
    parser.add_argument("out", help="the folder to write (OUT/run: checkpoints, OUT/model: the model)")
    parser.add_argument("--grow", type=int, default=0, help="freeze stage 1 and add this many features (0: no)")
    parser.add_argument("--grow_ffn", type=int, default=0, help="with --grow: FFN features added (default 4x)")
    parser.add_argument("--chat_template", help="a Jinja file, for a tokenizer that has no chat template")
    parser.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (default 1e-4)")
    parser.add_argument("--epochs", type=float, default=1.0, help="passes over the data (default 1)")
    parser.add_argument("--max_steps", type=int, default=-1, help="optimizer steps; overrides --epochs when > 0")
    parser.add_argument("--batch_size", type=int, default=8, help="conversations per step (default 8)")
    parser.add_argument("--max_length", type=int, default=1024, help="tokens per conversation, cut beyond")
    parser.add_argument("--save_steps", type=int, default=500, help="a checkpoint every this many steps")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = arguments()
    out = Path(args.out)
    if (out / "model").exists():
        raise SystemExit(f"{out / 'model'} exists: this run is finished (choose another OUT)")
    model, tokenizer, method = load_trained(args.model)
    if args.chat_template:
        tokenizer.chat_template = Path(args.chat_template).read_text()
    if not tokenizer.chat_template:
        raise SystemExit(f"the tokenizer of {args.model} has no chat template: pass --chat_template FILE.jinja")
    if args.grow:
        if not getattr(model, "is_scale_upscaled", False):
            raise SystemExit(f"--grow grows a SCALE model; {args.model} was trained with {method}")
        stage = ScaleConfig(
            method=model.scale_config.method, hidden_up=args.grow, ffn_up=args.grow_ffn or 4 * args.grow
        )
        model = upscale(model, stage)  # stage 1 frozen whole; this computes it exactly at the start
    device = resolve_device("auto")  # a GPU when torch sees one; bf16 mixed precision where it has it
    sft = SFTConfig(
        output_dir=str(out / "run"),
        use_cpu=device == "cpu",
        bf16=resolve_precision("auto", device),
        learning_rate=args.lr,
        num_train_epochs=args.epochs,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        max_length=args.max_length,
        save_steps=args.save_steps,
        seed=args.seed,
        report_to=[],
    )
    data = load_dataset("json", data_files=args.data, split="train")
    trainer = ScaleSFTTrainer(model=model.train(), args=sft, train_dataset=data, processing_class=tokenizer)
    last = get_last_checkpoint(sft.output_dir) if Path(sft.output_dir).is_dir() else None
    trainer.train(resume_from_checkpoint=last)
    base = BaseModelRef(**read_run_file(Path(args.model))["base"])
    save_trained(trainer.model, tokenizer, method, base, out / "model")
    print(f"[sft] done: {out / 'model'} ({method}{', grown' if args.grow else ''})")


if __name__ == "__main__":
    main()
