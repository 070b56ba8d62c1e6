// SPDX-License-Identifier: Apache-2.0
// kvmem-replay-cuda: kvmem-replay compiled by nvcc, so that its adapters can call the CUDA backend
// (include/kvmem/backend/cuda). The tool is kvmem_replay.cpp, included whole: one main, one option
// parser, one set of adapters and trace runners; examples/replay/CMakeLists.txt says which backends this
// build of it carries (reference, host and CUDA; not Kokkos).
#include "kvmem_replay.cpp"
