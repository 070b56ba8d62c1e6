// SPDX-License-Identifier: Apache-2.0
#pragma once
// Assertions of the documentation snippets' test programs (outside the quoted regions): a failed
// check prints what failed and where, and ends the program with exit status 1, so ctest reports it.

#include <cstdio>
#include <cstdlib>

#include "kvmem/core/status.hpp"

#define SNIPPET_CHECK(cond)                                                         \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (false)

// A Status that must be ok: prints its message otherwise.
#define SNIPPET_CHECK_OK(expr)                                                                      \
  do {                                                                                              \
    const ::kvmem::Status snippet_status_ = (expr);                                                 \
    if (!snippet_status_.is_ok()) {                                                                 \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, snippet_status_.to_string().c_str()); \
      std::exit(1);                                                                                 \
    }                                                                                               \
  } while (false)
