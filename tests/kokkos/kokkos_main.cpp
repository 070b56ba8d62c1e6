// SPDX-License-Identifier: Apache-2.0
// Catch2 v2 main of the Kokkos suite: Kokkos is initialised once per executable, around the session.
// Listing the tests (what catch_discover_tests runs after the build) initialises nothing, so a suite
// built for a device space can be built and registered on a machine without that device.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cstring>

#include <Kokkos_Core.hpp>

int main(int argc, char* argv[]) {
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], "--list", 6) == 0 || std::strcmp(argv[i], "-l") == 0)
      return Catch::Session().run(argc, argv);
  Kokkos::ScopeGuard kokkos(argc, argv);
  return Catch::Session().run(argc, argv);
}
