#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds Kokkos from a source folder for one execution space, then kvmem's Kokkos test suite and
# Kokkos benchmark against it, and runs both.
#
#   benchmarks/kokkos/build_and_run.sh <kokkos-source-dir> [OpenMP|Cuda]
#
# Environment (all optional):
#   KVMEM_KOKKOS_WORK   folder for the Kokkos build, its install and kvmem's build
#                       (default: build/kokkos-<space> under the kvmem checkout)
#   KVMEM_KOKKOS_ARCH   Kokkos architecture option for Cuda (default: HOPPER90, i.e. sm_90)
#   KVMEM_KOKKOS_RUN    0 = build only (e.g. on a machine without the GPU), 1 = build and run (default)
#   JOBS                parallel build jobs (default: nproc)
#   CMAKE_CXX_COMPILER_LAUNCHER  passed through (e.g. ccache)
#   CMAKE_PREFIX_PATH   further install prefixes (':'-separated) for kvmem's dependencies, searched after
#                       the Kokkos built here: kvmem's tests need Catch2 v2 (Debian's catch2 package, or a
#                       Catch2 2.x installed with CMake; Catch2 v3 does not fit) and nlohmann_json 3
#
# Kokkos versions: 4.6.01 tested for OpenMP and Cuda (CUDA 13.0). Kokkos before 4.7 needs these
# changes to build with CUDA 13, which this script applies to the source folder (idempotent, only
# for Cuda, and only where the text is still the old one):
#   - bin/nvcc_wrapper's default architecture is sm_70, which CUDA 13 no longer supports; CMake's
#     compiler check runs the wrapper without -arch, so the default becomes the target architecture;
#   - CUDA 13 changed three runtime signatures that Kokkos wraps in core/src/Cuda/Kokkos_Cuda_Instance.hpp:
#     cudaMemAdvise and cudaMemPrefetchAsync take a cudaMemLocation (and flags) instead of a device
#     number, and cudaGraphAddDependencies takes per-edge data (nullptr: default edges).
# Kokkos 4.7.00 and 4.7.01 use an mdspan-based View that nvcc >= 12.9 miscompiles under C++20: for
# them the legacy View is selected (Kokkos_ENABLE_IMPL_VIEW_LEGACY=ON); 4.6 has only the legacy View.
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: $0 <kokkos-source-dir> [OpenMP|Cuda]" >&2
  exit 2
fi
kokkos_src=$(cd "$1" && pwd)
space=${2:-OpenMP}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
kvmem_src=$(cd "$here/../.." && pwd)
space_lower=$(echo "$space" | tr '[:upper:]' '[:lower:]')
work=${KVMEM_KOKKOS_WORK:-$kvmem_src/build/kokkos-$space_lower}
jobs=${JOBS:-$(nproc)}
run=${KVMEM_KOKKOS_RUN:-1}
launcher=()
if [[ -n ${CMAKE_CXX_COMPILER_LAUNCHER:-} ]]; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER="$CMAKE_CXX_COMPILER_LAUNCHER")
fi
[[ -f $kokkos_src/CMakeLists.txt && -d $kokkos_src/core ]] || { echo "not a Kokkos source folder: $kokkos_src" >&2; exit 2; }

version=$(sed -n 's/^set(Kokkos_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\))/\2/p' "$kokkos_src/CMakeLists.txt" | paste -sd.)
echo "Kokkos $version from $kokkos_src, space $space, work folder $work"

kokkos_opts=(-DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_STANDARD=20 -DCMAKE_CXX_EXTENSIONS=OFF
  -DBUILD_SHARED_LIBS=OFF -DKokkos_ENABLE_SERIAL=ON -DKokkos_ENABLE_TESTS=OFF
  -DKokkos_ENABLE_EXAMPLES=OFF -DCMAKE_INSTALL_PREFIX="$work/install")
kvmem_opts=()
case $space in
  OpenMP)
    kokkos_opts+=(-DKokkos_ENABLE_OPENMP=ON)
    ;;
  Cuda)
    arch=${KVMEM_KOKKOS_ARCH:-HOPPER90}
    sm=$(case $arch in HOPPER90) echo sm_90 ;; AMPERE80) echo sm_80 ;; ADA89) echo sm_89 ;; BLACKWELL100) echo sm_100 ;; *) echo sm_90 ;; esac)
    wrapper=$kokkos_src/bin/nvcc_wrapper
    # CUDA 13 dropped sm_70, nvcc_wrapper's default when no -arch is given (CMake's compiler check).
    sed -i "s/^default_arch=\"sm_70\"/default_arch=\"$sm\"/" "$wrapper"
    # CUDA 13: cudaMemAdvise / cudaMemPrefetchAsync take a cudaMemLocation instead of a device.
    inst=$kokkos_src/core/src/Cuda/Kokkos_Cuda_Instance.hpp
    if [[ -f $inst ]] && ! grep -q 'cudaGraphAddDependencies(graph, from, to, nullptr' "$inst"; then
      perl -0pi -e '
        s{return cudaMemAdvise\(devPtr, count, advice, device\);}{#if CUDART_VERSION >= 13000
    cudaMemLocation loc;
    loc.id   = device;
    loc.type = device == cudaCpuDeviceId ? cudaMemLocationTypeHost : cudaMemLocationTypeDevice;
    return cudaMemAdvise(devPtr, count, advice, loc);
#else
    return cudaMemAdvise(devPtr, count, advice, device);
#endif};
        s{return cudaMemPrefetchAsync\(devPtr, count, dstDevice,\s*get_input_stream\(stream\)\);}{#if CUDART_VERSION >= 13000
    cudaMemLocation loc;
    loc.id   = dstDevice;
    loc.type = dstDevice == cudaCpuDeviceId ? cudaMemLocationTypeHost : cudaMemLocationTypeDevice;
    return cudaMemPrefetchAsync(devPtr, count, loc, 0, get_input_stream(stream));
#else
    return cudaMemPrefetchAsync(devPtr, count, dstDevice, get_input_stream(stream));
#endif};
        s{return cudaGraphAddDependencies\(graph, from, to, numDependencies\);}{#if CUDART_VERSION >= 13000
    return cudaGraphAddDependencies(graph, from, to, nullptr, numDependencies);
#else
    return cudaGraphAddDependencies(graph, from, to, numDependencies);
#endif};
      ' "$inst"
      echo "patched $inst for the CUDA 13 signatures of cudaMemAdvise, cudaMemPrefetchAsync, cudaGraphAddDependencies"
    fi
    kokkos_opts+=(-DKokkos_ENABLE_CUDA=ON "-DKokkos_ARCH_$arch=ON" -DKokkos_ENABLE_CUDA_LAMBDA=ON
      -DKokkos_ENABLE_CUDA_CONSTEXPR=ON -DKokkos_ENABLE_IMPL_VIEW_LEGACY=ON
      -DCMAKE_CXX_COMPILER="$wrapper")
    # nvcc_wrapper hands -Wall -Wextra -Wpedantic to g++ on nvcc's generated host code, which warns about
    # code that is not kvmem's: the warnings stay, -Werror goes.
    kvmem_opts+=(-DCMAKE_CXX_COMPILER="$wrapper" -DKVMEM_WERROR=OFF)
    ;;
  *)
    echo "space must be OpenMP or Cuda, not $space" >&2
    exit 2
    ;;
esac

cmake -S "$kokkos_src" -B "$work/kokkos-build" "${kokkos_opts[@]}" "${launcher[@]}"
cmake --build "$work/kokkos-build" -j "$jobs"
cmake --install "$work/kokkos-build" > /dev/null

prefixes="$work/install"
if [[ -n ${CMAKE_PREFIX_PATH:-} ]]; then
  prefixes+=";${CMAKE_PREFIX_PATH//:/;}"
fi
cmake -S "$kvmem_src" -B "$work/kvmem-build" -DCMAKE_BUILD_TYPE=Release -DKVMEM_KOKKOS=ON \
  -DKVMEM_BUILD_BENCHMARKS=ON -DKVMEM_TORCH=OFF -DKVMEM_BUILD_EXAMPLES=OFF \
  -DCMAKE_PREFIX_PATH="$prefixes" "${kvmem_opts[@]}" "${launcher[@]}"
cmake --build "$work/kvmem-build" -j "$jobs" --target kvmem_kokkos_suite kvmem_bench_kokkos

if [[ $run != 1 ]]; then
  echo "built; run with: (cd $work/kvmem-build && ctest -L kokkos) and $work/kvmem-build/benchmarks/kokkos/kvmem_bench_kokkos"
  if [[ $space == Cuda ]]; then
    # catch_discover_tests lists a suite's cases by running its executable after linking, which needs the
    # CUDA driver; built where there is none, ctest finds no Kokkos cases until the executables relink.
    echo "without a CUDA driver here the ctest lists stay empty; on the GPU machine run the executables directly:"
    echo "  for t in $work/kvmem-build/tests/kokkos/test_kokkos_*; do [[ -x \$t ]] && \$t --warn NoAssertions; done"
    echo "  (a case that does not apply prints 'SKIPPED: why'; with --warn NoAssertions it counts as failed)"
  fi
  exit 0
fi
if [[ $space == OpenMP ]]; then
  export OMP_PROC_BIND=${OMP_PROC_BIND:-spread} OMP_PLACES=${OMP_PLACES:-threads}
fi
(cd "$work/kvmem-build" && KVMEM_GOLDEN_DIR="$kvmem_src/tests/data/golden" ctest -L kokkos --output-on-failure)
"$work/kvmem-build/benchmarks/kokkos/kvmem_bench_kokkos" --json "$work/bench_kokkos_$space_lower.json"
