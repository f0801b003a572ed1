"""Issue 51: each real stage keeps its plain stage's skeleton, in its own file.

A reader of a real stage (`stages/zero2.py`) finds there what its plain stage
(`plain/stage2.py`) has: the stage registers its own gradient hook
(`hook_each_gradient(self.on_grad)` in its `__init__`) and defines the plain stage's
`on_grad`, `end_of_backward` and `zero_grad` itself, not inherited from a base class that
calls them in an order the reader cannot see; stage 3's file holds its units' lifecycle
(`Unit`) as plain/stage3.py does. Read by AST, without importing.

On fce1cc0 (before issue 51) every stage fails: GradientSync registered the hooks and
called `on_param_grad` / `on_group_ready` / `on_backward_end` from its own `_on_grad_accumulated`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from zero_lab.launch.paths import REPO_ROOT

STAGES = REPO_ROOT / "zero_lab" / "stages"
PLAIN = REPO_ROOT / "zero_lab" / "plain"
REAL = {0: ("ddp.py", "DataParallel"), 1: ("zero1.py", "Zero1"), 2: ("zero2.py", "Zero2"),
        3: ("zero3.py", "Zero3")}
SKELETON = ("on_grad", "end_of_backward", "zero_grad")  # the plain stages' hook methods


def classes(path: Path) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.ClassDef)}


def skeleton_missing(source: str, name: str) -> list[str]:
    """What class `name` of `source` lacks of the skeleton: its own methods, and the call
    that registers its hook in its __init__."""
    cls = {node.name: node for node in ast.parse(source).body
           if isinstance(node, ast.ClassDef)}[name]
    methods = {node.name: node for node in cls.body if isinstance(node, ast.FunctionDef)}
    missing = [m for m in SKELETON if m not in methods]
    init = methods.get("__init__")
    registers = init is not None and any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr == "hook_each_gradient"
        and ast.unparse(node.args[0]) == "self.on_grad" for node in ast.walk(init))
    return missing + ([] if registers else ["__init__: self.hook_each_gradient(self.on_grad)"])


@pytest.mark.parametrize("stage", sorted(REAL))
def test_each_stage_registers_its_own_hook_and_defines_the_plain_skeleton(stage):
    file, name = REAL[stage]
    assert skeleton_missing((STAGES / file).read_text(), name) == [], (file, name)


def test_the_plain_stages_have_that_skeleton():
    for k in (0, 2, 3):  # plain stage 1 takes stage 0's hooks as they are
        names = {n.name for node in classes(PLAIN / f"stage{k}.py").values()
                 for n in node.body if isinstance(n, ast.FunctionDef)}
        assert set(SKELETON) <= names, k


def test_stage_3_holds_its_units_lifecycle_as_the_plain_one_does():
    assert "Unit" in classes(STAGES / "zero3.py") and "Unit" in classes(PLAIN / "stage3.py")
    assert "Unit" not in classes(STAGES / "units.py")


def test_the_check_finds_a_stage_that_inherits_its_hooks():
    inherited = ("class Zero2(GradientSync):\n"
                 "    def __init__(self):\n        super().__init__()\n"
                 "    def on_param_grad(self, g, i, p):\n        pass\n")
    assert skeleton_missing(inherited, "Zero2") == [
        "on_grad", "end_of_backward", "zero_grad",
        "__init__: self.hook_each_gradient(self.on_grad)"]
    own = ("class Zero2(GradientSync):\n"
           "    def __init__(self):\n        self.hook_each_gradient(self.on_grad)\n"
           "    def on_grad(self, g, i, p):\n        pass\n"
           "    def end_of_backward(self):\n        pass\n"
           "    def zero_grad(self, set_to_none=True):\n        pass\n")
    assert skeleton_missing(own, "Zero2") == []
