# CPack settings for kvmem's Debian packages. `cpack -G DEB` in a configured and built build folder
# writes one package per install component:
#   libkvmem-dev_<version>_all.deb   headers, CMake package, kvmem.pc, license (component dev; Debian
#                                     names header-only development packages lib<name>-dev)
#   kvmem-tools_<version>_<arch>.deb  kvmem-plan, kvmem-demo, kvmem-replay (component tools, present
#                                     when KVMEM_BUILD_EXAMPLES is ON)
# `cpack -G DEB -D CPACK_COMPONENTS_ALL=dev` builds the library package alone.
set(CPACK_PACKAGE_NAME kvmem)
set(CPACK_PACKAGE_VENDOR "kvmem developers")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "${PROJECT_DESCRIPTION}")
set(CPACK_PACKAGE_VERSION "${PROJECT_VERSION}")
set(CPACK_RESOURCE_FILE_LICENSE "${PROJECT_SOURCE_DIR}/LICENSE")
set(CPACK_PACKAGE_CONTACT "kvmem developers" CACHE STRING "Maintainer field of the binary packages")
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)

set(CPACK_COMPONENTS_ALL dev)
if(KVMEM_BUILD_EXAMPLES)
  list(APPEND CPACK_COMPONENTS_ALL tools)
endif()
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION libdevel)

set(CPACK_DEBIAN_DEV_PACKAGE_NAME libkvmem-dev)
set(CPACK_DEBIAN_DEV_PACKAGE_ARCHITECTURE all)  # headers only
# Using it needs a C++20 compiler and the C library headers. The optional parts name their own
# dependencies and are only suggested: Eigen (dense host blocks), nlohmann-json (the safetensors
# reader), Kokkos (kvmem::kokkos), and a build tool that reads the CMake package or kvmem.pc.
set(CPACK_DEBIAN_DEV_PACKAGE_DEPENDS "g++ (>= 4:12) | c++-compiler, libc6-dev")
set(CPACK_DEBIAN_DEV_PACKAGE_SUGGESTS
    "cmake (>= 3.21) | pkgconf, libeigen3-dev, nlohmann-json3-dev, libtrilinos-kokkos-dev")

set(CPACK_DEBIAN_TOOLS_PACKAGE_NAME kvmem-tools)
set(CPACK_DEBIAN_TOOLS_PACKAGE_SECTION science)
find_program(KVMEM_DPKG_SHLIBDEPS dpkg-shlibdeps)
mark_as_advanced(KVMEM_DPKG_SHLIBDEPS)
if(KVMEM_DPKG_SHLIBDEPS)
  set(CPACK_DEBIAN_TOOLS_PACKAGE_SHLIBDEPS ON)  # the shared libraries the programs link, with versions
else()
  set(CPACK_DEBIAN_TOOLS_PACKAGE_DEPENDS "libc6, libstdc++6, libgcc-s1")  # no dpkg-dev: unversioned
endif()
include(CPack)
cpack_add_component(dev DISPLAY_NAME "kvmem headers and build files")
cpack_add_component(tools DISPLAY_NAME "kvmem tools (kvmem-plan, kvmem-demo, kvmem-replay)")
