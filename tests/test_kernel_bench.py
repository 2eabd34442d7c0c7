"""The benchmark's CPU-testable parts: the FLOP count, the configuration list, the table and
file writer (the timing itself needs a GPU and runs there)."""

from __future__ import annotations

import json

import pytest
from flashcheck.kernels import bench


@pytest.mark.parametrize("causal, pass_, want", [
    (False, "fwd", 4 * 2 * 3 * 5 * 7 * 11),
    (True, "fwd", 2 * 2 * 3 * 5 * 7 * 11),
    (False, "bwd", 2.5 * 4 * 2 * 3 * 5 * 7 * 11),
    (True, "fwd+bwd", 3.5 * 2 * 2 * 3 * 5 * 7 * 11),
])
def test_flops(causal, pass_, want):
    assert bench.flops(2, 3, 5, 7, 11, causal, pass_) == want


@pytest.mark.parametrize("quick, n", [(False, 24), (True, 2)])
def test_configurations(quick, n):
    cfgs = bench.configurations(quick)
    assert len(cfgs) == n
    assert all(c["B"] * c["H"] * c["N"] == bench.TOKENS for c in cfgs)
    assert cfgs[0] == dict(dtype="bfloat16", D=128, causal=False, N=4096, B=16, H=16)
    assert len({tuple(sorted(c.items())) for c in cfgs}) == n
    if quick:  # the subset a short GPU call runs: bf16, D=128, N=4K, causal and not
        assert {(c["dtype"], c["D"], c["N"]) for c in cfgs} == {("bfloat16", 128, 4096)}
        assert {c["causal"] for c in cfgs} == {False, True}


def test_table_and_files(tmp_path):
    cfg = dict(dtype="bfloat16", D=128, causal=True, N=4096, B=16, H=16)
    ms = 2.0
    tf = bench.flops(16, 16, 4096, 4096, 128, True, "fwd") / (ms * 1e-3) / 1e12
    rows = [dict(cfg, impl="triton-fa2", **{"pass": "fwd"}, ms=ms, tflops=tf, peak_mib=512.0,
                 note="")] + bench.na_rows(cfg, "sdpa-cudnn", "RuntimeError: no kernel")
    meta = {"gpu": "NVIDIA H200", "driver": "570.1", "torch": "2.11", "triton": "3.6",
            "tuning": "autotune"}
    jp, mp = bench.write_outputs(rows, meta, tmp_path)
    assert jp.name == "bench_nvidia_h200.json" and mp.name == "bench_nvidia_h200.md"
    assert json.loads(jp.read_text()) == {"meta": meta, "rows": rows}
    md = mp.read_text().splitlines()
    assert "NVIDIA H200" in md[0] and "570.1" in md[2] and "tuning autotune" in md[2]
    body = [line for line in md if line.startswith("| bfloat16")]
    assert body[0] == (f"| bfloat16 | 128 | yes | 4096 | 16 | triton-fa2 | fwd | 2.000 | "
                       f"{tf:.1f} | 512 |  |")
    assert len(body) == 4 and all("n/a: RuntimeError: no kernel" in b for b in body[1:])


def test_main_without_gpu_is_an_environment_error(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present, so the no-CUDA error path of bench.main cannot run here")
    assert bench.main(["--quick"]) == 2
    assert "CUDA" in capsys.readouterr().err


def test_ns_and_shard_arguments():
    assert bench._ns("1024,16384") == [1024, 16384]
    assert bench._shard("2/5") == (2, 5)
    with pytest.raises(Exception, match="N must be among 1024, 4096, 16384"):
        bench._ns("2048")
    with pytest.raises(Exception, match="comma-separated"):
        bench._ns("4k")
    for bad in ("5/5", "-1/3", "1"):
        with pytest.raises(Exception, match="I/J with 0 <= I < J"):
            bench._shard(bad)


def test_warm_compiles_its_shard_untimed_and_survives_failures(monkeypatch, capsys):
    cfgs = bench.configurations(False)
    calls = []

    def fake(cfg, impl, timed=True):
        calls.append((cfg["N"], cfg["D"], cfg["dtype"], cfg["causal"], impl, timed))
        if impl == "flex":
            raise RuntimeError("no compiler here")
        return []

    monkeypatch.setattr(bench, "_bench_one", fake)
    bench.warm(cfgs, 1, 5)
    want = [(c["N"], c["D"], c["dtype"], c["causal"], impl, False)
            for c in cfgs[1::5] for impl in bench.COMPILED]
    assert calls == want  # the flex failures did not stop the shard
    assert capsys.readouterr().err.count("warm flex") == len(cfgs[1::5])


def test_prewarm_shards_do_not_cache_autotune_choices(monkeypatch):
    seen = []

    class FakeProc:
        def __init__(self, cmd, env):
            seen.append((cmd, env))

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(bench.subprocess, "Popen", FakeProc)
    bench.prewarm(bench.configurations(False), 3, 10.0, quick=False, ns=[4096])
    assert [c[-1] for c, _ in seen] == ["0/3", "1/3", "2/3"]
    assert all(c[c.index("--ns") + 1] == "4096" for c, _ in seen)
    # tuned on a busy GPU: the choices must not reach the timed run through the disk cache
    assert all(env["FLASHCHECK_AUTOTUNE_CACHE"] == "0" for _, env in seen)


def test_run_checkpoints_after_each_configuration_and_keeps_failures(monkeypatch):
    cfgs = bench.configurations(True)  # 2 configurations
    seen = []

    def fake(cfg, impl, timed=True):
        if impl == "sdpa-cudnn":
            raise RuntimeError("no kernel\nsecond line")
        return [dict(cfg, impl=impl, **{"pass": p}, ms=1.0, tflops=1.0, peak_mib=1.0, note="")
                for p in bench.PASSES]

    monkeypatch.setattr(bench, "_bench_one", fake)
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: None)
    rows = bench.run(cfgs, budget_s=1e9, log=lambda *a: None,
                     checkpoint=lambda r: seen.append(len(r)))
    per_cfg = len(bench.PEERS) * len(bench.PASSES)
    assert len(rows) == 2 * per_cfg
    assert seen == [per_cfg]  # after the first configuration (the caller writes the last)
    cudnn = [r for r in rows if r["impl"] == "sdpa-cudnn"]
    assert all(r["tflops"] is None and r["note"] == "n/a: RuntimeError: no kernel"
               for r in cudnn)


def test_rounds_rotate_the_order_and_report_the_median(monkeypatch):
    cfgs = bench.configurations(True)[:1]
    order = []
    times = {"triton-fa2": iter([7.3, 6.2, 6.3]), "sdpa-cudnn": iter([6.0, 6.1, 5.9])}

    def fake(cfg, impl, timed=True):
        order.append(impl)
        if impl == "sdpa-efficient":
            raise RuntimeError("unsupported")
        ms = next(times[impl]) if impl in times else 1.0
        return [dict(cfg, impl=impl, **{"pass": p}, ms=ms, tflops=10.0 / ms, peak_mib=1.0,
                     note="") for p in bench.PASSES]

    monkeypatch.setattr(bench, "_bench_one", fake)
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: None)
    rows = bench.run(cfgs, budget_s=1e9, log=lambda *a: None, rounds=3)
    n = len(bench.PEERS)
    # each round starts one implementation later; a failed one is not retried
    assert order[:n] == list(bench.PEERS)
    assert order[n] == bench.PEERS[1] and "sdpa-efficient" not in order[n:]
    ours = next(r for r in rows if r["impl"] == "triton-fa2" and r["pass"] == "bwd")
    assert ours["ms"] == 6.3 and ours["ms_rounds"] == [7.3, 6.2, 6.3]
    assert abs(ours["tflops"] - 10.0 / 6.3) < 1e-12  # from the median, not the first round
    eff = [r for r in rows if r["impl"] == "sdpa-efficient"]
    assert len(eff) == 3 and all(r["ms"] is None and "unsupported" in r["note"] for r in eff)
    table = bench.format_table(rows, {"rounds": 3})
    assert "3 rounds: ms is the median" in table
    assert "| 6.300 |" in table and "rounds 6.200-7.300" in table


def test_rounds_argument_is_checked(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0"])
    assert "--rounds: must be an integer from 1 to 20, got '0'" in capsys.readouterr().err
