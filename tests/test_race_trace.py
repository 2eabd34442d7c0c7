"""scripts/gpu/race_trace.py: racecheck's reports read, placed in a kernel's shared-memory
layout by the instructions at their offsets."""

from __future__ import annotations

import json

import pytest

from tests.script_modules import load

rt = load("scripts/gpu/race_trace.py")

# racecheck's default (summary) output, as round 19 printed it, with the script's result lines
SUMMARY = """\
========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at _fwd_kernel+0x6290 in fwd.py:201
=========     and Read access at _fwd_kernel+0x6350 in fwd.py:201 [5 hazards]
=========
========= Error: Race reported between Write access at _bwd_kernel+0x4790 in bwd.py:325
=========     and Read access at _bwd_kernel+0x4850 in bwd.py:325 [5 hazards]
=========
ok  split causal=False hkv=2: launches 1, max |diff| / 4 ulps 0.0533
========= Error: Race reported between Read access at _bwd_kernel+0x54b0 in bwd.py:325
=========     and Write access at _bwd_kernel+0x9f0 in bwd.py:325 [14 hazards]
=========     and Write access at _bwd_kernel+0x53d0 in bwd.py:325 [10 hazards]
=========
BAD split_ordered causal=True hkv=1: launches 1, max |diff| / 4 ulps 7
========= RACECHECK SUMMARY: 3 hazards displayed (3 errors, 0 warnings)
"""

# --racecheck-report hazard, as the forward's detail log printed it
HAZARDS = """\
========= Error: Potential RAW hazard detected at __shared__ 0x30557 in block (0,1,0) :
=========     Write Thread (31,0,0) at _bwd_kernel+0x4790 in bwd.py:325
=========     Read Thread (352,0,0) at _bwd_kernel+0x4850 in bwd.py:325
=========     Current Value : 4
=========
ok  split causal=False hkv=2: launches 1, max |diff| / 4 ulps 0.0533
"""


def test_both_report_formats_are_read_with_the_run_they_belong_to():
    reps = rt.parse_log(SUMMARY)
    assert len(reps) == 3
    assert [r.config for r in reps] == [("split", False, 2), ("split", False, 2),
                                        ("split_ordered", True, 1)]
    first = reps[0].accesses
    assert [(a.kind, a.kernel, a.offset, a.hazards) for a in first] == [
        ("Write", "_fwd_kernel", 0x6290, None), ("Read", "_fwd_kernel", 0x6350, 5)]
    assert [(a.kind, a.offset, a.hazards) for a in reps[2].accesses] == [
        ("Read", 0x54b0, None), ("Write", 0x9f0, 14), ("Write", 0x53d0, 10)]
    (h,) = rt.parse_log(HAZARDS)
    assert (h.hazard, h.address, h.config) == ("RAW", 0x30557, ("split", False, 2))
    assert [(a.kind, a.offset, a.thread) for a in h.accesses] == [
        ("Write", 0x4790, 31), ("Read", 0x4850, 352)]


@pytest.mark.parametrize("insn, want", [
    ("STS.64 [UR4+0x30150], R2", (0x30150, 8, True)),
    ("LDS.U8 R0, [R8+UR5+0x3014c]", (0x3014c, 1, False)),
    ("LDS.128 R4, [UR36+0x38000]", (0x38000, 16, True)),
    ("@!P6 STS [UR17+0x30000], R5", (0x30000, 4, True)),
    ("STS [RZ+UR4], R0", (0, 4, True)),
    ("IADD3 R0, R1, 0x4, RZ", None),
])
def test_an_operand_gives_its_bytes_and_whether_a_thread_register_moves_them(insn, want):
    assert rt.footprint(insn) == want


# the shared-memory areas of a split kernel after Triton's allocation pass (abridged)
ALLOC = """\
module attributes {ttg.shared = 196952 : i32} {
  tt.func public @_bwd_kernel(%q: !tt.ptr<bf16>) attributes {allocation.offset = 196944 : i32} {
    %ticket = tt.atomic_rmw add, %p, %c1 {allocation.offset = 0 : i32, allocation.size = 4 : i32}
    %k_smem = ttg.local_alloc {allocation.offset = 0 : i32} : () -> !ttg.memdesc<128x128xbf16, #s>
    %ds_ready = ttg.local_alloc {allocation.offset = 196928 : i32} : () -> !ttg.memdesc<2x1xi64, #s>
    ttg.warp_specialize(%a) {allocation.offset = 196608 : i32, allocation.size = 272 : i32}
    default {
      %19 = tt.atomic_rmw add, %s, %c0 {allocation.offset = 196608 : i32, allocation.size = 4 : i32}
    }
    partition0(%arg: i32) num_warps(4) {
    }
  }
}
"""


def test_the_layout_names_every_area_an_address_falls_in():
    lay = rt.read_layout(ALLOC)
    assert lay.total == 196952
    assert lay.place(0x30150, 8)[0] == "warp_specialize"  # the state bytes
    region, what = lay.place(0x30000, 8)
    assert region == "warp_specialize"
    assert "captures" in what and "scratch of tt.atomic_rmw %19 in default" in what
    region, what = lay.place(0x100, 4)
    assert region == "kernel" and "%k_smem (128x128xbf16) 0x0-0x8000" in what
    assert lay.place(0x30140, 1)[0] == "kernel"  # %ds_ready 0x30140-0x30150
    assert lay.place(0x40000, 1)[0] == "unplaced"
    assert lay.place(None)[0] == "unplaced"


SASS = """\
        /*4780*/  ULEA UR4, UR5, UR4, 0x18 ;  /* 0x0 */
        /*4790*/  STS.64 [UR4+0x30150], R2 ;  /* 0x0 */
        /*47a0*/  BAR.SYNC.DEFER_BLOCKING 0x1 ;  /* 0x0 */
        /*4840*/  BAR.SYNC.DEFER_BLOCKING 0x1 ;  /* 0x0 */
        /*4850*/  LDS.U8 R0, [R8+UR5+0x3014c] ;  /* 0x0 */
        /*4860*/  STS [UR4+0x30140], R0 ;  /* 0x0 */
"""


def _sass_dir(tmp_path, tag="split-causal0-hkv2"):
    (tmp_path / f"{tag}.sass").write_text(SASS)
    (tmp_path / f"{tag}.alloc.mlir").write_text(ALLOC)
    (tmp_path / f"{tag}.json").write_text(json.dumps(dict(
        kernel="_fwd_kernel" if tag.startswith("fwd") else "_bwd_kernel", shared=196952,
        triton="3.9.0", ptxas="Build cuda_13.0.r13.0/compiler.36424714_0")))
    return tmp_path


def test_a_report_is_placed_by_the_access_whose_address_is_exact(tmp_path):
    """The state-byte read adds the warp's index to 0x3014c (a kernel barrier's bytes by its
    immediate alone): the report is placed at the write's exact bytes, the state."""
    body, bad = rt.trace(rt.parse_log(SUMMARY)[1:2], _sass_dir(tmp_path))
    assert bad == 0, body
    assert "`STS.64 [UR4+0x30150], R2` -> 0x30150-0x30158 in warp-specialize state" in body
    assert "/*4850*/ LDS.U8 R0, [R8+UR5+0x3014c]  <-" in body


def test_a_report_on_a_kernel_buffer_or_without_its_code_counts_against_it(tmp_path, capsys):
    d = _sass_dir(tmp_path)
    log = SUMMARY.replace("0x4790 in", "0x4860 in")  # a write to %ds_ready's bytes
    body, bad = rt.trace(rt.parse_log(log)[1:2], d)
    assert bad == 1 and "%ds_ready (2x1xi64)" in body
    body, bad = rt.trace(rt.parse_log(SUMMARY)[:1], d)  # the forward's code is not there
    assert bad == 1 and "no machine code for fwd-causal0-hkv2" in body
    (tmp_path / "race.log").write_text(SUMMARY)
    assert rt.main(["trace", str(tmp_path / "race.log"), "--sass", str(d)]) == 1
    assert "**2 of 3 reports** touch one of the kernel's own buffers" in capsys.readouterr().out
    (tmp_path / "one.log").write_text(HAZARDS)
    assert rt.main(["trace", str(tmp_path / "one.log"), "--sass", str(d),
                    "--out", str(tmp_path / "t.md")]) == 0
    assert "RAW at __shared__ 0x30557" in (tmp_path / "t.md").read_text()


def test_bad_arguments_name_themselves(tmp_path, capsys):
    with pytest.raises(SystemExit):
        rt.main(["trace", str(tmp_path / "missing.log"), "--sass", str(tmp_path)])
    assert "LOG: cannot read" in capsys.readouterr().err
    (tmp_path / "x.log").write_text(SUMMARY)
    with pytest.raises(SystemExit):
        rt.main(["trace", str(tmp_path / "x.log"), "--sass", str(tmp_path / "nope")])
    assert "--sass must be a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        rt.main(["compile", "--out", str(tmp_path), "--ptxas", str(tmp_path / "x.log")])
    assert "--ptxas must be an executable ptxas" in capsys.readouterr().err


@pytest.mark.parametrize("insn, want", [
    ("LDS.U8 R0, [R8+UR5+0x3014c]", {"Read"}),
    ("@!P6 STS [UR17+0x30000], R5", {"Write"}),
    ("@P0 SYNCS.ARRIVE.TRANS64 RZ, [UR8+0x30120], R0", {"Read", "Write"}),
    ("ULEA UR4, UR5, UR4, 0x18", set()),
])
def test_instructions_go_their_way(insn, want):
    assert rt.directions(insn) == want


def test_an_offset_on_another_instruction_says_the_code_is_not_the_gpus(tmp_path):
    log = SUMMARY.replace("0x4790 in", "0x4780 in")  # the ULEA before the store
    body, bad = rt.trace(rt.parse_log(log)[1:2], _sass_dir(tmp_path))
    assert bad == 1
    assert "`ULEA UR4, UR5, UR4, 0x18` is not a shared-memory write" in body


def test_a_report_printed_before_its_runs_line_is_placed_by_the_code_it_fits(tmp_path):
    """compute-sanitizer passes the program's output on late: a report of a later run's kernel
    can stand before an earlier run's "ok" line. Where the named run's code does not fit the
    offsets, the compiled kernel of that name whose code does is taken, and said."""
    d = _sass_dir(tmp_path)
    shifted = SASS.replace("/*4790*/", "/*0dc0*/").replace("/*4850*/", "/*4d90*/")
    _sass_dir(tmp_path, "writer_ordered-causal0-hkv2")
    (d / "writer_ordered-causal0-hkv2.sass").write_text(shifted)
    log = HAZARDS.replace("0x4790 in", "0xdc0 in").replace("0x4850 in", "0x4d90 in")
    body, bad = rt.trace(rt.parse_log(log), d)
    assert bad == 0, body
    assert ("the log's run split-causal0-hkv2 does not fit its offsets; the compiled code "
            "that does: `writer_ordered-causal0-hkv2`") in body
    assert "in `writer_ordered-causal0-hkv2`: `STS.64 [UR4+0x30150], R2`" in body
    # no compiled kernel fits: the named run's instructions are shown as they are
    body, bad = rt.trace(rt.parse_log(log.replace("0xdc0 in", "0xdb0 in")), d)
    assert bad == 1 and "no instruction at that offset in split-causal0-hkv2.sass" in body


def test_compare_finds_the_devices_identical_kernels(tmp_path, capsys):
    local, device = tmp_path / "local", tmp_path / "device"
    local.mkdir()
    device.mkdir()
    (local / "split-causal0-hkv2.sass").write_text(SASS)
    (device / "_bwd_kernel-abc.sass").write_text("        Function : _bwd_kernel\n" + SASS)
    assert rt.main(["compare", str(local), str(device)]) == 0
    assert "identical to the device's _bwd_kernel-abc.sass" in capsys.readouterr().out
    (local / "writer-causal0-hkv2.sass").write_text(SASS.replace("0x30150", "0x30158"))
    assert rt.main(["compare", str(local), str(device)]) == 1
    assert "writer-causal0-hkv2: no identical kernel" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        rt.main(["compare", str(local), str(tmp_path / "none")])
    assert "DEVICE must be a directory of .sass files" in capsys.readouterr().err


def test_sanitize_cases_runs_name_the_forward_they_launched(tmp_path):
    """sanitize_cases.py's result lines ("ok N=.. D=.. mode") place a report in the Gluon
    forward of that shape and mode (either kernel: per tile or persistent); a report in a
    Triton kernel of those runs has no Gluon machine code and counts against the run."""
    log = ("========= Error: Race reported between Write access at _fwd_persistent_kernel+0x4790"
           " in fwd.py:1\n=========     and Read access at _fwd_persistent_kernel+0x4850 in "
           "fwd.py:1 [2 hazards]\n=========\nok N=128 D=128 causal\n"
           "========= Error: Race reported between Write access at _attn_bwd+0x10 in fa.py:9\n"
           "=========     and Read access at _attn_bwd+0x20 in fa.py:9 [1 hazard]\n=========\n"
           "ok N=128 D=128 mask\n")
    reps = rt.parse_log(log)
    assert [r.config for r in reps] == [("sanitize", 128, 128, "causal"),
                                        ("sanitize", 128, 128, "mask")]
    body, bad = rt.trace(reps, _sass_dir(tmp_path, "fwd-N128-D128-causal"))
    assert bad == 1
    assert "(log line 1; N=128, D=128, causal)" in body
    assert "-> 0x30150-0x30158 in warp-specialize state" in body
    assert "no machine code for _attn_bwd, not a Gluon kernel" in body
