"""``kvtier bench`` on a plain install (no ``bench`` extra: no aiofiles, matplotlib or tqdm):
it runs to the end, with its baselines, and says in one line that there is no plot."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("aiofiles", "matplotlib", "tqdm")


def test_bench_runs_without_the_bench_extra(tmp_path):
    blocked = tmp_path / "blocked"
    for name in EXTRAS:  # each import of them fails, as when they are not installed
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(f"raise ImportError('no {name} here')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PYTHONPATH"] = os.pathsep.join([str(blocked), str(ROOT)])
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", "--size", "4MiB",
                             "--depths", "1", "--disk-path", str(tmp_path), "--out", str(out)],
                            capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert "matplotlib is not installed" in result.stdout
    assert (out / "bench.json").exists() and not (out / "bench.png").exists()
