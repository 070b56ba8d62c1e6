#!/bin/sh
# Every fenced C++ block (```cpp) of README.md and docs/*.md must be a verbatim copy of a marked region
# of a file that the build compiles, so no snippet in the documentation can drift from code that builds.
#
# In the Markdown, the line before the fence names the region:
#   <!-- snippet: examples/snippets/host_kvm.cpp#kvm-host -->
# In that file the region lies between the lines "// [snippet:kvm-host]" and "// [snippet-end]"; the
# block must equal it with the region's common indentation removed. Every region of
# examples/snippets must be quoted by at least one page.
#
# usage: check_snippets.sh <repository root>
set -eu
root=${1:?usage: check_snippets.sh <repository root>}
cd "$root"

status=0
for md in README.md docs/*.md; do
  [ -f "$md" ] || continue
  awk -v md="$md" '
    function fail(msg) { printf "%s:%d: %s\n", md, fence_line, msg; bad = 1 }
    # The region `name` of `path`, dedented, as one string of lines ending in "\n"; "" with err set if absent.
    function region(path, name,    line, inside, n, i, lines, indent, lead, text) {
      err = ""; inside = 0; n = 0
      while ((getline line < path) > 0) {
        if (!inside && line ~ ("^[ \t]*// \\[snippet:" name "\\][ \t]*$")) { inside = 1; continue }
        if (inside && line ~ /^[ \t]*\/\/ \[snippet-end\][ \t]*$/) { inside = 2; break }
        if (inside) lines[++n] = line
      }
      close(path)
      if (inside == 0) { err = "no region \"" name "\" in " path; return "" }
      if (inside == 1) { err = "region \"" name "\" of " path " has no // [snippet-end]"; return "" }
      indent = -1
      for (i = 1; i <= n; ++i) {
        if (lines[i] ~ /^[ \t]*$/) continue
        match(lines[i], /^ */); lead = RLENGTH
        if (indent < 0 || lead < indent) indent = lead
      }
      if (indent < 0) indent = 0
      text = ""
      for (i = 1; i <= n; ++i) text = text substr(lines[i], indent + 1) "\n"
      return text
    }
    BEGIN { bad = 0; in_block = 0; marker = ""; prev = "" }
    {
      if (in_block) {
        if ($0 ~ /^```[ \t]*$/) {
          in_block = 0
          if (marker == "") { fail("a ```cpp block without a <!-- snippet: FILE#NAME --> line before it"); next }
          split(marker, part, "#")
          if ((getline probe < part[1]) < 0) { fail("snippet file " part[1] " does not exist"); next }
          close(part[1])
          want = region(part[1], part[2])
          if (err != "") { fail(err); next }
          if (want != block) {
            nw = split(want, wl, "\n"); nb = split(block, bl, "\n")
            for (i = 1; i <= (nw > nb ? nw : nb); ++i) if (wl[i] != bl[i]) break
            fail("block differs from " marker " at its line " i ":\n  file: " wl[i] "\n  doc:  " bl[i])
          }
          next
        }
        block = block $0 "\n"
        next
      }
      if ($0 ~ /^```[ \t]*(cpp|c\+\+|cxx|cuda)[ \t]*$/) {
        in_block = 1; block = ""; fence_line = NR; marker = ""
        if (prev ~ /^<!-- snippet: [^ ]+#[^ ]+ -->$/) { marker = prev; sub(/^<!-- snippet: /, "", marker); sub(/ -->$/, "", marker) }
        next
      }
      if ($0 !~ /^[ \t]*$/) prev = $0
    }
    END {
      if (in_block) { fence_line = NR; fail("unterminated ```cpp block") }
      exit bad
    }' "$md" || status=1
  blocks=$(grep -c '^```\(cpp\|c++\|cxx\|cuda\)[[:space:]]*$' "$md" || true)
  echo "$md: $blocks C++ block(s) checked"
done
# Every region is quoted somewhere: a region no page shows is documentation that was dropped.
for file in examples/snippets/*.cpp examples/snippets/*.cu; do
  [ -f "$file" ] || continue
  for name in $(sed -n 's|^[[:space:]]*// \[snippet:\([^]]*\)\][[:space:]]*$|\1|p' "$file"); do
    if ! grep -q -F -x -- "<!-- snippet: $file#$name -->" README.md docs/*.md; then
      echo "$file: region \"$name\" is not quoted by README.md or docs/*.md"
      status=1
    fi
  done
done
[ "$status" -eq 0 ] && echo "every C++ block matches its snippet file" || echo "FAILED: see the messages above"
exit "$status"
