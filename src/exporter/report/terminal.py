"""report.md on a terminal narrower than its tables: the least needed columns are left out, whole, so the main
figures (status, error, median, speedup) are never cut. The file keeps every column."""

from __future__ import annotations

# left out first to last where a table does not fit (columns of other tables are kept)
DROP_ORDER = ("attention kernels", "TFLOP/s", "size", "build s", "p99 ms", "p90 ms", "noise")
CELL_PADDING = 3  # rich's table: a separator and a space either side of each cell


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _width(rows: list[list[str]]) -> int:
    columns = max(len(r) for r in rows)
    return sum(max(len(r[i]) if i < len(r) else 0 for r in rows) + CELL_PADDING for i in range(columns)) + 1


def _fit_table(lines: list[str], width: int) -> tuple[list[str], list[str]]:
    rows = [_cells(line) for line in lines]
    header, dropped = rows[0], []
    for name in DROP_ORDER:
        if _width([r for i, r in enumerate(rows) if i != 1]) <= width:
            break
        if name in header:
            index = header.index(name)
            rows = [r[:index] + r[index + 1:] for r in rows]
            header = rows[0]
            dropped.append(name)
    return ["| " + " | ".join(r) + " |" for r in rows], dropped


def _rule(line: str) -> bool:
    """A Markdown table's header rule: ``| --- | :---: |``."""
    return line.strip().startswith("|") and set(line.replace("|", "").strip()) <= {"-", ":", " "}


def fit(text: str, width: int) -> str:
    """``text`` (Markdown) with each table narrowed to ``width`` columns where it can be, by leaving out whole
    columns in :data:`DROP_ORDER`; a line after the table names what was left out."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].lstrip().startswith("|") and i + 1 < len(lines) and _rule(lines[i + 1]):
            j = i
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                j += 1
            table, dropped = _fit_table(lines[i:j], width)
            out += table
            if dropped:
                out += ["", f"*({', '.join(dropped)} left out for this terminal's width: report.md has every "
                            "column)*"]
            i = j
        else:
            out.append(lines[i])
            i += 1
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


__all__ = ["fit"]
