"""Methods declare their traits at registration and callers ask the trait, not the name: no method name
is compared as a string outside `scale_cl.methods`, and each declared trait is what preparing the method does."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from scale_cl.methods import METHOD_NAMES, QUANTIZABLE_METHODS, REGISTRY, check_quantizable, prepare
from scale_cl.tuner.config import ScaleConfig
from tests.conftest import make_model

PACKAGE = Path(__file__).parents[2] / "src" / "scale_cl"
NAMES = set(METHOD_NAMES)


def _names(node: ast.AST) -> list[str]:
    """The method names ``node`` spells: a string constant, or a tuple / list / set of them."""
    if isinstance(node, ast.Constant) and node.value in NAMES:
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in NAMES]
    return []


def _is_value(node: ast.AST) -> bool:
    """A constant (a rate, a measurement, a phrase), negative numbers included."""
    return isinstance(node, ast.Constant) or (isinstance(node, ast.UnaryOp) and isinstance(node.operand, ast.Constant))


def name_tests(source: str) -> list[tuple[int, list[str]]]:
    """(line, names) of every place in ``source`` that tests a value against method names: a comparison (``==``,
    ``in``, ...) with a name or a collection of names, a collection of names kept under a name of its own (a list
    of methods with some trait), a ``startswith("scale_")``, or a table keyed by method names whose values are more
    than constants (what each method reads or takes: its declaration's, `MethodSpec.settings`; a rate or a
    measurement per method is a value, not a trait)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Dict) and not all(_is_value(v) for v in node.values):
            names += [k.value for k in node.keys if isinstance(k, ast.Constant) and k.value in NAMES]
        elif isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                names += _names(side)
        elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            names += [] if isinstance(node.value, ast.Constant) else _names(node.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith":
            names += [a.value for a in node.args if isinstance(a, ast.Constant) and a.value == "scale_"]
        if names:
            found.append((node.lineno, names))
    return found


def test_the_check_finds_each_kind_of_name_test():
    source = (
        'if method == "lora": pass\n'
        'ok = method in ("fft", "freeze")\n'
        'ROWS = ("scale_preserve", "scale_adapt")\n'
        'x = name.startswith("scale_")\n'
        'label = "fft"\n'  # one name given as a value is not a test
        'SETTINGS = {"lora": ("lora_rank",), "freeze": {"layers": "freeze_layers"}}\n'
        'RATES = {"lora": 1e-4, "scale_route": -1.0, "fft": "full fine-tuning"}\n'  # a value per method is no trait
    )
    assert sorted(line for line, _ in name_tests(source)) == [1, 2, 3, 4, 6]


def test_no_method_name_is_compared_outside_methods():
    found = [
        f"{path.relative_to(PACKAGE)}:{line}: {names}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] != "methods"
        for line, names in name_tests(path.read_text())
    ]
    assert not found, "ask the method's trait (scale_cl.methods.MethodSpec) instead:\n" + "\n".join(found)


OPTIONS = {
    "lora": {"rank": 2},
    "freeze": {"layers": 1},
    "llama_pro": {"blocks": 1},
    **{name: {"scale": ScaleConfig(hidden_up=32, ffn_up=16, preserve_layers=1)} for name in NAMES if "scale" in name},
}


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_the_declared_traits_are_what_prepare_does(method):
    spec, base = REGISTRY[method], make_model("llama-gqa2-tied")
    original = {name: param.shape for name, param in base.named_parameters()}
    model = prepare(base, method, **OPTIONS.get(method, {}))
    params = dict(model.named_parameters())
    trains_original = any(p.requires_grad for name, p in params.items() if name in original)
    assert spec.trains_everything == all(p.requires_grad for p in params.values())
    same_architecture = {name: p.shape for name, p in params.items()} == original
    assert spec.wise_ft == (same_architecture and trains_original)
    assert spec.adapter == hasattr(model, "peft_config")
    assert spec.two_paths == (hasattr(model, "scale_route") and model.scale_route.first_stacked is not None)
    if spec.quantizable_base:  # a quantized base keeps the original weights frozen: the method must not train them
        assert not trains_original
    assert (method in QUANTIZABLE_METHODS) == spec.quantizable_base


@pytest.mark.parametrize("method", sorted(NAMES - set(QUANTIZABLE_METHODS)))
def test_a_quantized_base_is_refused_by_trait(method):
    with pytest.raises(ValueError, match=f"but {method} trains them"):
        check_quantizable(method, "nf4")


def test_the_design_maps_each_method_s_three_spellings_as_the_registry_does():
    design = (PACKAGE.parent.parent / "docs" / "design.md").read_text()
    rows = {}
    for line in design.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] in NAMES:
            rows[cells[0]] = (cells[1] or None, cells[2])
    assert rows == {name: (spec.scale_method, spec.title) for name, spec in REGISTRY.items()}
