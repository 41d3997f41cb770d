"""Markdown helpers of the paper-reproduction report (tables, comparisons, verdicts)."""

from __future__ import annotations

from typing import Any

#: Relative tolerance of "matches the paper" and of the targets' verdicts.
TOL = 0.10


def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "–"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:,.1f}"
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def pct(v: float | None) -> str:
    return "–" if v is None else f"{v:.1%}"


def compare(ours: float, paper: float, tol: float = TOL) -> str:
    """"matches" within ``tol`` (relative), else "above" or "below" the paper."""
    if abs(ours - paper) <= tol * paper:
        return "matches"
    return "above" if ours > paper else "below"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def params_line(params: dict[str, Any]) -> str:
    return ", ".join(f"`{k}={v}`" for k, v in params.items())
