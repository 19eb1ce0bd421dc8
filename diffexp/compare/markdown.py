"""compare.md's tables: one writer, so that every cell (the header's too: "Max |act|") is escaped alike and every
row has the header's number of cells, which is what makes a Markdown renderer draw a table at all."""

from __future__ import annotations

from collections.abc import Sequence

#: a column's alignment as the delimiter row writes it
ALIGN = {"left": "---", "right": "---:"}


def cell(text: object) -> str:
    """One cell: a pipe escaped (it would end the cell), line breaks as spaces (they would end the row)."""
    return " ".join(str(text).replace("|", "\\|").split("\n"))


def table(header: Sequence[str], rows: Sequence[Sequence[object]], align: Sequence[str] | None = None) -> list[str]:
    """The lines of a table: header, delimiter, rows. `align`: "left" or "right" per column (default: the first
    column left, the others right). A row with another number of cells than the header is a bug: refused."""
    align = list(align) if align is not None else ["left"] + ["right"] * (len(header) - 1)
    if len(align) != len(header):
        raise ValueError(f"{len(align)} alignments for {len(header)} columns")
    lines = ["| " + " | ".join(map(cell, header)) + " |", "|" + "|".join(ALIGN[a] for a in align) + "|"]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"a row of {len(row)} cells under a header of {len(header)}: {list(row)}")
        lines.append("| " + " | ".join(map(cell, row)) + " |")
    return lines
