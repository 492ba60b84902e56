"""benchmarks/summarize.py on synthetic runner CSVs (CPU)."""

import csv
import importlib.util
import pathlib
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "summarize.py"
FIELDS = ["op", "dtype", "M", "N", "impl", "time_us", "gbps", "pct_of_copy", "date", "error",
          "gpu"]


@pytest.fixture(scope="module")
def summarize():
    spec = importlib.util.spec_from_file_location("summarize", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def write(path, date, rows, gpu="NVIDIA H200"):
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        for op, m, n, impl, us, pct, error in rows:
            writer.writerow(dict(op=op, dtype="bf16", M=m, N=n, impl=impl, time_us=us,
                                 gbps=1.0, pct_of_copy=pct, date=date, error=error, gpu=gpu))


def test_latest_run_fastest_baseline_and_targets(tmp_path, summarize):
    # an older run, superseded for the norm case; a newer one where a baseline errored
    write(tmp_path / "a.csv", "2026-11-30T01:00", [
        ("rms_norm_bwd", 8192, 16384, "quack_kernels", 300.0, 70.0, ""),
        ("rms_norm_bwd", 8192, 16384, "torch", 600.0, 35.0, ""),
        ("softmax_fwd", 4096, 4096, "quack_kernels", 20.0, 72.0, ""),
        ("softmax_fwd", 4096, 4096, "quack", 19.0, 75.0, ""),
    ])
    write(tmp_path / "b.csv", "2026-11-30T02:00", [
        ("rms_norm_bwd", 8192, 16384, "quack_kernels", 250.0, 84.0, ""),
        ("rms_norm_bwd", 8192, 16384, "liger", 500.0, 42.0, ""),
        ("rms_norm_bwd", 8192, 16384, "torch", 400.0, 52.0, ""),
        ("rms_norm_bwd", 8192, 16384, "quack", "", "", "RuntimeError: no"),
    ])
    cases = summarize.read_cases(tmp_path)
    norm = cases[("rms_norm_bwd", "bf16", 8192, 16384)]
    assert (norm.csv, norm.ours_pct, norm.baseline) == ("b.csv", 84.0, "torch")
    assert norm.speedup == pytest.approx(1.6) and norm.target == 80.0 and not norm.misses
    small = cases[("softmax_fwd", "bf16", 4096, 4096)]
    assert small.target is None and small.misses  # off the grid: only the baselines count
    assert "| rms_norm_bwd | bf16 | 8192x16384 | 84.0 | 80.0 | torch |" in summarize.table([norm])


def test_gpu_filter_keeps_the_runs_of_one_card(tmp_path, summarize):
    write(tmp_path / "h200.csv", "2026-11-30T01:00", [
        ("layer_norm_fwd", 2048, 65536, "quack_kernels", 200.0, 83.0, "")])
    write(tmp_path / "h100.csv", "2026-12-06T07:45", [
        ("layer_norm_fwd", 2048, 65536, "quack_kernels", 190.0, 95.6, "")],
        gpu="NVIDIA H100 80GB HBM3")
    key = ("layer_norm_fwd", "bf16", 2048, 65536)
    assert summarize.read_cases(tmp_path)[key].csv == "h100.csv"  # the newest, any card
    assert summarize.read_cases(tmp_path, "h200")[key].csv == "h200.csv"
    assert summarize.read_cases(tmp_path, "H100")[key].ours_pct == 95.6
    assert summarize.read_cases(tmp_path, "a100") == {}


def test_options_case_is_held_to_a_share_of_the_plain_one(tmp_path, summarize):
    write(tmp_path / "plain.csv", "2026-12-06T01:00", [
        ("cross_entropy_fwdbwd", 8192, 16384, "quack_kernels", 200.0, 88.0, ""),
        ("cross_entropy_fwdbwd", 32768, 4096, "quack_kernels", 200.0, 86.0, "")])
    write(tmp_path / "options.csv", "2026-12-06T02:00", [
        ("cross_entropy_fwdbwd_options", 8192, 16384, "quack_kernels", 260.0, 67.0, ""),
        ("cross_entropy_fwdbwd_options", 32768, 4096, "quack_kernels", 220.0, 78.0, ""),
        ("cross_entropy_fwdbwd_options", 131072, 1024, "quack_kernels", 220.0, 50.0, "")])
    cases = summarize.read_cases(tmp_path)
    slow, close = (cases[("cross_entropy_fwdbwd_options", "bf16", m, n)]
                   for m, n in ((8192, 16384), (32768, 4096)))
    assert (slow.target, slow.misses) == (79.2, True)
    assert (close.target, close.misses) == (77.4, False)
    # without a plain result to compare with, only the baselines count
    assert cases[("cross_entropy_fwdbwd_options", "bf16", 131072, 1024)].target is None


@pytest.mark.parametrize("op, m, n, target", [
    ("softmax_bwd", 512, 262144, 92.0),
    ("softmax_fwd", 128, 1 << 20, 85.0),
    ("layer_norm_fwd_res", 2048, 65536, 92.0),
    ("layer_norm_bwd", 2048, 65536, 80.0),
    ("rms_norm_fwdbwd", 4096, 4096, None),
    ("cross_entropy_fwd", 4096, 128256, 90.0),
    ("cross_entropy_fwdbwd", 131072, 1024, 85.0),
    ("cross_entropy_fwdbwd_options", 131072, 1024, None),
    ("cross_entropy_fwdbwd_graphed", 131072, 1024, None),
    ("layer_norm_fwd", 256, 32000, None),
])
def test_issue_targets(summarize, op, m, n, target):
    assert summarize.target_pct(op, m, n) == target
