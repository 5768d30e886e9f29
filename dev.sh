#!/usr/bin/env bash
# dev.sh: the two commands of the README, with all set-up included.
#
#   ./dev.sh run    the main job: build, install, python -m l2prefetch
#   ./dev.sh test   build, install, run the test suite (GPU tests skip without a GPU),
#                   then the CPU suite again against an ASan/UBSan build of the extension
#
# Which Python: $L2P_PYTHON if set; else ./.venv if it exists; else the system
# python3 when it already has torch, pytest and setuptools (the H200 machine: no
# network, so no build isolation and no downloads); else a new ./.venv with the
# pinned test dependencies from PyPI (a fresh machine or CI).
set -euo pipefail
cd "$(dirname "$0")"

PINS=(torch==2.13.0 pytest==9.1.1 pytest-benchmark==5.3.0 nvidia-cuda-nvrtc==13.0.88
      setuptools==84.0.0 hypothesis==6.170.17)

pick_python() {
    if [[ -n "${L2P_PYTHON:-}" ]]; then
        PY=$L2P_PYTHON
    elif [[ -x .venv/bin/python ]]; then
        PY=.venv/bin/python
    elif python3 -c 'import torch, pytest, setuptools' >/dev/null 2>&1; then
        PY=python3
    else
        echo "dev.sh: creating .venv with ${PINS[*]}"
        python3 -m venv .venv
        .venv/bin/python -m pip install -q --upgrade pip
        .venv/bin/python -m pip install -q "${PINS[@]}"
        PY=.venv/bin/python
    fi
    PY=$("$PY" -c 'import sys; print(sys.executable)')
    echo "dev.sh: using $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
}

install() {
    "$PY" -m pip install -q --no-build-isolation --no-deps --no-index --force-reinstall . 2>&1 \
        | grep -v -E "^\s*$|WARNING: Location" || true
    "$PY" -c 'import l2prefetch; print("dev.sh: installed l2prefetch", l2prefetch.__version__)'
}

sanitized_suite() {
    # The C code under AddressSanitizer + UndefinedBehaviorSanitizer: built in
    # place into a scratch copy, run with the sanitizer runtime preloaded.
    # PYTHONMALLOC=malloc_debug is the malloc allocator (Python objects on ASan's
    # heap, so our code's reads of freed objects are caught) plus CPython's debug
    # hooks, which fill freed memory with 0xDD: a stale object read by CPython's
    # own (uninstrumented) code, e.g. PySequence_GetItem on a freed tuple, then
    # faults too, where with plain malloc it read stale bytes unnoticed
    # (tests/test_reentrancy.py).  ASan's report goes to $dir/asan.* and is
    # printed on failure (pytest's capture would swallow it).
    local asan
    asan=$(gcc -print-file-name=libasan.so)
    if [[ ! -e "$asan" || "${L2P_SKIP_SANITIZERS:-0}" == 1 ]]; then
        echo "dev.sh: sanitizer pass skipped (no libasan, or L2P_SKIP_SANITIZERS=1)"
        return 0
    fi
    local dir
    dir=$(mktemp -d)
    cp -r setup.py pyproject.toml README.md csrc kernels python tests benchmarks "$dir"/
    (cd "$dir" && L2PREFETCH_SANITIZE=1 "$PY" setup.py -q build_ext --inplace \
        --build-temp "$dir/build-asan" >/dev/null 2>&1) || { echo "dev.sh: sanitizer build failed"; return 1; }
    echo "dev.sh: CPU suite under ASan/UBSan"
    local rc=0
    (cd "$dir" && env LD_PRELOAD="$asan" PYTHONMALLOC=malloc_debug \
        ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:allocator_may_return_null=1:log_path="$dir/asan" \
        UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:log_path="$dir/ubsan" PYTHONPATH="$dir/python" \
        "$PY" -m pytest -q -p no:cacheprovider -m "not gpu" tests) || rc=$?
    if [[ $rc -ne 0 ]]; then
        cat "$dir"/asan.* "$dir"/ubsan.* 2>/dev/null | head -n 80 || true
    fi
    rm -rf "$dir"
    return $rc
}

case "${1:-}" in
    run)
        pick_python; install
        shift; exec "$PY" -m l2prefetch "$@" ;;
    test)
        pick_python; install
        shift
        "$PY" -m pytest -p no:cacheprovider tests "$@"
        sanitized_suite ;;
    *)
        echo "usage: ./dev.sh run|test [args]" >&2; exit 2 ;;
esac
