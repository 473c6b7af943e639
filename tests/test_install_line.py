"""The install line the docs give a GPU user keeps the torch already installed (a CUDA build): the project's
requirements are met by any installed torch >= 2.8, so pip installs no torch. Shown by pip's own resolver,
offline (--no-index: anything it would fetch fails), on the requirements pyproject.toml lists.

    python -m pytest tests/test_install_line.py -q
"""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_LINE = 'pip install -e ".[dev]"        # a GPU machine with its CUDA torch >= 2.8: keeps that torch'


def test_the_gpu_install_line_keeps_an_installed_torch():
    assert GPU_LINE in (ROOT / "docs" / "install_and_8b.md").read_text()
    assert GPU_LINE in (ROOT / "README.md").read_text()
    deps = re.search(r"^dependencies = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    reqs = re.findall(r'"([^"]+)"', deps)
    assert "torch>=2.8" in reqs and not any("index-url" in r or "torch<" in r for r in reqs)
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", *reqs],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert re.search(r"Requirement already satisfied: torch>=2\.8 ", p.stdout), p.stdout[-2000:]
    assert "Would install" not in p.stdout, p.stdout[-2000:]
