#!/usr/bin/env bash
# The wheels the H200 test machine's image lacks, for its Python 3.12 on manylinux x86_64: the
# versions in tests/gpu/gpu_env.py's WHEELS (megatron-core 0.19.2, transformers 5.24.0), each
# downloaded without its dependencies, then checked: every requirement of every wheel is met by the
# image's versions (gpu_env.py's IMAGE, from the device's KINDS.md) or by another wheel, one version
# of each, at most 60 MiB in all. Run where pip reaches the registry:
#
#   bash tests/gpu/prepare.sh [DIR]      (default tests/gpu/wheels: git-ignored, carried to the
#                                         machine by the device tool's `carry`, docs/gpu.md)
#
# tests/gpu/run_all.sh installs them with `pip install --no-index --no-deps --target $OUT/site`.
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR="${1:-tests/gpu/wheels}"
LIMIT_MIB=60
PY="${PYTHON:-python3}"
mkdir -p "$DIR"
rm -f "$DIR"/*.whl
# pip matches each manylinux tag exactly: the tags a CPython 3.12 x86_64 wheel of these may carry
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64 any; do
  platforms+=(--platform "$tag")
done
specs=$("$PY" -c "import sys; sys.path.insert(0, 'tests/gpu'); import gpu_env; print(' '.join(f'{n}=={v}' for n, v in gpu_env.WHEELS.items()))")
for spec in $specs; do
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none "${platforms[@]}" -d "$DIR" "$spec"
done
ls -l "$DIR"/*.whl
"$PY" tests/gpu/gpu_env.py static "$DIR"
bytes=$(cat "$DIR"/*.whl | wc -c)
mib=$(( (bytes + 1048575) / 1048576 ))
if [ "$bytes" -gt $(( LIMIT_MIB * 1048576 )) ]; then
  echo "FAILED the wheels in $DIR are $mib MiB, over the ${LIMIT_MIB} MiB limit (the tree that travels is 64 MiB)"
  exit 1
fi
echo "prepare.sh: $(ls "$DIR"/*.whl | wc -l) wheels, $bytes bytes (<= $mib MiB of ${LIMIT_MIB}) in $DIR"
