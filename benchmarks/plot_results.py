#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Plots of the results of record: one PNG per JSON file, prefill time and decode time per token
against the context length, kvmem's variants beside the dense anchors of the same run.

    python3 benchmarks/plot_results.py [FILE.json ...] [--out DIR]

With no file it reads every benchmarks/results/*.json and writes benchmarks/results/<name>.png.
Needs matplotlib (Debian: python3-matplotlib).

The JSON of record (schema "kvmem-benchmark-record/1"; benchmarks/gpu_report.py --record-dir writes it
for a GPU run, benchmarks/results/*.json are the files of record):

    schema     "kvmem-benchmark-record/1"
    mechanism  "kvm" or "ua"
    backend    "cuda" or "host"
    date       ISO date of the run
    machine    free-form object: gpu, sm_count, driver, cuda, torch, copy_tb_s, bf16_matmul_tflop_s
               (GPU runs), or cpu, compiler, build (CPU runs)
    shape      heads, kv_heads, head_dim, storage of the benchmark
    command    the command that produced the numbers
    notes      optional list of strings
    rows       list of objects, one per (variant, batch, tokens[, p, storage]):
      kind             "kvmem" or "anchor" (dense attention measured in the same run)
      variant          e.g. "KVM fixed-256", "KVM 16sqrtN", "UA dense", "UA pruned", "SDPA cudnn", "dense causal"
      batch, tokens    sequences per call and context length T
      heads, kv_heads  optional, where a row differs from `shape` (grouped-query rows)
      p                UA pruning threshold (0: dense)
      storage          optional, where the run covers several storage types
      slots            KVM state slots after the prefill
      prefill_ms       one prefill of T tokens of every sequence (null: not measured)
      decode_ms        ms per decode step (one token per sequence), each step a plain launch
      decode_graph_ms  the same steps replayed from a captured CUDA graph (null: not measured)
      run              optional: where a row was not measured in the run of the table
      gate_mean        the benchmark's gate-logit mean (--gate-mean; 1 where absent)
      kept_prefill, kept_decode, kept_kv_bytes, state_mib, kv_mib, ...: optional extras
Rows whose run starts with "kept-fraction sweep" (several gate means at a few context lengths, with their
own anchors) are drawn in a second row of panels, against the kept fraction instead of the context length.
"""
import argparse
import collections
import glob
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator  # noqa: E402

SCHEMA = "kvmem-benchmark-record/1"


def best_decode(row):
    """ms/token: the faster of the plain launches and the graph replay (the strict figure for both sides)."""
    times = [t for t in (row.get("decode_ms"), row.get("decode_graph_ms")) if t]
    return min(times) if times else None


def nice_limits(values):
    """The 1-2-5 steps just below the smallest and just above the largest value (log axes)."""
    steps = [m * 10.0**e for e in range(-6, 7) for m in (1, 2, 5)]
    lo = max([t for t in steps if t <= min(values)], default=min(values))
    hi = min([t for t in steps if t >= max(values)], default=max(values))
    return lo / 1.15, hi * 1.15


def series_name(row):
    name = row["variant"]
    if row.get("kind") == "anchor" and name.startswith("SDPA "):
        name = {"SDPA cudnn": "cuDNN SDPA", "SDPA flash": "FlashAttention SDPA"}.get(name, name) + " (dense)"
    if "p" in row and row["p"] > 0:
        name += f" p = {row['p']:g}"
    if row.get("storage"):
        name += f" ({row['storage']})"
    return name


def main_rows(record):
    """The rows of the record's main shape: the batch most kvmem rows use, KV heads as in `shape`."""
    kv_heads = record["shape"].get("kv_heads")
    rows = [r for r in record["rows"] if not is_sweep_row(r)]
    batches = collections.Counter(r["batch"] for r in rows if r["kind"] == "kvmem")
    batch = batches.most_common(1)[0][0]
    return batch, [r for r in rows if r["batch"] == batch and r.get("kv_heads", kv_heads) == kv_heads]


def is_sweep_row(row):
    """A row of the kept-fraction sweep (run: "kept-fraction sweep ..."), plotted against the kept fraction."""
    return row.get("run", "").startswith("kept-fraction sweep")


def draw_sweep(axes, rows, copy_tbs, backend, main=()):
    """Prefill and decode time against the kept fraction, one series per (T, p), with the dense anchors of
    each T as horizontal lines (cuDNN SDPA on a GPU, the plain causal attention on the host) and, where the
    record has a copy bandwidth, for decode the bound 1.3 x (kept bytes at that bandwidth) + 5 us. A T's
    anchors come from the sweep, or, where it has none, from `main` (the main table's rows of its shape); its
    dense UA line is the median of the dense rows of both (the gate means differ, and so does dense UA's cost)."""
    anchor = "SDPA cudnn" if backend == "cuda" else "dense causal attention"
    anchor_name = "cuDNN SDPA dense" if backend == "cuda" else "causal attention (anchor)"
    pruned = [r for r in rows if r["kind"] == "kvmem" and r.get("p", 0) > 0]
    for ti, T in enumerate(sorted({r["tokens"] for r in pruned})):
        shade = f"C{ti + 4}"
        for pi, p in enumerate(sorted({r["p"] for r in pruned if r["tokens"] == T})):
            pts = sorted((r for r in pruned if r["tokens"] == T and r["p"] == p), key=lambda r: r["kept_decode"])
            label = f"UA pruned T = {T // 1024}K, p = {p:g}"
            style = dict(color=shade, marker="o^"[pi % 2], linestyle="-" if pi == 0 else ":", linewidth=2)
            axes[0].plot([r["kept_prefill"] for r in pts], [r["prefill_ms"] for r in pts], label=label, **style)
            axes[1].plot([r["kept_decode"] for r in pts], [best_decode(r) for r in pts], label=label, **style)
            if copy_tbs and pi == 0:
                bound = [1.3 * r["kept_kv_bytes"] / (copy_tbs * 1e12) * 1e3 + 0.005 for r in pts]
                axes[1].plot([r["kept_decode"] for r in pts], bound, color=shade, linestyle="-.", linewidth=1,
                             label=f"1.3 x kept bytes at {copy_tbs:g} TB/s + 5 us, {T // 1024}K")
        anchors = [r for r in rows if r["tokens"] == T and r["kind"] == "anchor" and r["variant"] == anchor]
        for r in anchors or [r for r in main if r["tokens"] == T and r["kind"] == "anchor" and r["variant"] == anchor]:
            axes[0].axhline(r["prefill_ms"], color=shade, linestyle="--", linewidth=1,
                            label=f"{anchor_name}, {T // 1024}K")
            axes[1].axhline(best_decode(r), color=shade, linestyle="--", linewidth=1,
                            label=f"{anchor_name}, {T // 1024}K")
        # the host's dense UA rows have a decode too; the GPU's are prefill only
        dense_rows = [r for r in list(rows) + list(main) if r["tokens"] == T and r["kind"] == "kvmem" and r.get("p") == 0]
        prefill = sorted(r["prefill_ms"] for r in dense_rows if r.get("prefill_ms"))
        decode = sorted(best_decode(r) for r in dense_rows if best_decode(r))
        label = f"kvmem UA dense{'' if decode else ' prefill'}, {T // 1024}K"
        for ax, dense in ((axes[0], prefill), (axes[1], decode)):
            if dense:
                ax.axhline(dense[len(dense) // 2], color=shade, linestyle=(0, (1, 1)), linewidth=1.5, label=label)
    decode_title = "decode (CUDA graph)" if backend == "cuda" else "decode"
    for ax, ylabel, title in ((axes[0], "prefill time (ms)", "pruned prefill against the kept fraction"),
                              (axes[1], "decode time per token (ms)", f"{decode_title} against the kept fraction")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("kept fraction of the keys (gate-logit mean swept)")
        ax.set_ylabel(ylabel)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x * 100:g} %"))
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.grid(True, which="major", alpha=0.3)
        ax.set_title(title)


def row_legend(fig, axes, y):
    """One legend under a row of panels, each label once."""
    handles, labels = [], []
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, y), ncol=min(len(labels), 4), fontsize=8,
               frameon=False)


def plot(record, path):
    sweep = [r for r in record["rows"] if is_sweep_row(r)]
    batch, rows = main_rows(record)
    series = collections.OrderedDict()
    for r in sorted(rows, key=lambda r: (r["kind"] != "kvmem", r["variant"], r.get("p", 0), r["tokens"])):
        series.setdefault((r["kind"], series_name(r)), []).append(r)
    fig, grid = plt.subplots(2 if sweep else 1, 2, figsize=(12, 11.5 if sweep else 5.4), squeeze=False)
    axes = grid[0]
    markers = iter("o^vD<>pX*")
    # seconds where every prefill takes longer than one (the host backend's runs)
    in_s = all((r.get("prefill_ms") or 1e9) >= 1000 for r in rows)
    decode_title = ("decode (the faster of plain launches and CUDA-graph replay)" if record["backend"] == "cuda"
                    else "decode (mean over the steps after the prefill)")
    panels = ((axes[0], "prefill", lambda r: r.get("prefill_ms") and r["prefill_ms"] / (1000 if in_s else 1),
               "prefill time (s)" if in_s else "prefill time (ms)"),
              (axes[1], decode_title, best_decode, "decode time per token (ms)"))
    kvmem_series = [key for key in series if key[0] == "kvmem"]
    marker = {key: next(markers, "o") for key in kvmem_series}
    color = {key: f"C{i % 10}" for i, key in enumerate(kvmem_series)}  # one colour per series in both panels
    for ax, title, value, ylabel in panels:
        plotted = []
        for (kind, name), pts in series.items():
            xy = [(r["tokens"], value(r)) for r in pts if value(r)]
            if not xy:
                continue
            x, y = zip(*xy)
            plotted += y
            if kind == "kvmem":
                style = dict(marker=marker[(kind, name)], color=color[(kind, name)], linewidth=2, markersize=6)
            else:
                style = dict(marker="s", linestyle="--", color="0.2" if "cuDNN" in name or "causal" in name else "0.6")
            ax.plot(x, y, label=name, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length T (tokens)")
        ax.set_ylabel(ylabel)
        ticks = sorted({r["tokens"] for r in rows})
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t // 1024}K" for t in ticks])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        if plotted:
            ax.set_ylim(*nice_limits(plotted))
        ax.grid(True, which="major", alpha=0.3)
        ax.set_title(title)
    if sweep:
        draw_sweep(grid[1], sweep, record["machine"].get("copy_tb_s"), record["backend"], rows)
        row_legend(fig, grid[0], 0.555)
        row_legend(fig, grid[1], 0.085)
    else:
        row_legend(fig, axes, 0.1)
    m, s = record["machine"], record["shape"]
    where = f"{m['gpu']}, CUDA {m.get('cuda', '?')}" if record["backend"] == "cuda" else m.get("cpu", "CPU")
    heads = f"H{s['heads']}" + (f"/{s['kv_heads']}" if s.get("kv_heads") not in (None, s["heads"]) else "")
    backend = "CUDA backend" if record["backend"] == "cuda" else "host backend"
    fig.suptitle(f"{'KV Means' if record['mechanism'] == 'kvm' else 'Universal Attention'}, {backend}: "
                 f"B{batch} {heads} D{s['head_dim']} {s['storage']} — {where} — {record['date']}", fontsize=10)
    if sweep:
        fig.tight_layout(rect=(0, 0.09, 1, 1), h_pad=7.0)
    else:
        fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", help="JSON files of record (default: benchmarks/results/*.json)")
    ap.add_argument("--out", help="folder for the PNGs (default: next to each JSON file)")
    args = ap.parse_args()
    files = args.files or sorted(glob.glob(os.path.join(here, "*.json")))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    for f in files:
        with open(f) as fh:
            record = json.load(fh)
        if record.get("schema") != SCHEMA:
            sys.exit(f"{f}: schema {record.get('schema')!r}, expected {SCHEMA!r}")
        out = os.path.join(args.out or os.path.dirname(os.path.abspath(f)),
                           os.path.splitext(os.path.basename(f))[0] + ".png")
        plot(record, out)
        print(out)


if __name__ == "__main__":
    main()
