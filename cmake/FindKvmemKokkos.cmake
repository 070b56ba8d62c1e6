# FindKvmemKokkos: provides the imported target kvmem::KokkosCore.
#
# 1. A working find_package(Kokkos CONFIG) is preferred (a proper Kokkos install, e.g. Kokkos 4).
# 2. Debian 12's libtrilinos-kokkos-dev (Kokkos 3.4.1, Serial) ships a config whose imported target
#    points at /usr/lib/include, which does not exist; fall back to the headers in
#    /usr/include/trilinos and the library libtrilinos_kokkoscore.
# Headers are added as SYSTEM: Kokkos 3.4 warns under C++20 and our targets use -Werror.

if(TARGET kvmem::KokkosCore)
  set(KvmemKokkos_FOUND TRUE)
  return()
endif()

find_package(Kokkos CONFIG QUIET)
set(_kvmem_kokkos_config_ok FALSE)
if(Kokkos_FOUND AND TARGET Kokkos::kokkoscore)
  get_target_property(_kvmem_kokkos_inc Kokkos::kokkoscore INTERFACE_INCLUDE_DIRECTORIES)
  set(_kvmem_kokkos_config_ok TRUE)
  foreach(_dir IN LISTS _kvmem_kokkos_inc)
    if(NOT _dir MATCHES "^\\$<" AND NOT EXISTS "${_dir}")
      set(_kvmem_kokkos_config_ok FALSE)  # the Debian case: a path that does not exist
    endif()
  endforeach()
endif()

if(_kvmem_kokkos_config_ok)
  add_library(kvmem::KokkosCore INTERFACE IMPORTED)
  target_link_libraries(kvmem::KokkosCore INTERFACE Kokkos::kokkoscore)
  set(KvmemKokkos_VERSION ${Kokkos_VERSION})
  set(KvmemKokkos_FOUND TRUE)
  return()
endif()

find_path(KvmemKokkos_INCLUDE_DIR Kokkos_Core.hpp PATH_SUFFIXES trilinos kokkos)
find_library(KvmemKokkos_LIBRARY NAMES trilinos_kokkoscore kokkoscore)
if(KvmemKokkos_INCLUDE_DIR AND EXISTS "${KvmemKokkos_INCLUDE_DIR}/KokkosCore_config.h")
  file(STRINGS "${KvmemKokkos_INCLUDE_DIR}/KokkosCore_config.h" _kvmem_kokkos_ver REGEX "define KOKKOS_VERSION ")
  if(_kvmem_kokkos_ver MATCHES "KOKKOS_VERSION ([0-9]+)")
    math(EXPR _maj "${CMAKE_MATCH_1} / 10000")
    math(EXPR _min "(${CMAKE_MATCH_1} / 100) % 100")
    math(EXPR _pat "${CMAKE_MATCH_1} % 100")
    set(KvmemKokkos_VERSION "${_maj}.${_min}.${_pat}")
  endif()
endif()
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(KvmemKokkos REQUIRED_VARS KvmemKokkos_LIBRARY KvmemKokkos_INCLUDE_DIR
                                  VERSION_VAR KvmemKokkos_VERSION)
if(KvmemKokkos_FOUND)
  find_package(Threads REQUIRED)
  add_library(kvmem::KokkosCore UNKNOWN IMPORTED)
  set_target_properties(kvmem::KokkosCore PROPERTIES
    IMPORTED_LOCATION "${KvmemKokkos_LIBRARY}"
    INTERFACE_SYSTEM_INCLUDE_DIRECTORIES "${KvmemKokkos_INCLUDE_DIR}"
    INTERFACE_INCLUDE_DIRECTORIES "${KvmemKokkos_INCLUDE_DIR}")
  target_link_libraries(kvmem::KokkosCore INTERFACE Threads::Threads ${CMAKE_DL_LIBS})
endif()
mark_as_advanced(KvmemKokkos_INCLUDE_DIR KvmemKokkos_LIBRARY)
