"""Code verifiers: the program in a response, run in the sandbox against the row's tests; the score is the fraction of
the first `max_tests` tests it passes (or 0/1 against `pass_threshold`).

Ground truth: JSON text in one of two forms.
- verl's (APPS, TACO, CodeContests, PrimeIntellect): `{"inputs": [...], "outputs": [...]}`, one test per pair.
  Without `fn_name` each input is the program's standard input and each output its expected standard output (a list
  of lines is joined with newlines). With `"fn_name": "f"` the program defines `f` (or a class `Solution` with method
  `f`), each input is the JSON list of its arguments and each output its JSON return value; APPS' habit of wrapping
  the value in a one-element list is accepted.
- open-instruct's: a list of assert statements (`["assert add(1, 2) == 3", ...]`), each rewritten into a call test
  (`call_tests.rewrite_asserts`); a statement that cannot be rewritten is refused when the row loads.
Outputs are compared after stripping trailing whitespace from every line and trailing blank lines.

The program: the last ```python (or ```py, ```python3, or unlabelled) fenced block of the response, after any
`</think>`; a response without one is taken whole, as a program written without markdown. Each test runs in a fresh
sandboxed process (`open_instruct.sandbox`). Nothing the program controls decides a pass inside the sandbox: the
expected outputs never enter it, stdout is compared here as text, and a call's value comes back as JSON text (from a
harness process the program cannot read or write: code_harness.py), is decoded here with caps on its length and
nesting, and is compared here in plain Python (`call_tests.passes`). Nothing the program writes is evaluated or
unpickled. After a test that times out the remaining ones count as failed without running: a program that loops on
one input nearly always loops on the others, and each would cost a full timeout.

Every test ends in one OUTCOMES entry; `CodeVerifier.take_outcomes()` hands the counts to the step's metrics.
"""

import functools
import json
import secrets
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from open_instruct.rewards.call_tests import JSON_EQUAL, CallTest, passes, rewrite_asserts
from open_instruct.rewards.code_runner import tagged, untagged
from open_instruct.sandbox import ISOLATED, SANDBOX_ERROR, TIMEOUT, Limits, RunResult, Sandbox, SandboxPool

HARNESS_FILES = {
    name: (Path(__file__).parent / name).read_text() for name in ("code_harness.py", "code_runner.py")
}
FENCE = "```"
PYTHON_LABELS = ("python", "py", "python3", "")
THINK_END = "</think>"
DEFAULT_MAX_TESTS = 10
TEST_FORMS = (
    'verl\'s {"inputs": [...], "outputs": [...], "fn_name"?: "..."} or a list of assert statements '
    '["assert f(1) == 2", ...]'
)
# A call's reported value: longer or deeper JSON is no value (decoding it could exhaust memory or the stack).
MAX_VALUE_CHARS = 1 << 20
MAX_VALUE_DEPTH = 100
# How each test ended (the keys of `CodeVerifier.take_outcomes`).
PASSED, WRONG, CRASHED, TIMED_OUT, NO_VALUE, BAD_VALUE, SANDBOX_FAILED, SKIPPED = (
    "passed", "wrong", "crashed", "timeout", "no_value", "bad_value", "sandbox_error", "skipped_after_timeout",
)  # fmt: skip
OUTCOMES = (PASSED, WRONG, CRASHED, TIMED_OUT, NO_VALUE, BAD_VALUE, SANDBOX_FAILED, SKIPPED)


@dataclass(frozen=True)
class CodeTests:
    """A row's tests: `kind` "stdio" (`inputs` are stdin texts, `outputs` the expected stdout texts) or "call"
    (`inputs` are `CallTest`s, checked outside the sandbox; `outputs` is empty). `from_asserts`: rewritten from
    assert statements."""

    kind: str
    inputs: tuple
    outputs: tuple = ()
    from_asserts: bool = False

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
    """The tests a code row's ground truth holds; ValueError in one line naming what is wrong and the forms expected
    (an assert that cannot be rewritten into a call test included)."""
    try:
        tests = json.loads(ground_truth)
    except (json.JSONDecodeError, TypeError, RecursionError) as error:
        raise ValueError(f"code tests {str(ground_truth)[:80]!r} are not valid JSON ({error}); expected {TEST_FORMS}"
                         ) from None  # fmt: skip
    if isinstance(tests, list):
        if not tests or not all(isinstance(test, str) and test.strip() for test in tests):
            raise ValueError(f"code tests {str(ground_truth)[:80]!r} are not a non-empty list of assert statements; "
                             f"expected {TEST_FORMS}")  # fmt: skip
        return CodeTests("call", tuple(call for test in tests for call in rewrite_asserts(test)), from_asserts=True)
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
        calls = (CallTest(fn_name, tuple(args) if isinstance(args, list) else (args,), check=JSON_EQUAL,
                          expected=output) for args, output in zip(inputs, outputs))  # fmt: skip
        return CodeTests("call", tuple(calls))
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


def json_depth(text: str) -> int:
    """How deeply `text`'s arrays and objects nest (brackets inside strings not counted), read without decoding."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def reported_value(run: RunResult, nonce: str) -> tuple[str, object]:
    """(outcome, value) of a call test's run: PASSED-able ("value", the decoded value) when the harness reported,
    else the outcome saying why not. Never raises: a value too long, too deep, not JSON, an integer past Python's
    digit limit or a malformed tag is BAD_VALUE."""
    if not run.ok:
        return (TIMED_OUT if run.verdict == TIMEOUT else CRASHED), None
    marker = nonce + " "
    for line in reversed(run.stdout.splitlines()):
        if line.startswith(marker):
            text = line[len(marker) :]
            if len(text) > MAX_VALUE_CHARS or json_depth(text) > MAX_VALUE_DEPTH:
                return BAD_VALUE, None
            try:
                return "value", untagged(json.loads(text))
            except (ValueError, TypeError, RecursionError, MemoryError):
                return BAD_VALUE, None
    return NO_VALUE, None


class CodeVerifier:
    """Scores responses against code tests in a sandbox; `score_many` spreads the rows over a pool of workers."""

    def __init__(self, sandbox: Sandbox, max_tests: int = DEFAULT_MAX_TESTS, pass_threshold: float | None = None,
                 workers: int = 1):  # fmt: skip
        self.sandbox = sandbox
        self.max_tests = max_tests
        self.pass_threshold = pass_threshold
        self.pool = SandboxPool(workers)
        self._outcomes = Counter()
        self._outcomes_lock = threading.Lock()

    def run_test(self, program: str, tests: CodeTests, index: int) -> tuple[str, RunResult]:
        """(outcome, the run) of test `index`: PASSED, WRONG, or why it has no verdict (OUTCOMES)."""
        if tests.kind == "stdio":
            run = self.sandbox.run_python(program, tests.inputs[index])
            if run.verdict == SANDBOX_ERROR:
                return SANDBOX_FAILED, run
            if not run.ok:
                return (TIMED_OUT if run.verdict == TIMEOUT else CRASHED), run
            right = normalise_output(run.stdout) == normalise_output(tests.outputs[index])
            return (PASSED if right else WRONG), run
        test: CallTest = tests.inputs[index]
        nonce = secrets.token_hex(16)
        request = {"nonce": nonce, "fn_name": test.fn_name, "args": tagged(list(test.args)),
                   "kwargs": tagged(test.kwargs)}  # fmt: skip
        run = self.sandbox.run_python(HARNESS_FILES["code_harness.py"], json.dumps(request),
                                      files={"solution.py": program,
                                             "code_runner.py": HARNESS_FILES["code_runner.py"]})  # fmt: skip
        if run.verdict == SANDBOX_ERROR:
            return SANDBOX_FAILED, run
        outcome, value = reported_value(run, nonce)
        if outcome != "value":
            return outcome, run
        return (PASSED if passes(test, value) else WRONG), run

    def test_results(self, response: str, ground_truth: str) -> list[bool]:
        """Whether the response's program passes each of the first `max_tests` tests (False for those skipped after a
        timeout)."""
        return [outcome == PASSED for outcome in self.test_outcomes(response, ground_truth)]

    def test_outcomes(self, response: str, ground_truth: str) -> list[str]:
        """How each of the first `max_tests` tests ended (OUTCOMES), counted for `take_outcomes`."""
        tests = parse_tests(ground_truth)
        program = extract_program(response)
        count = min(len(tests), self.max_tests) if self.max_tests > 0 else len(tests)
        outcomes = []
        for index in range(count):
            outcome, _ = self.run_test(program, tests, index)
            outcomes.append(outcome)
            if outcome == TIMED_OUT:
                outcomes += [SKIPPED] * (count - len(outcomes))
                break
        with self._outcomes_lock:
            self._outcomes.update(outcomes)
        return outcomes

    def take_outcomes(self) -> dict[str, int]:
        """The tests' outcomes counted since the last call (OUTCOMES -> count), and the count restarted."""
        with self._outcomes_lock:
            counts, self._outcomes = dict(self._outcomes), Counter()
        return counts

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
