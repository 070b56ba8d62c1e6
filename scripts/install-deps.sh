#!/usr/bin/env bash
# Installs what kvmem's build, tests and tools need from Debian 12's packages (idempotent: packages
# already present are not touched). Runs apt-get directly as root, through sudo otherwise.
# pkgconf: the pkg-config consumer test; dpkg (always on Debian) and cpack (in cmake): the .deb test.
# python3-torch, libtorch-dev, python3-pytest: the PyTorch ops (python/) and their pytest suites; the
# build skips them, saying why, where torch is missing.
# hipcc, libamdhip64-dev: the HIP build of the GPU tests and benchmarks (compile only, ROCm 5.2).
set -euo pipefail
packages=(g++ cmake make catch2 nlohmann-json3-dev libeigen3-dev libtrilinos-kokkos-dev pkgconf clang-format
          python3-torch libtorch-dev python3-pytest hipcc libamdhip64-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  echo "install-deps: everything is installed (${packages[*]})"
  exit 0
fi
as_root=()
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "install-deps: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
  as_root=(sudo)
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
