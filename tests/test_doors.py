"""The house keeps its shape (issue 42): every module is named in its wing's door and in ARCHITECTURE's "Where things
are", no product module is over 600 lines and no function over 80."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("rlhf_pipeline", "deployments", "flows", "tasks", "validators", "trainers", "data")


def product_modules() -> list[Path]:
    found = []
    for layer in LAYERS:
        folder = ROOT / layer
        files = folder.glob("*.py") if layer == "rlhf_pipeline" else folder.rglob("*.py")
        found += [f for f in files if not f.is_symlink() and f.name != "__init__.py"]
    return sorted(found)


def where_things_are() -> str:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    return text[text.index("### Where things are") : text.index("## Library facts")]


def test_every_module_is_named_in_architecture_and_in_its_wings_door():
    listed = where_things_are()
    missing = [str(f.relative_to(ROOT)) for f in product_modules() if f"`{f.name}`" not in listed]
    assert not missing, f"not in ARCHITECTURE's 'Where things are': {missing}"
    for door in [*(ROOT / "trainers").glob("*/__init__.py"), *(ROOT / "tasks").glob("*/__init__.py")]:
        text = ast.get_docstring(ast.parse(door.read_text())) or ""
        unnamed = [f.name for f in door.parent.glob("*.py") if f.name != "__init__.py" and f.name not in text]
        assert not unnamed, f"{door.relative_to(ROOT)} does not name {unnamed}"
        assert len(list(door.parent.glob("*.py"))) - 1 <= 10, f"{door.parent.name}: more than 10 modules"


@pytest.mark.parametrize("module", product_modules(), ids=lambda f: str(f.relative_to(ROOT)))
def test_no_module_over_600_lines_and_no_function_over_80(module):
    source = module.read_text()
    assert source.count("\n") <= 600, f"{source.count(chr(10))} lines"
    long = [
        f"{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80
    ]
    assert not long


def test_every_module_of_a_wing_has_its_test_file_or_its_door_names_the_tests_that_cover_it():
    import re

    for door in [
        ROOT / "trainers" / "__init__.py",
        ROOT / "tasks" / "__init__.py",
        *(ROOT / "trainers").glob("*/__init__.py"),
        *(ROOT / "tasks").glob("*/__init__.py"),
    ]:
        text = ast.get_docstring(ast.parse(door.read_text())) or ""
        through = text.partition("Tested through")[2]
        for cited in re.findall(r"tests/[\w/]+\.py", through):
            assert (ROOT / cited).is_file(), f"{door.relative_to(ROOT)} cites {cited}, which does not exist"
        folder = door.parent.relative_to(ROOT)
        for module in door.parent.glob("*.py"):
            own = ROOT / "tests" / folder / f"test_{module.name}"
            if module.name != "__init__.py" and not own.is_file():
                assert module.name in through, (
                    f"{folder}/{module.name}: no {own.relative_to(ROOT)}, and its door names none"
                )
