#!/usr/bin/env bash
# A/B of two builds of the extension on one GPU, in one call: an old tree (a git revision, or a
# folder holding a checkout's files, e.g. one made by `git archive REV | tar -x -C DIR` and
# carried to the GPU machine) and the working tree, each built in place, then every
# kernel_times.py case on both in turn (old, new), for ROUNDS rounds (default 2): the same script
# and inputs, only the build differs. For the measure-after step of benchmarks/NOTES.md.
#
#   bash benchmarks/ab_builds.sh REV|DIR "chunk_gsa --bwd" "chunk_gsa --train" "chunk_gla --K 128"
#
# The old tree is copied to $AB_WORK (default /tmp/fla_ext_ab, replaced). Builds use MAX_JOBS
# (16) and TORCH_CUDA_ARCH_LIST (9.0a) as the README's GPU build does.
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,11p' "$0"; exit 2; }
rev=$1
shift
root=$(cd "$(dirname "$0")/.." && pwd)
work=${AB_WORK:-/tmp/fla_ext_ab}
rounds=${ROUNDS:-2}
export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
py=${PYTHON:-python3}

rm -rf "$work" && mkdir -p "$work"
if [ -d "$rev" ]; then
  cp -r "$rev"/. "$work"
  rm -rf "$work/build" "$work"/fla_ext/_C*.so
else
  git -C "$root" archive "$rev" | tar -x -C "$work"
  # The name as this checkout resolves it: a machine's copy of .git may lag the working tree's
  # (one GPU session built its first commit for HEAD), so the log says which commit ran.
  rev="$rev = $(git -C "$root" rev-parse --short "$rev^{commit}")"
fi
echo "old: $rev; tree: $(git -C "$root" rev-parse --short HEAD 2>/dev/null) plus its uncommitted changes"
(cd "$work" && "$py" setup.py -q build_ext --inplace > "$work/build.log" 2>&1) & old_build=$!
(cd "$root" && "$py" setup.py -q build_ext --inplace > "$work/build_tree.log" 2>&1) & new_build=$!
wait "$old_build" || { tail -20 "$work/build.log"; exit 1; }
wait "$new_build" || { tail -20 "$work/build_tree.log"; exit 1; }

for round in $(seq "$rounds"); do
  for case in "$@"; do
    for side in old new; do
      if [ "$side" = old ]; then dir=$work name=$rev; else dir=$root name=tree; fi
      echo "== round $round | $side ($name) | $case"
      # shellcheck disable=SC2086  # a case is the script's own arguments, split on spaces
      PYTHONPATH="$dir" "$py" "$root/benchmarks/kernel_times.py" $case
    done
  done
done
