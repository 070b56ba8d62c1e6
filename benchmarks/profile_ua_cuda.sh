#!/usr/bin/env bash
# Where the CUDA UA time goes, with Nsight Compute on the GPU machine (clocks left alone), at the
# benchmark shape (B8 H16 G4 D128 bf16, T = 8192):
#   1. kernel time summed by name over one benchmark run (dense prefill once, pruned prefill p = 0.05
#      and 0.15 four times each, 256 decode steps each);
#   2. speed of light, occupancy, launch and warp-stall sections of one dense prefill launch and of one
#      pruned chunk launch late in the prompt.
# Needs build/cuda from run_gpu.sh (or BENCH=path/to/kvmem_bench_ua_cuda). Results in $OUT/profile_ua*.
set -uo pipefail
out=${OUT:-$PWD/gpu-results}
mkdir -p "$out"
bench=${BENCH:-build/cuda/benchmarks/kvmem_bench_ua_cuda}
ncu --clock-control none --metrics gpu__time_duration.sum --csv "$bench" --tokens 8192 >/tmp/ncu_ua.csv 2>/dev/null
python3 benchmarks/ncu_kernel_times.py "UA B8 H16 G4 D128 T=8192: kernel time summed over one benchmark run" \
    /tmp/ncu_ua.csv | tee "$out/profile_ua.txt"
sections=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
          --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis)
ncu --clock-control none "${sections[@]}" -k regex:dense_prefill_tc --launch-count 1 \
    "$bench" --tokens 8192 >"$out/profile_ua_dense.txt" 2>&1
# the pruned chunk kernel of the 60th chunk of the first p = 0.05 prefill (the cache is at steady state)
ncu --clock-control none "${sections[@]}" -k regex:chunk_attend --launch-skip 60 --launch-count 1 \
    "$bench" --tokens 8192 >"$out/profile_ua_chunk.txt" 2>&1
grep -E "Duration|Achieved Occupancy|Theoretical Occupancy|Registers Per|Compute \(SM\) Throughput|Memory Throughput|Stall|Issued Warp|No Eligible|Block Limit" \
    "$out/profile_ua_dense.txt" "$out/profile_ua_chunk.txt" | sed 's|.*/profile_||' | tee -a "$out/profile_ua.txt"
