#!/usr/bin/env bash
# Checks with clang-format 14 (the repository's .clang-format) the C++/CUDA
# lines changed against a base; `make test` runs it.
#   tools/check_format.sh [--fix] [BASE]
# Lines changed: those `git diff BASE` adds or modifies in the working tree
# (committed since BASE, staged or not), plus every line of untracked files
# git does not ignore. Only those lines are checked: files written before the
# formatter stay as they are until someone changes them.
# BASE: the argument; else `git merge-base HEAD origin/main` where origin/main
# exists; else HEAD~1, i.e. the last commit and the uncommitted changes; in a
# clone without HEAD~1 (a shallow CI checkout) HEAD, i.e. the uncommitted
# changes only, which in CI is nothing.
# --fix formats those lines in place instead of checking them.
# Skips, exiting 0, where clang-format 14 is not installed.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

fix=0
if [ "${1:-}" = --fix ]; then
  fix=1
  shift
fi

formatter=
for candidate in clang-format-14 clang-format; do
  if command -v "$candidate" >/dev/null &&
    "$candidate" --version | grep -q 'clang-format version 14\.'; then
    formatter=$candidate
    break
  fi
done
if [ -z "$formatter" ]; then
  echo "== Format check SKIPPED: clang-format 14 not found (other versions format differently)"
  exit 0
fi

if [ $# -ge 1 ]; then
  base=$1
elif git rev-parse -q --verify origin/main >/dev/null; then
  base=$(git merge-base HEAD origin/main)
elif git rev-parse -q --verify HEAD~1 >/dev/null; then
  base=HEAD~1
else
  base=HEAD
fi

patterns=('*.cpp' '*.cc' '*.h' '*.hpp' '*.cu' '*.cuh')

# "FILE LINES" rows, LINES as clang-format's --lines=A:B arguments.
ranges=$(
  git diff -U0 -M --diff-filter=AMR --no-color "$base" -- "${patterns[@]}" |
    awk '
      /^\+\+\+ b\// { file = substr($0, 7); next }
      /^@@ / {
        split($3, a, ",")
        start = substr(a[1], 2); count = (a[2] == "") ? 1 : a[2]
        if (count > 0) lines[file] = lines[file] " --lines=" start ":" (start + count - 1)
      }
      END { for (f in lines) print f lines[f] }'
  git ls-files --others --exclude-standard -- "${patterns[@]}" | sed 's/$/ --lines=1:1000000/'
)
if [ -z "$ranges" ]; then
  echo "== Format check: no C++/CUDA lines changed since $base"
  exit 0
fi

status=0
checked=0
while read -r file args; do
  [ -f "$file" ] || continue
  checked=$((checked + 1))
  # shellcheck disable=SC2086
  if [ $fix = 1 ]; then
    "$formatter" -i --style=file $args "$file" || status=1
  elif ! out=$("$formatter" --dry-run -Werror --style=file $args "$file" 2>&1); then
    echo "$out" | head -n 12 >&2
    status=1
  fi
done <<<"$ranges"

if [ $fix = 1 ]; then
  echo "== Format: formatted the changed lines of $checked files (since $base)"
elif [ $status = 0 ]; then
  echo "== Format check: the changed lines of $checked files are formatted (since $base)"
else
  echo "== Format check FAILED (since $base): tools/check_format.sh --fix $* formats them" >&2
fi
exit $status
