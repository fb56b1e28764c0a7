#!/usr/bin/env bash
# Copy commit REV's tracked files (less docs/ and tests/) into DIR (default exp/base), for `gpu_host.sh ab-train`,
# which runs the 0.5B preset's loop from that copy and from the working tree on one machine. Keep DIR out of git
# (e.g. `echo /exp/ >> .git/info/exclude`) and send it to the GPU host with the tree.
#
#   bash scripts/ab_base.sh REV [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: bash scripts/ab_base.sh REV [DIR]}
dir=${2:-exp/base}
git rev-parse --verify -q "$rev^{commit}" > /dev/null || { echo "ab_base.sh: $rev is not a commit here" >&2; exit 2; }
rm -rf "$dir" && mkdir -p "$dir"
git archive "$rev" | tar -x -C "$dir" --exclude=docs --exclude=tests
echo "$dir: $(git rev-parse --short "$rev") ($(du -sh "$dir" | cut -f1)); run: AB_BASE=$dir AB_ARGS='...' bash scripts/gpu_host.sh ab-train"
