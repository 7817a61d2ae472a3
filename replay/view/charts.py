"""Small inline SVG charts (bars and a line), drawn here so the page needs no library.

Every label is escaped: instance ids and infra causes come from the log.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Any

from markupsafe import Markup

W, H, PAD = 320, 120, 18


def bars(title: str, items: Sequence[tuple[str, float]], *, color: str = "#4a78c2") -> Markup:
    """A bar per (label, value)."""
    items = list(items)
    top = max((v for _, v in items), default=0) or 1
    n = max(len(items), 1)
    bw = (W - 2 * PAD) / n
    parts = [
        f'<svg class="chart" viewBox="0 0 {W} {H + 30}" role="img" aria-label="{escape(title)}">',
        f'<text x="{PAD}" y="12" class="ct">{escape(title)}</text>',
    ]
    for i, (label, v) in enumerate(items):
        h = (H - PAD - 10) * v / top
        x = PAD + i * bw
        y = H - h
        parts.append(
            f'<rect x="{x + 1:.1f}" y="{y:.1f}" width="{max(bw - 2, 1):.1f}" height="{h:.1f}" '
            f'fill="{color}"><title>{escape(label)}: {v:g}</title></rect>'
        )
        # Labels under the bars only where they fit: every bar up to 6, else the ends.
        if n <= 6 or i in (0, n - 1):
            parts.append(
                f'<text x="{x + bw / 2:.1f}" y="{H + 12}" class="cl" text-anchor="middle">'
                f"{escape(label[:10])}</text>"
            )
        if v and n <= 12:
            parts.append(
                f'<text x="{x + bw / 2:.1f}" y="{max(y - 2, 22):.1f}" class="cl" '
                f'text-anchor="middle">{v:g}</text>'
            )
    if not items:
        parts.append(f'<text x="{W / 2}" y="{H / 2}" class="cl" text-anchor="middle">none</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def histogram(title: str, values: Sequence[float], *, bins: int = 10) -> Markup:
    """Bars of how many values fall in each of `bins` equal ranges."""
    if not values:
        return bars(title, [])
    lo, hi = min(values), max(values)
    if hi == lo:
        return bars(title, [(f"{lo:g}", float(len(values)))])
    width = (hi - lo) / bins
    counts = [0] * bins
    for v in values:
        counts[min(int((v - lo) / width), bins - 1)] += 1
    return bars(title, [(_short(lo + i * width), float(c)) for i, c in enumerate(counts)])


def _short(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def line(title: str, points: Sequence[tuple[float, float]], *, unit: str = "") -> Markup:
    """A polyline of (x, y) points (x is time), y scaled from 0."""
    parts = [
        f'<svg class="chart" viewBox="0 0 {W} {H + 30}" role="img" aria-label="{escape(title)}">',
        f'<text x="{PAD}" y="12" class="ct">{escape(title)}</text>',
    ]
    if points:
        x0, x1 = points[0][0], points[-1][0]
        top = max(y for _, y in points) or 1
        span = (x1 - x0) or 1
        coords = " ".join(
            f"{PAD + (W - 2 * PAD) * (x - x0) / span:.1f},{H - (H - PAD - 10) * y / top:.1f}"
            for x, y in points
        )
        parts.append(f'<polyline points="{coords}" fill="none" stroke="#c24a4a" stroke-width="2"/>')
        parts.append(
            f'<text x="{W - PAD}" y="28" class="cl" text-anchor="end">max {top:.3g}{unit}</text>'
        )
    else:
        parts.append(f'<text x="{W / 2}" y="{H / 2}" class="cl" text-anchor="middle">none</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


KIND_COLORS = {
    "final": "#2e7d32",
    "wipe": "#ef6c00",
    "subagent": "#1565c0",
    "side": "#8e24aa",
}


def lanes(lanes_: Sequence[Any], turn_href: str) -> Markup:
    """Chains as lanes: a square per turn (coloured by the segment kind, linked to
    the turn page at `turn_href` + turn), a line from the parent lane where a
    chain forked off. `lanes_` items have chain_id, parent, turns, kind."""
    turns = sorted({t for lane in lanes_ for t in lane.turns})
    if not turns:
        return Markup("")
    col = {t: i for i, t in enumerate(turns)}
    row = {lane.chain_id: i for i, lane in enumerate(lanes_)}
    cell, gap, left = 16, 22, 130
    width = left + len(turns) * cell + 10
    height = len(lanes_) * gap + 10
    parts = [
        f'<svg class="lanes-svg" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" role="img" aria-label="chains and segments">'
    ]
    for lane in lanes_:
        y = 5 + row[lane.chain_id] * gap
        color = KIND_COLORS.get(lane.kind, "#9e9e9e")
        parts.append(
            f'<text x="2" y="{y + 12}" class="cl">chain {lane.chain_id} {escape(lane.kind)}</text>'
        )
        if lane.parent in row and lane.turns:
            parent = next(p for p in lanes_ if p.chain_id == lane.parent)
            before = [t for t in parent.turns if t < lane.turns[0]]
            if before:
                x0 = left + col[before[-1]] * cell + cell / 2
                y0 = 5 + row[lane.parent] * gap + cell / 2
                x1 = left + col[lane.turns[0]] * cell
                parts.append(
                    f'<path d="M{x0:.0f},{y0:.0f} V{y + cell / 2:.0f} H{x1:.0f}" '
                    f'fill="none" stroke="{color}" stroke-width="1.5"/>'
                )
        for t in lane.turns:
            x = left + col[t] * cell
            parts.append(
                f'<a href="{escape(turn_href)}{t}"><rect x="{x + 1}" y="{y}" width="{cell - 2}" '
                f'height="{cell}" fill="{color}"><title>chain {lane.chain_id}, turn {t}'
                f"</title></rect></a>"
            )
    parts.append("</svg>")
    return Markup("".join(parts))
