#!/usr/bin/env bash
# Per-kernel time of KVM prefill + decode on the GPU machine with Nsight Compute (clocks left alone):
# one 4K prefill of each budget at B=8 H=32, summed by kernel name. Needs build/cuda from run_gpu.sh.
set -uo pipefail
out=${OUT:-$PWD/gpu-results}
for budget in fixed-256 16sqrtN; do
  ncu --clock-control none --metrics gpu__time_duration.sum --csv \
      build/cuda/benchmarks/kvmem_bench_kvm_cuda --tokens 4096 --budget $budget --b1 0 >"/tmp/ncu_$budget.csv" 2>/dev/null
  python3 - "$budget" "/tmp/ncu_$budget.csv" <<'PY' | tee -a "$out/profile.txt"
import csv, sys, collections
budget, path = sys.argv[1], sys.argv[2]
rows = [r for r in csv.reader(open(path)) if len(r) > 10]
head = rows[0]; k = head.index("Kernel Name"); v = head.index("Metric Value")
tot = collections.Counter(); cnt = collections.Counter()
for r in rows[1:]:
    name = r[k].split("<")[0].split("(")[0]
    try: tot[name] += float(r[v].replace(",", "")); cnt[name] += 1
    except ValueError: pass
# the benchmark runs 1 warm-up + 3 timed + 1 prefill before decode = 5 prefills, 256 decode steps
print(f"== {budget}, B=8 H=32 T=4096: kernel time summed over the whole benchmark run (ns -> ms)")
for name, ns in tot.most_common():
    print(f"{name:40s} {cnt[name]:7d} launches {ns/1e6:10.2f} ms")
PY
done
