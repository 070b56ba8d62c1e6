#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Dense anchors measured in the same run as kvmem's CUDA benchmarks, and the joined table.

Measures PyTorch's scaled_dot_product_attention with the cuDNN and FlashAttention backends (dense causal
prefill, and decode with one query over T keys) at the benchmark shape, a device-to-device copy bandwidth
and a bf16 matmul rate, then reads kvmem's JSON lines and prints one table with ratios to cuDNN SDPA.

A decode call of SDPA takes 30-200 us on the GPU, about what Python spends dispatching it, so a call
timed between two events partly measures the host. Decode anchors are therefore also replayed from a
CUDA graph (as kvmem's graph column), and the decode ratios use the faster of the two: the strict anchor.

    python3 benchmarks/gpu_report.py --kvm kvm.jsonl [--batch 8] [--heads 32] [--tokens 4096,...]
    python3 benchmarks/gpu_report.py --ua ua.jsonl [--ua-tokens 4096,8192,16384]   (B8 H16 G4 GQA anchors)
    python3 benchmarks/gpu_report.py --ragged ragged.jsonl   (kvmem_bench_kvm_slots_cuda and
        kvmem_bench_ua_slots_cuda: one decode step of sequences at their own lengths, against SDPA decode over
        the same sequences padded to the longest)

--record-dir DIR also writes the JSON of record, DIR/kvm_cuda.json and DIR/ua_cuda.json (schema in
benchmarks/plot_results.py, which plots them; --command names the command recorded in them).
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, reps=10, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def timed_graph(fn, reps=50):
    """Milliseconds per replay of fn captured in a CUDA graph (reps replays between two events)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def sdpa(backend, q, k, v, causal, gqa=False):
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


def ua_table(path, anchors_by_t, copy_tbs):
    with open(path) as f:
        ua = [json.loads(line) for line in f if line.strip()]
    print()
    print("| variant | B | T | p | prefill ms | x cuDNN | kept (prefill) | decode ms/token | x cuDNN | kept (decode) "
          "| kept KV MB | bandwidth-limit ms | x limit |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for T in sorted({r["T"] for r in ua}):
        for name in ("cudnn", "flash"):
            pre, dec = anchors_by_t.get((name, T), (float("nan"), float("nan")))
            print(f"| SDPA {name} dense GQA | {ua[0]['B']} | {T} | | {pre:.3f} | 1.00 | 1 | {dec:.4f} | 1.00 | 1 | | | |")
        for r in (x for x in ua if x["T"] == T):
            pre, dec = anchors_by_t.get(("cudnn", T), (float("nan"), float("nan")))
            variant = "pruned" if r["p"] > 0 else "dense"
            if r.get("gate_mean", 1.0) != 1.0:
                variant += f", gate mean {r['gate_mean']:g}"
            line = (f"| kvmem UA {variant} | {r['B']} | {T} | {r['p']:.2f} | {r['prefill_ms']:.3f} | "
                    f"{r['prefill_ms'] / pre:.2f} | {r['kept_prefill']:.4f} | ")
            if r["p"] > 0:
                limit_ms = r["kept_bytes"] / (copy_tbs * 1e12) * 1e3  # kept keys + values read at the copy rate
                line += (f"{r['decode_ms']:.4f} | {r['decode_ms'] / dec:.2f} | {r['kept_decode']:.4f} | "
                         f"{r['kept_bytes'] / 1e6:.2f} | {limit_ms:.4f} | {r['decode_ms'] / limit_ms:.1f} |")
            else:
                line += "| | | | | |"
            print(line)


def ragged_table(path):
    """kvmem's ragged decode step (kvmem_bench_kvm_slots_cuda, kvmem_bench_ua_slots_cuda: one token for each
    of N sequences at its own length) beside SDPA decode of the same N queries over keys and values padded to the longest sequence:
    what a dense engine without a ragged kernel reads. Tokens/s = N / step time; the SDPA rows take the
    faster of plain call and graph replay."""
    with open(path) as f:
        runs = [json.loads(line) for line in f if line.strip()]
    if not runs:
        return
    print()
    print("| variant | sequences | lengths | step ms (plain) | step ms (graph) | tokens/s | x cuDNN padded |")
    print("|---|---|---|---|---|---|---|")
    shape_of = lambda r: (r["sequences"], r["heads"], r["kv_heads"], r["longest"])
    for n, heads, kv_heads, longest in sorted({shape_of(r) for r in runs}):
        q1 = torch.randn(n, heads, 1, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(n, kv_heads, longest, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        anchor_ms = {}
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                dec = timed(lambda: sdpa(backend, q1, k, v, False, kv_heads != heads), reps=20)
                dec_graph = timed_graph(lambda: sdpa(backend, q1, k, v, False, kv_heads != heads))
            except RuntimeError as e:  # a backend may refuse the shape or the capture
                print(f"# {name} padded N={n} T={longest}: {str(e).splitlines()[0]}")
                dec = dec_graph = float("nan")
            anchor_ms[name] = (dec, dec_graph)
        best_cudnn = min((t for t in anchor_ms["cudnn"] if t == t), default=float("nan"))
        for name, (dec, dec_graph) in anchor_ms.items():
            best = min((t for t in (dec, dec_graph) if t == t), default=float("nan"))
            print(f"| SDPA {name} dense, padded | {n} | {longest} each | {dec:.4f} | {dec_graph:.4f} | "
                  f"{n / (best * 1e-3):.0f} | {best_cudnn / best:.2f} |")
        for r in (x for x in runs if shape_of(x) == (n, heads, kv_heads, longest)):
            best = min(r["step_ms"], r["graph_step_ms"])
            variant = f"KVM {r['budget']}" if "budget" in r else f"UA p={r['p']:g}"  # kvmem_bench_ua_slots_cuda
            if r.get("pool_pages", 0) > 0:  # --pool-pages: the slots share one pool of pages
                variant += f", shared pool of {r['pool_pages']} pages"
            if "kept_mean" in r:
                variant += f", {r['kept_mean']:.0f} kept rows"
            print(f"| kvmem {variant} ragged | {n} | {r['min']}..{r['max']} (longest {longest}) | "
                  f"{r['step_ms']:.4f} | {r['graph_step_ms']:.4f} | {n / (best * 1e-3):.0f} | {best_cudnn / best:.2f} |")
        del q1, k, v
        torch.cuda.empty_cache()


RECORDED_ANCHORS = []  # every anchor row measured, for the JSON of record


def none_if_nan(x):
    return None if x != x else x


def machine_record(copy_tbs, mm_tflops):
    props = torch.cuda.get_device_properties(0)
    driver = None
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"],
                                capture_output=True, text=True, check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        pass
    return dict(gpu=torch.cuda.get_device_name(), sm_count=props.multi_processor_count,
                memory_mib=props.total_memory // (1 << 20), driver=driver, cuda=torch.version.cuda,
                torch=torch.__version__, copy_tb_s=round(copy_tbs, 2), bf16_matmul_tflop_s=round(mm_tflops))


def write_record(path, mechanism, shape, machine, command, rows):
    """One JSON of record (schema: benchmarks/plot_results.py); creates the directory it goes in."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    record = dict(schema="kvmem-benchmark-record/1", mechanism=mechanism, backend="cuda",
                  date=datetime.datetime.now(datetime.timezone.utc).date().isoformat(), machine=machine,
                  shape=shape, command=command, rows=rows)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


def kvm_record_rows(kvm):
    return [dict(kind="kvmem", variant=f"KVM {r['budget']}", batch=r["B"], heads=r["H"], kv_heads=r.get("Hk", r["H"]),
                 tokens=r["T"], slots=r["slots"], prefill_ms=r["prefill_ms"], decode_ms=r["decode_ms"],
                 decode_graph_ms=r["decode_graph_ms"] or None) for r in kvm]


def ua_record_rows(ua):
    rows = []
    for r in ua:
        row = dict(kind="kvmem", variant="UA pruned" if r["p"] > 0 else "UA dense", batch=r["B"], tokens=r["T"],
                   p=r["p"], prefill_ms=r["prefill_ms"], kept_prefill=r["kept_prefill"],
                   gate_mean=r.get("gate_mean", 1.0))
        if r["p"] > 0:
            row.update(decode_ms=r["decode_ms"], decode_graph_ms=r.get("decode_graph_ms"),
                       kept_decode=r["kept_decode"], kept_kv_bytes=r["kept_bytes"])
        rows.append(row)
    return rows


def anchors(batch, heads, tokens, dim=128, kv_heads=None):
    """Dense causal SDPA prefill and q_len-1 decode per backend; kv_heads < heads runs grouped (GQA)."""
    kv_heads = kv_heads or heads
    gqa = kv_heads != heads
    rows = {}
    for T in tokens:
        q = torch.randn(batch, heads, T, dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, kv_heads, T, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        q1 = torch.randn(batch, heads, 1, dim, device="cuda", dtype=torch.bfloat16)
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                pre = timed(lambda: sdpa(backend, q, k, v, True, gqa))
                dec = timed(lambda: sdpa(backend, q1, k, v, False, gqa), reps=50)
            except RuntimeError as e:  # a backend may refuse a shape
                print(f"# {name} T={T}{' GQA' if gqa else ''}: {str(e).splitlines()[0]}")
                pre = dec = float("nan")
            try:
                dec_graph = timed_graph(lambda: sdpa(backend, q1, k, v, False, gqa))
            except RuntimeError as e:  # capture may be refused: the plain call stays the anchor
                print(f"# {name} T={T}{' GQA' if gqa else ''} decode graph: {str(e).splitlines()[0]}")
                dec_graph = float("nan")
            print(f"# SDPA {name} B={batch} H={heads}/{kv_heads} T={T} decode: {dec:.4f} ms plain call, "
                  f"{dec_graph:.4f} ms graph replay")
            measured = [t for t in (dec, dec_graph) if t == t]  # NaN: not measured
            rows[(name, T)] = (pre, min(measured) if measured else float("nan"))
            RECORDED_ANCHORS.append(dict(kind="anchor", variant=f"SDPA {name}", batch=batch, heads=heads,
                                         kv_heads=kv_heads, tokens=T, prefill_ms=none_if_nan(pre),
                                         decode_ms=none_if_nan(dec), decode_graph_ms=none_if_nan(dec_graph)))
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def machine_ceilings():
    n = 1 << 30  # 2 GiB of bf16 per side
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src))
    copy_tbs = 2 * src.numel() * 2 / (ms * 1e-3) / 1e12
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = timed(lambda: a @ b)
    return copy_tbs, 2 * 8192**3 / (ms * 1e-3) / 1e12


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvm", help="JSON lines written by kvmem_bench_kvm_cuda --json")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--tokens", default="4096,8192,16384,32768")
    ap.add_argument("--ua", help="JSON lines written by kvmem_bench_ua_cuda --json")
    ap.add_argument("--ua-tokens", default="4096,8192,16384")
    ap.add_argument("--ragged", help="JSON lines written by kvmem_bench_kvm_slots_cuda --json")
    ap.add_argument("--record-dir", help="write the JSON of record (kvm_cuda.json, ua_cuda.json) here")
    ap.add_argument("--command", default="", help="the command recorded in the JSON of record")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    copy_tbs, mm_tflops = machine_ceilings()
    print(f"copy bandwidth {copy_tbs:.2f} TB/s (read + write), bf16 matmul 8192^3 {mm_tflops:.0f} TFLOP/s")
    machine = machine_record(copy_tbs, mm_tflops)
    if args.ua:
        ua_tokens = [int(t) for t in args.ua_tokens.split(",")]
        ua_table(args.ua, anchors(8, 16, ua_tokens, kv_heads=4), copy_tbs)
        if args.record_dir:
            with open(args.ua) as f:
                ua = [json.loads(line) for line in f if line.strip()]
            write_record(os.path.join(args.record_dir, "ua_cuda.json"), "ua",
                         dict(heads=16, kv_heads=4, head_dim=128, storage="bf16"), machine, args.command,
                         RECORDED_ANCHORS + ua_record_rows(ua))
    if args.ragged:
        ragged_table(args.ragged)
    if not args.kvm:
        return
    RECORDED_ANCHORS.clear()
    dense = anchors(args.batch, args.heads, tokens)
    dense_b1 = anchors(1, args.heads, [tokens[0], tokens[-1]])
    kvm = []
    if args.kvm:
        with open(args.kvm) as f:
            kvm = [json.loads(line) for line in f if line.strip()]
    print()
    print(f"| variant | B | T | slots | prefill ms | x cuDNN | TFLOP/s | decode ms/token | x cuDNN | GB/s | graph ms/token |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for T in tokens:
        for name in ("cudnn", "flash"):
            pre, dec = dense[(name, T)]
            flop = 4 * 128 * args.batch * args.heads * T * (T + 1) / 2
            byts = args.batch * args.heads * T * 128 * 2 * 2
            print(f"| SDPA {name} dense | {args.batch} | {T} | {T} | {pre:.3f} | 1.00 | {flop / pre / 1e9:.0f} | "
                  f"{dec:.4f} | | {byts / dec / 1e6:.0f} | |")
    for r in kvm:
        if r.get("Hk", r["H"]) != r["H"]:
            continue  # grouped-query rows: the anchors measured here are multi-head
        key_rows = dense if r["B"] == args.batch else dense_b1
        ref = key_rows.get(("cudnn", r["T"]), (float("nan"), float("nan")))
        print(f"| kvmem KVM {r['budget']} | {r['B']} | {r['T']} | {r['slots']} | {r['prefill_ms']:.3f} | "
              f"{r['prefill_ms'] / ref[0]:.2f} | {r['prefill_tflops']:.1f} | {r['decode_ms']:.4f} | "
              f"{r['decode_ms'] / ref[1]:.2f} | {r['decode_gbps']:.0f} | "
              f"{r['decode_graph_ms']:.4f} |")
    for T in (tokens[0], tokens[-1]):
        pre, dec = dense_b1[("cudnn", T)]
        print(f"| SDPA cudnn dense B=1 | 1 | {T} | {T} | {pre:.3f} | | | {dec:.4f} | 1.00 | | |")
    if args.record_dir:
        write_record(os.path.join(args.record_dir, "kvm_cuda.json"), "kvm",
                     dict(heads=args.heads, kv_heads=args.heads, head_dim=128, storage="bf16"), machine, args.command,
                     RECORDED_ANCHORS + kvm_record_rows(kvm))


if __name__ == "__main__":
    main()
