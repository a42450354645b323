"""Runs inside the code sandbox, started by code_harness.py: the program in solution.py is executed as a module named
"solution" (its `if __name__ == "__main__":` block does not run), then one of its functions is called. Standard
library only; run with `python -I -S code_runner.py VALUE_FD`. The verifier imports `tagged` and `untagged` from here
(one definition of the format on both sides).

Standard input is {"fn_name", "args", "kwargs"}, the arguments tagged as below (a tuple argument arrives as a tuple).
The return value is written to VALUE_FD as JSON in a tagged form that keeps Python's own types apart where JSON would
merge them: a tuple as {"$tuple": [...]}, a set or frozenset as
{"$set": [...]}, a dict whose keys are not all strings (or one key starting with "$") as {"$dict": [[key, value],
...]}. Anything else (an object of the program's own class, bytes, a value nested deeper than MAX_DEPTH) has no
value: the runner exits non-zero and the test fails. This process is the program's own: everything here is only a
value the program could have returned, and the verifier compares it outside the sandbox on decoded JSON.
"""

import json
import os
import sys

MAX_DEPTH = 100
PLAIN = (bool, int, float, str, type(None))


def tagged(value, depth: int = 0):
    """`value` as JSON-encodable data, tagging the types JSON lacks; TypeError for what is not plain data."""
    if depth > MAX_DEPTH:
        raise TypeError(f"the value is nested deeper than {MAX_DEPTH} levels")
    kind = type(value)
    if kind in PLAIN:
        return value
    if kind is list:
        return [tagged(item, depth + 1) for item in value]
    if kind is tuple:
        return {"$tuple": [tagged(item, depth + 1) for item in value]}
    if kind in (set, frozenset):
        return {"$set": [tagged(item, depth + 1) for item in value]}
    if kind is dict:
        if all(type(key) is str and not key.startswith("$") for key in value):
            return {key: tagged(item, depth + 1) for key, item in value.items()}
        return {"$dict": [[tagged(key, depth + 1), tagged(item, depth + 1)] for key, item in value.items()]}
    raise TypeError(f"a {kind.__name__} is not plain data (None, bool, int, float, str, list, tuple, set or dict)")


def untagged(value):
    """`tagged`'s JSON back to Python's own types ({"$tuple": [...]} -> tuple, "$set" -> frozenset, "$dict" -> dict).
    TypeError/ValueError for a malformed tag (an unhashable set item, say)."""
    if isinstance(value, list):
        return [untagged(item) for item in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, items),) = value.items()
        if tag == "$tuple" and isinstance(items, list):
            return tuple(untagged(item) for item in items)
        if tag == "$set" and isinstance(items, list):
            return frozenset(untagged(item) for item in items)
        if tag == "$dict" and isinstance(items, list):
            return {untagged(key): untagged(item) for key, item in items}
    return {key: untagged(item) for key, item in value.items()}


def find_function(namespace: dict, name: str):
    """A top-level function `name`, or the method of a LeetCode-style `Solution` class."""
    if callable(namespace.get(name)):
        return namespace[name]
    solution_class = namespace.get("Solution")
    if isinstance(solution_class, type) and callable(getattr(solution_class, name, None)):
        return getattr(solution_class(), name)
    raise NameError(f"the program defines no function {name!r} (nor a class Solution with that method)")


def main() -> None:
    value_file = os.fdopen(int(sys.argv[1]), "w", encoding="utf-8")
    request = json.loads(sys.stdin.read())
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "solution.py"), encoding="utf-8") as file:
        source = file.read()
    namespace = {"__name__": "solution"}
    exec(compile(source, "solution.py", "exec"), namespace)  # noqa: S102 - this process is the sandboxed program's own
    args, kwargs = untagged(request["args"]), untagged(request["kwargs"])
    args = [set(arg) if type(arg) is frozenset else arg for arg in args]  # a set literal argument is a set
    result = find_function(namespace, request["fn_name"])(*args, **kwargs)
    value_file.write(json.dumps(tagged(result)))
    value_file.close()


if __name__ == "__main__":
    main()
