#!/usr/bin/env bash
# Run on the development machine (it has a package registry; the GPU machine has none): download
# the wheels of what the engine imports and the GPU image lacks -- pydantic and its dependencies
# -- for the GPU image's Python (3.12, x86-64) into .whl/, kept out of git by .git/info/exclude.
# Then give the device call `carry: [".whl"]`; benchmarks/gpu/run.sh installs them there.
# Versions are the ones installed here, so both machines run the same pydantic.
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON="${PYTHON:-python3}"
PACKAGES=(pydantic pydantic_core annotated_types typing_inspection typing_extensions)
pins=()
for name in "${PACKAGES[@]}"; do
    version=$("$PYTHON" -c "import importlib.metadata as m; print(m.version('$name'))")
    pins+=("$name==$version")
done

mkdir -p .whl
if ! grep -qxF "/.whl/" .git/info/exclude 2>/dev/null; then
    mkdir -p .git/info
    echo "/.whl/" >> .git/info/exclude
fi
"$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "${pins[@]}"
ls -la .whl
