"""The Neuron backend's NKI kernels, run on our numpy emulator (and on nki.simulate where installed).

Every test runs once per engine: "emulator" (moe_ops' numpy emulator, NOT AWS's simulator) and
"nki-simulate" (AWS's nki.simulate; skipped without the real nki package: select it with
``-m nki_simulate``). The shared property suite already runs the kernels on the emulator through
``run_backend("neuron", ...)`` on small shapes (M <= 64, one 128-row tile per block); these
tests add shapes that take several row, K, N and M tiles, several blocks per group, passes
over the output, both weight layouts and all served dtypes.

Categories:
* 2D x 3D forward / input gradient vs the float64 oracle: multi-tile shapes, empty groups,
  trailing rows, bias, fp32 output, weights plain and transposed, blocks of 128 and 256;
* 2D x 2D weight gradient: empty first / middle / last groups, multi-pass tiling;
* random shapes (hypothesis) across tile boundaries;
* the instruction stream is static: it depends on shapes only, never on offs values.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from moe_ops import _contract
from moe_ops.backends import neuron
from strategies import Case, cases
from test_properties import check_case

pytestmark = pytest.mark.backend_neuron

ENGINES = [
    pytest.param("emulator", id="emulator"),
    pytest.param("nki-simulate", id="nki-simulate",
                 marks=[pytest.mark.nki_simulate,
                        pytest.mark.skipif(not neuron.nki_status()[0], reason=neuron.NKI_MISSING)]),
]


class NkiImpl:
    """The NKI kernels on an engine, as a property-suite implementation."""

    cost = "slow"

    def __init__(self, engine: str, block=None, **static):
        self.engine, self.block, self.static = engine, block, static
        self.name = f"neuron-nki@{engine}(block={block}, {static})"

    def __call__(self, a, b, offs=None, bias=None, out_dtype=None, *, check_offs=True):
        p = _contract.check_args(a, b, offs, bias, out_dtype)
        _contract.check_offs_values(offs, p.extent)
        if self.engine == "emulator":
            return neuron.run_on_emulator(p, a, b, offs, bias, self.block, **self.static)[0]
        return neuron.run_on_simulator(p, a, b, offs, bias, self.block, **self.static)


BASE = dict(offs_dtype=torch.int32, stride_a="contiguous", seed=11)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("block", (128, 256))
@pytest.mark.parametrize("weights", ("contiguous", "transposed"))
@pytest.mark.parametrize("dtype, out_dtype", [(torch.float32, None), (torch.bfloat16, torch.float32),
                                              (torch.float16, None)])
def test_2d3d_multi_tile(engine, block, weights, dtype, out_dtype):
    # M = 300 rows: group 1 empty, group 2 spans two 128-row blocks, 40 trailing rows; K = 200 is
    # two K tiles (128 + 72), N = 600 two column panels (512 + 88).
    case = Case("2d3d", 4, 300, 200, 600, dtype, (50, 50, 200, 260), stride_b=weights, bias=True,
                out_dtype=out_dtype, **BASE)
    check_case(NkiImpl(engine, block), case)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("block", (128, 256))
@pytest.mark.parametrize("passes", ({}, {"m_pass_tiles": 1, "n_pass": 512}), ids=("one-pass", "4-passes"))
@pytest.mark.parametrize("dtype, out_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                              (torch.float16, torch.float32)])
def test_2d2d_multi_tile(engine, block, passes, dtype, out_dtype):
    # K = 300 contraction indices in 5 groups: empty first, middle and last groups, 10 trailing
    # indices in no group; M = 200 (two row tiles of the output), N = 600 (two panels).
    case = Case("2d2d", 5, 200, 300, 600, dtype, (0, 100, 100, 290, 290), stride_b="contiguous", bias=False,
                out_dtype=out_dtype, **{**BASE, "stride_a": "transposed"})
    check_case(NkiImpl(engine, block, **passes), case)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("weights", ("contiguous", "transposed"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_2d3d_rows_wider_than_one_gather_dma(engine, weights, dtype):
    """K = 600 > 512: the forward gathers each row in two DMAs (columns 0..511 and 512..599),
    the second at a column offset; the other tests keep K <= 200 (one DMA per row), so a wrong
    offset there went unnoticed. a [150, 600], b [3, 600, 130]; fp32 and bf16."""
    case = Case("2d3d", 3, 150, 600, 130, dtype, (40, 40, 140), stride_b=weights, bias=True,
                out_dtype=None, **BASE)
    check_case(NkiImpl(engine, 128), case)


def test_transposed_weights_are_read_in_place():
    """The input gradient's weights, a transposed view of [G, N, K] storage, go to the kernel as
    that storage (w_transposed: the kernel transposes tiles on chip), not as a [G, K, N] copy.
    a [20, 40], b [3, 40, 30] (a view of [3, 30, 40]), fp32."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(20, 40, generator=gen), torch.randn(3, 30, 40, generator=gen).transpose(1, 2)
    offs = torch.tensor([5, 5, 20])
    p = _contract.check_args(a, b, offs)
    _, args, kwargs = neuron._kernel_call(p, a, b, offs, None)
    assert kwargs["w_transposed"]
    assert args[1].data_ptr() == b.data_ptr() and args[1].shape == (3, 30, 40)


@pytest.mark.parametrize("engine", ENGINES)
def test_random_shapes_across_tiles(engine):
    impl = NkiImpl(engine)

    @settings(max_examples=8)
    @given(case=cases(layouts=neuron.LAYOUTS, dtypes=neuron.DTYPES, max_m=280, max_k=150, max_n=540, max_g=6,
                      allow_big_g=False))
    def run(case):
        check_case(impl, case)

    run()


@pytest.mark.parametrize("layout", neuron.LAYOUTS)
def test_instruction_stream_depends_on_shapes_only(layout):
    """Same shapes, different routing: the same instructions (static shapes, no data-dependent control)."""
    gen = torch.Generator().manual_seed(0)
    if layout == "2d3d":
        a, b, extent = torch.randn(200, 40, generator=gen), torch.randn(3, 40, 30, generator=gen), 200
    else:
        a, b, extent = torch.randn(20, 200, generator=gen), torch.randn(200, 30, generator=gen), 200
    counts = []
    for offs in ((0, 0, 0), (200, 200, 200), (10, 130, 190), (70, 70, 200)):
        offs = torch.tensor(offs)
        p = _contract.check_args(a, b, offs)
        counts.append(neuron.run_on_emulator(p, a, b, offs, None, 128)[1])
    assert all(c == counts[0] for c in counts), counts
    nb = -(-extent // 128) + 3 - (layout == "2d2d")  # ceil(extent / 128) + G (2d3d) or + G - 1 (2d2d)
    # One matmul per block, row tile, K tile and N panel: 128-row blocks, one tile of each here.
    assert counts[0]["nc_matmul"] == nb
