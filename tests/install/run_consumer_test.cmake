# Builds and runs one consumer of kvmem the way a user would get it (ctest label install).
#   cmake -DMODE=<mode> -DKVMEM_SOURCE_DIR=.. -DKVMEM_BINARY_DIR=.. -DWORK_DIR=.. -DCXX_COMPILER=..
#         -DGENERATOR=.. [-DCUDA_COMPILER=..] [-DHIP_COMPILER=..] [-DPKG_CONFIG=..] [-DCPACK=..] [-DDPKG=..] -P this file
# Modes:
#   find_package  `cmake --install --component dev` into a prefix, then find_package(kvmem)
#   kokkos, cuda  the same with COMPONENTS kokkos / cuda (the cuda consumer is compiled by nvcc)
#   hip           find_package(kvmem COMPONENTS hip REQUIRED) with a C++ compiler other than hipcc must
#                 fail, saying that the component needs hipcc
#   hip_build     the same with hipcc (HIP_COMPILER) as the C++ compiler: builds and runs (no GPU needed)
#   pkgconfig     the compiler driven by `pkg-config --cflags --libs kvmem` against the prefix
#   deb           `cpack -G DEB` (component dev), the .deb installed by dpkg into a private root
#                 (own admin dir, no system change), then find_package against <root>/usr
#   subdirectory  add_subdirectory(<kvmem source>) in a parent project
#   fetchcontent  FetchContent_Declare(kvmem SOURCE_DIR <kvmem source>) in a parent project
# Every consumer program prints "... ok" and exits 0 only when its checked value is right.
cmake_minimum_required(VERSION 3.21)
set(_here "${CMAKE_CURRENT_LIST_DIR}")
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

# run(<var> <command...>): runs the command, fails the test with its output unless it exits 0, and
# stores stdout + stderr in <var>.
function(run var)
  message(STATUS "run: ${ARGN}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  set(${var} "${out}${err}" PARENT_SCOPE)
endfunction()

function(install_dev prefix)
  run(_ ${CMAKE_COMMAND} --install "${KVMEM_BINARY_DIR}" --component dev --prefix "${prefix}")
endfunction()

# configure_build_run(<source> <exe> <expected output regex> [cmake args...]): configures without a
# build type (the consumer's choice; also what the subproject checks need), builds, runs the program.
function(configure_build_run source exe expect)
  set(build "${WORK_DIR}/build")
  run(configure_out ${CMAKE_COMMAND} -E env --unset=CMAKE_BUILD_TYPE
      ${CMAKE_COMMAND} -S "${source}" -B "${build}" -G "${GENERATOR}"
      -DCMAKE_CXX_COMPILER=${CXX_COMPILER} ${ARGN})
  set(configure_out "${configure_out}" PARENT_SCOPE)
  run(_ ${CMAKE_COMMAND} --build "${build}")
  run(program_out "${build}/${exe}")
  message(STATUS "${program_out}")
  if(NOT program_out MATCHES "${expect}")
    message(FATAL_ERROR "${exe} printed '${program_out}', expected '${expect}'")
  endif()
endfunction()

# The consumer must have found the package under <prefix>, not another kvmem on the machine.
function(expect_found_in prefix)
  string(FIND "${configure_out}" "kvmem_DIR=${prefix}/" _at)
  if(_at EQUAL -1)
    message(FATAL_ERROR "the consumer did not find kvmem under ${prefix}:\n${configure_out}")
  endif()
endfunction()

set(prefix "${WORK_DIR}/prefix")
if(MODE STREQUAL "find_package")
  install_dev("${prefix}")
  foreach(_file share/doc/kvmem/LICENSE share/pkgconfig/kvmem.pc include/kvmem/kvmem.hpp)
    if(NOT EXISTS "${prefix}/${_file}")
      message(FATAL_ERROR "not installed: ${_file}")
    endif()
  endforeach()
  configure_build_run("${_here}/consumer" kvmem_consumer "kvmem consumer ok \\(slots 443\\)"
                      -DCMAKE_PREFIX_PATH=${prefix})
  expect_found_in("${prefix}")

elseif(MODE STREQUAL "kokkos")
  install_dev("${prefix}")
  configure_build_run("${_here}/consumer_kokkos" kvmem_kokkos_consumer "kvmem kokkos consumer ok"
                      -DCMAKE_PREFIX_PATH=${prefix})
  expect_found_in("${prefix}")

elseif(MODE STREQUAL "cuda")
  install_dev("${prefix}")
  configure_build_run("${_here}/consumer_cuda" kvmem_cuda_consumer "kvmem cuda consumer ok"
                      -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_CUDA_COMPILER=${CUDA_COMPILER})
  expect_found_in("${prefix}")

elseif(MODE STREQUAL "hip")
  install_dev("${prefix}")
  execute_process(COMMAND ${CMAKE_COMMAND} -S "${_here}/consumer_hip" -B "${WORK_DIR}/build" -G "${GENERATOR}"
                          -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_PREFIX_PATH=${prefix}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "component hip needs hipcc as the C\\+\\+ compiler")
    message(FATAL_ERROR "find_package(kvmem COMPONENTS hip REQUIRED) without hipcc must fail naming what it "
                        "needs (exit ${rc}):\n${out}\n${err}")
  endif()
  message(STATUS "find_package(kvmem COMPONENTS hip REQUIRED) without hipcc failed as expected")

elseif(MODE STREQUAL "hip_build")
  install_dev("${prefix}")
  set(CXX_COMPILER "${HIP_COMPILER}")
  configure_build_run("${_here}/consumer_hip_build" kvmem_hip_consumer "kvmem hip consumer ok \\(warp 64"
                      -DCMAKE_PREFIX_PATH=${prefix} -DKVMEM_HIP_ARCHITECTURES=gfx90a)
  expect_found_in("${prefix}")

elseif(MODE STREQUAL "pkgconfig")
  install_dev("${prefix}")
  # PKG_CONFIG_LIBDIR replaces the default search path: only this prefix's kvmem.pc can be found.
  run(flags ${CMAKE_COMMAND} -E env PKG_CONFIG_LIBDIR=${prefix}/share/pkgconfig
      ${PKG_CONFIG} --cflags --libs kvmem)
  string(STRIP "${flags}" flags)
  message(STATUS "pkg-config --cflags --libs kvmem: ${flags}")
  if(NOT flags MATCHES "-std=c\\+\\+20" OR NOT flags MATCHES "-pthread")
    message(FATAL_ERROR "kvmem.pc lacks -std=c++20 or -pthread: ${flags}")
  endif()
  separate_arguments(flags UNIX_COMMAND "${flags}")
  # No -std of its own: the C++20 the headers need must come from kvmem.pc.
  run(_ ${CXX_COMPILER} "${_here}/consumer/main.cpp" ${flags} -o "${WORK_DIR}/kvmem_consumer")
  run(program_out "${WORK_DIR}/kvmem_consumer")
  if(NOT program_out MATCHES "kvmem consumer ok \\(slots 443\\)")
    message(FATAL_ERROR "consumer printed '${program_out}'")
  endif()
  message(STATUS "${program_out}")

elseif(MODE STREQUAL "deb")
  run(_ ${CPACK} -G DEB --config "${KVMEM_BINARY_DIR}/CPackConfig.cmake" -D CPACK_COMPONENTS_ALL=dev
      -B "${WORK_DIR}/deb")
  file(GLOB deb "${WORK_DIR}/deb/libkvmem-dev_*_all.deb")
  if(NOT deb)
    message(FATAL_ERROR "cpack wrote no libkvmem-dev_*_all.deb under ${WORK_DIR}/deb")
  endif()
  run(fields dpkg-deb -f "${deb}" Package Architecture Depends Suggests)
  message(STATUS "${fields}")
  foreach(_expect "Depends:[^\n]*g\\+\\+" "Depends:[^\n]*libc6-dev" "Suggests:[^\n]*libeigen3-dev"
                  "Suggests:[^\n]*nlohmann-json3-dev" "Suggests:[^\n]*libtrilinos-kokkos-dev" "Architecture: all")
    if(NOT fields MATCHES "${_expect}")
      message(FATAL_ERROR "the .deb's control fields do not match '${_expect}':\n${fields}")
    endif()
  endforeach()
  # A private dpkg database and root: nothing of the machine's own package state is touched.
  set(admin "${WORK_DIR}/admin")
  set(root "${WORK_DIR}/root")
  file(MAKE_DIRECTORY "${admin}/info" "${admin}/updates" "${root}")
  file(TOUCH "${admin}/status")
  run(_ ${DPKG} --force-not-root --force-depends --admindir=${admin} --instdir=${root}
      --log=${WORK_DIR}/dpkg.log -i "${deb}")
  run(status ${DPKG} --admindir=${admin} -s libkvmem-dev)
  if(NOT status MATCHES "Status: install ok installed")
    message(FATAL_ERROR "dpkg does not list libkvmem-dev as installed:\n${status}")
  endif()
  if(NOT EXISTS "${root}/usr/share/doc/kvmem/LICENSE" OR NOT EXISTS "${root}/usr/share/pkgconfig/kvmem.pc")
    message(FATAL_ERROR "the .deb did not install the license and kvmem.pc under ${root}/usr/share")
  endif()
  configure_build_run("${_here}/consumer" kvmem_consumer "kvmem consumer ok \\(slots 443\\)"
                      -DCMAKE_PREFIX_PATH=${root}/usr)
  expect_found_in("${root}/usr")

elseif(MODE STREQUAL "subdirectory")
  configure_build_run("${_here}/consumer_subdir" kvmem_consumer "kvmem consumer ok \\(slots 443\\)"
                      -DKVMEM_SOURCE_DIR=${KVMEM_SOURCE_DIR})
  if(NOT configure_out MATCHES "subproject check: no tests")
    message(FATAL_ERROR "the subproject checks did not run:\n${configure_out}")
  endif()

elseif(MODE STREQUAL "fetchcontent")
  configure_build_run("${_here}/consumer_fetch" kvmem_consumer "kvmem consumer ok \\(slots 443\\)"
                      -DKVMEM_SOURCE_DIR=${KVMEM_SOURCE_DIR})
  if(NOT configure_out MATCHES "subproject check: no tests")
    message(FATAL_ERROR "the subproject checks did not run:\n${configure_out}")
  endif()

else()
  message(FATAL_ERROR "unknown MODE '${MODE}'")
endif()
