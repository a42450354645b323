"""The command line's own mistakes, answered before the trainer's imports.

`python -m open_instruct.ppo_vllm_thread_ray_gtrl` imports torch, transformers' models, datasets and vLLM before the
recipe's first line runs: ~8 s on a 2-core machine, a cost every typo paid again. So both entry points call
`exit_on_bad_command_line` first, with only this module's imports loaded: `--help`, an unknown or mistyped flag, a value
of the wrong type, a missing YAML file and batch sizes that do not fit together are answered in ~2 s (transformers'
flag parser, which needs no torch, is the cost). It reads the flags and nothing else; `main` parses them again after
the imports and checks everything (ranges, devices, files, models, the hub), so nothing is checked only here.
"""

import os
import sys
import traceback
from typing import NoReturn

from open_instruct.run import console
from open_instruct.run.args import ConfigError, compute_batch_sizes, parse_args
from open_instruct.run.validation import as_config_errors, one_line


def debug_requested(argv: list[str]) -> bool:
    """--debug or OPEN_INSTRUCT_DEBUG=1: the CLI prints the traceback before its one-line error."""
    return "--debug" in argv or os.environ.get("OPEN_INSTRUCT_DEBUG", "") not in ("", "0")


def exit_for_config_error(error: ConfigError, debug: bool) -> NoReturn:
    """The configuration cannot work and nothing was trained: `error: ...` on one line, exit code 2."""
    if debug:
        traceback.print_exc(file=console.stream())
    console.say(f"error: {one_line(error)}", error=True)
    sys.exit(2)


def exit_on_bad_command_line(argv: list[str], algorithm: str) -> None:
    """Exit as `cli` does for a configuration error (one line, code 2) when the flags do not parse or their batch
    sizes do not fit together; `--help` prints the flags and exits 0. Returns when they parse."""
    try:
        with as_config_errors():
            compute_batch_sizes(parse_args(argv, algorithm))
    except ConfigError as error:
        exit_for_config_error(error, debug_requested(argv))
