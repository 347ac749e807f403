"""A stage's code version: the digest of its trainer's source and of every project module it imports
(docs/ARCHITECTURE.md, "Artifacts and the cache key"). Derived from the imports, never listed by hand.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import io
import tokenize
from pathlib import Path

PACKAGE = "rlhf_pipeline"


def code_version(trainer: str | None) -> str:
    """sha256 of the code (`code_of`) of `trainer` and of every project module it imports, directly or not
    (imports inside functions count; those under `if TYPE_CHECKING:` do not). Derived, never listed
    by hand: editing `trainers/evaluation/stage.py` re-keys eval alone, the tiny tokenizer re-keys data and sft."""
    digest = hashlib.sha256()
    for name, file in sorted(project_imports(trainer).items()) if trainer else ():
        digest.update(name.encode() + b"\0" + read_source(file))
    return digest.hexdigest()[:16]


def read_source(file: Path) -> bytes:
    """The code of a module file as its version counts it (`code_of`)."""
    stat = file.stat()
    return _code_of_file(file, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=1024)
def _code_of_file(file: Path, mtime_ns: int, size: int) -> bytes:
    """`code_of` a file, tokenized once per process and version of the file (its time and size), as `_imports_of`
    parses it once: every stage of a run keys on its closure, and the closures overlap (a default run's five stages
    read 139 modules, 51 distinct ones; a process that runs the pipeline again reads them all again)."""
    return code_of(file.read_text())


def code_of(text: str) -> bytes:
    """A module's code: its tokens, less comments, docstrings (a bare string statement: a module's, a class's, a
    function's or an attribute's) and layout. A prose edit re-keys no stage; a change of code, of a field's
    description or of an error message does."""
    prose = {
        (node.lineno, node.col_offset)
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }
    kept, after_prose = [], False
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type in (tokenize.COMMENT, tokenize.NL) or (after_prose and token.type == tokenize.NEWLINE):
            after_prose = False
            continue
        after_prose = token.type == tokenize.STRING and token.start in prose
        if not after_prose:
            kept.append(f"{tokenize.tok_name[token.type]} {token.string}")
    return "\n".join(kept).encode()


def project_imports(module: str) -> dict[str, Path]:
    """`module` and the project modules it imports, transitively: name -> its source file."""
    found: dict[str, Path] = {}
    pending = [module]
    while pending:
        name = pending.pop()
        if name in found:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            raise ValueError(f"code version: {name!r} is not a project module with Python source")
        found[name] = Path(spec.origin)
        pending += [imported for imported in _imported_modules(found[name], name) if imported not in found]
    return found


def _imported_modules(file: Path, module: str) -> list[str]:
    stat = file.stat()
    return list(_imports_of(file, module, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=1024)
def _imports_of(file: Path, module: str, mtime_ns: int, size: int) -> tuple[str, ...]:
    """The project modules `file` imports, parsed once per process and version of the file (its time and size): each
    stage keys on its trainer's whole import closure, ~40 modules, and a cached re-run keys every stage."""
    names: list[str] = []
    package = module if file.name == "__init__.py" else module.rpartition(".")[0]
    for node in _runtime_nodes(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], *([base] if base else [])]
                )
            candidates = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for candidate in candidates:
            if candidate == PACKAGE or candidate.startswith(PACKAGE + "."):
                parts = candidate.split(".")
                # `import a.b.c` imports a and a.b too; `from a.b import name` names a module or an attribute
                names += [".".join(parts[:i]) for i in range(1, len(parts) + 1) if _is_module(".".join(parts[:i]))]
    return tuple(names)


def _runtime_nodes(tree: ast.AST):
    """Every node, less the bodies of `if TYPE_CHECKING:` (imports for annotations only)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
