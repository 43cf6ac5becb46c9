#!/usr/bin/env bash
# Create, once, the pinned PyTorch/XLA environment for tests/test_tpu_xla.py, and print its python.
#
# torch-xla 2.9.0 is the newest torch_xla on PyPI; it needs torch 2.9.x (not declared in its
# metadata) and its "pallas" extra pins jax/jaxlib 0.7.1. PyPI has only the CUDA build of torch
# 2.9.1 for x86_64 (~4.1 GB with its nvidia-* wheels), so the environment lives outside the
# checkout and is reused while its pins match. Override the place with MOE_OPS_XLA_ENV.
# Exit status non-zero (and the reason on stderr) when the environment cannot be created.
set -euo pipefail
ENV_DIR="${MOE_OPS_XLA_ENV:-$HOME/.cache/moe_ops/venv-xla-2.9}"
PINS="torch==2.9.1 torch-xla==2.9.0 jax==0.7.1 jaxlib==0.7.1 numpy pytest hypothesis"
STAMP="$ENV_DIR/.moe_ops-pins"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$PINS" ] && "$ENV_DIR/bin/python" -c "import torch_xla, jax" 2>/dev/null; then
    echo "$ENV_DIR/bin/python"
    exit 0
fi
rm -rf "$ENV_DIR"
mkdir -p "$(dirname "$ENV_DIR")"
python3 -m venv "$ENV_DIR" >&2
# shellcheck disable=SC2086
"$ENV_DIR/bin/python" -m pip install --quiet $PINS >&2
"$ENV_DIR/bin/python" -c "import torch, torch_xla, jax; print('xla env:', torch.__version__, torch_xla.__version__, jax.__version__)" >&2
echo "$PINS" > "$STAMP"
echo "$ENV_DIR/bin/python"
