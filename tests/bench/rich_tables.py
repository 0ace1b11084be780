"""The rows of the rich tables a benchmark printed, as lists of stripped cells."""

from __future__ import annotations


def table_rows(out: str) -> list[list[str]]:
    """Every body row (a line between `│` borders) of every table in `out`, in order. A cell
    rich wrapped onto more lines yields more rows: keep the columns that are asserted short."""
    return [
        [cell.strip() for cell in line.split("│")[1:-1]]
        for line in out.splitlines()
        if line.startswith("│")
    ]


def rows_starting(out: str, first: str) -> list[list[str]]:
    """The rows whose first cell is `first`."""
    return [row for row in table_rows(out) if row and row[0] == first]
