"""Runs inside the code sandbox as its main program (the package never imports it): one function-call or assert test
of the program in solution.py beside it. Standard library only; run with `python -I -S`.

argv[1] is "call" or "assert". Standard input is one JSON object: {"nonce", "fn_name", "args"} for a call,
{"nonce", "test"} for an assert. The program is executed as a module named "solution" (its `if __name__ ==
"__main__":` block does not run: the test calls it), then the test runs; when it ran to the end, the last line written
is the nonce and the JSON of the function's return value (null for an assert). The verifier compares that value outside
the sandbox; an exception, an exit or a crash leaves no such line, and the test fails.
"""

import json
import os
import sys


def find_function(namespace: dict, name: str):
    """A top-level function `name`, or the method of a LeetCode-style `Solution` class."""
    if callable(namespace.get(name)):
        return namespace[name]
    solution_class = namespace.get("Solution")
    if isinstance(solution_class, type) and callable(getattr(solution_class, name, None)):
        return getattr(solution_class(), name)
    raise NameError(f"the program defines no function {name!r} (nor a class Solution with that method)")


def main() -> None:
    request = json.loads(sys.stdin.read())
    report = os.fdopen(os.dup(1), "w")  # the program may rebind or close sys.stdout; the report uses its own copy
    folder = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(folder, "solution.py"), encoding="utf-8") as file:
        source = file.read()
    namespace = {"__name__": "solution"}
    exec(compile(source, "solution.py", "exec"), namespace)  # noqa: S102 - this process is the sandboxed program's own
    if sys.argv[1] == "call":
        result = find_function(namespace, request["fn_name"])(*request["args"])
    else:
        exec(compile(request["test"], "test.py", "exec"), namespace)  # noqa: S102
        result = None
    encoded = json.dumps(result)
    sys.stdout.flush()
    report.write("\n" + request["nonce"] + " " + encoded + "\n")
    report.flush()


main()
