#!/usr/bin/env bash
# One GPU run: build the CUDA targets, run the gpu test suites (plus compute-sanitizer memcheck and
# racecheck on the [sanitize] cases), then the CUDA benchmarks and the PyTorch SDPA anchors in the same
# run, print the tables and write the JSON of record (kvm_cuda.json, ua_cuda.json; the schema is in
# benchmarks/plot_results.py). Run from the repository root on a machine with an NVIDIA GPU
# (docs/performance.md):
#   benchmarks/run_gpu.sh [--out DIR]       (results; default $OUT, else ./gpu-results)
#                         [--prefix DIR]    (CMAKE_PREFIX_PATH for Catch2 and nlohmann_json if not installed)
#                         [--golden DIR]    (the golden vectors, KVMEM_GOLDEN_DIR; default: the configure's)
#                         [--jobs N]        (build jobs; default: nproc)
#                         [--quick]         (4K and 8K only) [--only kvm|ua]
#                         [--no-sanitize]   (skip compute-sanitizer) [--no-bench] (build and tests only)
#                         [--bin DIR]       (no build: test_*_cuda and kvmem_bench_*_cuda built elsewhere with
#                                            the same configure, run directly)
set -uo pipefail
out=${OUT:-$PWD/gpu-results}
prefix="" golden="" quick=0 only="" sanitize=1 bench=1 bin="" jobs=$(nproc 2>/dev/null || echo 4)
args="$*"
while (($#)); do
  case $1 in
    --out) out=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
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
mkdir -p "$out"
logs=$(mktemp -d)
mechanisms=(kvm ua)
[[ -n $only ]] && mechanisms=("$only")
cfg=(--preset cuda -DKVMEM_BUILD_EXAMPLES=OFF)
[[ -n $prefix ]] && cfg+=(-DCMAKE_PREFIX_PATH="$prefix")
[[ -n $golden ]] && cfg+=(-DKVMEM_GOLDEN_DIR="$golden")
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
# build logs stay out of the results folder unless a build fails
built=()
if [[ -n $bin ]]; then
  tests=$bin benches=$bin
  for m in "${mechanisms[@]}"; do
    if [[ -x $bin/test_${m}_cuda && -x $bin/kvmem_bench_${m}_cuda ]]; then built+=("$m"); else echo "MISSING in $bin: $m binaries"; fi
  done
else
  tests=build/cuda/tests/cuda benches=build/cuda/benchmarks
  cmake "${cfg[@]}" >$logs/configure.log 2>&1 || { cp $logs/configure.log "$out/"; tail -30 $logs/configure.log; exit 1; }
  for m in "${mechanisms[@]}"; do
    # one mechanism failing to build does not hide the other's results
    if cmake --build build/cuda -j"$jobs" --target test_${m}_cuda kvmem_bench_${m}_cuda >$logs/build_$m.log 2>&1; then
      built+=("$m")
    else
      cp $logs/build_$m.log "$out/"
      echo "BUILD FAILED: $m"; grep -E "error" $logs/build_$m.log | head -20
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
    # racecheck of the longest [sanitize] case takes over four minutes: 480 s a tool
    for tool in memcheck racecheck; do
      timeout 480 compute-sanitizer --tool $tool --error-exitcode 3 "$tests/test_${m}_cuda" "[sanitize]" \
        >$logs/sanitizer_${m}_$tool.log 2>&1
      rc=$?
      echo "compute-sanitizer $tool $m: exit $rc -- $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|No tests ran|FAILED|passed' $logs/sanitizer_${m}_$tool.log | tail -2 | tr '\n' ' ')" | tee -a "$out/sanitizer.log"
      ((rc != 0)) && tail -40 $logs/sanitizer_${m}_$tool.log >>"$out/sanitizer.log"
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
      # grouped-query attention, 32 query heads over 8 KV heads: printed only (the report's anchors are multi-head)
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
((${#report[@]})) && PYTHONUNBUFFERED=1 python3 benchmarks/gpu_report.py "${report[@]}" --record-dir "$out" \
  --command "benchmarks/run_gpu.sh $args" 2>&1 | tee "$out/report.md"
