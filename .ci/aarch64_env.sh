#!/usr/bin/env bash
# Create, once, an aarch64 Linux user space that QEMU's user-mode emulator runs on this x86-64
# machine, for .ci/aarch64_qemu.sh, and print its directory. Inside it:
#   root/  Debian's arm64 Python 3.11 with its runtime libraries (dpkg-deb -x of the packages;
#          nothing is installed into this machine's system but qemu-user and the arm64 package
#          lists), the sysroot QEMU_LD_PREFIX points at;
#   site/  torch's aarch64 wheel from PyPI and what `import torch` loads, plus numpy, pytest and
#          hypothesis, unpacked with --no-deps from the exact list below (no resolver). PyPI's
#          aarch64 torch is the CUDA build: libtorch_cpu links libcudart and libcupti and
#          libtorch_cuda (loaded with torch._C) the rest, so their wheels are needed to import it
#          (~2.2 GB download); cusolver (loaded lazily), triton and cuda-bindings are left out;
#   torch  a link to site/torch, so that .ci/aarch64.sh can build against this copy of the wheel
#          (MOE_OPS_AARCH64_CACHE=<this directory>);
#   cpuinfo  the /proc/cpuinfo of a two-core Neoverse N1, which .ci/aarch64_qemu.sh mounts over
#          the real one: qemu-user 7.2 (Debian 12) shows the x86 host's to the emulated process,
#          and the cpuinfo library in libc10 crashes parsing it (SIGSEGV in cpuinfo_arm_linux_init
#          at torch's import, measured).
# The directory is reused while its pins match (override the place with MOE_OPS_AARCH64_ENV).
# Exits non-zero, with the reason on stderr, when the environment cannot be created.
set -euo pipefail
ENV_DIR="${MOE_OPS_AARCH64_ENV:-$HOME/.cache/moe_ops/aarch64-env-torch-2.13.0-cp311}"
PINS="torch==2.13.0 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cupti==13.0.85 nvidia-cublas==13.1.1.3
nvidia-cudnn-cu13==9.20.0.48 nvidia-cuda-nvrtc==13.0.88 nvidia-cufft==12.0.0.61 nvidia-curand==10.4.0.35
nvidia-cusparse==12.6.3.3 nvidia-cusparselt-cu13==0.8.1 nvidia-nvjitlink==13.5.37 nvidia-nccl-cu13==2.29.7
nvidia-nvshmem-cu13==3.4.5 nvidia-cufile==1.15.1.6
filelock==4.3.2 fsspec==2026.9.0 Jinja2==3.1.6 MarkupSafe==3.0.4 networkx==3.6.1 sympy==1.14.0 mpmath==1.3.0
typing_extensions==4.16.0 numpy==2.4.6
pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 Pygments==2.21.0
hypothesis==6.170.27 sortedcontainers==2.4.0"
DEBS="python3.11:arm64 libgomp1:arm64 libstdc++6:arm64"
STAMP="$ENV_DIR/.moe_ops-pins"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$PINS $DEBS" ] && command -v qemu-aarch64 >/dev/null \
        && [ -f /usr/lib/binfmt.d/qemu-aarch64.conf ]; then
    echo "$ENV_DIR"
    exit 0
fi
fail() { echo "aarch64 environment: $*" >&2; exit 1; }
[ "$(uname -m)" = x86_64 ] || fail "made for an x86-64 machine (this is $(uname -m))"
# qemu-user-binfmt: the rule (and its wrapper) that .ci/aarch64_qemu.sh registers with binfmt_misc.
if ! command -v qemu-aarch64 >/dev/null || [ ! -f /usr/lib/binfmt.d/qemu-aarch64.conf ]; then
    { apt-get install -y -q qemu-user qemu-user-binfmt || { apt-get update -q && apt-get install -y -q qemu-user qemu-user-binfmt; }; } \
        >/dev/null 2>&1 || fail "cannot install qemu-user (apt-get install qemu-user qemu-user-binfmt)"
fi
if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    { dpkg --add-architecture arm64 && apt-get update -q; } >/dev/null 2>&1 || fail "cannot add Debian's arm64 package lists"
fi
rm -rf "$ENV_DIR"
mkdir -p "$ENV_DIR/debs" "$ENV_DIR/root" "$ENV_DIR/wheels" "$ENV_DIR/site"
# The arm64 packages the interpreter needs, as apt resolves them (architecture-independent ones
# such as perl, pulled in by dpkg's own dependencies, are not needed to run it).
packages="$(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks --no-replaces \
            --no-enhances --no-pre-depends $DEBS | grep -E '^[a-z0-9].*:arm64$' | grep -v -E '^(dpkg|tar|install-info):' | sort -u)"
(cd "$ENV_DIR/debs" && apt-get download -q $packages media-types >/dev/null 2>&1) || fail "cannot download the arm64 packages: $packages"
for deb in "$ENV_DIR"/debs/*.deb; do dpkg-deb -x "$deb" "$ENV_DIR/root"; done
rm -rf "$ENV_DIR/debs"
[ -x "$ENV_DIR/root/usr/bin/python3.11" ] || fail "the arm64 packages hold no python3.11"
platforms=(--platform manylinux2014_aarch64)
for minor in $(seq 17 39); do platforms+=(--platform "manylinux_2_${minor}_aarch64"); done
# shellcheck disable=SC2086
PIP_NO_CACHE_DIR=1 python -m pip download -q --no-deps --only-binary=:all: "${platforms[@]}" --python-version 3.11 \
    --implementation cp --abi cp311 -d "$ENV_DIR/wheels" $PINS 2>&1 | grep -v "^WARNING: Location" >&2 || true
[ "$(ls "$ENV_DIR"/wheels/*.whl 2>/dev/null | wc -l)" -eq "$(echo $PINS | wc -w)" ] \
    || fail "could not download every wheel of: $PINS (have: $(ls "$ENV_DIR/wheels"))"
# Unpacked side by side (the nvidia wheels are most of the 3.6 GB), into directories made
# beforehand: several wheels share directories (nvidia/cu13/include, ...), and zipfile makes a
# missing one after checking that it is missing, so two unpackers racing for it failed with
# FileExistsError (seen on a Zen 4 guest, 2026-12-06: three wheels, the stage skipped).
python - "$ENV_DIR/site" "$ENV_DIR"/wheels/*.whl <<'EOF' || fail "cannot read the wheels' directories"
import os, sys, zipfile
site = sys.argv[1]
for wheel in sys.argv[2:]:
    for name in zipfile.ZipFile(wheel).namelist():
        folder = name if name.endswith("/") else os.path.dirname(name)
        if folder:
            os.makedirs(os.path.join(site, folder), exist_ok=True)
EOF
pids=()
for wheel in "$ENV_DIR"/wheels/*.whl; do python -m zipfile -e "$wheel" "$ENV_DIR/site" & pids+=($!); done
for pid in "${pids[@]}"; do wait "$pid" || fail "cannot unpack a wheel"; done
rm -rf "$ENV_DIR/wheels"
ln -s site/torch "$ENV_DIR/torch"
touch "$ENV_DIR/.done"  # .ci/aarch64.sh's mark of a complete torch tree
for cpu in 0 1; do
    printf 'processor\t: %s\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x3\nCPU part\t: 0xd0c\nCPU revision\t: 1\n\n' "$cpu"
done > "$ENV_DIR/cpuinfo"
echo "$PINS $DEBS" > "$STAMP"
echo "$ENV_DIR"
