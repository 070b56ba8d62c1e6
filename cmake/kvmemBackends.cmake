# Usage requirements of kvmem's optional backend targets. The build tree (CMakeLists.txt) and the
# installed package (kvmemConfig.cmake) both call these, so an installed kvmem::cuda or kvmem::kokkos
# carries exactly the options that the in-tree target has.

# kvmem::cuda: the .cuh sources need C++20 under nvcc (CMake 3.25 has no CUDA20 dialect for nvcc, so
# the flag is passed directly) and constexpr host helpers (numeric_limits, std::min) callable from
# device code; the backend calls the CUDA runtime. Needs find_package(CUDAToolkit) first.
function(kvmem_cuda_usage target)
  target_link_libraries(${target} INTERFACE CUDA::cudart)
  target_compile_options(${target} INTERFACE
    $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20 --expt-relaxed-constexpr>)
endfunction()

# kvmem::kokkos: Kokkos itself, through kvmem::KokkosCore (FindKvmemKokkos.cmake, which also copes
# with Debian 12's broken Kokkos config). Needs find_package(KvmemKokkos) first.
function(kvmem_kokkos_usage target)
  target_link_libraries(${target} INTERFACE kvmem::KokkosCore)
endfunction()
