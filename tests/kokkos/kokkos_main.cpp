// SPDX-License-Identifier: Apache-2.0
// Catch2 v2 main of the Kokkos suite: Kokkos is initialised once per executable, around the session.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <Kokkos_Core.hpp>

int main(int argc, char* argv[]) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  return Catch::Session().run(argc, argv);
}
