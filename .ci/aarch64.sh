#!/usr/bin/env bash
# Both C++ modules cross-compiled and linked for aarch64 Linux (Graviton, Grace, Ampere Altra)
# against the aarch64 wheel of the torch installed here, and every symbol they import checked
# against that wheel's libraries, the aarch64 C / C++ / OpenMP runtimes and Python's C API.
# This shows that they build and link there (the x86 kernels compile to nothing; such CPUs take
# the generic path, ATen's mm per item); .ci/aarch64_qemu.sh then runs them under emulation.
# Exits 1 when a module does not compile or link or imports a symbol nothing provides, and 2
# (with the reason) when the cross compiler or the wheel cannot be had.
set -euo pipefail
cd "$(dirname "$0")/.."
CXX=aarch64-linux-gnu-g++
NM=aarch64-linux-gnu-nm
SYSROOT_LIB=/usr/aarch64-linux-gnu/lib
if ! command -v "$CXX" >/dev/null; then
    { apt-get install -y -q g++-aarch64-linux-gnu || { apt-get update -q && apt-get install -y -q g++-aarch64-linux-gnu; }; } \
        >/dev/null 2>&1 || { echo "aarch64: cannot install the cross compiler (apt-get install g++-aarch64-linux-gnu)"; exit 2; }
fi
version="$(python -c 'import torch; print(torch.__version__.split("+")[0])')"
pyver="$(python -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')"
cache="${MOE_OPS_AARCH64_CACHE:-$HOME/.cache/moe_ops/aarch64-torch-$version-cp$pyver}"
if [ ! -f "$cache/.done" ]; then
    rm -rf "$cache"
    mkdir -p "$cache"
    python -m pip download -q torch=="$version" --platform manylinux_2_28_aarch64 --python-version "$pyver" \
        --only-binary=:all: --no-deps -d "$cache" 2>&1 | grep -v "^WARNING: Location" || true
    wheel="$(ls "$cache"/torch-*.whl 2>/dev/null)" || { echo "aarch64: cannot download torch $version for aarch64"; exit 2; }
    (cd "$cache" && python -m zipfile -e "$wheel" extracted >/dev/null && mv extracted/torch torch && rm -rf extracted "$wheel")
    touch "$cache/.done"
fi
T="$cache/torch"
wheel_version="$(python -c "import re, sys; print(re.search(r\"__version__ = '([^']+)'\", open(sys.argv[1]).read())[1])" "$T/version.py")"
if [ -n "${MOE_OPS_AARCH64_OUT:-}" ]; then  # keep the modules there (.ci/aarch64_qemu.sh runs them)
    out="$MOE_OPS_AARCH64_OUT"
    mkdir -p "$out"
else
    out="$(mktemp -d)"
    trap 'rm -rf "$out"' EXIT
fi
# The flags setup.py's two extensions get from torch.utils.cpp_extension, plus their own; the
# Python headers are this machine's (an extension module does not link libpython).
common=(-std=c++20 -fPIC -D_GLIBCXX_USE_CXX11_ABI=1 -DTORCH_API_INCLUDE_EXTENSION_H
        "-DMOE_OPS_TORCH_VERSION=$wheel_version" -I"$T/include" -I"$T/include/torch/csrc/api/include"
        -I"$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')")
compile() {  # module name, extra flags (one word), source
    "$CXX" -c "${common[@]}" -DTORCH_EXTENSION_NAME="$1" $2 "$3" -o "$out/$(basename "$3" .cpp).o"
}
link() {  # module name, extra flags (one word), sources...
    local name="$1" extra="$2" objs=()
    shift 2
    for src in "$@"; do objs+=("$out/$(basename "$src" .cpp).o"); done
    "$CXX" -shared $extra -o "$out/$name.so" "${objs[@]}" -L"$T/lib" -lc10 -ltorch -ltorch_cpu -ltorch_python
}
cpu_sources=(csrc/cpu/grouped_mm.cpp csrc/cpu/kernels_x86.cpp csrc/cpu/kernels_avx2.cpp csrc/cpu/output_cache.cpp)
autograd_sources=(csrc/autograd/grouped_mm_autograd.cpp)
# The five compiles side by side (most of the time is torch's headers).
pids=()
for src in "${cpu_sources[@]}"; do compile _cpu "-O3 -fopenmp" "$src" & pids+=($!); done
compile _autograd "-O2" "${autograd_sources[0]}" & pids+=($!)
for pid in "${pids[@]}"; do wait "$pid" || { echo "aarch64: a C++ source does not compile for aarch64 (above)"; exit 1; }; done
link _cpu "-O3 -fopenmp" "${cpu_sources[@]}"
link _autograd "-O2" "${autograd_sources[@]}"
defined="$out/defined.txt"
for lib in "$T"/lib/libc10.so "$T"/lib/libtorch.so "$T"/lib/libtorch_cpu.so "$T"/lib/libtorch_python.so \
           "$T"/lib/libgomp.so* "$SYSROOT_LIB"/libc.so.6 "$SYSROOT_LIB"/libm.so.6 "$SYSROOT_LIB"/libstdc++.so.6 \
           "$SYSROOT_LIB"/libgcc_s.so.1 "$SYSROOT_LIB"/libgomp.so.1; do
    "$NM" -D --defined-only "$lib" | awk '{print $3}'
done | sed 's/@.*//' | sort -u > "$defined"
status=0
for so in "$out"/_cpu.so "$out"/_autograd.so; do
    file "$so" | grep -q "ARM aarch64" || { echo "aarch64: $so is not an aarch64 object"; exit 1; }
    imported="$("$NM" -D --undefined-only "$so" | awk '$1 == "U" {print $2}' | sed 's/@.*//' | sort -u)"
    missing="$(comm -23 <(echo "$imported") "$defined" | grep -v -E '^_?Py' || true)"
    if [ -n "$missing" ]; then
        echo "aarch64: $(basename "$so") imports symbols that neither torch $wheel_version (aarch64) nor the runtimes define:"
        echo "$missing"
        status=1
    else
        echo "aarch64: $(basename "$so") built and linked against torch $wheel_version (aarch64 wheel);" \
             "its $(echo "$imported" | wc -l) imported symbols all resolve"
    fi
done
exit "$status"
