#!/usr/bin/env bash
# One GPU run: build the CUDA targets, run the gpu test suites (plus compute-sanitizer memcheck and
# racecheck on the [sanitize] cases), then the CUDA benchmarks and the PyTorch SDPA anchors in the same
# run, and print the tables. Results go to $OUT (or ./gpu-results). Usage on the GPU machine, from the
# repo root:
#   benchmarks/run_gpu.sh [--prefix DIR_WITH_CATCH2_AND_JSON] [--golden DIR] [--quick] [--only kvm|ua]
#                         [--no-sanitize]   (skips compute-sanitizer when the device time is short)
#                         [--no-bench]      (build and tests only)
#                         [--bin DIR]       (no build: test_*_cuda and kvmem_bench_*_cuda built elsewhere with
#                                            the same configure, run directly; see docs/GPU.md)
set -uo pipefail
out=${OUT:-$PWD/gpu-results}
mkdir -p "$out"
prefix="" golden="" quick=0 only="" sanitize=1 bench=1 bin=""
while (($#)); do
  case $1 in
    --prefix) prefix=$2; shift 2 ;;
    --golden) golden=$2; shift 2 ;;
    --quick) quick=1; shift ;;
    --only) only=$2; shift 2 ;;
    --no-sanitize) sanitize=0; shift ;;
    --no-bench) bench=0; shift ;;
    --bin) bin=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
mechanisms=(kvm ua)
[[ -n $only ]] && mechanisms=("$only")
cfg=(--preset cuda -DKVMEM_BUILD_EXAMPLES=OFF)
[[ -n $prefix ]] && cfg+=(-DCMAKE_PREFIX_PATH="$prefix")
[[ -n $golden ]] && cfg+=(-DKVMEM_GOLDEN_DIR="$golden")
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
# logs of the build stay out of $OUT unless it fails (at most 8 files come back from a device run)
built=()
if [[ -n $bin ]]; then
  tests=$bin benches=$bin
  for m in "${mechanisms[@]}"; do
    if [[ -x $bin/test_${m}_cuda && -x $bin/kvmem_bench_${m}_cuda ]]; then built+=("$m"); else echo "MISSING in $bin: $m binaries"; fi
  done
else
  tests=build/cuda/tests/cuda benches=build/cuda/benchmarks
  cmake "${cfg[@]}" >/tmp/kvmem_configure.log 2>&1 || { cp /tmp/kvmem_configure.log "$out/"; tail -30 /tmp/kvmem_configure.log; exit 1; }
  for m in "${mechanisms[@]}"; do
    # one mechanism failing to build does not hide the other's results
    if cmake --build build/cuda -j16 --target test_${m}_cuda kvmem_bench_${m}_cuda >/tmp/kvmem_build_$m.log 2>&1; then
      built+=("$m")
    else
      cp /tmp/kvmem_build_$m.log "$out/"
      echo "BUILD FAILED: $m"; grep -E "error" /tmp/kvmem_build_$m.log | head -20
    fi
  done
fi
for m in "${built[@]}"; do
  if [[ -n $bin ]]; then  # a carried build tree would want to rebuild under ctest: run the suite itself
    timeout 180 "$tests/test_${m}_cuda" 2>&1 | tee "$out/ctest_$m.log" | tail -8
  else
    ctest --test-dir build/cuda -R "test_${m}_cuda" --timeout 180 --output-on-failure 2>&1 | tee "$out/ctest_$m.log" | tail -8
  fi
  if ((sanitize)) && command -v compute-sanitizer >/dev/null; then
    # racecheck of the KVM "readouts beside the update chain" case ran past 240 s with the routing pass on
    # wgmma (main a6fb1f6, 2026-11-30 v8; five cases before it were clean): give each tool 480 s
    for tool in memcheck racecheck; do
      timeout 480 compute-sanitizer --tool $tool --error-exitcode 3 "$tests/test_${m}_cuda" "[sanitize]" \
        >/tmp/sanitizer_${m}_$tool.log 2>&1
      rc=$?
      echo "compute-sanitizer $tool $m: exit $rc -- $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|No tests ran|FAILED|passed' /tmp/sanitizer_${m}_$tool.log | tail -2 | tr '\n' ' ')" | tee -a "$out/sanitizer.log"
      ((rc != 0)) && tail -40 /tmp/sanitizer_${m}_$tool.log >>"$out/sanitizer.log"
    done
  fi
done
report=()
((bench)) || built=()
for m in "${built[@]}"; do
  case $m in
    kvm)
      tokens=4096,8192,16384,32768
      ((quick)) && tokens=4096,8192
      rm -f "$out/kvm.jsonl"
      timeout 240 "$benches/kvmem_bench_kvm_cuda" --tokens $tokens --json "$out/kvm.jsonl"
      # grouped-query attention, 32 query heads over 8 KV heads (printed only, no file: the report's anchors are multi-head, and at most 8 files come back)
      ((quick)) || timeout 60 "$benches/kvmem_bench_kvm_cuda" --kv-heads 8 --tokens 32768 --b1 1
      report+=(--kvm "$out/kvm.jsonl" --tokens $tokens) ;;
    ua)
      tokens=4096,8192,16384 dense_only=32768
      ((quick)) && tokens=4096,8192 dense_only=16384
      rm -f "$out/ua.jsonl"
      timeout 300 "$benches/kvmem_bench_ua_cuda" --tokens $tokens --dense-only $dense_only --json "$out/ua.jsonl"
      report+=(--ua "$out/ua.jsonl" --ua-tokens $tokens,$dense_only) ;;
  esac
done
((${#report[@]})) && PYTHONUNBUFFERED=1 python3 benchmarks/gpu_report.py "${report[@]}" 2>&1 | tee "$out/report.md"
