#!/usr/bin/env bash
# Another Triton release than the device's own (triton 3.6), carried to the GPU in one call.
#   bash scripts/gpu/triton_slim.sh pack 3.9.0   here: .triton/triton-3.9.0-slim.tar.xz (~40 MB)
#   . scripts/gpu/triton_slim.sh use             there (carry .triton): unpacked under /tmp/triton-slim,
#                                                first on PYTHONPATH, with the settings it needs
#                                                (add to PYTHONPATH after it, never reset it: an
#                                                `export PYTHONPATH=$PWD` after `use` runs the
#                                                device's triton 3.6 again, as a bench of round
#                                                24 of docs/benchmarks/sweep.md did)
# The wheel (3.9.0: 285 MB, 1 GB unpacked) is over the 64 MiB a call carries; cut to what an
# sm_90 launch needs it is 40 MB: libtriton.so without its debug sections (500 -> 192 MB),
# the NVIDIA backend without CUPTI, nvdisasm, cuobjdump and both ptxas, no AMD backend, no
# proton, no headers for plugins. Backends are then found in the tree
# (TRITON_BACKENDS_IN_TREE=1: the wheel's entry points name the AMD one); sm_90 compiles
# with the tool Triton calls ptxas-blackwell, here the device's ptxas (on PATH or in
# /usr/local/cuda/bin; CUDA 13.0 on the H100s and H200s so far). The wheel's own (CUDA 12.9,
# 8.6 MB packed) stays out: with it the tree and .triton came to 67.4 of the 65.5 MiB
# (64 MiB) a call carries, counted in disk blocks (`du -sk`); SLIM_PTXAS=1 keeps it.
# Used for docs/benchmarks/sweep.md round 11 (the same sweep under triton 3.6 and 3.9.0).
case "${1:-}" in
  pack)
    set -euo pipefail
    v=${2:?version, e.g. 3.9.0}
    w=$(mktemp -d); trap 'rm -rf "$w"' EXIT
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$w" "triton==$v"
    (cd "$w" && python3 -m zipfile -e triton-"$v"-*.whl x)
    t=$w/x/triton
    [ "${SLIM_PTXAS:-0}" = 1 ] || rm -f "$t"/backends/nvidia/bin/ptxas
    rm -rf "$t"/backends/amd "$t"/backends/nvidia/lib/cupti "$t"/backends/nvidia/lib/cupti-blackwell \
      "$t"/backends/nvidia/bin/ptxas-blackwell "$t"/backends/nvidia/bin/cuobjdump \
      "$t"/backends/nvidia/bin/nvdisasm "$t"/instrumentation "$t"/_C/libproton.so "$t"/FileCheck \
      "$t"/plugins "$t"/include
    strip --strip-unneeded "$t"/_C/libtriton.so
    [ ! -f "$t"/backends/nvidia/bin/ptxas ] || chmod +x "$t"/backends/nvidia/bin/ptxas
    mkdir -p .triton
    tar -C "$w/x" -cf - triton "triton-$v.dist-info" | xz -9 -T2 > ".triton/triton-$v-slim.tar.xz"
    ls -l ".triton/triton-$v-slim.tar.xz"
    ;;
  use)
    mkdir -p /tmp/triton-slim
    [ -d /tmp/triton-slim/triton ] || tar -xJf .triton/triton-*-slim.tar.xz -C /tmp/triton-slim
    export TRITON_BACKENDS_IN_TREE=1 TRITON_DEFAULT_FP_FUSION=1
    TRITON_PTXAS_BLACKWELL_PATH=$(command -v ptxas || ls /usr/local/cuda/bin/ptxas 2>/dev/null ||
                                  ls /tmp/triton-slim/triton/backends/nvidia/bin/ptxas 2>/dev/null)
    if [ -z "$TRITON_PTXAS_BLACKWELL_PATH" ]; then
      echo "triton_slim.sh use: no ptxas on PATH, in /usr/local/cuda/bin or in the pack" \
           "(pack again with SLIM_PTXAS=1 to carry the wheel's)" >&2
      return 1 2>/dev/null || exit 1
    fi
    # the same tool under its pre-sm_90 name, for any caller that asks for that one
    export TRITON_PTXAS_BLACKWELL_PATH TRITON_PTXAS_PATH=$TRITON_PTXAS_BLACKWELL_PATH
    export PYTHONPATH=/tmp/triton-slim:$PWD
    python3 -c "import triton; print('triton', triton.__version__, triton.__file__)"
    "$TRITON_PTXAS_BLACKWELL_PATH" --version | tail -n 2  # the release, then its build
    ;;
  *) echo "usage: triton_slim.sh pack VERSION | . triton_slim.sh use" >&2; return 2 2>/dev/null || exit 2 ;;
esac
