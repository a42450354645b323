"""The README, the docs pages and the recipes' comments stay true: every link, path, module, flag and test they name
exists; the flags reference is what the argument dataclasses generate; and the docs site builds with no warning
(`mkdocs build --strict`: a broken link or anchor, or a page missing from the nav, fails it)."""

import functools
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Flags of programs other than ours that the pages show in commands (pip, pytest, Ray, SLURM, mkdocs, ...).
EXTERNAL_FLAGS = set(
    "--no-deps --no-build-isolation --upgrade"  # pip
    " --durations --basetemp --strict --strict-markers --timeout --junitxml --dist --no-loadscope-reorder"  # pytest (pytest-timeout, pytest-xdist), mkdocs
    " --head --address --port --block --node-ip-address --generate"  # ray start, ray get-auth-token
    " --signal --requeue --mount-proc --ip-address --help"  # sbatch, unshare, hostname
    " --repo-type --local-dir".split()  # hf download
)
# Names the pages use on purpose although they are no flag of ours: the abbreviation the parser refuses, a placeholder.
NOT_FLAGS_ON_PURPOSE = {"--learn", "--flag"}
# Files of other projects the pages name (DeepSpeed's checkpoint converter and ZeRO-2 optimizer), and the user's own
# files of docs/extending.md's example (`--reward_function my_reward.py:fn`, `file.py:function`).
EXTERNAL_FILES = {"ds_to_universal.py", "stage_1_and_2.py", "my_reward.py", "file.py", "my_tools.py", "my_env.py"}
# Dotted names that are no module of ours: dataset row keys, DeepSpeed's and vLLM's own names, and the arguments of
# an example function in the docs (`ground_truth.strip()`).
EXTERNAL_DOTTED = {"reward_model", "nccl_common", "data_types", "ground_truth"}


PATH_PREFIXES = ("open_instruct/", "scripts/", "configs/", "tests/", "docs/")


def doc_files() -> list[Path]:
    return [
        REPO / "README.md",
        *sorted((REPO / "docs").glob("*.md")),
        REPO / "configs/model_configs/README.md",
        REPO / "docs/measurements/README.md",
        REPO / "tests/README.md",
    ]


def texts() -> list[tuple[Path, str]]:
    """Each page's text; for the recipes and the shell scripts, their comments only (their usage lines are docs too;
    a recipe's keys are flags the trainer parses)."""
    found = [(path, path.read_text(encoding="utf-8")) for path in doc_files() if path.exists()]
    commented = [
        *sorted((REPO / "configs/train_configs").glob("*.yaml")),
        *sorted(REPO.glob("scripts/**/*.sh")),
        *sorted(REPO.glob("scripts/**/*.sbatch")),
    ]
    for recipe in commented:
        comments = [line.split("#", 1)[1] for line in recipe.read_text(encoding="utf-8").splitlines() if "#" in line]
        found.append((recipe, "\n".join(comments)))
    return found


def expand_braces(reference: str) -> list[str]:
    """`scripts/train/debug/{ppo,grpo}.sh` -> both paths."""
    match = re.search(r"\{([^{}]*)\}", reference)
    if not match:
        return [reference]
    head, tail = reference[: match.start()], reference[match.end() :]
    return [name for part in match.group(1).split(",") for name in expand_braces(head + part + tail)]


def path_exists(reference: str) -> bool:
    reference = reference.rstrip(".,:;)")
    for candidate in expand_braces(reference):
        if any(mark in candidate for mark in "*?"):
            if not glob.glob(str(REPO / candidate)):
                return False
        elif not (REPO / candidate.split("#")[0]).exists():
            return False
    return True


def code_spans(text: str) -> list[str]:
    """Inline code spans and the lines of fenced code blocks."""
    spans = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S):
        spans += block.splitlines()
    text = re.sub(r"```[^\n]*\n.*?```", "", text, flags=re.S)
    return spans + re.findall(r"`([^`\n]+)`", text)


def stale_paths(text: str) -> list[str]:
    """Repository paths in code spans that do not exist; `open_instruct.x.y` modules and `our_module.name`s that
    do not."""
    stale = []
    for span in code_spans(text):
        for token in re.findall(r"[\w./{},*?-]+", span):
            stale += stale_module_names(token)
            if token.startswith(PATH_PREFIXES) and not path_exists(token):
                stale.append(token)
            for module in re.findall(r"\bopen_instruct(?:\.\w+)+", token):
                if not module_exists(module):
                    stale.append(module)
    return stale


def stale_module_names(token: str) -> list[str]:
    """`vllm_utils.load_weights`: a dotted name whose first part looks like one of our modules (snake_case with an
    underscore) names a module stem of the repo or an installed package."""
    match = re.fullmatch(r"([a-z][a-z0-9]*_[a-z0-9_]+)\.[A-Za-z_]\w*(?:\.\w+)*", token)
    if not match or re.search(r"\.(py|sh|sbatch|json|yaml|yml|md|jsonl|png|pt|txt|log)$", token):
        return []
    name = match.group(1)
    if name in EXTERNAL_DOTTED or name in module_stems() or importlib.util.find_spec(name) is not None:
        return []
    return [token]


def module_stems() -> set[str]:
    return {Path(name).stem for name in repo_file_names() if name.endswith(".py")} | {
        path.name for path in REPO.glob("open_instruct/*/") if path.is_dir()
    }


@functools.cache
def repo_file_names() -> frozenset[str]:
    """The names of the repository's files, without walking the virtual environment, git's folder or run outputs."""
    skip = {".git", ".venv", "output", "wandb", "site", "__pycache__", ".pytest_cache"}
    names = set()
    for _, folders, files in os.walk(REPO):
        folders[:] = [folder for folder in folders if folder not in skip and not folder.endswith(".egg-info")]
        names.update(files)
    return frozenset(names)


def module_exists(dotted: str) -> bool:
    """`open_instruct.run.args` or `open_instruct.run.args.parse_args` (a module, then attributes)."""
    parts = dotted.split(".")
    for end in range(len(parts), 1, -1):
        path = REPO.joinpath(*parts[:end])
        if path.with_suffix(".py").exists() or (path / "__init__.py").exists():
            return True
    return False


def stale_file_names(text: str) -> list[str]:
    """Bare file names of code and recipes in code spans (`test_resume.py`, `ppo_arithmetic_cpu.yaml`) that no file
    of the repo has. Data files (`summary.json`, `args.json`) are what a run writes, and `CONFIG.yaml` a placeholder."""
    stale = []
    for span in code_spans(text):
        for token in re.findall(r"(?<![\w/.{,-])([\w-]+\.(?:py|sh|sbatch)|[a-z0-9]+_[\w-]+\.yaml)\b", span):
            if token not in repo_file_names() and token not in EXTERNAL_FILES:
                stale.append(token)
    return stale


def stale_links(path: Path, text: str) -> list[str]:
    """Relative links to files that do not exist, or to a section (`page.md#anchor`) the page does not have."""
    stale = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^(https?:|mailto:|#)", target):
            continue
        file, _, anchor = target.partition("#")
        linked = path.parent / file
        if not linked.exists():
            stale.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
            stale.append(target)
    return stale


def heading_anchors(page: Path) -> set[str]:
    """The anchors of a page's headings as the docs site (mkdocs' toc) and GitHub make them, outside code blocks."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    anchors = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, flags=re.M):
        words = re.sub(r"[^\w\s-]", "", heading).strip().lower()
        anchors.add(re.sub(r"[-\s]+", "-", words))
    return anchors


def trainer_flags() -> set[str]:
    from open_instruct.run.args import ARG_GROUPS

    names = set()
    for group in ARG_GROUPS:
        for field in fields(group):
            names.add(f"--{field.name}")
            names.update(field.metadata.get("aliases", []))
    return names


def script_flags() -> set[str]:
    """Flags our other programs take: argparse options in Python, and the options shell scripts read."""
    names = set()
    for path in [*REPO.glob("open_instruct/**/*.py"), *REPO.glob("scripts/**/*.py")]:
        names.update(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", path.read_text(encoding="utf-8")))
    for path in [*REPO.glob("scripts/**/*.sh"), *REPO.glob("scripts/**/*.sbatch")]:
        names.update(re.findall(r"(--[a-z][\w-]+)\)", path.read_text(encoding="utf-8")))  # case patterns
        names.update(re.findall(r"== \"(--[a-z][\w-]+)\"", path.read_text(encoding="utf-8")))
    from open_instruct.evaluate import EvalArgs
    from open_instruct.sft_warmup import WarmupArgs

    names.update(f"--{field.name}" for group in (EvalArgs, WarmupArgs) for field in fields(group))
    return names


def unknown_flags(text: str, known: set[str]) -> list[str]:
    unknown = []
    for span in code_spans(text):
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]*)", span):
            if flag not in known | EXTERNAL_FLAGS | NOT_FLAGS_ON_PURPOSE:
                unknown.append(flag)
    return unknown


def test_tests_named_with_k_exist():
    """`-k NAME` in a command must select some test: a file or a test function of that name."""
    test_sources = "\n".join(path.read_text(encoding="utf-8") for path in (REPO / "tests").glob("test_*.py"))
    names = {path.stem for path in (REPO / "tests").glob("test_*.py")}
    names.update(re.findall(r"def (test_\w+)", test_sources))
    missing = []
    for path, text in texts():
        for selector in re.findall(r"-k ([\w]+)", text):
            if not any(selector in name for name in names):
                missing.append(f"{path.relative_to(REPO)}: -k {selector}")
    assert not missing, f"commands select tests that do not exist: {missing}"


def test_references_exist():
    """Every path, module, file name and link the README, the docs and the recipes' comments name exists."""
    problems = []
    for path, text in texts():
        where = path.relative_to(REPO)
        problems += [f"{where}: path {ref}" for ref in stale_paths(text)]
        problems += [f"{where}: file {ref}" for ref in stale_file_names(text)]
        if path.suffix == ".md":
            problems += [f"{where}: link {ref}" for ref in stale_links(path, text)]
    assert not problems, "references to things that do not exist:\n" + "\n".join(problems)


def test_flags_exist():
    """Every `--flag` the pages show is one the trainer or one of our scripts takes."""
    known = trainer_flags() | script_flags()
    problems = [f"{path.relative_to(REPO)}: {flag}" for path, text in texts() for flag in unknown_flags(text, known)]
    assert not problems, "flags that no program of ours takes:\n" + "\n".join(sorted(set(problems)))


def test_readme_layout_names_every_module():
    """The README's layout lists every module of the package, so a newcomer finds each one from there."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    layout = readme[readme.index("## Layout") :]
    modules = sorted(p for p in (REPO / "open_instruct").rglob("*.py") if p.name != "__init__.py")
    missing = [str(path.relative_to(REPO)) for path in modules if not re.search(rf"\b{re.escape(path.name)}\b", layout)]
    assert not missing, f"the README's layout leaves out {missing}; add each where its layer is listed"


def test_flags_reference_is_current():
    """docs/flags.md is what scripts/docs/flags_reference.py writes from the argument dataclasses today."""
    spec = importlib.util.spec_from_file_location("flags_reference", REPO / "scripts/docs/flags_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (REPO / "docs/flags.md").read_text(encoding="utf-8") == module.render(), (
        "docs/flags.md is out of date; run python scripts/docs/flags_reference.py"
    )


def test_docs_site_builds_strict(tmp_path):
    """`mkdocs build --strict`: no broken link or anchor, every page in the nav (requirements-docs.txt)."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail("mkdocs is not installed; bash scripts/install.sh installs requirements-docs.txt")
    site = tmp_path / "site"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--site-dir",
            str(site),
            "--config-file",
            str(REPO / "mkdocs.yml"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert (site / "index.html").exists() and (site / "flags" / "index.html").exists()
    shutil.rmtree(site)


def test_the_code_passes_the_linter_the_readme_names():
    """`ruff check open_instruct scripts tests` (README, "Contributing"; settings in pyproject.toml) passes, so the
    command a contributor is told to run says something about their change only."""
    if importlib.util.find_spec("ruff") is None:
        pytest.fail("ruff is not installed; bash scripts/install.sh installs requirements-docs.txt")
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "open_instruct", "scripts", "tests"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
