"""Turning tables into the metadata a person reads in the Dagster UI (previews, histograms)."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
from dagster import MetadataValue, TableColumn, TableRecord, TableSchema

_TEXT_LIMIT = 80


def _cell(value: object) -> str | int | float | bool | None:
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    text = str(value)
    return text if len(text) <= _TEXT_LIMIT else text[: _TEXT_LIMIT - 1] + "…"


def preview_table(frame: pl.DataFrame, n: int = 5) -> MetadataValue:
    """The first ``n`` rows of ``frame`` as a UI table; long text is cut to 80 characters and
    list or binary cells are shown as text."""
    head = frame.head(n)
    columns = [
        TableColumn(name, "number" if dtype.is_numeric() else "bool" if dtype == pl.Boolean else "string")
        for name, dtype in head.schema.items()
    ]
    records = [TableRecord({k: _cell(v) for k, v in row.items()}) for row in head.iter_rows(named=True)]
    return MetadataValue.table(records, schema=TableSchema(columns=columns))


def histogram_markdown(values: pl.Series, bins: int = 10) -> MetadataValue:
    """A text histogram of ``values`` (equal-width bins over [min, max] of the finite ones) as a
    Markdown table; non-finite values (NaN, ±inf) get a row of their own. Values near the float64
    limits, whose range overflows, are binned on a scaled copy."""
    data = values.drop_nulls().to_numpy().astype(np.float64)
    finite = data[np.isfinite(data)]
    extra = [f"| non-finite | {data.size - finite.size} | |"] if finite.size < data.size else []
    if finite.size == 0:
        return MetadataValue.md("\n".join(["| bin | count | |", "|---|---:|---|", *extra]) if extra else "_no values_")
    lo, hi = float(finite.min()), float(finite.max())
    if lo == hi:
        return MetadataValue.md("\n".join([f"| bin | count |\n|---|---|\n| {lo:.4g} | {finite.size} |", *extra]))
    scale = max(abs(lo), abs(hi)) if not np.isfinite(hi - lo) else 1.0
    counts, edges = np.histogram(finite / scale, bins=bins, range=(lo / scale, hi / scale))
    edges = edges * scale
    width = max(int(counts.max()), 1)
    lines = ["| bin | count | |", "|---|---:|---|"]
    for count, left, right in zip(counts, edges[:-1], edges[1:]):
        bar = "█" * round(20 * count / width)
        lines.append(f"| [{left:.4g}, {right:.4g}) | {int(count)} | {bar} |")
    lines.extend(extra)
    return MetadataValue.md("\n".join(lines))
