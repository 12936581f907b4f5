#!/usr/bin/env bash
# Download the wheels the device GPU image lacks (docs/gpu.md) into .whl/ for its Python 3.12 on x86-64 (torchao:
# torchpar's model.float8 rows).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .gitignore || echo '/.whl/' >> .gitignore
mkdir -p .whl
for spec in "grain==0.2.18" array-record portpicker hjson pydantic pydantic-core annotated-types typing-inspection \
            tensorboardX "torchao==0.18.0"; do
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "$spec"
done
# DeepSpeed publishes source only: build its pure-Python wheel here (ops are compiled on first use, DS_BUILD_OPS=0);
# the build imports torch, so run this from the project's environment (./setup.sh).
DS_BUILD_OPS=0 python3 -m pip wheel --quiet --no-deps --no-build-isolation -w .whl "deepspeed==0.19.8"
ls .whl
