"""``kvtier gpu``: the GPUs of this machine and their free memory, through NVML."""

from __future__ import annotations

from kvtier.cli.app import JsonFlag, app, console, emit_json, fail, shown
from kvtier.units import format_size


def gpu_inventory() -> list[dict]:
    """One dict per GPU; raises RuntimeError naming why NVML is not usable."""
    try:
        import pynvml
    except ImportError as exc:
        raise RuntimeError("nvidia-ml-py is not installed (pip install nvidia-ml-py)") from exc
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise RuntimeError(f"no NVIDIA driver or GPU found ({exc})") from exc
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            gpus.append({"index": index, "name": name.decode() if isinstance(name, bytes) else name,
                         "memory_total": memory.total, "memory_free": memory.free,
                         "memory_used": memory.used})
        return gpus
    finally:
        pynvml.nvmlShutdown()


@app.command()
def gpu(as_json: JsonFlag = False) -> None:
    """List the GPUs and their free memory (exit 1 when there is none to list)."""
    try:
        gpus = gpu_inventory()
    except RuntimeError as exc:
        if as_json:
            emit_json({"gpus": [], "error": str(exc)})
        raise fail(f"gpu: {exc}", code=1) from exc
    if as_json:
        emit_json({"gpus": gpus})
        return
    from rich.table import Table

    table = Table("index", "name", "free", "total", title="GPUs")
    for g in gpus:
        table.add_row(str(g["index"]), shown(g["name"]), format_size(g["memory_free"]),
                      format_size(g["memory_total"]))
    console.print(table)
