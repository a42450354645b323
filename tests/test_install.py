"""scripts/install.sh refuses an interpreter older than vLLM 0.32 needs (Python 3.11), in one line naming what to
install, before it creates or installs anything. No Python 3.10 exists on these machines: the old interpreter is
this one, told to report 3.10 (sys.version_info, platform.python_version)."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PYTHON_3_10 = f"""#!/bin/sh
# A Python 3.10 stand-in: answers `-c CODE` as this interpreter would if it were 3.10.12.
[ "$1" = "-c" ] || exit 3
exec {sys.executable} -c "import sys, platform; sys.version_info = (3, 10, 12, 'final', 0); \\
platform.python_version = lambda: '3.10.12'; exec(sys.argv[1])" "$2"
"""


def test_install_refuses_python_older_than_3_11_naming_what_to_install(tmp_path):
    old_python = tmp_path / "python3.10"
    old_python.write_text(PYTHON_3_10)
    old_python.chmod(0o755)
    venv = tmp_path / "venv"
    env = {**os.environ, "OPEN_INSTRUCT_VENV": str(venv), "OPEN_INSTRUCT_DEVICE": "cpu",
           "OPEN_INSTRUCT_PYTHON": str(old_python)}  # fmt: skip
    process = subprocess.run(["bash", str(REPO / "scripts" / "install.sh")], env=env, capture_output=True, text=True,
                             timeout=60)  # fmt: skip
    assert process.returncode == 2, process.stdout + process.stderr
    assert process.stderr.strip().splitlines() == [
        f"[install] {old_python} is Python 3.10.12, but vLLM 0.32 needs Python >= 3.11: install python3.11 (e.g. "
        "apt-get install python3.11 python3.11-venv) and rerun with OPEN_INSTRUCT_PYTHON=python3.11."
    ]
    assert not venv.exists() and "installing" not in process.stdout


def test_setup_py_states_the_python_vllm_needs():
    assert 'python_requires=">=3.11"' in (REPO / "setup.py").read_text()
