"""`--reward_function path/to/file.py:fn`: a verifier of the user's own, loaded from their file.

`fn(response: str, ground_truth: str) -> float` in [0, 1] (1: correct), the interface of every verifier in
`verifiers`. It replaces the rows' verifiers for every row: the `dataset`/`data_source` names are not read, a row with
a ground truth is scored by `fn` (times --verification_reward), and its correct rate is logged as
`objective/<fn>_correct_rate` besides `objective/verifiable_correct_rate`. The other reward terms (a reward model, the
format reward, the overlong and non-stop penalties) add to it as they add to a verifier's score.

The file is the user's own trusted code (never model output), imported as a module from its path: it may import what
it needs. The trainer imports it at start (its problems are one line, before any model loads); it scores in the
reward worker (`reward_worker`), a process that imports it again from the same absolute path and is killed when a
call runs past --reward_timeout_s. A call that raises, returns something that is not a number in [0, 1], or times out
scores its response 0 and is counted (`reward_failures`).
"""

import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Callable

USAGE = "give path/to/file.py:function, a function (response, ground_truth) -> float in [0, 1]"


def absolute_spec(spec: str) -> str:
    """`spec` with the file's path made absolute (the Ray learner ranks may run in another working directory)."""
    path, name = split_spec(spec)
    return f"{os.path.abspath(path)}:{name}"


def split_spec(spec: str) -> tuple[str, str]:
    path, separator, name = spec.rpartition(":")
    if not separator or not path or not name.isidentifier():
        raise ValueError(f"--reward_function {spec!r} is not a file and a function's name; {USAGE}.")
    return path, name


def load_reward_function(spec: str) -> Callable[[str, str], float]:
    """The function `spec` names, imported from its file; a ValueError in one line when the file or the function is
    missing, the file fails to import, or the function cannot be called as fn(response, ground_truth)."""
    path, name = split_spec(spec)
    if not os.path.isfile(path):
        raise ValueError(f"--reward_function {spec!r}: {path} is not a file; {USAGE}.")
    module_name = "open_instruct_reward_function_" + re.sub(r"\W", "_", os.path.abspath(path))
    module = sys.modules.get(module_name)  # imported once per process: the start-up check, then the reward manager
    if module is None:
        module = import_file(spec, path, module_name)
    function = getattr(module, name, None)
    if not callable(function):
        defined = sorted(key for key, value in vars(module).items() if inspect.isfunction(value) and not key.startswith("_"))
        raise ValueError(
            f"--reward_function {spec!r}: {path} defines no function {name!r} (its functions: "
            f"{', '.join(defined) or 'none'}); {USAGE}."
        )
    try:
        inspect.signature(function).bind("response", "ground truth")
    except TypeError:
        raise ValueError(
            f"--reward_function {spec!r}: {name}{inspect.signature(function)} cannot be called as "
            f"{name}(response, ground_truth); {USAGE}."
        ) from None
    except ValueError:  # a builtin without a signature: called as it is
        pass
    return function


def import_file(spec: str, path: str, module_name: str, flag: str = "--reward_function", usage: str = USAGE):
    """The user's file `path` as the module `module_name`; a ValueError in one line, naming `flag`, when it fails."""
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"{flag} {spec!r}: {path} is not a Python file (give a .py file); {usage}.")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # as an import would: dataclasses and pickle in the file look their module up
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 - the user's file: whatever it raises, said in one line
        del sys.modules[module_name]
        message = " ".join(str(error).split())
        raise ValueError(f"{flag} {spec!r}: importing {path} failed: {type(error).__name__}: {message}") from error
    return module
