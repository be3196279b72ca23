#!/usr/bin/env bash
# Build the folder of Lightning's sources that the Makefile's LIGHTNING_SOURCES names (make test-lightning,
# test-upstream, test-patched, bench-master read it) from a clone of Lightning's repository, at fixed commits:
#   lightning-master-7f0c3436cd.tar.gz  master at $MASTER: src/, tests/, requirements/ and the files the upstream
#                                       work reads (pyproject.toml, setup.py, ...), top folder lightning-master/
#   lightning-2.6.5-tests.tar.gz        tag 2.6.5 ($RELEASE_COMMIT): tests/, requirements/, pyproject.toml, top folder
#                                       lightning-2.6.5/ (the release's sdist has no tests)
#   open-prs/pr<N>.diff                 `git diff <merge-base with master> <head>` of the open pull requests the patch
#                                       series is stacked on or checked against, at their heads of 2026-07-23 and -24
# The archives are `git archive` output (gzip -n), so the same commit gives the same files.
#
#   bash tools/fetch_upstream.sh DEST      (make fetch-upstream: DEST is $(LIGHTNING_SOURCES))
#   bash tools/fetch_upstream.sh --path master|tests DEST
#                                          prints that archive's path: the Makefile takes the pinned names from here
#
# Builds only what DEST lacks, so a complete folder costs nothing and needs no network. LIGHTNING_REPO=<url or path>
# clones another copy of the repository. Fails, naming the commit, when one cannot be found (a pull request whose
# head was force-pushed away from the pinned one, say): the pinned diffs are what the series was checked against.
set -euo pipefail

PRINT=""
if [ "${1:-}" = --path ]; then
  PRINT=${2:?usage: tools/fetch_upstream.sh --path master|tests DEST}
  shift 2
fi
DEST=${1:?usage: tools/fetch_upstream.sh [--path master|tests] DEST}
REPO=${LIGHTNING_REPO:-https://github.com/Lightning-AI/pytorch-lightning.git}
MASTER=7f0c3436cd3f6ad3753125672024fc415cbcb414
MASTER_PATHS=(.actions .github/CONTRIBUTING.md .github/PULL_REQUEST_TEMPLATE.md .pre-commit-config.yaml LICENSE
  Makefile pyproject.toml requirements requirements.txt setup.py src tests)
RELEASE=2.6.5
RELEASE_COMMIT=be98784a1a03581b7051a355ae1084fd352d7cea
RELEASE_PATHS=(pyproject.toml requirements tests)
# pull request number:its head commit (the diff is of that commit, wherever the pull request has moved since)
PULLS=(21666:b4794f794b22 21407:7ed9ea79cbbf 21640:4aa8af723d71 21665:8b24b0b2dc1b 21751:f418848686 21772:2cccb8b963)

MASTER_ARCHIVE=$DEST/lightning-master-${MASTER:0:10}.tar.gz
RELEASE_ARCHIVE=$DEST/lightning-$RELEASE-tests.tar.gz
case $PRINT in
  "") ;;
  master) echo "$MASTER_ARCHIVE"; exit 0 ;;
  tests) echo "$RELEASE_ARCHIVE"; exit 0 ;;
  *) echo "error: --path master or --path tests, not $PRINT" >&2; exit 2 ;;
esac
missing=()
for file in "$MASTER_ARCHIVE" "$RELEASE_ARCHIVE"; do
  [ -f "$file" ] || missing+=("$file")
done
for pull in "${PULLS[@]}"; do
  [ -f "$DEST/open-prs/pr${pull%%:*}.diff" ] || missing+=("$DEST/open-prs/pr${pull%%:*}.diff")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "$DEST has Lightning's archives and open pull requests' diffs: nothing to fetch"
  exit 0
fi

# A whole clone: the merge bases need the history, and a partial one would fetch the archives' files one by one.
CLONE=$(mktemp -d "${TMPDIR:-/tmp}/lightning-clone.XXXXXX")
trap 'rm -rf "$CLONE"' EXIT
echo "cloning $REPO into $CLONE"
GIT_TERMINAL_PROMPT=0 git clone --quiet --bare "$REPO" "$CLONE"
mkdir -p "$DEST/open-prs"
lightning() { git --git-dir="$CLONE" -c core.quotePath=false "$@"; }

# commit NAME SHA: fails unless the clone has the commit.
commit() {
  lightning rev-parse --verify --quiet "$2^{commit}" >/dev/null \
    || { echo "error: $1 ($2) is not in $REPO" >&2; exit 1; }
  lightning rev-parse --verify "$2^{commit}"
}

# archive COMMIT PREFIX FILE PATHS...: written beside FILE, then renamed, so an interrupted run leaves no archive.
archive() {
  local commit=$1 prefix=$2 file=$3
  shift 3
  [ -f "$file" ] && return
  lightning archive --format=tar --prefix="$prefix/" "$commit" -- "$@" | gzip -cn >"$file.partial"
  mv "$file.partial" "$file"
  echo "wrote $file"
}

master=$(commit master "$MASTER")
archive "$master" lightning-master "$MASTER_ARCHIVE" "${MASTER_PATHS[@]}"
release=$(commit "tag $RELEASE" "$RELEASE_COMMIT")
tagged=$(lightning rev-parse --verify --quiet "refs/tags/$RELEASE^{commit}" || true)
if [ -n "$tagged" ] && [ "$tagged" != "$release" ]; then
  echo "error: tag $RELEASE is $tagged in $REPO, not $RELEASE_COMMIT" >&2
  exit 1
fi
archive "$release" "lightning-$RELEASE" "$RELEASE_ARCHIVE" "${RELEASE_PATHS[@]}"

for pull in "${PULLS[@]}"; do
  number=${pull%%:*} head=${pull#*:}
  file=$DEST/open-prs/pr$number.diff
  [ -f "$file" ] && continue
  GIT_TERMINAL_PROMPT=0 lightning fetch --quiet origin "+refs/pull/$number/head:refs/pull/$number/head"
  head=$(commit "pull request #$number's head" "$head")
  base=$(lightning merge-base "$master" "$head")
  # the options pin what a user's git configuration could change; 10-digit blob names as in the original diffs
  lightning -c diff.noprefix=false -c diff.mnemonicPrefix=false -c diff.renames=true \
    diff --no-color --no-ext-diff --abbrev=10 "$base" "$head" >"$file.partial"
  mv "$file.partial" "$file"
  echo "wrote $file (#$number: $base..$head)"
done
