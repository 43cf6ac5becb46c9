"""Importing moe_ops' compiled modules (``moe_ops._cpu``, ``moe_ops._autograd``).

Each module checks in its init that the running torch is the one it was compiled against
(csrc/common/torch_version_guard.h) and raises ImportError "<name> was built against torch X,
this is torch Y" otherwise. Under another torch the dynamic loader usually fails first, on a
symbol that torch no longer exports ("undefined symbol: _ZN3c10..."), which says nothing about
versions; then the version the module carries as bytes behind a marker is read from its file
and the error says the same as the guard would have.
"""

from __future__ import annotations

import importlib
import importlib.util
import types

import torch

MARKER = b"moe_ops: built against torch "


def built_against(name: str) -> str | None:
    """The torch version module ``name`` was compiled against, read from its file without loading
    it; None where there is no such file or no marker in it."""
    try:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or spec.origin in ("built-in", "frozen"):
            return None
        with open(spec.origin, "rb") as f:
            data = f.read()
    except (ImportError, OSError, ValueError):
        return None
    start = data.find(MARKER)
    if start < 0:
        return None
    start += len(MARKER)
    end = data.find(b"\0", start)
    return data[start:end if end >= 0 else None].decode("ascii", "replace")


def import_native(name: str) -> types.ModuleType:
    """importlib.import_module(name); an ImportError / OSError of a module built against another
    torch becomes the ImportError that names both versions (chained to the loader's)."""
    try:
        return importlib.import_module(name)
    except (ImportError, OSError) as e:
        built, running = built_against(name), torch.version.__version__
        if built is None or built == running or str(e).startswith(f"{name} was built against torch"):
            raise
        raise ImportError(f"{name} was built against torch {built}, this is torch {running}") from e
