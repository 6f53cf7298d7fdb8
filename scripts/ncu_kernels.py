#!/usr/bin/env python3
"""Kernel time by kernel name from `ncu --csv --metrics gpu__time_duration.sum` output (one
row a launch): launches, total and mean microseconds, largest total first.

Run: ncu --clock-control none --csv --metrics gpu__time_duration.sum PROGRAM > ncu.csv
     python3 scripts/ncu_kernels.py ncu.csv [--top 20]
"""
import argparse
import csv
import collections

ap = argparse.ArgumentParser()
ap.add_argument("csv")
ap.add_argument("--top", type=int, default=20)
args = ap.parse_args()
lines = open(args.csv, errors="replace").read().splitlines()
start = next(i for i, l in enumerate(lines) if '"Kernel Name"' in l and '"Metric Value"' in l)
rows = list(csv.DictReader(lines[start:]))
totals = collections.defaultdict(lambda: [0, 0.0])
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
for r in rows:
    if r.get("Metric Name") != "gpu__time_duration.sum":
        continue
    name = r["Kernel Name"].split("(")[0].split("<")[0].strip()
    value = float(r["Metric Value"].replace(",", ""))
    t = totals[name]
    t[0] += 1
    t[1] += value * scale.get(r.get("Metric Unit", "ns").strip(), 1e-3)
whole = sum(t[1] for t in totals.values())
print(f"{len(rows)} launches, {whole:.0f} us of kernels")
print("| kernel | launches | total us | mean us | share |")
print("|---|---|---|---|---|")
for name, (n, us) in sorted(totals.items(), key=lambda kv: -kv[1][1])[: args.top]:
    print(f"| {name[:60]} | {n} | {us:.0f} | {us / n:.1f} | {us / whole:.2f} |")
