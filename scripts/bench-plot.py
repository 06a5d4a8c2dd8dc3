#!/usr/bin/env python3
"""Plots scripts/bench-http's results.tsv as an SVG (usage: bench-plot.py TSV SVG [TITLE]): transitions/s against clients for each engine,
beside pgbench TPC-B tps (PostgreSQL) and SQLite's one-row durable commit rate; on PostgreSQL also the
hot-account story (transitions/s) and the queue round trip (jobs/s) beside graphile-worker's. No
dependencies."""
import csv
import sys

title = sys.argv[3] if len(sys.argv) > 3 else "Guarded transitions/s over HTTP (scripts/bench-http)"
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
# Older tables have no story column: their rows are the seed-000 story on spread accounts.
series = {}
for r in rows:
    c, story = int(r["clients"]), r.get("story", "spread")
    rate = float(r["transitions_per_s"])
    baseline = float(r["baseline_per_s"]) if r["baseline_per_s"] not in ("", "n/a") else None
    if r["engine"] == "sqlite":
        series.setdefault("Settle on SQLite (FULL)", {})[c] = rate
        series.setdefault("SQLite one-row commits/s", {})[c] = baseline
    elif story == "spread":
        series.setdefault("Settle on PostgreSQL", {})[c] = rate
        series.setdefault("pgbench TPC-B tps", {})[c] = baseline
    elif story == "hot":
        series.setdefault("PostgreSQL, one hot account", {})[c] = rate
    elif story == "roundtrip":
        series.setdefault("PostgreSQL round trip (jobs/s)", {})[c] = rate
        series.setdefault("graphile-worker (jobs/s)", {})[c] = baseline
series = {name: {c: v for c, v in pts.items() if v is not None} for name, pts in series.items()}
series = {name: pts for name, pts in series.items() if pts}
colors = {
    "Settle on SQLite (FULL)": "#1f77b4",
    "SQLite one-row commits/s": "#9ecae1",
    "Settle on PostgreSQL": "#d62728",
    "pgbench TPC-B tps": "#f4a582",
    "PostgreSQL, one hot account": "#9467bd",
    "PostgreSQL round trip (jobs/s)": "#2ca02c",
    "graphile-worker (jobs/s)": "#98df8a",
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
    dash = ' stroke-dasharray="5,4"' if name in ("SQLite one-row commits/s", "pgbench TPC-B tps", "graphile-worker (jobs/s)") else ""
    path = " ".join(f"{x(c):.1f},{y(v):.1f}" for c, v in sorted(pts.items()))
    out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
    for c, v in pts.items():
        out.append(f'<circle cx="{x(c):.1f}" cy="{y(v):.1f}" r="3" fill="{color}"/>')
    ly = T + 10 + k * 20
    out.append(f'<line x1="{L + pw + 15}" y1="{ly}" x2="{L + pw + 40}" y2="{ly}" stroke="{color}" stroke-width="2"{dash}/>')
    out.append(f'<text x="{L + pw + 45}" y="{ly + 4}">{name}</text>')
out.append("</svg>")
open(sys.argv[2], "w").write("\n".join(out) + "\n")
