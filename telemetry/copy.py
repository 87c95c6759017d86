"""PostgreSQL binary COPY payloads built with numpy, without a Python loop per row.

Every column the telemetry tables write is fixed-width (bigint, integer, smallint, real,
timestamptz), so the rows that share one pattern of NULLs are a numpy structured array in
PostgreSQL's binary tuple layout (big-endian, each field prefixed by its length). Rows are
grouped by NULL pattern (usually one), and each group is a single ``tobytes()``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

HEADER = b"PGCOPY\n\xff\r\n\x00" + (0).to_bytes(4, "big") + (0).to_bytes(4, "big")
TRAILER = (-1).to_bytes(2, "big", signed=True)
PG_EPOCH_S = 946684800.0  # 2000-01-01T00:00:00Z, PostgreSQL's timestamp origin

# Column type -> numpy big-endian type of its binary form.
BINARY_TYPES = {"bigint": ">i8", "integer": ">i4", "smallint": ">i2", "real": ">f4", "timestamptz": ">i8"}


def timestamptz_from_epoch_s(epoch_s: np.ndarray) -> np.ndarray:
    """Unix seconds (float) to PostgreSQL's binary timestamptz: microseconds since 2000-01-01."""
    return np.rint((epoch_s - PG_EPOCH_S) * 1e6).astype(np.int64)


def binary_payload(
    columns: Sequence[tuple[str, str]], values: dict[str, np.ndarray], nulls: dict[str, np.ndarray] | None = None
) -> bytes:
    """The whole COPY ... (FORMAT BINARY) stream for ``values`` (one array per column name).

    ``columns`` are ``(name, type)`` pairs in table order; ``nulls`` maps a nullable column to a
    boolean mask of the rows where it is NULL.
    """
    nulls = {name: mask for name, mask in (nulls or {}).items() if mask.any()}
    rows = len(next(iter(values.values())))
    chunks = [HEADER]
    if not nulls:
        chunks.append(_pack(columns, values, frozenset(), np.arange(rows)))
    else:
        names = list(nulls)
        bits = np.zeros(rows, dtype=np.int64)
        for i, name in enumerate(names):
            bits |= nulls[name].astype(np.int64) << i
        for pattern in np.unique(bits):
            null_columns = frozenset(name for i, name in enumerate(names) if pattern >> i & 1)
            chunks.append(_pack(columns, values, null_columns, np.flatnonzero(bits == pattern)))
    chunks.append(TRAILER)
    return b"".join(chunks)


def _pack(
    columns: Sequence[tuple[str, str]], values: dict[str, np.ndarray], null_columns: frozenset[str], rows: np.ndarray
) -> bytes:
    layout: list[tuple[str, str]] = [("fields", ">i2")]
    for name, kind in columns:
        layout.append((f"{name}__len", ">i4"))
        if name not in null_columns:
            layout.append((name, BINARY_TYPES[kind]))
    packed = np.empty(len(rows), dtype=np.dtype(layout))
    packed["fields"] = len(columns)
    for name, kind in columns:
        if name in null_columns:
            packed[f"{name}__len"] = -1
        else:
            packed[f"{name}__len"] = np.dtype(BINARY_TYPES[kind]).itemsize
            column = values[name]
            packed[name] = column if len(rows) == len(column) else column[rows]
    return packed.tobytes()
