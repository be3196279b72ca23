#!/usr/bin/env bash
# The interpreter for Python $1 (e.g. 3.12): python$1 on the PATH, else under pyenv; its path on stdout, or a
# message and exit 1. The suite runs on 3.12: this machine's 3.11.7 has CPython's fork bug gh-112275 (a DataLoader
# worker can hang inside fork(), with or without the package), so a hang on 3.11.7 says nothing of ours.
set -euo pipefail
for candidate in "python$1" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$1"*/bin/"python$1"; do
    if "$candidate" -c '' 2>/dev/null; then command -v "$candidate"; exit 0; fi
done
echo "error: no python$1 on the PATH nor under ${PYENV_ROOT:-$HOME/.pyenv}/versions (pyenv install $1)" >&2
exit 1
