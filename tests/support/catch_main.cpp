// SPDX-License-Identifier: Apache-2.0
// Catch2 v2 main, compiled once for every test executable.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
