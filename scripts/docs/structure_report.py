"""The package's shape in numbers: what a reader meets in the tree, measured the same way every time.

    python scripts/docs/structure_report.py            # the table
    python scripts/docs/structure_report.py --json F   # and the numbers as JSON

- subpackages (the layers of open_instruct/), import circles and upward imports (read with `ast` by
  tests/test_layers.py's rules: a lazy import inside a function counts);
- the longest module and the longest function (lines, docstrings included), and the modules over 600 lines;
- the docs pages' sizes (lines);
- argv's path: the trainer started on the default flags (the embedded task, one process) and traced from `main`
  until the first call into the learner or the engine (every flag, data and model check is done by then, before a
  weight loads). Each is counted once per edge of the path (caller line -> function), not per call, so that a check run
  on every dataset row counts once: "entries" are the edges into run/validation.py (and the flag combinations it runs,
  run/flag_combinations.py) from outside them; "returns up" are the edges, of our functions that received the flags
  (argv, the `Args` dataclasses), to a caller on a higher layer (the flags' own dataclass methods, such as
  `args.dist.uses_ray`, read a flag: not counted).
"""

import argparse
import ast
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.test_layers import FLOORS, MODULES, PACKAGE, floor_of, internal_imports  # noqa: E402


def subpackages() -> list[str]:
    return sorted(path.parent.name for path in PACKAGE.glob("*/__init__.py"))


def upward_imports() -> int:
    count = 0
    for name, path in MODULES.items():
        for imported, _ in internal_imports(path):
            target = imported if imported in MODULES else imported.rsplit(".", 1)[0]
            count += floor_of(target) > floor_of(name)
    return count


def import_circles() -> int:
    graph = {name: {imported for imported, _ in internal_imports(path) if imported in MODULES and imported != name}
             for name, path in MODULES.items()}  # fmt: skip
    circles, state = 0, {}

    def visit(node: str) -> None:
        nonlocal circles
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles += 1
            elif nxt not in state:
                visit(nxt)
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)
    return circles


def module_sizes() -> dict[str, int]:
    return {str(path.relative_to(REPO)): len(path.read_text().splitlines()) for path in MODULES.values()}


def function_sizes() -> list[tuple[int, str]]:
    sizes = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                sizes.append((node.end_lineno - node.lineno + 1, f"{path.relative_to(REPO)}:{node.name}"))
    return sorted(sizes, reverse=True)


def docs_sizes() -> dict[str, int]:
    pages = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md", REPO / "tests" / "README.md"]
    return {str(page.relative_to(REPO)): len(page.read_text().splitlines()) for page in pages}


class _Stop(Exception):
    """Raised by the tracer at the first call into the learner or the engine."""


def argv_path(argv: list[str]) -> dict[str, int]:
    """Trace the trainer's start (see the module's docstring)."""
    from dataclasses import is_dataclass

    from open_instruct import ppo_vllm_thread_ray_gtrl as trainer

    flag_modules = {"open_instruct.run.args", "open_instruct.run.flags", "open_instruct.data.dataset_args",
                    "open_instruct.rewards.config"}  # fmt: skip

    def holds_flags(value) -> bool:
        if value is argv:
            return True
        return is_dataclass(value) and not isinstance(value, type) and type(value).__module__ in flag_modules

    def module_of(frame) -> str | None:
        name = frame.f_globals.get("__name__", "")
        return name if name.startswith("open_instruct") else None

    entries, returns_up = set(), set()
    validation = {"open_instruct.run.validation", "open_instruct.run.flag_combinations"}

    def edge(caller, frame) -> str:
        where = f"{caller.f_code.co_filename}:{caller.f_lineno}" if caller is not None else "?"
        return f"{where} -> {frame.f_globals.get('__name__')}.{frame.f_code.co_qualname}"

    def local_trace(frame, event, arg):
        if event == "return":
            caller = frame.f_back
            caller_module = module_of(caller) if caller is not None else None
            if caller_module is not None and floor_of(caller_module) > floor_of(module_of(frame)):
                returns_up.add(edge(caller, frame))
        return local_trace

    def global_trace(frame, event, arg):
        module = module_of(frame)
        if event != "call" or module is None:
            return None
        if module.startswith(("open_instruct.learner", "open_instruct.generation")):
            raise _Stop
        caller = frame.f_back
        caller_module = module_of(caller) if caller is not None else None
        if module in validation and caller_module is not None and caller_module not in validation:
            entries.add(edge(caller, frame))
        code = frame.f_code
        if module in flag_modules and code.co_argcount and code.co_varnames[0] == "self":
            return None  # a method of the flags' own dataclasses (args.dist.uses_ray): reading a flag, not a path
        arguments = [frame.f_locals.get(name) for name in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]]
        return local_trace if any(holds_flags(value) for value in arguments) else None

    sys.settrace(global_trace)
    try:
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            trainer.main(argv)
    except _Stop:
        pass
    finally:
        sys.settrace(None)
    return {"entries into run/validation.py": len(entries), "returns up the layers": len(returns_up),
            "edges": sorted(entries | returns_up)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="also write the numbers to this file")
    parser.add_argument("--no_argv_path", action="store_true", help="skip the traced start (it loads the data)")
    options = parser.parse_args()
    modules, functions = module_sizes(), function_sizes()
    longest_module = max(modules.items(), key=lambda item: item[1])
    report = {
        "subpackages": subpackages(),
        "layers": list(FLOORS),
        "import circles": import_circles(),
        "upward imports": upward_imports(),
        "longest module": {"path": longest_module[0], "lines": longest_module[1]},
        "modules over 600 lines": {path: lines for path, lines in modules.items() if lines > 600},
        "longest function": {"name": functions[0][1], "lines": functions[0][0]},
        "functions over 70 lines": {name: lines for lines, name in functions if lines > 70},
        "docs pages (lines)": docs_sizes(),
    }
    if not options.no_argv_path:
        with tempfile.TemporaryDirectory() as output_dir:
            os.environ.setdefault("WANDB_MODE", "offline")
            report["argv path"] = argv_path(["--output_dir", output_dir, "--with_tracking", "false"])
    for key, value in report.items():
        if key == "argv path":
            value = {name: count for name, count in value.items() if name != "edges"}
        print(f"{key}: {json.dumps(value)}")
    if options.json:
        Path(options.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
