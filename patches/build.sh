#!/usr/bin/env bash
# Build Lightning with this project's patch series: download the released source distribution, check its sha256,
# apply the src/ part of patches/lightning-$VERSION/series in order, build a wheel into dist/.
#   bash patches/build.sh PYTHON                 a Python whose pip downloads and builds
#   bash patches/build.sh --tests ARCHIVE        Lightning's 2.6.5 tests (the sdist has none) unpacked into
#                                                build/lightning-$VERSION-tests with the tests/ part of the series
# Fails loudly, naming the file and hunk, when a patch no longer applies; the trees are unpacked afresh every time.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=2.6.6
SHA256=1c6329e241f8a85f29fedead89c1ee138b36caa08de60c260c6a7eaee81c8295
# The wheel's version carries a local label, so a run can tell the patched build from the release.
LABEL=ddpsigterm
SERIES=patches/lightning-$VERSION

# The open upstream pull requests the series is stacked on ($SERIES/base names their diffs, applied first, CHANGELOG
# hunks left out): their folder, open-prs/ in the Makefile's LIGHTNING_SOURCES unless OPEN_PRS says otherwise.
OPEN_PRS=${OPEN_PRS:-${LIGHTNING_SOURCES:-build/lightning-sources}/open-prs}

# apply TREE PATCH FILTER...: git apply, not patch: it takes the filters, and a patch with a hunk that does not apply
# changes nothing; the ceiling keeps it from taking build/ for part of this repository.
apply() {
  local tree=$1 patch=$2 report
  shift 2
  if ! report=$(cd "$tree" && GIT_CEILING_DIRECTORIES="$(dirname "$PWD")" git apply "$@" "$patch" 2>&1); then
    echo "$report" >&2
    echo "error: $patch no longer applies to $tree (failing file and hunk above)" >&2
    exit 1
  fi
  echo "applied $(basename "$patch") ($*)"
}

# apply_series TREE GIT-APPLY-FILTER: the base's diffs, then every patch of the series, in order.
apply_series() {
  local tree=$1 filter=$2 name
  if [ -f "$SERIES/base" ]; then
    grep -v '^#' "$SERIES/base" | while read -r name; do
      [ -n "$name" ] || continue
      [ -f "$OPEN_PRS/$name" ] || { echo "error: $SERIES/base names $name, not in $OPEN_PRS (make fetch-upstream builds it; or set OPEN_PRS=<folder>)" >&2; exit 1; }
      apply "$tree" "$(cd "$OPEN_PRS" && pwd)/$name" --exclude='*CHANGELOG.md' "$filter"
    done
  fi
  grep -v '^#' "$SERIES/series" | while read -r name; do
    [ -n "$name" ] || continue
    apply "$tree" "$PWD/$SERIES/$name" "$filter"
  done
}

mkdir -p build dist
if [ "${1:-}" = "--tests" ]; then
  ARCHIVE=${2:?usage: patches/build.sh --tests ARCHIVE}
  TESTS=build/lightning-$VERSION-tests
  rm -rf "$TESTS" build/lightning-2.6.5
  tar -xzf "$ARCHIVE" -C build
  mv build/lightning-2.6.5 "$TESTS"
  apply_series "$TESTS" --include='tests/*'
  exit 0
fi

PYTHON=${1:?usage: patches/build.sh PYTHON}
SDIST=build/lightning-$VERSION.tar.gz
TREE=build/lightning-$VERSION
PIP=("$PYTHON" -m pip --disable-pip-version-check --quiet)
if ! echo "$SHA256  $SDIST" | sha256sum --check --status 2>/dev/null; then
  rm -f "$SDIST"
  "${PIP[@]}" download --no-deps --no-binary :all: "lightning==$VERSION" -d build
fi
echo "$SHA256  $SDIST" | sha256sum --check  # stops the build on a mismatch

rm -rf "$TREE"
tar -xzf "$SDIST" -C build
apply_series "$TREE" --exclude='tests/*'

echo "$VERSION+$LABEL" >"$TREE/src/version.info"
echo "$VERSION+$LABEL" >"$TREE/src/lightning/version.info"
rm -f "dist/lightning-$VERSION+$LABEL-"*.whl
"${PIP[@]}" wheel --no-deps -w dist "$TREE"
ls "dist/lightning-$VERSION+$LABEL-py3-none-any.whl"
