"""scripts/smem_bank_conflicts.py: the dQ staging stores' shared-memory wavefronts, and the
Gluon backward's switch of that tile's swizzle."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.script_modules import load

ROOT = Path(__file__).resolve().parent.parent
MOD = load(ROOT / "scripts" / "smem_bank_conflicts.py")


@pytest.mark.parametrize("swizzle", [32, 64, 128])
@pytest.mark.parametrize("cols", [32, 64])
def test_the_layout_places_every_element_once_inside_the_tile(swizzle, cols):
    addrs = {MOD.address(r, c, swizzle) for r in range(MOD.ROWS) for c in range(cols)}
    assert len(addrs) == MOD.ROWS * cols
    assert min(addrs) == 0 and max(addrs) == MOD.ROWS * cols * 4 - 4
    assert all(a % 4 == 0 for a in addrs)


def test_128_byte_swizzle_doubles_the_half_warp_wavefronts_and_32_does_not():
    for j in range(8):
        for row0 in (0, 16, 32, 48):
            for half in (0, 1):
                assert MOD.store_wavefronts(128, j, row0, half) == [2, 2]
                assert MOD.store_wavefronts(32, j, row0, half) == [1, 1]
    # rows r and r ^ 1 of a half-warp on the same two 16-byte chunks
    chunks = lambda r: {MOD.address(r, c, 128) // 16 % 8 for c in range(8)}  # noqa: E731
    assert chunks(0) == chunks(1) and chunks(2) == chunks(3) and chunks(0) != chunks(2)


def test_the_prediction_at_the_profiled_shape():
    # docs/benchmarks/profile_h100.md: 135.7 M store conflicts in the whole kernel
    assert MOD.predicted_conflicts(128, 16, 16, 4096, 128) == 134_217_728
    assert MOD.predicted_conflicts(32, 16, 16, 4096, 128) == 0


def test_bad_arguments_name_the_option(capsys):
    assert MOD.main(["--swizzle", "16"]) == 2
    assert "--swizzle must be among 32, 64, 128, got [16]" in capsys.readouterr().err
    assert MOD.main(["--cols", "12"]) == 2
    assert "--cols must be a positive multiple of 8, got 12" in capsys.readouterr().err
    assert MOD.main(["--b", "16"]) == 2
    assert "--b, --h, --n and --d go together" in capsys.readouterr().err


def test_the_backward_switch_refuses_other_swizzles():
    env = dict(os.environ, FLASHCHECK_GLUON_BWD_DQ_SWIZZLE="64")
    res = subprocess.run([sys.executable, "-c",
                          "import flashcheck.kernels.flash_attention_gluon_bwd"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    assert "FLASHCHECK_GLUON_BWD_DQ_SWIZZLE must be one of ('128', '32'), got '64'" in res.stderr


def test_the_default_swizzle_is_the_blocks_own():
    """128, the default, is what the descriptor picked before the switch for the dQ tile at
    both head dims (so the default launch compiles to the same code)."""
    fg = pytest.importorskip("flashcheck.kernels.flash_attention_gluon")
    bwd = pytest.importorskip("flashcheck.kernels.flash_attention_gluon_bwd")
    if not fg.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    from triton.experimental.gluon import language as gl
    assert bwd.DQ_SWIZZLE == 128
    for d in (64, 128):
        default = gl.NVMMASharedLayout.get_default_for([bwd.BLOCK_M, d // 2], gl.float32)
        assert default.swizzle_byte_width == bwd.DQ_SWIZZLE
