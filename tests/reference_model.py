"""A pure-Python model of vLLM-Omni's block management, used only by tests.

It follows vLLM-Omni S1 literally (vLLM's FIFO ``BlockPool`` with null block 0, per-request tables
that keep null placeholders, the ChunkWindow skip rule with its backward walk that stops at the
first null entry), with the S2 frame-aligned generalisation: frame ``f`` owns pages
``[f * ppf, (f + 1) * ppf)``. Nothing here shares code with ``arkv_jax.state``.
"""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass
class RefRow:
    prefill: int = 0
    completed: int = 0
    table: list[int] = dataclasses.field(default_factory=list)


class RefCache:
    """Block management of one pool with any number of rows (requests)."""

    def __init__(self, *, num_blocks, tokens_per_frame, block_size, sink_frames, window_frames,
                 reset_at_boundary=False):
        self.free = collections.deque(range(1, num_blocks))
        self.tpf, self.bs = tokens_per_frame, block_size
        self.ppf = -(-tokens_per_frame // block_size)
        self.sink, self.window, self.reset = sink_frames, window_frames, reset_at_boundary
        self.rows: dict[int, RefRow] = {}

    # -- token and page arithmetic --------------------------------------------------------------
    def computed(self, row: RefRow) -> int:
        return row.prefill + row.completed * self.tpf

    def pages_for(self, tokens: int) -> int:
        return (tokens // self.tpf) * self.ppf + -(-(tokens % self.tpf) // self.bs)

    def skipped_tokens(self, n: int) -> int:
        sink = self.sink * self.tpf
        if self.reset:
            return max(0, (n // self.tpf) * self.tpf - sink)
        return (max(0, n - self.window * self.tpf - sink) // self.tpf) * self.tpf

    # -- operations -----------------------------------------------------------------------------
    def begin(self, rid: int, prefill: int = 0) -> None:
        assert rid not in self.rows
        self.rows[rid] = RefRow(prefill=prefill)

    def remove_skipped(self, row: RefRow) -> None:
        skipped = self.skipped_tokens(self.computed(row))
        if skipped <= 0:
            return
        sink_pages = self.sink * self.ppf
        last = min(sink_pages + (skipped // self.tpf) * self.ppf, len(row.table))
        freed = []
        for index in range(last - 1, sink_pages - 1, -1):
            if row.table[index] == 0:
                break
            freed.append(row.table[index])
            row.table[index] = 0
        self.free.extend(freed)

    def allocate(self, rid: int, num_tokens: int) -> bool:
        row = self.rows[rid]
        self.remove_skipped(row)
        new = max(0, self.pages_for(self.computed(row) + num_tokens) - len(row.table))
        if new > len(self.free):
            return False
        row.table.extend(self.free.popleft() for _ in range(new))
        return True

    def commit(self, rid: int, num_frames: int) -> None:
        row = self.rows[rid]
        for _ in range(num_frames):
            row.completed += 1
            self.remove_skipped(row)

    def end(self, rid: int) -> None:
        row = self.rows.pop(rid)
        self.free.extend(b for b in reversed(row.table) if b != 0)

    # -- views ----------------------------------------------------------------------------------
    def table(self, rid: int) -> list[int]:
        return list(self.rows[rid].table)

    def resident(self, rid: int) -> list[int]:
        return [b for b in self.rows[rid].table if b != 0]

    def slots(self, rid: int, num_tokens: int) -> list[int]:
        row = self.rows[rid]
        out = []
        for t in range(self.computed(row), self.computed(row) + num_tokens):
            frame, offset = divmod(t, self.tpf)
            page = frame * self.ppf + offset // self.bs
            out.append(row.table[page] * self.bs + offset % self.bs if page < len(row.table) else -1)
        return out

    def visible(self, rid: int, current_frames: int) -> tuple[list[int], int]:
        """History pages and valid tokens attended by a forward of ``current_frames`` frames: the
        vLLM-Omni's ``video_block_table`` selection at frame granularity, history part only."""
        row = self.rows[rid]
        frames = self.computed(row) // self.tpf
        history = [f for f in range(frames) if f * self.ppf < len(row.table) and row.table[f * self.ppf] != 0]
        if len(history) + current_frames > self.sink + self.window:
            sink = history[:self.sink]
            rest = history[len(sink):]
            keep = max(0, self.window - current_frames)
            history = sink + (rest[-keep:] if keep else [])
        pages = [row.table[f * self.ppf + p] for f in history for p in range(self.ppf)]
        return pages, len(history) * self.tpf
