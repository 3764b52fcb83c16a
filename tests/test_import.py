"""The core imports light: no torch at ``import kvtier``, and never vLLM outside connector/."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1] / "kvtier"


def test_import_kvtier_loads_neither_torch_nor_vllm():
    code = ("import sys, kvtier; from kvtier import config, keys, units;"
            "print(sorted(m for m in ('torch', 'vllm', 'numpy') if m in sys.modules))")
    out = subprocess.check_output([sys.executable, "-c", code], text=True)
    assert out.strip() == "['numpy']"


def test_lazy_names_resolve():
    import kvtier

    assert kvtier.KVStore.__name__ == "KVStore"
    assert kvtier.load_config(environ={}).chunk_tokens == 256


def test_only_the_connector_imports_vllm():
    offenders = [
        str(path.relative_to(ROOT)) for path in ROOT.rglob("*.py")
        if "connector" not in path.parts
        and any(line.lstrip().startswith(("import vllm", "from vllm"))
                for line in path.read_text().splitlines())
    ]
    assert offenders == []


def test_scheduler_and_worker_sides_import_without_vllm():
    code = ("import sys; sys.modules['vllm'] = None;"  # any import of vllm now fails
            "import kvtier.connector.scheduler.side, kvtier.connector.worker.side,"
            " kvtier.connector.common.messages;"
            "print('ok')")
    out = subprocess.check_output([sys.executable, "-c", code], text=True)
    assert out.strip() == "ok"
