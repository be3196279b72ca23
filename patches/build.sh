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

# apply_series TREE GIT-APPLY-FILTER: every patch of the series, in order. git apply, not patch: it takes the filter,
# and a patch with a hunk that does not apply changes nothing; the ceiling keeps it from taking build/ for part of this
# repository.
apply_series() {
  local tree=$1 filter=$2 name report
  grep -v '^#' "$SERIES/series" | while read -r name; do
    [ -n "$name" ] || continue
    if ! report=$(cd "$tree" && GIT_CEILING_DIRECTORIES="$(dirname "$PWD")" git apply "$filter" \
        "$OLDPWD/$SERIES/$name" 2>&1); then
      echo "$report" >&2
      echo "error: $SERIES/$name no longer applies to $tree (failing file and hunk above)" >&2
      exit 1
    fi
    echo "applied $name ($filter)"
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
