#!/usr/bin/env python3
"""Sums Nsight Compute's gpu__time_duration per kernel name from an `ncu --csv` log.

Usage: ncu_kernel_times.py TITLE NCU_CSV
Prints one line per kernel (launches and total milliseconds), largest first. Return types,
namespaces, template arguments and parameter lists are dropped from the names, so every
instantiation of a kernel adds to one line.
"""
import collections
import csv
import sys


def main() -> None:
    title, path = sys.argv[1], sys.argv[2]
    rows = [r for r in csv.reader(open(path)) if len(r) > 10]
    if not rows:
        print(f"== {title}: no kernel rows in {path} (did ncu run?)")
        return
    head = rows[0]
    name_col, value_col = head.index("Kernel Name"), head.index("Metric Value")
    total_ns, launches = collections.Counter(), collections.Counter()
    for r in rows[1:]:
        words = r[name_col].split("<")[0].split("(")[0].split()
        if not words:  # a row of ncu's own messages, not a kernel
            continue
        name = words[-1].split("::")[-1]
        try:
            total_ns[name] += float(r[value_col].replace(",", ""))
            launches[name] += 1
        except ValueError:  # a unit row or a metric ncu could not read
            pass
    print(f"== {title} (ns -> ms)")
    for name, ns in total_ns.most_common():
        print(f"{name:40s} {launches[name]:7d} launches {ns / 1e6:10.2f} ms")


if __name__ == "__main__":
    main()
