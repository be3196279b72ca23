#!/usr/bin/env bash
# Build Lightning with this project's patch series: download the released source distribution,
# check its sha256, apply patches/lightning-$VERSION/series in order, build a wheel into dist/.
# Fails loudly, naming the file and hunk, when a patch no longer applies.
# Usage: bash patches/build.sh PYTHON   (a Python whose pip downloads and builds)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${1:?usage: patches/build.sh PYTHON}
VERSION=2.6.6
SHA256=1c6329e241f8a85f29fedead89c1ee138b36caa08de60c260c6a7eaee81c8295
# The wheel's version carries a local label, so a run can tell the patched build from the release.
LABEL=ddpsigterm
SERIES=patches/lightning-$VERSION
SDIST=build/lightning-$VERSION.tar.gz
TREE=build/lightning-$VERSION
PIP=("$PYTHON" -m pip --disable-pip-version-check --quiet)

mkdir -p build dist
if ! echo "$SHA256  $SDIST" | sha256sum --check --status 2>/dev/null; then
  rm -f "$SDIST"
  "${PIP[@]}" download --no-deps --no-binary :all: "lightning==$VERSION" -d build
fi
echo "$SHA256  $SDIST" | sha256sum --check  # stops the build on a mismatch

rm -rf "$TREE"
tar -xzf "$SDIST" -C build
grep -v '^#' "$SERIES/series" | while read -r name; do
  [ -n "$name" ] || continue
  # dry run first: a series that half applies must not leave a half-patched tree behind
  if ! report=$(patch --dry-run --batch --forward -p1 -d "$TREE" <"$SERIES/$name" 2>&1); then
    echo "$report" >&2
    echo "error: $SERIES/$name no longer applies to lightning $VERSION (failing file and hunk above)" >&2
    exit 1
  fi
  patch --batch --forward --silent -p1 -d "$TREE" <"$SERIES/$name"
  echo "applied $name"
done

echo "$VERSION+$LABEL" >"$TREE/src/version.info"
echo "$VERSION+$LABEL" >"$TREE/src/lightning/version.info"
rm -f "dist/lightning-$VERSION+$LABEL-"*.whl
"${PIP[@]}" wheel --no-deps -w dist "$TREE"
ls "dist/lightning-$VERSION+$LABEL-py3-none-any.whl"
