# Usage requirements of kvmem's optional backend targets. The build tree (CMakeLists.txt) and the
# installed package (kvmemConfig.cmake) both call these, so an installed kvmem::cuda, kvmem::hip or
# kvmem::kokkos carries exactly the options that the in-tree target has.

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

# kvmem::hip: the same .cuh sources compiled by hipcc for AMD GPUs (include/kvmem/backend/cuda/vendor.cuh
# maps the CUDA names to HIP's). The consumer's C++ compiler is hipcc, which compiles .cu and .cpp
# files as HIP and links the HIP runtime; every GPU architecture in `archs` (a list such as
# gfx90a;gfx940) is compiled and linked for (--offload-arch, also at the link so that hipcc does not
# probe the machine for a GPU).
# -xhip: CMake compiles a .cu source given LANGUAGE CXX with `-x c++` first; the later -xhip makes it HIP.
function(kvmem_hip_usage target archs)
  target_compile_options(${target} INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-xhip>)
  foreach(_arch IN LISTS archs)
    target_compile_options(${target} INTERFACE $<$<COMPILE_LANGUAGE:CXX>:--offload-arch=${_arch}>)
    target_link_options(${target} INTERFACE --offload-arch=${_arch})
  endforeach()
endfunction()
