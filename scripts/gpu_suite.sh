#!/bin/bash
# The GPU suite from prebuilt binaries, for a GPU machine without cargo:
#
#   scripts/gpu_suite.sh build DIR        # here: the GPU, device and XLA tests, `tutti` and
#                                         # libtutti.so built with --features cuda,xla into DIR
#   scripts/gpu_suite.sh run DIR LOGS [all|gpu|perf|devices|python|xla]
#                                         # there, from the repository root: each part's log in
#                                         # LOGS, a summary on stdout
#
# `run` sets TUTTI_REQUIRE_GPU=1 (a test that would skip for want of a GPU fails instead) and
# finds NCCL, NVRTC and the CUDA PJRT plugin (jax's `xla_cuda13`) in python3's site-packages.
set -u
mode=${1:?usage: gpu_suite.sh build DIR | run DIR LOGS [part]}
B=$(mkdir -p "${2:?DIR}" && cd "$2" && pwd)
if [ "$mode" = build ]; then
    set -e
    f=(--release --features cuda,xla)
    cargo build "${f[@]}" -p tutti-cli -p tutti-ffi
    cargo test "${f[@]}" -p tutti --test gpu --test devices --test xla --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys,shutil
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        shutil.copy(m["executable"], sys.argv[1] + "/" + m["target"]["name"])' "$B"
    cp target/release/tutti target/release/libtutti.so "$B"/
    strip --strip-debug "$B"/*
    ls -l "$B"
    exit 0
fi
LOGS=$(mkdir -p "${3:?LOGS}" && cd "$3" && pwd)
PART=${4:-all}
export TUTTI_TEST_BIN=$B/tutti TUTTI_REQUIRE_GPU=1 RUST_BACKTRACE=1 TUTTI_TIMEOUT=${TUTTI_TIMEOUT:-60}
PY=$(command -v python3)
SP=$($PY -c 'import site; print(site.getsitepackages()[0])')
PJRT=$(find "$SP" -name 'xla_cuda_plugin.so' 2>/dev/null | head -1)
want() { [ "$PART" = all ] || [ "$PART" = "$1" ]; }
step() { # name seconds command...
    local name=$1 t=$2 s=$SECONDS
    shift 2
    timeout -k 5 "$t" "$@" >"$LOGS/$name.log" 2>&1
    echo "=== $name: exit $? in $((SECONDS - s)) s"
    grep -E "^test result|FAILED|panicked|passed|failed" "$LOGS/$name.log" | head -20
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "python3: $PY; CUDA PJRT plugin: ${PJRT:-none}"
want devices && "$B/tutti" devices 2>&1 | head -30
want gpu && step gpu 240 "$B/gpu" --test-threads=1 --nocapture
if want perf; then
    for a in "-n 1 -a nccl" "-n 2 -a hierarchical-copy" "-n 4 -a reduce-to-one"; do
        for c in all-reduce all-gather all-to-all; do
            echo "--- perf --device gpu $a -c $c"
            timeout 25 "$B/tutti" perf --device gpu $a -c $c -b 1K -e 256M -f 16 2>&1
        done
    done >"$LOGS/perf.log"
    echo "=== perf"
    grep -vE "^\s*$" "$LOGS/perf.log"
fi
want devices && step devices 60 "$B/devices" --test-threads=1
want python && (cd bindings/python && TUTTI_LIBRARY=$B/libtutti.so PYTHONPATH=$PWD step python 240 \
    "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py tests/test_jax.py)
if want xla; then
    if [ -z "$PJRT" ]; then
        echo "=== xla: no CUDA PJRT plugin in $SP"
    else
        export TUTTI_PJRT_PLUGIN=$PJRT TPU_SKIP_MDS_QUERY=1
        TUTTI_REQUIRE_XLA=1 step xla 120 "$B/xla" --test-threads=1
        timeout 60 "$B/tutti" perf --device xla -n 1 -b 1K -e 64M -f 64 2>&1 | grep -v "^I[0-9]"
    fi
fi
