#!/bin/bash
# Reassemble, verify and install a wheelhouse made by scripts/wheelhouse.py, without any index.
#   bash scripts/install_wheelhouse.sh PARTS TARGET
# PARTS: a folder holding the part files wheelhouse.tar.NN and wheelhouse.sha256 (any depth: the
# partN/ folders as written, or all files gathered in one folder). TARGET: the site folder to
# install into (then export PYTHONPATH=TARGET). PYTHON (default python3) selects the interpreter.
set -euo pipefail
PARTS=${1:?usage: install_wheelhouse.sh PARTS TARGET}
TARGET=${2:?usage: install_wheelhouse.sh PARTS TARGET}
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mapfile -t FILES < <(find "$PARTS" -name 'wheelhouse.tar.[0-9][0-9]' -printf '%f %p\n' | sort | cut -d' ' -f2-)
SUM=$(find "$PARTS" -name wheelhouse.sha256 | head -1)
[ "${#FILES[@]}" -gt 0 ] && [ -n "$SUM" ] || { echo "no wheelhouse parts (wheelhouse.tar.NN + wheelhouse.sha256) under $PARTS" >&2; exit 3; }
cat "${FILES[@]}" > "$WORK/wheelhouse.tar"
(cd "$WORK" && sha256sum -c --quiet "$SUM") || { echo "wheelhouse incomplete: ${#FILES[@]} parts found: ${FILES[*]}" >&2; exit 3; }
tar -C "$WORK" -xf "$WORK/wheelhouse.tar"
mkdir -p "$TARGET"
"$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$TARGET" "$WORK"/wheels/*.whl
echo "installed $(ls "$WORK"/wheels/*.whl | wc -l) wheels into $TARGET"
