"""The package is a stack of layers (open_instruct/__init__.py): every import points down or sideways, never up, and
no two modules import each other, directly or around a circle, whether at the top of a file or inside a function.

Read from the source with `ast`, so a lazy import inside a function counts like a top-level one: a circle dodged
with a local import is still a circle.
"""

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "open_instruct"
# Bottom to top; the modules directly in open_instruct/ (the entry points) are the top floor.
FLOORS = ("sandbox", "rl", "rewards", "data", "environments", "run", "generation", "learner")
TOP = len(FLOORS)
# Third-party packages a floor may not import (each floor's __init__ docstring says what it may import).
FORBIDDEN = {
    "sandbox": {"torch", "transformers", "datasets", "vllm", "ray", "deepspeed", "wandb", "math_verify"},
    "rl": {"transformers", "datasets", "vllm", "ray", "deepspeed", "wandb", "math_verify", "langdetect"},
    "rewards": {"transformers", "datasets", "vllm", "ray", "deepspeed", "wandb"},
    "data": {"vllm", "ray", "deepspeed", "wandb"},
    "environments": {"ray", "deepspeed", "wandb"},
    "run": {"vllm", "deepspeed"},
    "generation": {"deepspeed"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


MODULES = all_modules()


def floor_of(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return -1  # the package's own __init__: imports nothing
    if parts[1] in FLOORS:
        return FLOORS.index(parts[1])
    return TOP


def imports_of(path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file; `from open_instruct import rl` names open_instruct.rl."""
    return [(name, node.lineno) for node in ast.walk(ast.parse(path.read_text())) for name in imported_names(node)]


def imported_names(node: ast.AST) -> list[str]:
    """The modules an import statement imports (none for any other node)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module
                for alias in node.names]  # fmt: skip
    return []


def internal_imports(path: Path) -> list[tuple[str, int]]:
    return [(name, line) for name, line in imports_of(path) if name.split(".")[0] == "open_instruct"]


def test_every_module_is_on_a_floor_and_every_floor_says_what_it_may_import():
    for floor in FLOORS:
        init = PACKAGE / floor / "__init__.py"
        docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import:" in docstring, f"{init} must say in its docstring what the layer holds and may import"
    stray = [name for name in MODULES if name.count(".") >= 2 and name.split(".")[1] not in FLOORS]
    assert not stray, f"modules outside the layers {FLOORS}: {stray}; put each where its imports say it belongs"


def test_imports_point_down():
    upward = []
    for name, path in MODULES.items():
        for imported, line in internal_imports(path):
            target = imported if imported in MODULES else imported.rsplit(".", 1)[0]
            if floor_of(target) > floor_of(name):
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {imported} (a higher layer)")
    assert not upward, "\n".join(upward)


def test_no_module_imports_itself_around_a_circle():
    graph = {name: {imported for imported, _ in internal_imports(path) if imported in MODULES and imported != name}
             for name, path in MODULES.items()}  # fmt: skip
    circles = []

    def visit(node: str, stack: list[str], state: dict[str, str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(stack[stack.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt], state)
        state[node] = "done"

    state: dict[str, str] = {}
    for name in sorted(graph):
        if name not in state:
            visit(name, [name], state)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_sandbox_is_used_through_its_exports():
    """Other layers import `open_instruct.sandbox` (its __init__ names what they may use), never its modules: the
    isolation's internals can change without touching the rewards or the tools."""
    reaching_in = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {imported}"
                   for name, path in MODULES.items() if not name.startswith("open_instruct.sandbox")
                   for imported, line in internal_imports(path) if imported.startswith("open_instruct.sandbox.")]  # fmt: skip
    assert not reaching_in, "\n".join(reaching_in)


@pytest.mark.parametrize("floor", sorted(FORBIDDEN))
def test_lower_layers_keep_off_the_heavy_frameworks(floor):
    offending = []
    for name, path in MODULES.items():
        if name.split(".")[1:2] != [floor]:
            continue
        for imported, line in imports_of(path):
            if imported.split(".")[0] in FORBIDDEN[floor]:
                offending.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {imported}")
    assert not offending, "\n".join(offending)


def module_level_imports(path: Path) -> list[str]:
    """What importing the file imports: its module-level and class-level imports, not those inside functions (run
    when called) or under `if TYPE_CHECKING:`."""
    found = []

    def visit(statements) -> None:
        for node in statements:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            found.extend(imported_names(node))
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit(getattr(node, field, []))

    visit(ast.parse(path.read_text()).body)
    return found


def imported_on_start(module: str) -> dict[str, str]:
    """Third-party package -> the chain of our modules that imports it when `module` is imported (packages'
    __init__ files included)."""
    chains, packages, todo = {module: module}, {}, [module]
    while todo:
        name = todo.pop()
        parents = [".".join(name.split(".")[:end]) for end in range(1, name.count(".") + 1)]
        for imported in [*parents, *module_level_imports(MODULES[name])]:
            if imported in MODULES:
                if imported not in chains:
                    chains[imported] = f"{chains[name]} -> {imported}"
                    todo.append(imported)
            elif imported.split(".")[0] != "open_instruct":
                packages.setdefault(imported.split(".")[0], chains[name])
    return packages


def chains_to(packages: dict[str, str], unwanted: tuple[str, ...]) -> str:
    """How each of the `unwanted` packages that `imported_on_start` found gets imported, a line each ("" if none)."""
    return "\n".join(f"{name}: {chain}" for name, chain in packages.items() if name in unwanted)


# What a Ray learner rank and an engine actor import (engine_actors imports vllm_engine in the actor): they never build
# a dataset. run.args once imported `datasets`, `pyarrow` and `pandas` into every such process (~0.6 s of each start).
@pytest.mark.parametrize("module", ["open_instruct.learner.ray_group", "open_instruct.generation.vllm_engine"])
def test_learner_ranks_and_engine_actors_start_without_the_dataset_libraries(module):
    packages = imported_on_start(module)
    assert "torch" in packages  # the walk sees what it imports
    loaded = chains_to(packages, ("datasets", "pyarrow", "pandas"))
    assert not loaded, loaded


# What both entry points import before they check the command line (run/command_line.py): a mistyped flag is answered
# without torch, vLLM or the dataset libraries. (Any import of the rl package once loaded its torch math.)
def test_the_command_line_check_starts_without_torch_or_the_engines():
    packages = imported_on_start("open_instruct.run.command_line")
    assert "transformers" in packages  # the walk sees what it imports: the flag parser
    loaded = chains_to(packages, ("torch", "vllm", "datasets", "deepspeed", "ray", "peft"))
    assert not loaded, loaded


def test_the_layer_test_sees_an_upward_import_and_a_circle(tmp_path, monkeypatch):
    """The checks above can fail: a fake package with a circle between two floors trips both."""
    fake = tmp_path / "open_instruct"
    for floor in FLOORS:
        (fake / floor).mkdir(parents=True)
        (fake / floor / "__init__.py").write_text('"""x\nMay import: nothing."""\n')
    (fake / "__init__.py").write_text("")
    (fake / "rl" / "low.py").write_text("def f():\n    from open_instruct.learner import high\n")
    (fake / "learner" / "high.py").write_text("from open_instruct.rl import low\n")
    module = sys.modules[__name__]
    monkeypatch.setattr(module, "PACKAGE", fake)
    monkeypatch.setattr(module, "MODULES", all_modules())
    with pytest.raises(AssertionError, match="rl/low.py:2 imports open_instruct.learner.high"):
        test_imports_point_down()
    with pytest.raises(AssertionError, match="import circles"):
        test_no_module_imports_itself_around_a_circle()
