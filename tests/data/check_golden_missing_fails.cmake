# A golden suite whose folder is missing must fail, naming the folder (support/golden.hpp), instead
# of passing with nothing compared. Runs the suite EXE with KVMEM_GOLDEN_DIR pointing at MISSING.
#   cmake -DEXE=<a golden test executable> -DMISSING=<a path that does not exist> -P this file
cmake_minimum_required(VERSION 3.21)
if(EXISTS "${MISSING}")
  message(FATAL_ERROR "${MISSING} exists; the check needs a path that does not")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -E env KVMEM_GOLDEN_DIR=${MISSING} "${EXE}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
string(FIND "${out}${err}" "golden vectors missing: ${MISSING}" _at)
if(rc EQUAL 0 OR _at EQUAL -1)
  message(FATAL_ERROR "${EXE} with KVMEM_GOLDEN_DIR=${MISSING} exited ${rc}; expected a failure "
                      "naming the folder:\n${out}\n${err}")
endif()
message("${EXE} fails without its golden folder, naming it (exit ${rc})")
