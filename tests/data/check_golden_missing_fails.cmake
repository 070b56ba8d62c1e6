# A golden suite whose folder is missing must fail, naming the folder (support/golden.hpp), instead
# of passing with nothing compared. Runs the suite EXE with KVMEM_GOLDEN_DIR pointing at MISSING.
#   cmake -DEXE=<a golden test executable> -DMISSING=<a path that does not exist> -P this file
cmake_minimum_required(VERSION 3.21)
if(EXISTS "${MISSING}")
  message(FATAL_ERROR "${MISSING} exists; the check needs a path that does not")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -E env KVMEM_GOLDEN_DIR=${MISSING} "${EXE}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
# Catch wraps long messages at 80 columns (inside the path, too), so compare with all whitespace removed.
string(REGEX REPLACE "[ \t\r\n]" "" _flat "${out}${err}")
string(REGEX REPLACE "[ \t\r\n]" "" _expected "golden vectors missing: ${MISSING}")
string(FIND "${_flat}" "${_expected}" _at)
if(rc EQUAL 0 OR _at EQUAL -1)
  message(FATAL_ERROR "${EXE} with KVMEM_GOLDEN_DIR=${MISSING} exited ${rc}; expected a failure "
                      "naming the folder:\n${out}\n${err}")
endif()
message("${EXE} fails without its golden folder, naming it (exit ${rc})")
