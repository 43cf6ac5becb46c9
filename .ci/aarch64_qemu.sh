#!/usr/bin/env bash
# The aarch64 builds of both C++ modules (from .ci/aarch64.sh, in the directory given as $1) run
# under QEMU's user-mode emulator with torch's aarch64 wheel (environment: .ci/aarch64_env.sh,
# its directory as $2), under the tests of the CPU kernel at the level aarch64 CPUs get (generic:
# the items' own C++ around ATen's mm, which is the aarch64 wheel's: NVPL BLAS, and oneDNN with
# the Arm Compute Library), the shared property suite for the cpu backend, and the tests of
# autograd (the C++ Autograd module) and of the errors. This checks what the cross build cannot:
# that the modules load into aarch64 torch, register, and compute what the reference
# does. It is emulation, not an Arm CPU: QEMU runs Arm's instructions but on x86's stronger
# memory ordering (so it cannot show a race that only Arm's weaker one allows), its timings mean
# nothing, and qemu-user 7.2 answers madvise hints with success and does nothing.
# Needs root: binfmt_misc (a test's subprocesses run the aarch64 python) and a mount namespace
# (the aarch64 /proc/cpuinfo). Exits 1 when a test fails, 2 (with the reason) when the emulation
# cannot be set up here.
set -euo pipefail
cd "$(dirname "$0")/.."
modules="$1"
env_dir="$2"
skip() { echo "aarch64 emulation: $*"; exit 2; }
[ -f "$modules/_cpu.so" ] && [ -f "$modules/_autograd.so" ] || { echo "aarch64 emulation: no modules in $modules"; exit 1; }
# An aarch64 ELF run by this kernel goes to qemu-aarch64 (Debian's rule, as qemu-user-binfmt
# installs it), so that subprocess.run([sys.executable, ...]) in the tests works.
binfmt=/proc/sys/fs/binfmt_misc
[ -f "$binfmt/register" ] || mount -t binfmt_misc binfmt_misc "$binfmt" 2>/dev/null || skip "cannot mount binfmt_misc"
if [ ! -f "$binfmt/qemu-aarch64" ]; then
    rule=/usr/lib/binfmt.d/qemu-aarch64.conf
    [ -f "$rule" ] || skip "no $rule (Debian's qemu-user package)"
    cat "$rule" > "$binfmt/register" 2>/dev/null || skip "cannot register qemu-aarch64 with binfmt_misc"
fi
unshare -m true 2>/dev/null || skip "cannot create a mount namespace (unshare -m) for the aarch64 /proc/cpuinfo"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
git ls-files -z | xargs -0 cp --parents -t "$scratch"
cp "$modules/_cpu.so" "$scratch/moe_ops/_cpu.cpython-311-aarch64-linux-gnu.so"
cp "$modules/_autograd.so" "$scratch/moe_ops/_autograd.cpython-311-aarch64-linux-gnu.so"
cd "$scratch"
export QEMU_LD_PREFIX="$env_dir/root" QEMU_CPU=neoverse-n1 PYTHONPATH="$scratch:$env_dir/site"
# A module that failed to load would leave the tests on the reference: require it.
export MOE_OPS_REQUIRE_BACKENDS=cpu
# Two selections. CI's (the default, ~2 min emulated on 2 cores): the property suite's cpu
# cases, test_cpu.py's tests at the generic level (every layout and dtype against the oracle, bf16
# rounding, bias strides, stale NaN, offs strides, the K indices next to a weight-gradient group;
# not the 30 cases of large outputs in reused blocks, 100 s) with its module and gradcheck tests,
# tests/test_autograd.py (but its gradchecks of moe_ops.reference called directly: Python and
# ATen only, ~30 s emulated) and tests/test_errors.py.
# MOE_OPS_QEMU_FULL=1 (~5 min): all four files but what cannot or need not run emulated (each runs
# natively in the Quickstart suite, the generic level included): torch.compile's graph test
# (Inductor would need an aarch64 C++ compiler inside the emulated system), the tests of the build
# and of the package without its module (setup.py with this machine's compiler), the benchmarks'
# smoke runs, the two tests of what madvise does (qemu-user ignores it), the Python-threads test
# (x86's memory ordering; 150 s) and the guard-page test (90 s; the same C++ as the generic level,
# natively under the sanitizers too).
if [ "${MOE_OPS_QEMU_FULL:-0}" = 1 ]; then
    deselect="compiled_graph or without_the_compiled_module or refuses_another_torch or failed_rebuild or suite_collects"
    deselect="$deselect or benchmark_smoke or benchmarks_smoke or lazy_free or cpu_huge_pages or python_threads"
    select="(not test_properties or cpu) and not ($deselect or page_ends)"
else
    # Not the status-text test of the generic level: a second interpreter under emulation (25 s).
    select="(test_properties and cpu) or (test_cpu and (generic or extension_serves or gradcheck_through)"
    select="$select and not (large_output or reported_as_documented))"
    select="$select or (test_autograd and not reference_called_directly) or test_errors"
fi
set +e
unshare -m sh -c 'mount --bind "$1/cpuinfo" /proc/cpuinfo && shift && exec "$@"' sh "$env_dir" \
    "$env_dir/root/usr/bin/python3.11" -m pytest -q -p no:cacheprovider --durations=10 \
    tests/test_cpu.py tests/test_properties.py tests/test_autograd.py tests/test_errors.py \
    -k "$select"
status=$?
set -e
# pytest's 2-5 (interrupted, usage, no tests) are failures too, not this script's 2.
[ "$status" -eq 0 ] || { echo "aarch64 emulation: the tests failed (pytest exited with $status)"; exit 1; }
