#!/usr/bin/env bash
# dev.sh: the commands of the README, with all set-up included.
#
#   ./dev.sh run [ARGS]     build, install, python -m l2prefetch ARGS (default: info, what
#                           l2prefetch does on this machine)
#   ./dev.sh test [ARGS]    build, install, the test suite with pytest ARGS (GPU tests skip
#                           without a GPU); the package check (.ci/package: sdist and wheel
#                           into fresh venvs; L2P_SKIP_PACKAGE=1 skips it); the CPU suite
#                           again against an ASan/UBSan build of the extension
#   ./dev.sh quick [ARGS]   build, install, the CPU suite alone, in parallel (pytest-xdist,
#                           L2P_JOBS workers, default auto): the loop while working
#   ./dev.sh package        the package check alone
#
# Which Python: $L2P_PYTHON if set; else ./.venv if it exists (brought up to PINS
# when they changed); else the system python3 when it already has torch, pytest
# and setuptools (the H200 machine: no network, so no build isolation and no
# downloads); else a new ./.venv with the pinned test dependencies from PyPI (a
# fresh machine or CI).
set -euo pipefail
cd "$(dirname "$0")"

PINS=(torch==2.13.0 pytest==9.1.1 pytest-benchmark==5.3.0 nvidia-cuda-nvrtc==13.0.88
      setuptools==84.0.0 pytest-xdist==3.8.0 hypothesis==6.170.17
      transformers==5.17.0)

venv_with_pins() {   # ./.venv, made or brought up to PINS (.venv/.pins says what it holds)
    if [[ ! -x .venv/bin/python ]]; then
        echo "dev.sh: creating .venv"
        python3 -m venv .venv
        .venv/bin/python -m pip install -q --upgrade pip
    fi
    if [[ "$(cat .venv/.pins 2>/dev/null)" != "${PINS[*]}" ]]; then
        echo "dev.sh: installing ${PINS[*]} into .venv"
        .venv/bin/python -m pip install -q "${PINS[@]}"
        echo "${PINS[*]}" >.venv/.pins
    fi
    PY=.venv/bin/python
}

pick_python() {
    if [[ -n "${L2P_PYTHON:-}" ]]; then
        PY=$L2P_PYTHON
    elif [[ ! -x .venv/bin/python ]] && python3 -c 'import torch, pytest, setuptools' >/dev/null 2>&1; then
        PY=python3
    else
        venv_with_pins
    fi
    PY=$("$PY" -c 'import sys; print(sys.executable)')
    echo "dev.sh: using $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
}

install() {
    "$PY" -m pip install -q --no-build-isolation --no-deps --no-index --force-reinstall . 2>&1 \
        | grep -v -E "^\s*$|WARNING: Location" || true
    "$PY" -c 'import l2prefetch; print("dev.sh: installed l2prefetch", l2prefetch.__version__)'
}

package_check() {
    if [[ "${L2P_SKIP_PACKAGE:-0}" == 1 ]]; then
        echo "dev.sh: package check skipped (L2P_SKIP_PACKAGE=1)"
        return 0
    fi
    "$PY" .ci/package
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
        package_check
        sanitized_suite
        echo "dev.sh: test done in $((SECONDS / 60)) min $((SECONDS % 60)) s" ;;
    quick)
        pick_python; install
        shift
        workers=(-n "${L2P_JOBS:-auto}")
        if ! "$PY" -c 'import xdist' >/dev/null 2>&1; then
            echo "dev.sh: no pytest-xdist in $PY: the CPU suite runs in one process"
            workers=()
        fi
        "$PY" -m pytest -p no:cacheprovider -q -m "not gpu" "${workers[@]}" tests "$@"
        echo "dev.sh: quick done in $((SECONDS / 60)) min $((SECONDS % 60)) s" ;;
    package)
        pick_python
        package_check ;;
    *)
        echo "usage: ./dev.sh run|test|quick|package [args]" >&2; exit 2 ;;
esac
