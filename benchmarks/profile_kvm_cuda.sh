#!/usr/bin/env bash
# Per-kernel time of KVM prefill + decode on the GPU machine with Nsight Compute (clocks left alone):
# one 4K prefill of each budget at B=8 H=32, summed by kernel name. Needs build/cuda from run_gpu.sh
# (or BENCH=path/to/kvmem_bench_kvm_cuda).
set -uo pipefail
out=${OUT:-$PWD/gpu-results}
mkdir -p "$out"
bench=${BENCH:-build/cuda/benchmarks/kvmem_bench_kvm_cuda}
for budget in fixed-256 16sqrtN; do
  ncu --clock-control none --metrics gpu__time_duration.sum --csv \
      "$bench" --tokens 4096 --budget $budget --b1 0 >"/tmp/ncu_$budget.csv" 2>/dev/null
  # the benchmark runs 1 warm-up + 3 timed + 1 prefill before decode = 5 prefills, 256 decode steps
  python3 benchmarks/ncu_kernel_times.py "$budget, B=8 H=32 T=4096: kernel time summed over the whole benchmark run" \
      "/tmp/ncu_$budget.csv" | tee -a "$out/profile.txt"
done
