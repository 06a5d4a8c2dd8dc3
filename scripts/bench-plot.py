#!/usr/bin/env python3
"""Plots scripts/bench-http's results.tsv as an SVG (usage: bench-plot.py TSV SVG [TITLE]): transitions/s against clients for each engine,
beside pgbench TPC-B tps (PostgreSQL) and SQLite's one-row durable commit rate. No dependencies."""
import csv
import sys

title = sys.argv[3] if len(sys.argv) > 3 else "Guarded transitions/s over HTTP (scripts/bench-http)"
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
# The seed-000 story on spread accounts (older tables have no story column); hot and roundtrip rows
# are in the table only.
rows = [r for r in rows if r.get("story", "spread") == "spread"]
series = {}
for r in rows:
    c = int(r["clients"])
    if r["engine"] == "sqlite":
        series.setdefault("Settle on SQLite (FULL)", {})[c] = float(r["transitions_per_s"])
        series.setdefault("SQLite one-row commits/s", {})[c] = float(r["baseline_per_s"])
    else:
        series.setdefault("Settle on PostgreSQL", {})[c] = float(r["transitions_per_s"])
        series.setdefault("pgbench TPC-B tps", {})[c] = float(r["baseline_per_s"])
colors = {
    "Settle on SQLite (FULL)": "#1f77b4",
    "SQLite one-row commits/s": "#9ecae1",
    "Settle on PostgreSQL": "#d62728",
    "pgbench TPC-B tps": "#f4a582",
}
clients = sorted({c for s in series.values() for c in s})
top = max([v for s in series.values() for v in s.values()] + [1]) * 1.1
W, H, L, R, T, B = 720, 420, 70, 220, 30, 50
pw, ph = W - L - R, H - T - B


def x(c):
    return L + (clients.index(c) + 0.5) * pw / len(clients)


def y(v):
    return T + ph - v / top * ph


out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
       f'<rect width="{W}" height="{H}" fill="white"/>',
       f'<text x="{L}" y="18" font-size="14">{title}</text>',
       f'<line x1="{L}" y1="{T + ph}" x2="{L + pw}" y2="{T + ph}" stroke="black"/>',
       f'<line x1="{L}" y1="{T}" x2="{L}" y2="{T + ph}" stroke="black"/>',
       f'<text x="{L + pw / 2}" y="{H - 10}" text-anchor="middle">concurrent clients</text>']
for i in range(6):
    v = top * i / 5
    out.append(f'<text x="{L - 6}" y="{y(v) + 4}" text-anchor="end">{v:,.0f}</text>')
    out.append(f'<line x1="{L}" y1="{y(v)}" x2="{L + pw}" y2="{y(v)}" stroke="#eee"/>')
for c in clients:
    out.append(f'<text x="{x(c)}" y="{T + ph + 18}" text-anchor="middle">{c}</text>')
for k, (name, pts) in enumerate(series.items()):
    color = colors.get(name, "black")
    dash = ' stroke-dasharray="5,4"' if "Settle" not in name else ""
    path = " ".join(f"{x(c):.1f},{y(v):.1f}" for c, v in sorted(pts.items()))
    out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
    for c, v in pts.items():
        out.append(f'<circle cx="{x(c):.1f}" cy="{y(v):.1f}" r="3" fill="{color}"/>')
    ly = T + 10 + k * 20
    out.append(f'<line x1="{L + pw + 15}" y1="{ly}" x2="{L + pw + 40}" y2="{ly}" stroke="{color}" stroke-width="2"{dash}/>')
    out.append(f'<text x="{L + pw + 45}" y="{ly + 4}">{name}</text>')
out.append("</svg>")
open(sys.argv[2], "w").write("\n".join(out) + "\n")
