#!/usr/bin/env bash
# mypy over the package as it installs. scheduling/ graphs/ kernels/ nn/ are installed as
# deviceops.* (setuptools package-dir), so mypy, reading folders, cannot map those names back
# to them. This builds build/typecheck/deviceops/: a link to every entry of deviceops/ and
# deviceops/{scheduling,graphs,kernels,nn} -> the top-level folders; pyproject's [tool.mypy]
# checks that tree (files, mypy_path), so every import resolves to the real source.
# Git-ignored (build/), rebuilt on every call. Errors are reported under
# build/typecheck/deviceops/<sub>/..., i.e. <sub>/... in the repository.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-${DEVICEOPS_VENV:-.venv}/bin/python}
TREE=build/typecheck/deviceops
rm -rf "$TREE"
mkdir -p "$TREE"
for entry in deviceops/*; do
    name=$(basename "$entry")
    [ "$name" = __pycache__ ] && continue
    ln -s "../../../deviceops/$name" "$TREE/$name"
done
for sub in scheduling graphs kernels nn; do
    ln -s "../../../$sub" "$TREE/$sub"
done
exec "$PY" -m mypy "$@"
