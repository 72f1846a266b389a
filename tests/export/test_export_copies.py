"""The exported model's standalone copies (`scale_cl.export.modeling_scale`, which imports nothing of scale-cl) are
marked as copies of their sources, and each pair is kept equal: the same code where the copy is verbatim, else a
named test that compares the two numerically. The source side names its copy too."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
from pathlib import Path

import pytest

from scale_cl.export import modeling_scale

ROOT = Path(__file__).parents[2]
MARKER = re.compile(r"# Copy of (?P<source>[\w.]+)(?P<same>: the same code\.)?")
TESTED = re.compile(r"# tested equal by (?P<file>[\w/.]+)::(?P<test>\w+)\.")
# what the exported file copies (a new copy is added here and marked there)
COPIES = {
    "norm_groups",
    "SplitRMSNormGroups",
    "SplitLayerNorm",
    "TwoPathLinear",
    "route_mask",
    "running_ratio",
    "padding_free",
    "document_starts",
    "with_missing_rows",
    "ExpertMemory",
    "posterior_mix",
    "expert_confidence",
    "expert_statistics",
    "log_normalisers",
    "chunk_rows",
    "mixture_log_probs",
    "capture_router_inputs",
    "RouteHead",
    "_stack",
    "stack_paths",
}


def marked_copies() -> dict[str, str]:
    """The exported file's top-level names whose comment block says they are a copy, with that comment."""
    found = {}
    for name, value in vars(modeling_scale).items():
        if (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__ == modeling_scale.__name__:
            comments = inspect.getcomments(value) or ""
            if "# Copy of " in comments:
                found[name] = comments
    return found


def source_object(dotted: str) -> object:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def code_without_docstring(obj: object) -> str:
    node = ast.parse(textwrap.dedent(inspect.getsource(obj))).body[0]
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return ast.dump(ast.Module(body=body, type_ignores=[]))


def test_every_copy_is_marked():
    assert set(marked_copies()) == COPIES


@pytest.mark.parametrize("name", sorted(COPIES))
def test_each_copy_names_its_source_and_is_kept_equal(name):
    comments = marked_copies()[name]
    marker = MARKER.search(comments)
    assert marker, comments
    source = source_object(marker["source"])  # the source exists where the marker says
    assert "modeling_scale.py" in (inspect.getcomments(source) or ""), f"{marker['source']} does not name its copy"
    copy = getattr(modeling_scale, name)
    if marker["same"]:
        assert code_without_docstring(copy) == code_without_docstring(source), f"{name} is no longer the same code"
        return
    tested = TESTED.search(comments)
    assert tested, f"{name}: a rewritten copy names the test that compares it with its source"
    tree = ast.parse((ROOT / tested["file"]).read_text())
    tests = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert tested["test"] in tests, f"{tested['file']} has no {tested['test']}"


def test_a_changed_verbatim_copy_is_found():
    """The check compares code, not names: a copy that drifted differs."""

    def drifted(value, batch):
        return value

    assert code_without_docstring(drifted) != code_without_docstring(
        source_object("scale_cl.tuner.routing.state._stack")
    )


def test_the_exported_config_holds_every_route_setting():
    """`ScaleFields` (the exported config's SCALE settings, a standalone copy) has Eq. 5's settings as
    ``scale_<name>`` with `ScaleConfig`'s defaults, and a mixing router's as its declaration writes them
    (``scale_mixture``): each setting a registered mixing router declares is in its mixture, under the name
    `posterior_mix` takes, so the export computes every router it can write."""
    import inspect as inspect_
    from dataclasses import fields

    from scale_cl.tuner.config import ScaleConfig
    from scale_cl.tuner.routing import ROUTERS
    from scale_cl.tuner.routing.posterior import MixtureRouter, posterior_mix

    exported = {f.name: f.default for f in fields(modeling_scale.ScaleFields)}
    ours = {f.name: f.default for f in fields(ScaleConfig)}
    assert {f"scale_{name}": ours[name] for name in ROUTERS["cosine"].reads}.items() <= exported.items()
    assert exported["scale_mixture"] is None
    taken = set(inspect_.signature(posterior_mix).parameters)
    config = ScaleConfig(hidden_up=32, ffn_up=0)
    for router in ROUTERS.values():
        if isinstance(router, MixtureRouter):
            mixture = router.mixture(lambda name: getattr(config, name))
            assert set(mixture) <= taken, router.name
            assert {name.removeprefix("router_") for name in router.reads} <= set(mixture), router.name


def test_the_exported_linears_are_the_architectures_of_the_tuner():
    """Each exported family's decoder-layer linears and their sizes before upscaling (what Route's two-path layers
    are built from) are the tuner's architecture data (`scale_cl.tuner.arch`): the same paths, each sized by its
    declared growth units."""
    from scale_cl.export.merge import FAMILIES
    from scale_cl.tuner.arch import SPECS

    d, ffn, heads, kv_heads = 64, 112, 4, 2
    for name, (config_class, model_class) in FAMILIES.items():
        head_dim = d // heads if SPECS[name].family == "gpt_neox" else 24  # Llama's heads need not span d
        q = heads * head_dim
        sizes = {"hidden": d, "q": q, "kv": kv_heads * head_dim, "qkv": 3 * q, "ffn": ffn}
        config = config_class(
            hidden_size=d + 32,
            num_attention_heads=heads + 2,
            head_dim=head_dim,
            scale_hidden_size=d,
            scale_intermediate_size=ffn,
            scale_num_attention_heads=heads,
            scale_num_key_value_heads=kv_heads,
        )
        exported = model_class.base_class.original_linears(None, config)
        tuner = {lin.path: (sizes[lin.grow_in], sizes[lin.grow_out]) for lin in SPECS[name].linears}
        assert exported == tuner, name
