"""The mpkern command line: --help, every subcommand's quick path, bad flags -> exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mpkern.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("info", "compare", "bench", "plan"):
        assert cmd in out


@pytest.mark.parametrize("cmd, flags", [("compare", ["--precision", "--steps", "--lr", "--batch-size", "--seq-len",
                                                     "--d-model", "--layers", "--device", "--seed", "--out",
                                                     "--optimizer-state", "--find-batch", "--memory-budget",
                                                     "--release", "--release-bucket"]),
                                        ("bench", ["--device", "--quick", "--json", "--plot"]),
                                        ("plan", ["--params", "--world-size", "--gpu-mem", "--hf-config",
                                                  "--memory-budget", "--safety-margin"])])
def test_subcommand_help(cmd, flags, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for f in flags:
        assert f in out, f


@pytest.mark.parametrize("argv, needle", [
    (["compare", "--steps", "0"], "--steps"),
    (["compare", "--steps", "ten"], "--steps"),
    (["compare", "--lr", "-1"], "--lr"),
    (["compare", "--lr", "nan"], "--lr"),
    (["compare", "--precision", "fp32,fp8"], "fp8"),
    (["compare", "--optimizer-state", "int4"], "--optimizer-state"),
    (["compare", "--device", "tpu"], "--device"),
    (["compare", "--bogus"], "--bogus"),
    (["compare", "--d-model", "30", "--heads", "4", "--steps", "2", "--no-progress", "--no-plot"], "d_model"),
    (["compare", "--memory-budget", "96MiB"], "--find-batch"),
    (["compare", "--release-bucket", "64KiB"], "--release"),
    (["compare", "--release", "--release-bucket", "lots"], "--release-bucket"),
    (["compare", "--release", "--precision", "fp32", "--steps", "2", "--no-progress", "--no-plot"], "release"),
    (["compare", "--find-batch", "--memory-budget", "lots"], "--memory-budget"),
    (["compare", "--find-batch", "--device", "cpu", "--steps", "2", "--no-progress", "--no-plot"], "memory-budget"),
    (["plan", "--memory-budget", "0GB"], "--memory-budget"),
    (["plan", "--memory-budget", "1GB", "--params", "7e9"], "--hf-config"),
    (["bench", "everything"], "which"),
    (["bench", "--params", "0"], "--params"),
    (["plan"], "--params"),
    (["plan", "--params", "lots"], "--params"),
    (["plan", "--params", "1e9", "--world-size", "0"], "--world-size"),
    (["nosuchcommand"], "invalid choice"),
])
def test_bad_flags_exit_2_with_message(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and needle in err


def test_console_exit_code_is_2():
    r = subprocess.run([sys.executable, "-m", "mpkern", "compare", "--steps", "-3"], capture_output=True, text=True,
                       check=False, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "--steps" in r.stderr


def test_plan_quick_path(capsys):
    assert main(["plan", "--params", "7e9", "--gpu-mem", "80"]) == 0
    out = capsys.readouterr().out
    assert "fp32 AdamW" in out and "112.00 GB" in out  # 16 B/param x 7e9
    assert main(["plan", "--params", "1e9", "--world-size", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    fp32 = next(r for r in data["rows"] if r["recipe"] == "fp32 AdamW")
    assert fp32["per_rank_GB"] == pytest.approx(16 * 1e9 / 4 / 1e9)


def test_compare_quick_path(tmp_path, capsys):
    out = tmp_path / "cmp"
    rc = main(["compare", "--precision", "fp32,mpkern-bf16", "--steps", "4", "--warmup", "1", "--log-every", "2",
               "--batch-size", "4", "--seq-len", "8", "--d-model", "16", "--heads", "2", "--layers", "1",
               "--out", str(out), "--no-progress", "--no-plot"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| fp32 |" in text and "| mpkern-bf16 |" in text
    data = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in data["runs"]] == ["fp32", "mpkern-bf16"]
    assert data["config"]["steps"] == 4 and data["config"]["d_model"] == 16
    assert not (out / "compare.png").exists()


def test_compare_release_flag(tmp_path, capsys):
    out = tmp_path / "cmp"
    rc = main(["compare", "--precision", "mpkern-bf16", "--release", "--release-bucket", "4KiB", "--steps", "4",
               "--warmup", "1", "--log-every", "2", "--batch-size", "4", "--seq-len", "8", "--d-model", "16",
               "--heads", "2", "--layers", "1", "--out", str(out), "--no-progress", "--no-plot"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| mpkern-bf16 |" in text and "| mpkern-bf16+release |" in text and "Gradient release:" in text
    data = json.loads((out / "results.json").read_text())
    reg, rel = data["runs"]
    assert rel["name"] == "mpkern-bf16+release" and rel["release"]["bucket_bytes"] == 4096
    assert rel["peak_mem_bytes"] > 0 and rel["tokens_per_s"] > 0 and rel["final_loss"] == reg["final_loss"]


def test_bench_quick_path(tmp_path, capsys):
    path = tmp_path / "b.json"
    rc = main(["bench", "unscale", "--quick", "--params", "30000", "--tensors", "5", "--reps", "2",
               "--json", str(path)])
    assert rc == 0
    assert "byte-model limit" in capsys.readouterr().out
    data = json.loads(path.read_text())
    assert data["meta"]["params"] == 30000 and data["meta"]["which"] == "unscale"
    ours, peer = data["rows"]
    assert ours["bytes_per_param"] == 6 and peer["bytes_per_param"] == 10  # DESIGN.md's byte model
    assert peer["byte_model_limit"] == pytest.approx(10 / 6)
    assert peer["mpkern_speedup"] == pytest.approx(peer["ms"] / ours["ms"], rel=1e-6)
    for r in data["rows"]:
        assert r["rate"] == pytest.approx(r["bytes_per_param"] * 30000 / (r["ms"] / 1e3) / 1e9, rel=1e-6)


def test_bench_release_quick_path(tmp_path, capsys):
    path = tmp_path / "r.json"
    assert main(["bench", "release", "--quick", "--reps", "1", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "(b) release, one pass: opt.backward(loss)" in out and "(d) release, two passes" in out
    data = json.loads(path.read_text())
    assert data["meta"]["which"] == "release"
    assert [r["variant"] for r in data["rows"]] == ["a", "b", "c", "bound", "d", "e", "f"]
    assert all(r["ms"] > 0 and r["rate"] > 0 for r in data["rows"])


def test_bench_adamw_limits(tmp_path):
    from mpkern import bench

    rows = bench.bench_adamw("cpu", params=20000, tensors=4, reps=2, bandwidth={"inplace_GBps": 1.0},
                             log=lambda s: None)
    assert [r["bytes_per_param"] for r in rows] == [30, 48, 52, 30]  # last: mpkern with the write check off
    assert rows[3]["mpkern_speedup"] is None and "write check off" in rows[3]["method"]
    assert rows[1]["byte_model_limit"] == pytest.approx(48 / 30)
    assert rows[2]["byte_model_limit"] == pytest.approx(52 / 30)


@pytest.mark.parametrize("argv, usage", [
    (["compare", "--memory-budget", "96MiB"], "usage: mpkern compare"),  # an error raised by _cmd_compare
    (["plan"], "usage: mpkern plan"),  # an error raised by _cmd_plan
])
def test_a_command_reports_its_errors_through_its_own_parser(argv, usage, capsys):
    """The parser handed to a command is that subcommand's (its usage line), not the top-level one."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith(usage)
