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


# Rule 12 of the style guide: a page says what is true now; dated measurements, commits and logs of what was tried are
# records in docs/measurements/. Neither code nor pages speak of issue numbers, work rounds or sessions: a reader cannot
# open them.
RECORDS = "docs/measurements/"
TEXT_SUFFIXES = {".md", ".py", ".sh", ".sbatch", ".yaml", ".yml", ".toml", ".ini", ".txt", ".cfg"}
# Projects whose issue trackers a reader can open: "TRL issue 6688" names one of theirs, not ours.
OTHER_PROJECTS = {
    "TRL", "vLLM", "verl", "DeepSpeed", "Ray", "transformers", "PyTorch", "torch", "open-instruct", "huggingface_hub",
    "peft", "pytest", "pytest-xdist", "mkdocs",
}
# Hex strings that are no commit of ours: the example commit in a message the code prints (run/hub_models.py,
# docs/resume.md).
NOT_COMMITS = {"0123abcd", "0123abcd4567"}
# "session" in its technical sense: a process session (setsid), which a page may well describe.
TECHNICAL_SESSIONS = re.compile(r"session of its own|new session|start_new_session", flags=re.I)
WORK_LOG_WORDS = [
    re.compile(r"\bsessions?\b", flags=re.I),
    re.compile(
        r"\b(?:this|that|the|next|previous|earlier|later|last|each|every|a|one|another|work)\s+rounds?\b(?![ -](?:trip|robin))",
        flags=re.I,
    ),
    re.compile(r"\brounds?\s+\d+\b", flags=re.I),
    re.compile(r"\blent\b", flags=re.I),
]


def checked_text_files() -> list[Path]:
    """The repository's text files (tracked, or new and not ignored) outside the records."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], capture_output=True, text=True, cwd=REPO
    )
    assert listed.returncode == 0, listed.stderr
    paths = []
    for name in listed.stdout.splitlines():
        path = REPO / name
        if name.startswith(RECORDS) or path.suffix not in TEXT_SUFFIXES or not path.is_file():
            continue
        paths.append(path)
    return paths


def issue_numbers(text: str) -> list[str]:
    """Our own tracker's numbers ("issue" or "issues", an optional #, a number), which a reader cannot open; another
    project's ("TRL" before it) are fine."""
    found = []
    for match in re.finditer(r"\bissues?\s+#?\d+", text, flags=re.I):
        before = text[: match.start()].split()
        if before and before[-1].strip("(\"'`") in OTHER_PROJECTS:
            continue
        found.append(match.group(0))
    return found


def commit_hashes(text: str) -> list[str]:
    """Short or full commit hashes: 7-40 hex digits with a letter and a digit, standing alone (not part of a UUID, a
    longer digest, a colour or a float such as 2250e12)."""
    found = []
    for match in re.finditer(r"(?<![\w#.-])[0-9a-f]{7,40}(?![\w-])", text):
        token = match.group(0)
        if not re.search(r"[a-f]", token) or not re.search(r"[0-9]", token):
            continue
        if re.fullmatch(r"[0-9]+e[0-9]+", token) or token in NOT_COMMITS:
            continue
        found.append(token)
    return found


def pages() -> list[Path]:
    """The pages a reader reads as guides: every doc page but the records."""
    return [path for path in doc_files() if path.exists() and not str(path.relative_to(REPO)).startswith(RECORDS)]


def suite_figures(tests_readme: str) -> list[str]:
    """The suite's test count and time, and the fast tier's, as tests/README.md's tiers table states them."""
    figures = []
    for command in ("`bash scripts/test.sh`", "`bash scripts/test.sh --fast`"):
        row = next(line for line in tests_readme.splitlines() if line.startswith(f"| {command} |"))
        count = re.search(r"~?(\d{3,5})(?: tests| that)", row)
        time = re.search(r"~?\d+m\d+s|~?[\d.]+ min\b", row)
        assert count and time, f"tests/README.md's row of {command} states no test count or time: {row}"
        figures += [count.group(1), time.group(0).lstrip("~")]
    return figures


def repeated_figures(text: str, figures: list[str]) -> list[str]:
    return [figure for figure in figures if re.search(rf"(?<![\w.]){re.escape(figure)}(?![\w.])", text)]


def work_log_words(text: str) -> list[str]:
    text = TECHNICAL_SESSIONS.sub("", text)
    return [match.group(0) for pattern in WORK_LOG_WORDS for match in pattern.finditer(text)]


def test_no_issue_numbers_or_commits_outside_the_records():
    """No page, module, script, recipe or test outside docs/measurements/ cites an issue number of ours or a commit."""
    problems = []
    for path in checked_text_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        where = path.relative_to(REPO)
        problems += [f"{where}: {found!r}" for found in issue_numbers(text)]
        problems += [f"{where}: commit {found}" for found in commit_hashes(text)]
    assert not problems, (
        "issue numbers or commits outside docs/measurements/ (say what is true now; a measurement's commit goes in "
        "its record):\n" + "\n".join(problems)
    )


def test_the_issue_and_commit_finders_catch_bad_examples():
    word = "iss" + "ue"
    ours = f"Until {word} 31 the path averaged; see {word.title()}s #7."
    assert issue_numbers(ours) == [f"{word} 31", f"{word.title()}s #7"]
    assert issue_numbers(f"the adapters drift (TRL {word} 6688), so we merge") == []
    commit = "9dba" + "448"
    assert commit_hashes(f"the docs of that run ({commit}) and main (a8c6" + "fa1)") == [commit, "a8c6" + "fa1"]
    not_commits = "GPU-5f0d3a1c-0d0e-4b1e-9d7a-2a51c9f0e001, 2250e12, 1234567, deadbeef, #1f77b4, " + "ab12" * 16
    assert commit_hashes(not_commits) == []


def test_the_suite_figures_are_stated_in_one_page():
    """tests/README.md states how many tests the suite has and how long it and its fast tier take; other pages link
    to it, so the figures cannot disagree."""
    tests_readme = REPO / "tests/README.md"
    figures = suite_figures(tests_readme.read_text(encoding="utf-8"))
    problems = []
    for path in pages():
        if path != tests_readme:
            problems += [f"{path.relative_to(REPO)}: {figure}" for figure in repeated_figures(path.read_text(), figures)]
    assert not problems, "the suite's figures repeated outside tests/README.md (link to it instead):\n" + "\n".join(
        problems
    )


def test_the_figures_finder_catches_a_repeat():
    table = (
        "| `bash scripts/test.sh` | all 1459 tests on two workers | 36m35s |\n"
        "| `bash scripts/test.sh --fast` | the ~1300 that need no engine | ~5.5 min |\n"
    )
    figures = suite_figures(table)
    assert figures == ["1459", "36m35s", "1300", "5.5 min"]
    assert repeated_figures("the whole suite (1459 tests, 36m35s); the fast tier in 5.5 min", figures) == [
        "1459",
        "36m35s",
        "5.5 min",
    ]
    assert repeated_figures("a 14590-token row took 5.55 min; 1300.5 s", figures) == []


def test_pages_speak_of_no_sessions_rounds_or_lent_machines():
    """A guide says what is true now, not when or by whom it was found: no "this session", "a later round", "a lent
    GPU" outside docs/measurements/."""
    problems = [
        f"{path.relative_to(REPO)}: {found!r}" for path in pages() for found in work_log_words(path.read_text())
    ]
    assert not problems, "work-log words in the pages (move the measurement to docs/measurements/):\n" + "\n".join(
        problems
    )


def test_the_work_log_finder_catches_bad_examples():
    bad = "A later " + "session ran it; the docs of this " + "round; on a " + "lent H200; " + "round 3 fixed it."
    assert len(work_log_words(bad)) == 4
    fine = "a round trip, the other way round, a bf16 engine rounds small updates, no session of its own, `round`"
    assert work_log_words(fine) == []


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
