"""The same chunk reads through aiofiles, to decide where (if anywhere) it should serve.
aiofiles is optional (the ``bench`` extra): without it there is no such figure."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from kvtier.io.buffers import AlignedBuffer


def have_aiofiles() -> bool:
    try:
        import aiofiles  # noqa: F401
    except ImportError:
        return False
    return True


def aiofiles_read_gib_s(path: Path, block: int, count: int, depth: int,
                        o_direct: bool = True) -> float:
    """GiB/s reading ``count`` blocks of ``block`` bytes from ``path`` with ``depth``
    aiofiles reads in flight (each into its own aligned buffer)."""
    import aiofiles

    flags = os.O_RDONLY | (os.O_DIRECT if o_direct else 0)
    buffers = [AlignedBuffer(block, pin=False) for _ in range(depth)]

    async def worker(handle, index: int) -> None:
        view = buffers[index].array.data
        for i in range(index, count, depth):
            await handle.seek(i * block)
            got = await handle.readinto(view)
            assert got == block, f"short read: {got}"

    async def run() -> float:
        handles = [await aiofiles.open(path, "rb", buffering=0,
                                       opener=lambda p, _f: os.open(p, flags))
                   for _ in range(depth)]
        start = time.perf_counter()
        await asyncio.gather(*(worker(h, i) for i, h in enumerate(handles)))
        elapsed = time.perf_counter() - start
        for handle in handles:
            await handle.close()
        return elapsed

    elapsed = asyncio.run(run())
    for buffer in buffers:
        buffer.close()
    return count * block / 2**30 / elapsed
