#!/usr/bin/env bash
# Create, once, the pinned PyTorch/XLA environment for tests/test_tpu_xla.py, and print its python.
#
# torch-xla 2.9.0 is the newest torch_xla on PyPI; it needs torch 2.9.x (not declared in its
# metadata), its "pallas" extra pins jax/jaxlib 0.7.1, and its call_jax needs torchax. The wheel
# ships its own torchax 0.0.6, whose __init__ imports flax (and flax pulls optax, orbax, ...);
# torchax 0.0.7 does not, so it is installed over the shipped copy in a second step. PyPI has only the CUDA build of torch 2.9.1 for x86_64, so the
# environment lives outside the checkout and is reused while its pins match (override the place
# with MOE_OPS_XLA_ENV). Everything is installed with --no-deps from the exact list below: no
# resolver, and no triton, cusolver, nvrtc or nvtx wheels, which `import torch` does not load
# (about 0.5 GB of the ~4.1 GB download).
# Exits non-zero, with the reason on stderr, when the environment cannot be created.
set -euo pipefail
ENV_DIR="${MOE_OPS_XLA_ENV:-$HOME/.cache/moe_ops/venv-xla-2.9}"
PINS="torch==2.9.1 torch-xla==2.9.0 jax==0.7.1 jaxlib==0.7.1
ml_dtypes==0.6.0 numpy==2.4.6 scipy==1.17.1 opt_einsum==3.4.0 absl-py==2.5.1 PyYAML==6.0.4
requests==2.34.2 certifi==2026.10.19.post1 charset-normalizer==3.5.3 idna==3.20 urllib3==2.8.0
filelock==4.3.1 fsspec==2026.9.0 Jinja2==3.1.6 MarkupSafe==3.0.4 networkx==3.6.1 sympy==1.14.0
mpmath==1.3.0 typing_extensions==4.16.0
nvidia-cublas-cu12==12.8.4.1 nvidia-cuda-cupti-cu12==12.8.90 nvidia-cuda-runtime-cu12==12.8.90
nvidia-cudnn-cu12==9.10.2.21 nvidia-cufft-cu12==11.3.3.83 nvidia-cufile-cu12==1.13.1.3
nvidia-curand-cu12==10.3.9.90 nvidia-cusparse-cu12==12.5.8.93 nvidia-cusparselt-cu12==0.7.1
nvidia-nccl-cu12==2.27.5 nvidia-nvjitlink-cu12==12.8.93 nvidia-nvshmem-cu12==3.3.20
pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 Pygments==2.21.0
hypothesis==6.170.17 sortedcontainers==2.4.0"
STAMP="$ENV_DIR/.moe_ops-pins"
OVERLAY="torchax==0.0.7"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$PINS $OVERLAY" ] && "$ENV_DIR/bin/python" -c "import torch_xla, jax, torchax" 2>/dev/null; then
    echo "$ENV_DIR/bin/python"
    exit 0
fi
rm -rf "$ENV_DIR"
mkdir -p "$(dirname "$ENV_DIR")"
python3 -m venv "$ENV_DIR" >&2
# shellcheck disable=SC2086
"$ENV_DIR/bin/python" -m pip install --quiet --no-deps $PINS 2>&1 | grep -v "^WARNING: Location" >&2 || true
"$ENV_DIR/bin/python" -m pip install --quiet --no-deps --force-reinstall "$OVERLAY" 2>&1 | grep -v "^WARNING: Location" >&2 || true
PJRT_DEVICE=CPU "$ENV_DIR/bin/python" -c "import torch, torch_xla, jax, torchax; print('xla env:', torch.__version__, torch_xla.__version__, jax.__version__)" >&2
echo "$PINS $OVERLAY" > "$STAMP"
echo "$ENV_DIR/bin/python"
