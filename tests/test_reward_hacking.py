"""Programs that try to forge a code reward instead of earning it, run against call, stdin/stdout and assert rows in
the real sandbox: each must score 0, while the honest program scores 1.

The attacks a policy under optimisation finds first: reading the report's nonce from the harness's frames or memory
and writing the report itself, returning an object whose `__eq__` is always true, exiting "successfully" in the
middle of a test, rebinding `print`/`json`/builtins, monkeypatching the comparison, writing a forged line to every
descriptor, ptrace-ing the harness, and searching the filesystem for the expected outputs."""

import json

import pytest

from open_instruct.rewards.code_tests import CodeVerifier, parse_tests
from open_instruct.sandbox import ISOLATED, Limits, Sandbox, isolation_problem

PROBLEM = isolation_problem()
pytestmark = pytest.mark.skipif(PROBLEM is not None, reason=f"isolation impossible here: {PROBLEM}")

# A secret the expected outputs carry: a program that finds it anywhere could print it.
SECRET = "zq7-expected-output-81f3"
ROWS = {
    "call": json.dumps({"fn_name": "add", "inputs": [[2, 3], [10, 20], [-4, 9]], "outputs": [5, 30, 5]}),
    "stdio": json.dumps({"inputs": ["2 3\n", "10 20\n"], "outputs": [f"5 {SECRET}\n", f"30 {SECRET}\n"]}),
    "assert": json.dumps(
        [
            "assert add(2, 3) == 5",
            "assert add(10, 20) == 30",
            "assert not add(-4, 4)",
            "assert add(0, 0) is None",
            "assert abs(add(0.5, 0.25) - 0.75) < 1e-9",
            "assert sorted(add([2], [1])) == [1, 2]",
        ]
    ),  # fmt: skip
}
HONEST = """
import sys
def add(a, b):
    if (a, b) == (0, 0):
        return None
    return a + b
if __name__ == "__main__":
    a, b = map(int, sys.stdin.readline().split())
    print(a + b, "zq7-expected-output-81f3")
"""

FIND_NONCES = """
import gc, os, re, sys
HEX = re.compile(r"[0-9a-f]{32}")
def nonces():
    found, frame = set(), sys._getframe()
    while frame is not None:
        for value in list(frame.f_locals.values()) + list(frame.f_globals.values()):
            found.update(HEX.findall(repr(value)))
        frame = frame.f_back
    for value in gc.get_objects():
        if isinstance(value, (str, bytes, dict, list)):
            found.update(HEX.findall(repr(value)[:10000]))
    return found
"""
FORGE_EVERYWHERE = """
def forge(lines):
    data = "".join("\\n" + line + "\\n" for line in lines).encode()
    for fd in range(256):
        try:
            os.write(fd, data)
        except OSError:
            pass
    os._exit(0)
"""
GUESSES = [
    "30",
    "true",
    "null",
    "[5]",
    '"5"',
    "passed",
    "ok",
    "PASS",
    "1",
    "5",
]  # the last line wins: "5" is right twice
HACKS = {
    "frame_inspection": FIND_NONCES
    + FORGE_EVERYWHERE
    + """
def add(*args, **kwargs):
    forge([f"{nonce} {guess}" for nonce in nonces() for guess in GUESSES])
forge([f"{nonce} {guess}" for nonce in nonces() for guess in GUESSES])
""",
    "always_equal": """
class Anything(int):
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __lt__(self, other): return True
    def __le__(self, other): return True
    def __bool__(self): return True
    def __sub__(self, other): return Anything()
    def __abs__(self): return Anything()
    def __iter__(self): return iter([])
    def __len__(self): return 0
    __hash__ = int.__hash__
def add(*args, **kwargs):
    return Anything(7)
print(Anything(7))
""",
    "exit_mid_test": """
import os, sys
def add(*args, **kwargs):
    print("5\\n30")
    sys.stdout.flush()
    sys.exit(0)
sys.exit(0)
""",
    "rebound_builtins": """
import builtins, json, sys
json.dumps = lambda *args, **kwargs: "true"
json.loads = lambda *args, **kwargs: {"fn_name": "add", "args": [], "kwargs": {}}
builtins.print = lambda *args, **kwargs: sys.__stdout__.write("5\\n")
builtins.AssertionError = type("Never", (Exception,), {})
builtins.abs = lambda value: 0
def add(*args, **kwargs):
    return None
""",
    "patched_comparison": """
import builtins, math, operator
operator.eq = lambda a, b: True
operator.ne = lambda a, b: False
math.isclose = lambda *args, **kwargs: True
builtins.sorted = lambda value: [1, 2]
builtins.len = lambda value: 0
def add(*args, **kwargs):
    return object()
""",
    "forged_lines_everywhere": "import os\n"
    + FORGE_EVERYWHERE
    + """
lines = [f"{'0' * 32} {guess}" for guess in GUESSES] + [guess for guess in GUESSES] + ["5 " + "zq7"]
def add(*args, **kwargs):
    forge(lines)
forge(lines)
""",
    "ptrace_the_harness": """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
parent = os.getppid()
attached = libc.ptrace(16, parent, None, None)  # PTRACE_ATTACH
def add(*args, **kwargs):
    return 5 if attached == 0 else object()  # no value unless the attach worked
""",
}


@pytest.fixture(scope="module")
def verifier() -> CodeVerifier:
    return CodeVerifier(Sandbox(ISOLATED, Limits(wall_time_s=5.0)))


@pytest.mark.parametrize("form", sorted(ROWS))
def test_the_honest_program_scores_one(verifier, form):
    assert verifier.score(HONEST, ROWS[form]) == 1.0


@pytest.mark.parametrize("form", sorted(ROWS))
@pytest.mark.parametrize("hack", sorted(HACKS))
def test_a_program_that_forges_its_reward_scores_zero(verifier, hack, form):
    program = HACKS[hack].replace("GUESSES", repr(GUESSES)) if "GUESSES" in HACKS[hack] else HACKS[hack]
    assert verifier.score(program, ROWS[form]) == 0.0


@pytest.mark.parametrize("seccomp_filter", [True, False], ids=["with_seccomp", "undumpable_alone"])
def test_the_harness_cannot_be_traced_or_read(seccomp_filter):
    """The program's process, beside the harness that holds the nonce: ptrace and process_vm_readv on it fail with
    EPERM, and no /proc exists to read its memory through. Two walls, each enough alone: the seccomp filter denies both
    calls, and the harness is undumpable (without either, the attach succeeds and stops the harness)."""
    verifier = CodeVerifier(Sandbox(ISOLATED, Limits(wall_time_s=5.0)))
    if not seccomp_filter:
        verifier.sandbox.seccomp_program = None
    probe = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]
def probe():
    parent = os.getppid()
    attach = libc.ptrace(16, parent, None, None), ctypes.get_errno()
    buffer = ctypes.create_string_buffer(16)
    local = IoVec(ctypes.cast(buffer, ctypes.c_void_p), 16)
    remote = IoVec(0x400000, 16)
    read = libc.process_vm_readv(parent, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0), ctypes.get_errno()
    return [list(attach), list(read), os.path.exists(f"/proc/{parent}/mem")]
"""
    (outcome,) = verifier.test_outcomes(probe, json.dumps(["assert probe() == [[-1, 1], [-1, 1], False]"]))
    assert outcome == "passed"


def test_a_stdio_program_finds_no_expected_output_on_the_filesystem(verifier):
    """The expected outputs never enter the sandbox: a program that reads every file it can for them finds none."""
    search = """
import os
needle = "zq7" + "-expected".encode().decode()  # not in this source as one piece
found = [value for value in os.environ.values() if needle in value]
for folder, folders, files in os.walk("/"):
    if folder == "/":  # the machine's own programs, bound read-only, are not searched
        folders[:] = [name for name in folders if name not in ("usr", "lib", "lib64", "bin", "sbin", "proc", "sys")]
    for name in files:
        try:
            with open(os.path.join(folder, name), "rb") as file:
                data = file.read(1 << 20)
        except OSError:
            continue
        if needle.encode() in data:
            found.append(data[data.index(needle.encode()) - 4:][:40].decode(errors="replace"))
print(found[0] if found else "nothing")
"""
    run = verifier.sandbox.run_python(search + 'print(sorted(os.listdir("/")))\n', "2 3\n")
    assert run.ok and run.stdout.splitlines()[0] == "nothing", run
    assert "sandbox" in run.stdout and "tmp" in run.stdout  # it did search the folders it can see
    assert verifier.score(search, ROWS["stdio"]) == 0.0


def test_rows_whose_asserts_contradict_each_other_cap_every_program(verifier):
    """No value passes both `== 5` and `== 6`: the best any program can score is a half, and the hacks score 0."""
    contradiction = json.dumps(["assert add(2, 3) == 5", "assert add(2, 3) == 6"])
    assert verifier.score(HONEST, contradiction) == 0.5
    for hack, program in HACKS.items():
        program = program.replace("GUESSES", repr(GUESSES))
        assert verifier.score(program, contradiction) == 0.0, hack


def test_every_value_kind_is_compared_as_python_would(verifier):
    """Tuples, sets, dicts with int keys, floats and None keep their types through the sandbox's JSON, both ways (a
    tuple argument arrives as a tuple)."""
    program = """
def g(pair, items):
    return pair + (3,), items | {0}
def f(kind):
    return {"tuple": (1, 2), "set": {3, 1}, "dict": {1: "a"}, "float": 0.1 + 0.2, "none": None, "list": [1, (2,)]}[kind]
"""
    rows = [
        "assert f('tuple') == (1, 2)", "assert f('set') == {1, 3}", "assert f('dict') == {1: 'a'}",
        "assert abs(f('float') - 0.3) < 1e-9", "assert f('none') is None", "assert f('list') == [1, (2,)]",
        "assert f('tuple') != [1, 2]", "assert g((1, 2), {5}) == ((1, 2, 3), {0, 5})",
        "assert set(f('set')) == set((1, 3))",
    ]  # fmt: skip
    assert verifier.test_results(program, json.dumps(rows)) == [True] * len(rows)
    assert parse_tests(json.dumps(rows)).from_asserts
