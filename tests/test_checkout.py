"""The suite tests the checkout it is in: a process it starts from a temporary folder (as the trainer runs are)
imports open_instruct from this checkout, not from wherever the venv's editable install points (tests/conftest.py)."""

import subprocess
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent


def test_a_process_started_from_elsewhere_imports_this_checkouts_open_instruct(tmp_path):
    imported = subprocess.run([sys.executable, "-c", "import open_instruct; print(open_instruct.__file__)"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True).stdout.strip()  # fmt: skip
    assert Path(imported).resolve() == CHECKOUT / "open_instruct" / "__init__.py"
