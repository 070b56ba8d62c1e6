#!/usr/bin/env bash
# One GPU run: build the CUDA targets, run the gpu test suite (plus compute-sanitizer memcheck and
# racecheck on a subset), then the CUDA benchmarks and the PyTorch SDPA anchors in the same run, and
# print one table. Results go to $OUT (or ./gpu-results). Usage on the GPU machine, from the repo root:
#   benchmarks/run_gpu.sh [--prefix DIR_WITH_CATCH2_AND_JSON] [--golden DIR] [--quick]
set -uo pipefail
out=${OUT:-$PWD/gpu-results}
mkdir -p "$out"
prefix="" golden="" quick=0
while (($#)); do
  case $1 in
    --prefix) prefix=$2; shift 2 ;;
    --golden) golden=$2; shift 2 ;;
    --quick) quick=1; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
cfg=(--preset cuda -DKVMEM_BUILD_EXAMPLES=OFF)
[[ -n $prefix ]] && cfg+=(-DCMAKE_PREFIX_PATH="$prefix")
[[ -n $golden ]] && cfg+=(-DKVMEM_GOLDEN_DIR="$golden")
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
# logs of the build stay out of $OUT unless it fails (at most 8 files come back from a device run)
cmake "${cfg[@]}" >/tmp/kvmem_configure.log 2>&1 || { cp /tmp/kvmem_configure.log "$out/"; tail -30 /tmp/kvmem_configure.log; exit 1; }
cmake --build build/cuda -j16 --target test_kvm_cuda kvmem_bench_kvm_cuda >/tmp/kvmem_build.log 2>&1 || { cp /tmp/kvmem_build.log "$out/"; grep -E "error|Error" /tmp/kvmem_build.log | head -40; exit 1; }
ctest --test-dir build/cuda -L gpu --timeout 120 --output-on-failure 2>&1 | tee "$out/ctest.log" | tail -15
if command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    timeout 150 compute-sanitizer --tool $tool --error-exitcode 3 build/cuda/tests/cuda/test_kvm_cuda "[sanitize]" \
      >"$out/sanitizer_$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $? -- $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|No tests ran|FAILED' "$out/sanitizer_$tool.log" | tail -2 | tr '\n' ' ')"
  done
fi
tokens=4096,8192,16384,32768
((quick)) && tokens=4096,8192
rm -f "$out/kvm.jsonl"
timeout 240 build/cuda/benchmarks/kvmem_bench_kvm_cuda --tokens $tokens --json "$out/kvm.jsonl"
PYTHONUNBUFFERED=1 python3 benchmarks/gpu_report.py --kvm "$out/kvm.jsonl" --tokens $tokens 2>&1 | tee "$out/report.md"
