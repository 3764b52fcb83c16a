"""Byte movement below the bookkeeping: aligned and pinned buffers, disk I/O."""
