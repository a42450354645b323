"""Code verifiers: a response's program graded against verl's stdin/stdout and function-call tests and open-instruct's
assert statements, in the sandbox; the fraction, the threshold, the first-N cut; the pool's scores equal the serial
ones and come faster; code rows through the reward manager and the row loader; the start-up sandbox check."""

import json
import time
from pathlib import Path

import pytest

from open_instruct.data.prompt_dataset import load_prompt_dataset
from open_instruct.data.sources import normalise_row
from open_instruct.rewards.code_tests import CodeVerifier, extract_program, normalise_output, parse_tests
from open_instruct.rewards.manager import RewardConfig, RewardManager
from open_instruct.rewards.verifiers import GROUND_TRUTH_CHECKS, resolve_verifier_name
from open_instruct.sandbox import ISOLATED, Limits, Sandbox, isolation_problem

PROBLEM = isolation_problem()
needs_sandbox = pytest.mark.skipif(PROBLEM is not None, reason=f"isolation impossible here: {PROBLEM}")

ADD_STDIO = json.dumps({"inputs": ["1 2\n", "3 4\n", "10 -3\n"], "outputs": ["3\n", "7\n", "7\n"]})
ADD_CALL = json.dumps({"inputs": [[1, 2], [3, 4], [10, -3]], "outputs": [3, [7], 7], "fn_name": "add"})
ADD_ASSERTS = json.dumps(["assert add(1, 2) == 3", "assert add(3, 4) == 7", "assert add(10, -3) == 7"])
READ_AND_ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
DEFINE_ADD = "def add(a, b):\n    return a + b\n"
# Right on the first test only: 1 + 2 = 3 but 3 * 4 != 7.
READ_AND_MULTIPLY_OR_3 = "a, b = map(int, input().split())\nprint(3 if (a, b) == (1, 2) else a * b)\n"
DEFINE_WRONG_ADD = "def add(a, b):\n    return 3 if (a, b) == (1, 2) else a * b\n"


def fenced(program: str, prose: str = "Here is my solution.") -> str:
    return f"{prose}\n```python\n{program}```\nIt reads the input and prints the sum."


@pytest.fixture(scope="module")
def verifier() -> CodeVerifier:
    return CodeVerifier(Sandbox(ISOLATED, Limits(wall_time_s=5.0)))


@pytest.fixture(scope="module")
def quick_verifier() -> CodeVerifier:
    """For programs meant to run into the time limit."""
    return CodeVerifier(Sandbox(ISOLATED, Limits(wall_time_s=0.5)))


# ---- what needs no sandbox: parsing the tests and the response ----------------------------------------------------


def test_tests_are_parsed_in_each_form():
    stdio = parse_tests(json.dumps({"inputs": [["1 2", "3"]], "outputs": ["3"]}))
    assert (stdio.kind, stdio.inputs, stdio.outputs) == ("stdio", ("1 2\n3\n",), ("3",))
    call = parse_tests(json.dumps({"inputs": [[1, 2], 5], "outputs": [3, 5], "fn_name": "f"}))
    assert call.kind == "call" and [(test.fn_name, test.args, test.expected) for test in call.inputs] == [
        ("f", (1, 2), 3), ("f", (5,), 5)
    ]
    asserts = parse_tests(ADD_ASSERTS)
    assert (asserts.kind, asserts.from_asserts, len(asserts)) == ("call", True, 3)
    assert [(test.fn_name, test.args, test.check, test.expected) for test in asserts.inputs][0] == (
        "add", (1, 2), "equal", 3
    )
    assert parse_tests(json.dumps({"inputs": ["1"], "outputs": ["1"], "fn_name": ""})).kind == "stdio"  # verl's blank


@pytest.mark.parametrize(
    ("ground_truth", "message"),
    [
        ("assert add(1, 2) == 3", "are not valid JSON"),
        ("['assert add(1, 2) == 3']", "are not valid JSON"),  # a Python literal: never evaluated
        ("[]", "not a non-empty list of assert statements"),
        ('{"inputs": [], "outputs": []}', "hold no test"),
        ('{"inputs": ["1", "2"], "outputs": ["1"]}', "have 2 inputs but 1 outputs"),
        ('{"inputs": ["1"]}', "have no `inputs` and `outputs` lists"),
        ('{"inputs": [1], "outputs": [1]}', "test 0's input is int"),
        ('{"inputs": [[1]], "outputs": [1], "fn_name": "not a name"}', "is not a Python function name"),
        ("42", "have no `inputs` and `outputs` lists"),
        # Asserts that cannot be checked outside the program are refused, naming the statement.
        ('["x = add(1, 2)\\nassert x == 3"]', "'x = add.1, 2.' cannot be checked outside the program .a statement that is not an assert"),
        ('["assert add(1, 2) > 2"]', "the comparison Gt"),
        ('["assert add(two(), 2) == 4"]', "neither side is a call with literal arguments"),
        ('["assert add(1, 2) == 1 < 2"]', "a chained comparison"),
        ('["assert add(1, 2) is 3"]', "`is` against something other than True, False or None"),
        ('["assert all(add(i, 0) == i for i in range(3))"]', "not a call with literal arguments"),
        ('["for i in range(3): assert add(i, 0) == i"]', "a statement that is not an assert"),
        ('["assert add(1, 2) ==="]', "not valid Python"),
    ],
)
def test_tests_the_verifier_cannot_run_are_refused_in_one_line(ground_truth, message):
    with pytest.raises(ValueError, match=message) as error:
        GROUND_TRUTH_CHECKS[resolve_verifier_name("codecontests")](ground_truth)
    assert "\n" not in str(error.value)


def test_the_program_is_the_last_python_block_or_the_whole_response():
    two_blocks = "```python\nprint(1)\n```\nbetter:\n```py\nprint(2)\n```\n```text\nnot code\n```"
    assert extract_program(two_blocks) == "print(2)"
    assert extract_program("```cpp\nint main();\n```\nand\n```\nprint(3)\n```") == "print(3)"
    assert extract_program("<think>```python\nprint(0)\n```</think>print(4)") == "print(4)"
    assert extract_program("print(5)") == "print(5)"
    assert extract_program("Sure:\n```python\nprint(6)\n") == "print(6)\n"  # cut off at the length limit
    assert extract_program("```python\nx = 7\nprint(x)```\nDone.") == "x = 7\nprint(x)"


def test_outputs_compare_without_trailing_whitespace():
    assert normalise_output("1 2 \n3\t\n\n") == normalise_output("1 2\n3") != normalise_output(" 1 2\n3")


def test_aliases_of_the_code_data_sources():
    for name in ("code", "codecontests", "apps", "taco", "codeforces", "PrimeIntellect", "deepmind/code_contests"):
        assert resolve_verifier_name(name) == "code"


def test_the_row_loader_keeps_code_tests_whole_as_json():
    asserts = ["assert add(1, 2) == 3", "assert add(3, 4) == 7"]
    row = normalise_row({"prompt": "Write add.", "ground_truth": asserts, "dataset": "code"}, "row 0", "f")
    assert json.loads(row["ground_truth"]) == asserts
    verl = {"prompt": [{"role": "user", "content": "Add."}], "data_source": "taco",
            "reward_model": {"ground_truth": {"inputs": ["1 2\n"], "outputs": ["3\n"]}, "style": "rule"}}  # fmt: skip
    assert json.loads(normalise_row(verl, "row 1", "f")["ground_truth"]) == {"inputs": ["1 2\n"], "outputs": ["3\n"]}
    gsm8k = normalise_row({"prompt": "q", "ground_truth": ["72", "seventy-two"], "dataset": "gsm8k"}, "row 2", "f")
    assert gsm8k["ground_truth"] == "72"  # other verifiers keep a list's first element


# ---- graded in the sandbox ------------------------------------------------------------------------------------------


@needs_sandbox
@pytest.mark.parametrize(
    ("tests", "right", "partly_right"),
    [(ADD_STDIO, READ_AND_ADD, READ_AND_MULTIPLY_OR_3), (ADD_CALL, DEFINE_ADD, DEFINE_WRONG_ADD),
     (ADD_ASSERTS, DEFINE_ADD, DEFINE_WRONG_ADD)],
    ids=["stdio", "call", "assert"],
)  # fmt: skip
def test_right_wrong_and_crashing_programs_in_each_form(verifier, tests, right, partly_right):
    assert verifier.score(fenced(right), tests) == 1.0
    assert verifier.score(fenced(partly_right), tests) == pytest.approx(1 / 3)
    assert verifier.score(fenced("raise SystemExit(0)\n"), tests) == 0.0  # exits "successfully" before any output
    assert verifier.score(fenced("import os\nos._exit(0)\n"), tests) == 0.0
    assert verifier.score(fenced("def add(a, b):\n    return 1 / 0\nprint(1 / 0)\n"), tests) == 0.0


@needs_sandbox
def test_a_class_solution_method_is_called_and_its_prints_do_not_count(verifier):
    program = "class Solution:\n    def add(self, a, b):\n        print('debug', a, b)\n        return a + b\n"
    assert verifier.score(program, ADD_CALL) == 1.0
    assert verifier.score("def add(a, b):\n    return {a + b}\n", ADD_CALL) == 0.0  # a set is no JSON value


@needs_sandbox
def test_a_program_that_times_out_scores_zero_and_stops_the_row(quick_verifier):
    start = time.monotonic()
    assert quick_verifier.test_results("while True:\n    pass\n", ADD_STDIO) == [False, False, False]
    assert time.monotonic() - start < 2 * 0.5 + 1.0  # one timeout, not three
    looping_on_the_second = "a, b = map(int, input().split())\nwhile (a, b) == (3, 4):\n    pass\nprint(a + b)\n"
    assert quick_verifier.test_results(looping_on_the_second, ADD_STDIO) == [True, False, False]


@needs_sandbox
def test_threshold_and_first_n_tests():
    sandbox = Sandbox(ISOLATED, Limits(wall_time_s=5.0))
    assert CodeVerifier(sandbox, pass_threshold=0.3).score(READ_AND_MULTIPLY_OR_3, ADD_STDIO) == 1.0
    assert CodeVerifier(sandbox, pass_threshold=0.5).score(READ_AND_MULTIPLY_OR_3, ADD_STDIO) == 0.0
    assert CodeVerifier(sandbox, max_tests=1).score(READ_AND_MULTIPLY_OR_3, ADD_STDIO) == 1.0
    assert CodeVerifier(sandbox, max_tests=0).test_results(READ_AND_MULTIPLY_OR_3, ADD_STDIO) == [True, False, False]


@needs_sandbox
def test_the_pool_scores_as_serial_and_faster_on_two_workers():
    sandbox = Sandbox(ISOLATED, Limits(wall_time_s=5.0))
    sleeping = "import time\ntime.sleep(0.15)\n"
    responses = [sleeping + READ_AND_ADD, sleeping + READ_AND_MULTIPLY_OR_3] * 2
    tests = [json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]})] * 4
    timings, scores = {}, {}
    for workers in (1, 2):
        verifier = CodeVerifier(sandbox, workers=workers)
        start = time.monotonic()
        scores[workers] = verifier.score_many(responses, tests)
        timings[workers] = time.monotonic() - start
        verifier.pool.close()
    assert scores[1] == scores[2] == [1.0, 0.5, 1.0, 0.5]
    assert timings[2] < 0.75 * timings[1], timings


@needs_sandbox
def test_code_rows_through_the_reward_manager():
    manager = RewardManager(RewardConfig(verification_reward=2.0, code_workers=2, code_timeout_s=5.0))
    score, correct, metrics = manager.score_and_correct(
        [fenced(READ_AND_ADD), fenced(READ_AND_MULTIPLY_OR_3), "the answer is 72", fenced(DEFINE_ADD)],
        [ADD_STDIO, ADD_STDIO, "72", ADD_ASSERTS],
        ["codecontests", "apps", "gsm8k", "code"],
        [True] * 4,
    )
    assert correct.tolist() == pytest.approx([1.0, 1 / 3, 1.0, 1.0])
    assert score.tolist() == pytest.approx([2.0, 2 / 3, 2.0, 2.0])
    assert metrics["objective/code_correct_rate"] == pytest.approx((1 + 1 / 3 + 1) / 3)
    assert metrics["objective/gsm8k_correct_rate"] == 1.0
    assert metrics["time/reward"] > 0
    # 3 + 3 + 3 tests: 7 passed, the wrong program's last two wrong.
    assert (metrics["code/tests_passed"], metrics["code/tests_wrong"]) == pytest.approx((7 / 9, 2 / 9))
    assert metrics["code/tests_timeout"] == metrics["code/tests_bad_value"] == 0.0


FIXTURE = Path(__file__).resolve().parents[1] / "open_instruct" / "data" / "fixtures" / "code_problems.jsonl"
# A right answer to each shipped problem, in its order: each must score 1, so that every row can be learned.
FIXTURE_SOLUTIONS = [
    READ_AND_ADD,
    "print(input()[::-1])",
    "print(int(input()) * 2)",
    "print(input().upper())",
    DEFINE_ADD,
    "def is_even(n):\n    return n % 2 == 0\n",
    "def square(x):\n    return x * x\n",
    "def largest(numbers):\n    return max(numbers)\n",
]


@needs_sandbox
def test_the_shipped_code_fixture_loads_and_each_problem_can_be_solved(verifier):
    """`--dataset_mixer_list open_instruct/data/fixtures/code_problems.jsonl 8`: every row loads, passes the start-up
    check, and a right program scores 1 on it (a wrong one 0)."""
    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    loaded = load_prompt_dataset([str(FIXTURE), str(len(rows))], ["train"], seed=0)
    assert sorted(loaded["ground_truth"]) == sorted(row["ground_truth"] for row in rows)
    forms = {(tests.kind, tests.from_asserts) for tests in (parse_tests(row["ground_truth"]) for row in rows)}
    assert forms == {("stdio", False), ("call", False), ("call", True)}
    for row, solution in zip(rows, FIXTURE_SOLUTIONS, strict=True):
        GROUND_TRUTH_CHECKS[resolve_verifier_name(row["dataset"])](row["ground_truth"])
        assert verifier.score(fenced(solution), row["ground_truth"]) == 1.0, row["messages"][0]["content"]
    assert verifier.score(fenced("print('no')"), rows[0]["ground_truth"]) == 0.0
