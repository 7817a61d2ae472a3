"""Printing results: rich tables, and fixed-width text tables whose layout scripts parse.

`rich_table` right-aligns every column (numbers); `Columns` lays out plain
text rows from a list of (header, width, align) so a header and its rows can
never drift apart; `print_grid` sizes its columns to their widest cell.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table


def rich_table(
    title: str, columns: Sequence[str], rows: Iterable[Sequence[str]], *, left: int = 0
) -> Table:
    """A table with `columns` right-aligned but the first `left` (labels)."""
    table = Table(title=title)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i < left else "right")
    for row in rows:
        table.add_row(*row)
    return table


def console() -> Console:
    """Wide enough that no benchmark's table wraps."""
    return Console(width=200)


@dataclass(frozen=True)
class Columns:
    """Fixed-width text columns: `(header, width, align)` with align `<` or `>`."""

    spec: Sequence[tuple[str, int, str]]
    sep: str = ""
    edges: tuple[str, str] = ("", "")

    def header(self) -> str:
        return self.row(*(name for name, _, _ in self.spec))

    def rule(self) -> str:
        """The header's width in dashes, keeping its `|` (a markdown table's second line)."""
        return "".join(c if c == "|" else "-" for c in self.header())

    def row(self, *cells: object) -> str:
        """Cells in column order (already formatted); fewer cells than columns is fine."""
        parts = [
            f"{cell!s:{align}{width}}"
            for cell, (_, width, align) in zip(cells, self.spec)  # noqa: B905
        ]
        return self.edges[0] + self.sep.join(parts) + self.edges[1]


def print_grid(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Left-aligned text columns as wide as their widest cell, ruled above and below."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)
    print(line)
    for r in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
        if r is header:
            print(line)
    print(line)
