# Fails when a shared module defines libstdc++'s std::locale::classic(), i.e. carries its own copy
# of the C++ runtime instead of using the one of the process that loads it.
#   cmake -DNM=<nm> -DMODULE=<file> -P check_no_static_cxx_runtime.cmake
execute_process(COMMAND "${NM}" --defined-only "${MODULE}" OUTPUT_VARIABLE _symbols RESULT_VARIABLE _rc ERROR_QUIET)
if(NOT _rc EQUAL 0)
  message(STATUS "kvmem: could not list the symbols of ${MODULE} (${NM}); C++ runtime check skipped")
  return()
endif()
if(_symbols MATCHES "[ \t]_ZNSt6locale7classicEv\n")
  message(FATAL_ERROR "kvmem: ${MODULE} contains a static copy of libstdc++ (it defines std::locale::classic). \
Loaded into Python beside torch it would print numbers wrongly or crash while formatting an error message. \
The C++ compiler links libstdc++ statically into shared objects (for example a wrapper that passes \
-static-libstdc++); configure with a compiler that does not, e.g. -DCMAKE_CXX_COMPILER=/usr/bin/g++.")
endif()
