"""Side-by-side tables of benchmark results (`bench compare`, `bench prefix`): one column per
deployment, then each one's ratio to the first, aligned for a terminal."""

from __future__ import annotations

from collections.abc import Sequence


def cell(value: object) -> str:
    """Numbers with two decimals; anything else as it is."""
    return f"{value:.2f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def ratio(value: float, baseline: float) -> str:
    """`value / baseline` as `1.23x`; n/a when the baseline is not positive."""
    return f"{value / baseline:.2f}x" if baseline > 0 else "n/a"


def render(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """The table between rules: the first column left-aligned, the others right-aligned."""
    table = [tuple(header), *(tuple(row) for row in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = [
        "  ".join(
            text.ljust(width) if i == 0 else text.rjust(width) for i, (text, width) in enumerate(zip(row, widths))
        )
        for row in table
    ]
    rule = "=" * len(lines[0])
    return "\n".join([rule, lines[0], "-" * len(lines[0]), *lines[1:], rule])
