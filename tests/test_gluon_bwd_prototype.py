"""scripts/gpu/gluon_bwd.py, the five-product Gluon backward prototype, compiled for sm_90a
without a GPU (scripts/ptxas_report.py's stand-in driver, in a subprocess without the
interpreter): the head-dim-split forms (the consumers adding dQ, or a writer warp; as the
adds come, or in order; GQA's group loop) fit the multiprocessor (shared memory, the
partitions' register budgets) and add dQ by bulk tensor reduce-adds: the form
docs/benchmarks/sweep.md round 18 timed and those written after it stay compilable. Needs
a Triton whose Gluon has the bulk reduce-add (3.9); skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

_COMPILE = r"""
import json, sys, importlib.util, torch
from pathlib import Path
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec); sys.modules[name] = mod
    spec.loader.exec_module(mod); return mod
rep = load("ptxas_report", "scripts/ptxas_report.py")
comp = rep._Compiler(Path(sys.argv[1])); comp.install()
g = load("gluon_bwd", "scripts/gpu/gluon_bwd.py")
if not g.BULK:
    print(json.dumps("no-bulk")); sys.exit(0)
t = torch.empty(2, 2, 1024, 128, dtype=torch.bfloat16)
r = torch.empty(2, 2, 1024)
for writer in (False, True):
    for ordered in (False, True):
        comp.tag = f"{'writer' if writer else 'split'} ordered={ordered}"
        g.dkdv(t, t, t, t, r, r, False, torch.empty(2, 2, 1024, 128), ordered=ordered,
               bulk=True, split=True, writer=writer)
comp.tag = "split gqa"  # one kv head for both query heads: the group loop (same kernel)
kv = torch.empty(2, 1, 1024, 128, dtype=torch.bfloat16)
g.dkdv(t, kv, kv, t, r, r, False, torch.empty(2, 2, 1024, 128), bulk=True, split=True)
try:
    g.dkdv(t, kv, kv, t, r, r, False, torch.empty(2, 2, 1024, 128), ordered=True, bulk=True,
           split=True)
except ValueError as e:
    print("refused:", e, file=sys.stderr)
print(json.dumps(comp.records))
"""


def test_split_forms_compile_for_sm90_with_bulk_reduce_adds(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    pytest.importorskip("triton.experimental.gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    res = subprocess.run([sys.executable, "-c", _COMPILE, str(tmp_path)], env=env,
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    recs = json.loads(res.stdout.strip().splitlines()[-1])
    if recs == "no-bulk":
        pytest.skip("this Triton's Gluon has no bulk tensor reduce-add (tma.async_atomic_add)")
    # GQA is a runtime group size (Triton specialises a group of 1: a compile of its own);
    # the ordered form refuses it by name
    assert [r["launch"] for r in recs] == ["split ordered=False", "split ordered=True",
                                           "writer ordered=False", "writer ordered=True",
                                           "split gqa"]
    assert "ordered dQ adds are for MHA" in res.stderr
    for r in recs:
        assert r["kernel"] == "_dkdv_kernel" and r["registers"] == 168, r
        assert r["shared_bytes"] <= 227 * 1024, r
    texts = [p.read_text() for p in sorted(tmp_path.glob("*.ptx"))]
    assert len(texts) == 5
    for text in texts:
        assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240;", text)
        assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", text)
        # each warpgroup's dQ half goes out as one bulk tensor reduce-add per tile
        assert "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add" in text
    # only the ordered forms wait for their turn, with acquire semantics
    assert sum("acquire" in text for text in texts) == 2
