"""Code verifiers: the program in a response, run in the sandbox against the row's tests; the score is the fraction of
the first `max_tests` tests it passes (or 0/1 against `pass_threshold`).

Ground truth: JSON text in one of two forms.
- verl's (APPS, TACO, CodeContests, PrimeIntellect): `{"inputs": [...], "outputs": [...]}`, one test per pair.
  Without `fn_name` each input is the program's standard input and each output its expected standard output (a list
  of lines is joined with newlines). With `"fn_name": "f"` the program defines `f` (or a class `Solution` with method
  `f`), each input is the JSON list of its arguments and each output its JSON return value; APPS' habit of wrapping
  the value in a one-element list is accepted.
- open-instruct's: a list of test statements (`["assert add(1, 2) == 3", ...]`), each run after the program.
Outputs are compared after stripping trailing whitespace from every line and trailing blank lines.

The program: the last ```python (or ```py, ```python3, or unlabelled) fenced block of the response, after any
`</think>`; a response without one is taken whole, as a program written without markdown. Each test runs in a fresh
sandboxed process (`open_instruct.sandbox`); the expected outputs never enter the sandbox, and nothing the program
writes is evaluated or unpickled here: stdout is compared as text, return values read as JSON. After a test that
times out the remaining ones count as failed without running: a program that loops on one input nearly always loops
on the others, and each would cost a full timeout.
"""

import functools
import json
import secrets
from dataclasses import dataclass
from pathlib import Path

from open_instruct.sandbox import ISOLATED, Limits, RunResult, Sandbox, SandboxPool
from open_instruct.sandbox.isolation import TIMEOUT

HARNESS_SOURCE = (Path(__file__).parent / "code_harness.py").read_text()
FENCE = "```"
PYTHON_LABELS = ("python", "py", "python3", "")
THINK_END = "</think>"
DEFAULT_MAX_TESTS = 10
TEST_FORMS = (
    'verl\'s {"inputs": [...], "outputs": [...], "fn_name"?: "..."} or a list of assert statements '
    '["assert f(1) == 2", ...]'
)


@dataclass(frozen=True)
class CodeTests:
    """A row's tests: `kind` "stdio" (inputs are stdin, outputs stdout), "call" (inputs are argument lists, outputs
    return values, of `fn_name`) or "assert" (each input a statement; no outputs)."""

    kind: str
    inputs: tuple
    outputs: tuple = ()
    fn_name: str | None = None

    def __len__(self) -> int:
        return len(self.inputs)


def lines_text(value, what: str, index: int) -> str:
    """A stdin/stdout test value as text: a string, or a list of lines joined with newlines."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "\n".join(value) + "\n"
    raise ValueError(f"code test {index}'s {what} is {type(value).__name__} {str(value)[:60]!r}, expected a string "
                     "(or a list of lines) for a stdin/stdout test; give `fn_name` for function-call tests")  # fmt: skip


def parse_tests(ground_truth: str) -> CodeTests:
    """The tests a code row's ground truth holds; ValueError in one line naming what is wrong and the forms expected."""
    try:
        tests = json.loads(ground_truth)
    except (json.JSONDecodeError, TypeError) as error:
        raise ValueError(f"code tests {str(ground_truth)[:80]!r} are not valid JSON ({error}); expected {TEST_FORMS}"
                         ) from None  # fmt: skip
    if isinstance(tests, list):
        if not tests or not all(isinstance(test, str) and test.strip() for test in tests):
            raise ValueError(f"code tests {str(ground_truth)[:80]!r} are not a non-empty list of assert statements; "
                             f"expected {TEST_FORMS}")  # fmt: skip
        return CodeTests("assert", tuple(tests))
    if (
        not isinstance(tests, dict)
        or not isinstance(tests.get("inputs"), list)
        or not isinstance(tests.get("outputs"), list)
    ):
        raise ValueError(
            f"code tests {str(ground_truth)[:80]!r} have no `inputs` and `outputs` lists; expected {TEST_FORMS}"
        )
    inputs, outputs, fn_name = tests["inputs"], tests["outputs"], tests.get("fn_name")
    if len(inputs) != len(outputs):
        raise ValueError(f"code tests have {len(inputs)} inputs but {len(outputs)} outputs; give one output per input")
    if not inputs:
        raise ValueError(f"code tests {str(ground_truth)[:80]!r} hold no test; give at least one input and output")
    if fn_name is not None and fn_name != "":
        if not isinstance(fn_name, str) or not fn_name.isidentifier():
            raise ValueError(f"code tests' fn_name {fn_name!r} is not a Python function name")
        return CodeTests(
            "call", tuple(args if isinstance(args, list) else [args] for args in inputs), tuple(outputs), fn_name
        )
    return CodeTests("stdio", tuple(lines_text(value, "input", i) for i, value in enumerate(inputs)),
                     tuple(lines_text(value, "output", i) for i, value in enumerate(outputs)))  # fmt: skip


def check_ground_truth(ground_truth: str) -> None:
    """GROUND_TRUTH_CHECKS' entry for `code`: raises ValueError for tests the verifier cannot run."""
    parse_tests(ground_truth)


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(label, body) of each markdown fenced block, read line by line (a block left open at the end counts: a response
    cut at its length limit keeps its last code; a fence may close at the end of a code line)."""
    blocks, label, lines = [], "", None
    for line in text.split("\n"):
        stripped = line.strip()
        if lines is None:
            if stripped.startswith(FENCE):
                label, lines = stripped[len(FENCE) :].strip().lower(), []
        elif stripped.startswith(FENCE):
            blocks.append((label, "\n".join(lines)))
            lines = None
        elif stripped.endswith(FENCE):  # "    return x```": the fence closed on the code's last line
            blocks.append((label, "\n".join(lines + [line.rstrip()[: -len(FENCE)]])))
            lines = None
        else:
            lines.append(line)
    if lines is not None:
        blocks.append((label, "\n".join(lines)))
    return blocks


def extract_program(response: str) -> str:
    """The program in a response: its last python (or unlabelled) fenced block after any `</think>`, else all of it."""
    if THINK_END in response:
        response = response.rsplit(THINK_END, 1)[1]
    python_blocks = [body for label, body in fenced_blocks(response) if label in PYTHON_LABELS]
    return python_blocks[-1] if python_blocks else response


def normalise_output(text: str) -> str:
    """Trailing whitespace of each line and trailing blank lines dropped: "1 2 \\n3\\n\\n" and "1 2\\n3" match."""
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


def reported_value(run: RunResult, nonce: str) -> tuple[bool, object]:
    """(whether the harness reported, the JSON value it reported): the last stdout line that starts with the nonce."""
    if not run.ok:
        return False, None
    marker = nonce + " "
    for line in reversed(run.stdout.splitlines()):
        if line.startswith(marker):
            try:
                return True, json.loads(line[len(marker) :])
            except json.JSONDecodeError:
                return False, None
    return False, None


def return_value_matches(value: object, expected: object) -> bool:
    return value == expected or (isinstance(expected, list) and len(expected) == 1 and value == expected[0])


class CodeVerifier:
    """Scores responses against code tests in a sandbox; `score_many` spreads the rows over a pool of workers."""

    def __init__(self, sandbox: Sandbox, max_tests: int = DEFAULT_MAX_TESTS, pass_threshold: float | None = None,
                 workers: int = 1):  # fmt: skip
        self.sandbox = sandbox
        self.max_tests = max_tests
        self.pass_threshold = pass_threshold
        self.pool = SandboxPool(workers)

    def run_test(self, program: str, tests: CodeTests, index: int) -> tuple[bool, RunResult]:
        """(passed, the run) of test `index`."""
        if tests.kind == "stdio":
            run = self.sandbox.run_python(program, tests.inputs[index])
            return run.ok and normalise_output(run.stdout) == normalise_output(tests.outputs[index]), run
        nonce = secrets.token_hex(16)
        if tests.kind == "call":
            request, expected = (
                {"nonce": nonce, "fn_name": tests.fn_name, "args": tests.inputs[index]},
                tests.outputs[index],
            )
        else:
            request, expected = {"nonce": nonce, "test": tests.inputs[index]}, None
        run = self.sandbox.run_python(HARNESS_SOURCE, json.dumps(request), files={"solution.py": program},
                                      argv=(tests.kind,))  # fmt: skip
        reported, value = reported_value(run, nonce)
        return reported and (tests.kind == "assert" or return_value_matches(value, expected)), run

    def test_results(self, response: str, ground_truth: str) -> list[bool]:
        """Whether the response's program passes each of the first `max_tests` tests (False for those skipped after a
        timeout)."""
        tests = parse_tests(ground_truth)
        program = extract_program(response)
        count = min(len(tests), self.max_tests) if self.max_tests > 0 else len(tests)
        passed = []
        for index in range(count):
            ok, run = self.run_test(program, tests, index)
            passed.append(ok)
            if run.verdict == TIMEOUT:
                passed += [False] * (count - len(passed))
                break
        return passed

    def score(self, response: str, ground_truth: str) -> float:
        """The fraction of tests passed, or 1.0/0.0 against `pass_threshold` when one is set."""
        passed = self.test_results(response, ground_truth)
        fraction = sum(passed) / len(passed)
        if self.pass_threshold is None:
            return fraction
        return float(fraction >= self.pass_threshold)

    def score_many(self, responses: list[str], ground_truths: list[str]) -> list[float]:
        """`score` of each (response, ground truth), on the pool's workers; in order."""
        return self.pool.map(lambda pair: self.score(*pair), list(zip(responses, ground_truths)))

    def __call__(self, response: str, ground_truth: str) -> float:
        return self.score(response, ground_truth)


@functools.lru_cache(maxsize=1)
def default_verifier() -> CodeVerifier:
    """The verifier `VERIFIERS["code"]` calls: isolated sandbox, default limits, one worker. A run configures its own
    from the --code_* flags (rewards.RewardManager)."""
    return CodeVerifier(Sandbox(ISOLATED, Limits()))


def code(response: str, ground_truth: str) -> float:
    """Code: the fraction of the row's tests (first DEFAULT_MAX_TESTS) the response's program passes in the sandbox."""
    return default_verifier().score(response, ground_truth)
