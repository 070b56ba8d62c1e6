#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Mutation testing: applies each mutant of a list (tests/mutation/mutants.txt) alone to a scratch copy
# of the tree, rebuilds the tests the mutant names, runs them, and reports which mutants survive (no
# test failed). See tests/mutation/README.md.
#
#   tests/mutation/run.sh [--only REGEX] [--builds host,kokkos,cuda] [--list FILE] [--keep] [--check-list]
#
# --check-list only checks that every selected mutant still applies (its file exists and holds the old
# text at least `occurrence` times) and builds nothing: a fast test of the suite runs it, so a change
# that removes a mutant's text fails there and the list is updated with the code.
#
# Environment: JOBS (build parallelism, default 2), TEST_TIMEOUT (seconds per test executable, default
# 1200; a timeout counts as caught), MUTATION_SCRATCH (scratch folder, default a new mktemp folder),
# KVMEM_GOLDEN_DIR (golden vectors; default: the build's, the repository's tests/data/golden).
# Exit status: 0 when every mutant that ran was caught; 1 when one survived, did not apply or did not
# build; 2 on a usage error or a failing unmutated baseline.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
list="$here/mutants.txt"
only=""
builds="host,kokkos,cuda"
keep=0
check_list=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --only) only="$2"; shift 2 ;;
    --builds) builds="$2"; shift 2 ;;
    --list) list="$2"; shift 2 ;;
    --keep) keep=1; shift ;;
    --check-list) check_list=1; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "run.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
jobs="${JOBS:-2}"
test_timeout="${TEST_TIMEOUT:-1200}"

# ---- the mutant list: id @@ build @@ file @@ occurrence @@ old @@ new @@ tests ----------------------
ids=(); kinds=(); files=(); occs=(); olds=(); news=(); tests=()
while IFS= read -r line || [[ -n "$line" ]]; do
  [[ -z "${line// }" || "$line" =~ ^[[:space:]]*# ]] && continue
  python3 - "$line" > /dev/null <<'EOF' || { echo "run.sh: malformed mutant line: $line" >&2; exit 2; }
import sys
assert len(sys.argv[1].split(" @@ ")) == 7
EOF
  IFS=$'\x1f' read -r id kind file occ old new tst < <(python3 -c 'import sys; print("\x1f".join(f.strip() for f in sys.argv[1].split(" @@ ")))' "$line")
  [[ -n "$only" && ! "$id" =~ $only ]] && continue
  [[ ",$builds," == *",$kind,"* ]] || continue
  ids+=("$id"); kinds+=("$kind"); files+=("$file"); occs+=("$occ"); olds+=("$old"); news+=("$new"); tests+=("$tst")
done < "$list"
if [[ ${#ids[@]} -eq 0 ]]; then echo "run.sh: no mutant selected" >&2; exit 2; fi

# ---- --check-list: does every mutant still apply? ---------------------------------------------------
if [[ $check_list -eq 1 ]]; then
  stale=0
  for i in "${!ids[@]}"; do
    if python3 - "$repo/${files[$i]}" "${occs[$i]}" "${olds[$i]}" <<'EOF'
import os, sys
path, occ, old = sys.argv[1], int(sys.argv[2]), sys.argv[3]
found = open(path).read().count(old) if os.path.isfile(path) else -1
sys.exit(0 if found >= max(occ, 1) else 1)
EOF
    then
      echo "applies   ${ids[$i]}"
    else
      echo "STALE     ${ids[$i]}: ${files[$i]} does not hold the old text ${occs[$i]} time(s): update mutants.txt"
      stale=$((stale + 1))
    fi
  done
  echo "mutation: ${#ids[@]} mutants checked, $stale stale"
  [[ $stale -eq 0 ]] && exit 0 || exit 1
fi

# ---- CUDA mutants need a GPU ------------------------------------------------------------------------
have_gpu=0
gpu_note="no GPU: nvidia-smi not found"
if command -v nvidia-smi > /dev/null 2>&1; then
  if nvidia-smi -L 2>/dev/null | grep -q "GPU"; then have_gpu=1; else gpu_note="no GPU: nvidia-smi lists no device"; fi
fi

# ---- scratch copy of the tree (tracked and untracked, not ignored files) ----------------------------
scratch="${MUTATION_SCRATCH:-$(mktemp -d "${TMPDIR:-/tmp}/kvmem-mutation.XXXXXX")}"
src="$scratch/src"
mkdir -p "$src"
(cd "$repo" && git ls-files -z --cached --others --exclude-standard | tar --null --ignore-failed-read -T - -cf -) |
  (cd "$src" && tar -xf -)
echo "mutation: scratch tree $src"
golden="${KVMEM_GOLDEN_DIR:-}"
cfg_extra=(-DKVMEM_BUILD_EXAMPLES=OFF -DKVMEM_BUILD_BENCHMARKS=OFF)
[[ -n "$golden" ]] && cfg_extra+=("-DKVMEM_GOLDEN_DIR=$golden")
if command -v ccache > /dev/null 2>&1; then
  cfg_extra+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  export CCACHE_BASEDIR="$scratch"  # objects of unchanged sources are reused from mutant to mutant
fi

preset_of() { case "$1" in host) echo release ;; kokkos) echo kokkos ;; cuda) echo cuda ;; esac; }
bindir_of() { echo "$src/build/$(preset_of "$1")"; }
configured=""
configure() {  # configure once per build kind
  local kind="$1"
  [[ ",$configured," == *",$kind,"* ]] && return 0
  echo "mutation: configuring the $kind build (preset $(preset_of "$kind"))"
  (cd "$src" && cmake --preset "$(preset_of "$kind")" "${cfg_extra[@]}" > "$scratch/configure-$kind.log" 2>&1) ||
    { echo "mutation: configure of $kind failed, see $scratch/configure-$kind.log" >&2; exit 2; }
  configured="$configured,$kind"
}
# Test executables of a list that exist as targets in the build (golden suites need the goldens).
existing_targets() {
  local kind="$1" t out=()
  IFS=',' read -ra want <<< "$2"
  for t in "${want[@]}"; do
    if find "$(bindir_of "$kind")" -type d -name "$t.dir" -print -quit | grep -q .; then out+=("$t"); fi
  done
  echo "${out[*]:-}"
}
build() {  # build kind targets... ; returns the build's status
  local kind="$1"; shift
  cmake --build "$(bindir_of "$kind")" -j"$jobs" --target "$@" > "$scratch/build.log" 2>&1
}
# Runs test executables in order; prints the first that fails ("name: summary") and returns 1, or 0.
run_tests() {
  local kind="$1" t exe summary; shift
  for t in "$@"; do
    exe=$(find "$(bindir_of "$kind")" -type f -name "$t" -perm -u+x -print -quit)
    [[ -n "$exe" ]] || { echo "$t: executable not found"; return 1; }
    if ! (cd "$(dirname "$exe")" && timeout "$test_timeout" "$exe" > "$scratch/test.log" 2>&1); then
      summary=$(grep -E "^test cases:" "$scratch/test.log" | tail -1)
      [[ -n "$summary" ]] || summary="exit status other than a Catch failure (crash or timeout)"
      echo "$t: $summary"
      return 1
    fi
  done
  return 0
}

# ---- baseline: the unmutated tree passes every test the selected mutants run ------------------------
declare -A base_targets=()
for i in "${!ids[@]}"; do
  kind="${kinds[$i]}"
  [[ "$kind" == cuda && $have_gpu -eq 0 ]] && continue
  configure "$kind"
  base_targets[$kind]="${base_targets[$kind]:-} $(existing_targets "$kind" "${tests[$i]}")"
done
for kind in "${!base_targets[@]}"; do
  read -ra ts <<< "$(echo "${base_targets[$kind]}" | tr ' ' '\n' | sort -u | tr '\n' ' ')"
  echo "mutation: baseline $kind: ${ts[*]}"
  build "$kind" "${ts[@]}" || { echo "mutation: baseline build failed, see $scratch/build.log" >&2; exit 2; }
  if ! res=$(run_tests "$kind" "${ts[@]}"); then
    echo "mutation: the unmutated tree fails: $res (log $scratch/test.log)" >&2
    exit 2
  fi
done

# ---- one mutant at a time ---------------------------------------------------------------------------
apply() {  # file occurrence old new: replaces the occurrence-th (0 = every) occurrence; fails if absent
  python3 - "$@" <<'EOF'
import sys
path, occ, old, new = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
text = open(path, encoding="utf-8").read()
n = text.count(old)
if n == 0 or occ > n:
    sys.exit(f"pattern found {n} times, occurrence {occ} asked")
if occ == 0:
    text = text.replace(old, new)
else:
    at = -1
    for _ in range(occ):
        at = text.index(old, at + 1)
    text = text[:at] + new + text[at + len(old):]
open(path, "w", encoding="utf-8").write(text)
EOF
}
results=()
survived=0; errors=0; caught=0; skipped=0
for i in "${!ids[@]}"; do
  id="${ids[$i]}"; kind="${kinds[$i]}"; file="${files[$i]}"
  if [[ "$kind" == cuda && $have_gpu -eq 0 ]]; then
    results+=("SKIPPED   $id ($kind): $gpu_note"); skipped=$((skipped + 1)); continue
  fi
  read -ra ts <<< "$(existing_targets "$kind" "${tests[$i]}")"
  if [[ ${#ts[@]} -eq 0 ]]; then
    results+=("ERROR     $id ($kind): none of its tests ($tests) is a target of this build"); errors=$((errors + 1)); continue
  fi
  cp "$src/$file" "$scratch/original"
  if ! why=$(apply "$src/$file" "${occs[$i]}" "${olds[$i]}" "${news[$i]}" 2>&1); then
    results+=("ERROR     $id ($kind): mutation did not apply to $file: $why"); errors=$((errors + 1)); continue
  fi
  if cmp -s "$src/$file" "$scratch/original"; then
    results+=("ERROR     $id ($kind): the mutation left $file unchanged"); errors=$((errors + 1)); continue
  fi
  echo "mutation: $id ($kind) in $file, tests ${ts[*]}"
  if ! build "$kind" "${ts[@]}"; then
    results+=("ERROR     $id ($kind): does not compile (log kept in $scratch/build-$id.log)")
    cp "$scratch/build.log" "$scratch/build-$id.log"; errors=$((errors + 1))
  elif res=$(run_tests "$kind" "${ts[@]}"); then
    results+=("SURVIVED  $id ($kind): ${ts[*]} all pass"); survived=$((survived + 1))
  else
    results+=("caught    $id ($kind) by $res"); caught=$((caught + 1))
  fi
  cp "$scratch/original" "$src/$file"
done

echo
echo "mutation results (${#ids[@]} mutants: $caught caught, $survived survived, $errors errors, $skipped skipped)"
printf '  %s\n' "${results[@]}"
[[ $keep -eq 1 ]] || rm -rf "$scratch"
[[ $survived -eq 0 && $errors -eq 0 ]]
