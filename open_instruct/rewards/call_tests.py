"""Function-call tests of code rows: a call evaluated in the sandbox, its value checked here. Pure: text and plain
data in, `CallTest`s and verdicts out; nothing is executed.

verl's call rows ({"fn_name", "inputs", "outputs"}) become JSON_EQUAL tests. Assert statements are rewritten:
`assert add(1, 2) == 3` becomes "call add(1, 2) in the sandbox, compare its value with 3 here".

Why: run inside the program's process, an assert can be passed by the program itself (an object whose `__eq__` is
always true, a rebound `AssertionError`, a forged report line, an `os._exit(0)` at the right moment). Rewritten, the
sandbox only evaluates the call and returns its value as JSON, and the comparison happens in the trainer, in plain
Python on decoded data, never on an object the program made.

The forms rewritten (CALL is `f(literal, ..., key=literal)` or `Solution().f(...)`, LIT a Python literal, also
`float("inf")`/`float("nan")`; either side of `==`/`!=` may be the call):
    assert CALL == LIT          assert CALL != LIT          assert CALL
    assert not CALL             assert CALL is True/False/None (or `is not`)
    assert abs(CALL - LIT) < EPS   (or <=, or abs(LIT - CALL))
    assert math.isclose(CALL, LIT[, rel_tol=..., abs_tol=...])   (or isclose(...))
A test text may hold several such statements (one test each). Anything else (a loop, a helper variable, a call inside
an argument) raises `UnrewritableAssert`, which the row check turns into a one-line refusal at load.
"""

import ast
import json
import math
from dataclasses import dataclass, field

# How a value is checked against `expected`, outside the sandbox.
EQUAL = "equal"
NOT_EQUAL = "not_equal"
TRUTHY = "truthy"
FALSY = "falsy"
IS = "is"
IS_NOT = "is_not"
CLOSE = "close"  # expected = (target, rel_tol, abs_tol, strict): within abs_tol (strictly below it when strict)
JSON_EQUAL = "json_equal"  # verl's rows: equal as JSON (a tuple is a list), or APPS' one-element list around it

REWRITTEN_FORMS = (
    "assert f(...) == LITERAL (or !=, is True/False/None, is not), assert f(...), assert not f(...), "
    "assert abs(f(...) - LITERAL) < EPS, assert math.isclose(f(...), LITERAL), with literal arguments"
)


class UnrewritableAssert(ValueError):
    """An assert statement that cannot become a call test; the message names the statement and the forms accepted."""


# Built-ins an assert may wrap around the call (`assert sorted(f(x)) == [1, 2]`): applied here, to decoded data.
WRAPPERS = {
    "sorted": sorted, "set": frozenset, "frozenset": frozenset, "len": len, "list": list, "tuple": tuple,
    "abs": abs, "round": round, "str": str, "int": int, "float": float, "bool": bool,
}  # fmt: skip


@dataclass(frozen=True)
class CallTest:
    """Call `fn_name(*args, **kwargs)` in the sandbox; its value, passed through `wrappers` here (innermost first:
    (built-in name, its extra literal arguments)), passes when `check` holds against `expected`."""

    fn_name: str
    args: tuple
    kwargs: dict = field(default_factory=dict)
    check: str = EQUAL
    expected: object = None
    wrappers: tuple = ()


def refuse(statement: str, why: str) -> UnrewritableAssert:
    shown = " ".join(statement.split())
    return UnrewritableAssert(
        f"code test {shown[:100]!r} cannot be checked outside the program ({why}); the verifier accepts "
        f"{REWRITTEN_FORMS}"
    )


def literal(node: ast.expr):
    """A literal's value; also float("inf"), float("-inf"), float("nan"), their negation, and WRAPPERS applied to
    literals (`set((4, 5))`, `sorted([2, 1])`). ValueError otherwise."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
        raise ValueError("a sign before a value that is no number")
    if (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "float"
        and len(node.args) == 1 and not node.keywords and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str) and node.args[0].value.strip().lower() in ("inf", "-inf", "nan", "+inf")
    ):  # fmt: skip
        return float(node.args[0].value)
    if (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in WRAPPERS
        and node.func.id != "float" and not node.keywords and len(node.args) in (1, 2)
    ):  # fmt: skip
        return WRAPPERS[node.func.id](*(literal(arg) for arg in node.args))  # `set((4, 5))`: a built-in of literals
    return ast.literal_eval(node)


def call_of(node: ast.expr) -> tuple[str, tuple, dict, tuple] | None:
    """(function name, args, kwargs, wrappers) of `f(...)` or `Solution().f(...)` with literal arguments, maybe inside
    WRAPPERS (`sorted(f(...))`, `round(f(...), 2)`); None for anything else."""
    if not isinstance(node, ast.Call):
        return None
    if isinstance(node.func, ast.Name) and node.func.id in WRAPPERS and node.args and not node.keywords:
        inner = call_of(node.args[0])
        if inner is None:
            return None
        try:
            extra = tuple(literal(arg) for arg in node.args[1:])
        except (ValueError, TypeError, SyntaxError):
            return None
        if extra and node.func.id != "round":
            return None
        return (*inner[:3], (*inner[3], (node.func.id, extra)))
    function = node.func
    if isinstance(function, ast.Name):
        name = function.id
    elif (
        isinstance(function, ast.Attribute) and isinstance(function.value, ast.Call)
        and isinstance(function.value.func, ast.Name) and function.value.func.id == "Solution"
        and not function.value.args and not function.value.keywords
    ):  # fmt: skip
        name = function.attr
    else:
        return None
    if name in WRAPPERS or name == "isclose" or any(isinstance(arg, ast.Starred) for arg in node.args):
        return None
    if any(keyword.arg is None for keyword in node.keywords):
        return None
    try:
        args = tuple(literal(arg) for arg in node.args)
        kwargs = {keyword.arg: literal(keyword.value) for keyword in node.keywords}
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    return name, args, kwargs, ()


def make_test(call: tuple[str, tuple, dict, tuple], check: str, expected=None) -> CallTest:
    name, args, kwargs, wrappers = call
    return CallTest(name, args, kwargs, check, expected, wrappers)


def is_isclose(function: ast.expr) -> bool:
    return (isinstance(function, ast.Name) and function.id == "isclose") or (
        isinstance(function, ast.Attribute) and function.attr == "isclose"
        and isinstance(function.value, ast.Name) and function.value.id == "math"
    )  # fmt: skip


def close_test(node: ast.Compare, statement: str) -> CallTest:
    """`abs(CALL - LIT) < EPS` (or <=, or LIT - CALL)."""
    difference = node.left.args[0]
    if not isinstance(difference, ast.BinOp) or not isinstance(difference.op, ast.Sub):
        raise refuse(statement, "abs() of something other than a difference")
    for call_side, value_side in ((difference.left, difference.right), (difference.right, difference.left)):
        call = call_of(call_side)
        if call is not None:
            try:
                target, tolerance = literal(value_side), literal(node.comparators[0])
            except (ValueError, TypeError, SyntaxError):
                raise refuse(statement, "the target or the tolerance is not a number") from None
            strict = isinstance(node.ops[0], ast.Lt)
            return make_test(call, CLOSE, (target, 0.0, tolerance, strict))
    raise refuse(statement, "no call with literal arguments inside abs()")


def isclose_test(node: ast.Call, statement: str) -> CallTest:
    """`math.isclose(CALL, LIT, rel_tol=..., abs_tol=...)` (either order)."""
    if len(node.args) != 2 or any(keyword.arg not in ("rel_tol", "abs_tol") for keyword in node.keywords):
        raise refuse(statement, "isclose() needs two values and only rel_tol/abs_tol")
    try:
        tolerances = {keyword.arg: literal(keyword.value) for keyword in node.keywords}
    except (ValueError, TypeError, SyntaxError):
        raise refuse(statement, "a tolerance is not a number") from None
    for call_side, value_side in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        call = call_of(call_side)
        if call is not None:
            try:
                target = literal(value_side)
            except (ValueError, TypeError, SyntaxError):
                raise refuse(statement, "the target is not a literal") from None
            expected = (target, tolerances.get("rel_tol", 1e-9), tolerances.get("abs_tol", 0.0), False)
            return make_test(call, CLOSE, expected)
    raise refuse(statement, "no call with literal arguments inside isclose()")


COMPARE_CHECKS = {ast.Eq: EQUAL, ast.NotEq: NOT_EQUAL, ast.Is: IS, ast.IsNot: IS_NOT}


def compare_test(node: ast.Compare, statement: str) -> CallTest:
    if len(node.ops) != 1:
        raise refuse(statement, "a chained comparison")
    operator, left, right = node.ops[0], node.left, node.comparators[0]
    if isinstance(operator, (ast.Lt, ast.LtE)) and isinstance(left, ast.Call) and isinstance(left.func, ast.Name) \
            and left.func.id == "abs" and len(left.args) == 1:  # fmt: skip
        return close_test(node, statement)
    check = COMPARE_CHECKS.get(type(operator))
    if check is None:
        raise refuse(statement, f"the comparison {type(operator).__name__}")
    for call_side, value_side in ((left, right), (right, left)):
        call = call_of(call_side)
        if call is None:
            continue
        try:
            expected = literal(value_side)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise refuse(statement, "the expected value is not a literal") from None
        if check in (IS, IS_NOT) and expected not in (True, False, None):
            raise refuse(statement, "`is` against something other than True, False or None")
        return make_test(call, check, expected)
    raise refuse(statement, "neither side is a call with literal arguments")


def assert_test(node: ast.Assert, statement: str) -> CallTest:
    test = node.test
    if isinstance(test, ast.Compare):
        return compare_test(test, statement)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        call = call_of(test.operand)
        if call is not None:
            return make_test(call, FALSY)
    if isinstance(test, ast.Call) and is_isclose(test.func):
        return isclose_test(test, statement)
    call = call_of(test)
    if call is not None:
        return make_test(call, TRUTHY)
    raise refuse(statement, "not a call with literal arguments")


def rewrite_asserts(text: str) -> list[CallTest]:
    """The call tests of one test text (one or more assert statements); UnrewritableAssert otherwise."""
    try:
        module = ast.parse(text)
    except (SyntaxError, ValueError, MemoryError, RecursionError) as error:
        raise refuse(text, f"not valid Python: {type(error).__name__}") from None
    if not module.body:
        raise refuse(text, "no statement")
    tests = []
    for node in module.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)) and all(alias.name == "math" or alias.name == "isclose"
                                                                  for alias in node.names):  # fmt: skip
            continue  # `import math` before `assert math.isclose(...)`: the check runs outside, with our own math
        if not isinstance(node, ast.Assert):
            raise refuse(ast.get_source_segment(text, node) or text, "a statement that is not an assert")
        tests.append(assert_test(node, ast.get_source_segment(text, node) or text))
    if not tests:
        raise refuse(text, "no assert statement")
    return tests


def passes(test: CallTest, value) -> bool:
    """Whether `value` (plain data decoded outside the sandbox) passes `test`. Total: a value of the wrong type fails,
    it never raises."""
    try:
        for name, extra in test.wrappers:
            value = WRAPPERS[name](value, *extra)
        if test.check == EQUAL:
            return bool(value == test.expected)
        if test.check == NOT_EQUAL:
            return bool(value != test.expected)
        if test.check == TRUTHY:
            return bool(value)
        if test.check == FALSY:
            return not value
        if test.check == IS:
            return value is test.expected
        if test.check == IS_NOT:
            return value is not test.expected
        if test.check == JSON_EQUAL:
            value = as_json(value)
            expected = test.expected
            return value == expected or (isinstance(expected, list) and len(expected) == 1 and value == expected[0])
        if test.check == CLOSE:
            target, rel_tol, abs_tol, strict = test.expected
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return False
            if strict:
                return abs(value - target) < abs_tol
            return math.isclose(value, target, rel_tol=rel_tol, abs_tol=abs_tol)
    except (TypeError, ValueError, OverflowError, RecursionError, MemoryError):
        return False
    raise ValueError(f"unknown check {test.check!r}")


def as_json(value):
    """A decoded value as plain JSON would hold it: tuples become lists (sets and non-string keys stay, and match no
    JSON value)."""
    if isinstance(value, (list, tuple)):
        return [as_json(item) for item in value]
    if isinstance(value, dict):
        return {json_key(key): as_json(item) for key, item in value.items()}
    return value


def json_key(key):
    """A dict key as json.dumps writes it (1 -> "1", True -> "true", None -> "null"); other keys stay as they are."""
    if isinstance(key, str) or not isinstance(key, (bool, int, float, type(None))):
        return key
    return json.dumps(key)
