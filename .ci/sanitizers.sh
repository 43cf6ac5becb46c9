#!/usr/bin/env bash
# The C++ modules rebuilt with AddressSanitizer and UndefinedBehaviorSanitizer in a scratch copy
# of the tracked tree, and the tests of the native CPU kernels and of the C++ Autograd kernel run
# against them: an out-of-bounds access, a use after free or undefined behaviour in our C++
# aborts the run. torch itself is not instrumented (libasan is preloaded into python; its
# allocator puts red zones around every tensor allocation). Run by .ci/run in its environment.
# `.ci/sanitizers.sh` builds in a scratch directory and tests; .ci/run takes the two apart
# (`build DIR`, then `test DIR`) to build in the background of the Quickstart suite.
set -euo pipefail
cd "$(dirname "$0")/.."
phase="${1:-all}"
case "$phase" in
    all) scratch="$(mktemp -d)"; trap 'rm -rf "$scratch"' EXIT ;;
    build|test) scratch="${2:?usage: .ci/sanitizers.sh [build DIR | test DIR]}" ;;
    *) echo "usage: .ci/sanitizers.sh [build DIR | test DIR]"; exit 1 ;;
esac
# The AMX kernels run natively where the CPU has AMX (each tile load and store checks its bytes
# in this build: check_tile in kernels_x86.cpp). On CPUs with AVX512-BF16 and no AMX, where they
# would not run at all, the build puts their tiles on our emulator (csrc/cpu/amx_emulator.h),
# whose tile loads and stores ASan sees; on CPUs without AVX512-BF16 they cannot run here.
flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true) "
amx_emulator=0
[[ "$flags" == *" avx512_bf16 "* && "$flags" != *" amx_bf16 "* ]] && amx_emulator=1
if [ "$phase" != test ]; then
    start=$SECONDS
    mkdir -p "$scratch"
    git ls-files -z | xargs -0 cp --parents -t "$scratch"
    (cd "$scratch" && MOE_OPS_OPT=-O1 MOE_OPS_AMX_EMULATOR=$amx_emulator \
        CFLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g1" \
        LDFLAGS="-fsanitize=address,undefined" python setup.py -q build_ext --inplace)
    echo "sanitizer build: $((SECONDS - start)) s"
fi
[ "$phase" = build ] && exit 0
cd "$scratch"
for module in moe_ops/_cpu.*.so moe_ops/_autograd.*.so; do
    [ -f "$module" ] || { echo "sanitizers: no module $module (the build failed: above)"; exit 1; }
    nm -D "$module" | grep __asan_init >/dev/null || {  # not -q: nm would die of SIGPIPE (pipefail)
        echo "sanitizers: $module was not built with AddressSanitizer"; exit 1; }
done
# A module that failed to build would leave its tests on the reference or skipped: require it.
export MOE_OPS_REQUIRE_BACKENDS=cpu
export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
python - "$amx_emulator" <<'PY'
import sys, torch, moe_ops._cpu  # noqa: F401 (registers torch.ops.moe_cpu)
machine, emulated = torch.ops.moe_cpu.machine(), torch.ops.moe_cpu.amx_emulated()
if emulated != (sys.argv[1] == "1"):
    sys.exit(f"sanitizers: the module's AMX emulator is {'on' if emulated else 'off'}, asked {sys.argv[1]}")
print("AMX kernels: " + ("on our emulator of the tiles" if emulated else "native" if machine == "amx"
                         else f"not run (best level here: {machine})"))
PY
# Not the tests marked outside_cpp (27, ~65 s of the 230 s here): torch.compile's graphs, which
# call the same C++ entry as eager calls do after an Inductor compile that is most of their time,
# the package without its module or with a module of another torch, the build, and the benchmark
# scripts. Each runs natively in the Quickstart suite. A marker, not a -k substring: a new test
# whose name holds "compiled" must not leave this stage unseen.
# --capture=sys: a sanitizer's report goes to file descriptor 2, which pytest must not swallow.
sanitized_tests() {  # test files: their tests that reach the C++ modules (the CPU ones of test_properties)
    python -m pytest -q -p no:cacheprovider --capture=sys "$@" -m "not outside_cpp" -k "not test_properties or cpu"
}
sanitized_tests tests/test_cpu.py tests/test_autograd.py tests/test_func.py tests/test_vmap.py tests/test_errors.py \
    tests/test_properties.py
# With the emulator, the machine's level above is AMX, so bf16 in the property, autograd, func
# and vmap tests took the AMX kernels; this CPU's own bf16 kernels (the AVX512-BF16 level and its
# schemes) get those tests too, the level capped (test_cpu.py above runs every level already).
# ~20 s: the hypothesis sweep took 1.5 s of the 277 s above on a Zen 4 guest.
if [ "$amx_emulator" = 1 ]; then
    export MOE_OPS_CPU_ISA=avx512_bf16
    python -c 'import sys, torch, moe_ops._cpu  # noqa: F401
level = torch.ops.moe_cpu.kernel_for(torch.bfloat16)
print(f"bf16 at MOE_OPS_CPU_ISA=avx512_bf16: {level}")
sys.exit(0 if level == "avx512_bf16" else "sanitizers: the cap did not take")'
    sanitized_tests tests/test_autograd.py tests/test_func.py tests/test_vmap.py tests/test_properties.py
fi
