"""Per-GPU-model constants: the preset of the GPU torch names is picked, the H100 preset carries the H100's
numbers (not the H200's), and the refit from benchmark logs (bench/planner_predict.py --refit) recovers the
constants the logs were made with and rewrites the preset file."""

from __future__ import annotations

import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from paths import ROOT, cpu_subprocess_env

from embshard.planner import Topology, plan_with_report
from embshard.planner import refit as rf
from embshard.planner.presets import load_preset_file, preset_path
from embshard.planner.topology import GIB
from embshard.spec.optim import FusedOptimizerConfig
from embshard.tools.plan_inputs import load_planner_input

H200_KERNELS_LOG = ROOT / "bench" / "results" / "2026-11-23-h200" / "summary.md"  # kernels.log's key lines


@pytest.mark.parametrize(
    ("name", "memory_gib", "preset"),
    [
        ("NVIDIA H100 80GB HBM3", 79.1, "h100"),
        ("NVIDIA H200", 139.8, "h200"),
        ("NVIDIA GH200 480GB", 94.5, "h200"),
        ("NVIDIA A100-SXM4-80GB", 79.1, "a100"),
    ],
)
def test_detect_uses_the_preset_of_the_gpu_model(monkeypatch, name, memory_gib, preset):
    props = SimpleNamespace(name=name, total_memory=int(memory_gib * GIB), L2_cache_size=50 << 20)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    topo = Topology.detect(world_size=2)
    want = Topology.preset(preset, 2)
    assert topo.device_name == preset and preset in topo.source
    assert topo.hbm_bytes == int(memory_gib * GIB)  # the GPU's own memory, the preset's speeds
    for field in ("hbm_bw", "fwd_id_s", "small_fwd_id_s", "small_dense_sector_s", "step_overhead_s"):
        assert getattr(topo, field) == getattr(want, field), field


def test_unknown_gpus_warn_and_get_the_h100_speeds(monkeypatch):
    props = SimpleNamespace(name="Some GPU 9000", total_memory=40 * GIB, L2_cache_size=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    with pytest.warns(UserWarning, match="'Some GPU 9000' has no planner preset"):
        topo = Topology.detect(world_size=1)
    assert topo.hbm_bw == Topology.preset("h100", 1).hbm_bw


def test_h100_preset_has_h100_numbers():
    h100, h200 = Topology.preset("h100", 2), Topology.preset("h200", 2)
    assert h100.hbm_bw == 2.8e12 and h200.hbm_bw == 3.9e12  # measured copies (embshard calibrate)
    assert h100.hbm_bytes < h200.hbm_bytes
    ratio = 3.9 / 2.8  # constants not measured on an H100: the H200's scaled by the measured copy bandwidth ratio
    for field in (
        "bwd_id_s",
        "bwd_row_s",
        "small_fwd_id_s",
        "small_atomic_sector_s",
        "small_dense_sector_s",
    ):
        assert getattr(h100, field) == pytest.approx(getattr(h200, field) * ratio, rel=1e-3), field
    # measured on the H100 itself, in the step: the forward's time per id and the host link's row costs
    assert h100.fwd_id_s != pytest.approx(h200.fwd_id_s * ratio, rel=0.1)
    assert h100.uvm_bwd_row_s > 0 and h200.uvm_bwd_row_s == 0
    # host-side costs are the host's, the same on both GPU models (fitted to the steps measured on both)
    assert h100.host_sync_s == h200.host_sync_s > 0 and h100.step_overhead_s == h200.step_overhead_s
    assert h200.batch_bag_s > 0 and h200.host_step_s == 0  # the H200's hosts not measured: its per-bag term
    assert h100.batch_bag_s == 0 and h100.host_step_s > h100.host_dp_group_s > h100.host_group_s > 0  # its host floor
    # the same plan is predicted slower on the H100 (its GPU part by the copy bandwidth ratio, not its host part)
    inp = load_planner_input(ROOT / "configs" / "planner" / "uniform26.yaml")
    on = {
        n: plan_with_report(inp.tables, t, inp.batch_size, inp.optimizer)[1]
        for n, t in (("h100", h100), ("h200", h200))
    }
    assert on["h100"].step_time_s > 1.2 * on["h200"].step_time_s
    # `embshard plan --device h100` plans with them
    out = subprocess.run(
        [sys.executable, "-m", "embshard.cli", "plan", str(ROOT / "configs/planner/uniform26.yaml"), "--world-size", "2",
         "--device", "h100", "--format", "json"],
        capture_output=True, text=True, env=cpu_subprocess_env(), cwd=ROOT, check=True,
    )  # fmt: skip
    assert '"world_size": 2' in out.stdout


def test_a100_preset_is_the_h200s_scaled_with_its_own_sizes_and_links():
    a100, h200 = Topology.preset("a100", 2), Topology.preset("h200", 2)
    # presets/a100.yaml, in code units, bit for bit
    assert (a100.hbm_bytes, a100.l2_bytes) == (int(79.2 * GIB), 40 << 20)
    assert (a100.hbm_bw, a100.uvm_bw, a100.ddr_bw) == (1.7e12, 25e9, 40e9)
    assert (a100.intra_host_bw, a100.inter_host_bw) == (200e9, 22e9)
    assert a100.device_name == "a100" and a100.measured == ()
    for field in ("fwd_id_s", "bwd_row_s", "bag_s", "batch_bag_s", "uvm_row_s", "small_fwd_id_s", "small_same_row_s"):
        assert getattr(a100, field) == getattr(h200, field) * 1.7, field
    for field in ("ddr_bytes", "kernel_s", "host_sync_s", "collective_latency_s", "uvm_page_s", "regroup_efficiency"):
        assert getattr(a100, field) == getattr(h200, field), field


def test_refit_recovers_the_kernel_constants_of_its_log():
    """The H200 preset's small-table kernel constants are the fit to the stored H200 log; with them the model gives
    the log's uniform-id times back."""
    from embshard.planner import kernel_model as kcost

    h200 = Topology.preset("h200", 2)
    log = rf.parse_kernel_log(H200_KERNELS_LOG.read_text(), str(H200_KERNELS_LOG))
    assert (log.tables, log.rows, log.dim, log.batch, log.ids_per_bag) == (100, 10_000, 16, 8192, 30)
    assert rf.gpu_of_log(H200_KERNELS_LOG.read_text()) == "NVIDIA H200"
    fitted, lines = rf.fit_kernel_log(log, h200)
    for field, value in fitted.items():
        assert value == pytest.approx(getattr(h200, field), rel=2e-3), field
    k = h200.kernel_constants
    n, b = 8192 * 30, 8192
    fwd = 100 * float(kcost.small_table_forward(n, b, 10_000, 16, 10_000, 0, h200.hbm_bw, h200.l2_bytes, k))
    bwd = 100 * float(kcost.small_table_backward(n, b, 10_000, 16, 10_000, 0, 4, 0.0, h200.hbm_bw, k)[0])
    dense = 100 * float(kcost.small_table_backward(n, b, 10_000, 16, 10_000, 0, 0, 0.0, h200.hbm_bw, k, "dense")[0])
    case = "uniform rowwise_adagrad (10000 rows/table)"
    assert fwd == pytest.approx(log.times[("small", case, "atomic fwd")], rel=0.01)
    assert fwd + bwd == pytest.approx(log.times[("small", case, "atomic fwd+bwd")], rel=0.01)
    assert fwd + dense == pytest.approx(
        log.times[("dense", "uniform (10000 rows/table)", "kernel atomic fwd+bwd")], rel=0.01
    )
    with pytest.raises(ValueError, match="no 'small tables: T x R rows"):
        rf.parse_kernel_log("nothing here", "x.log")


def test_step_overhead_fit():
    assert rf.fit_step_overhead([4e-3, 5e-3, 6e-3], [4.5e-3, 5.5e-3, 6.5e-3]) == pytest.approx(0.5e-3)
    assert rf.fit_step_overhead([5e-3], [4e-3]) == 0.0  # never negative
    log = "\n".join(
        [
            'META date=2026-11-26 gpu="NVIDIA H100 80GB HBM3" gpus=2',
            'PLAN workload=tiny json={"world_size":2}',
            "RESULT framework=torchrec bench=emb workload=tiny world=2 ms_per_step=1.0",
            "RESULT framework=embshard bench=emb workload=tiny world=2 plan=planner hbm_gib=0 ms_per_step=0.91",
            "RESULT framework=embshard bench=emb workload=uniform26 world=2 plan=planner hbm_gib=16 ms_per_step=5.80",
            "RESULT framework=embshard bench=soak workload=uniform26 world=2 ms_per_step=5.0",
        ]
    )
    runs = rf.parse_step_log(log)
    assert [(r["workload"], r["seconds"], r["plan_json"]) for r in runs] == [
        ("tiny", 0.91e-3, '{"world_size":2}'),
        ("uniform26", 5.80e-3, None),
    ]
    assert runs[1]["hbm_gib"] == "16" and rf.gpu_of_log(log) == "NVIDIA H100 80GB HBM3"


def test_refit_command_rewrites_the_preset(tmp_path):
    """bench/planner_predict.py --refit on a log of RESULT lines with the plans the runs printed: the step overhead
    that makes the predictions match (here: measured = predicted + 0.4 ms, with the runs' host batch counts, which
    a line without counts= would not have: device, +host_sync) goes into the preset file, the other values and
    notes stay; a log of another GPU model is refused."""
    import json

    from bench.planner_predict import dmp_workload

    h100 = Topology.preset("h100", 2)
    opt = FusedOptimizerConfig("rowwise_adagrad", lr=0.01)
    lines = ['META date=2026-11-26 gpu="NVIDIA H100 80GB HBM3" gpus=2']
    for workload in ("uniform26", "tiny"):
        tables, batch = dmp_workload(workload)
        plan, report = plan_with_report(tables, h100, batch, opt)
        ms = (report.step_time_s - h100.step_overhead_s + 0.4e-3) * 1e3
        compact = json.dumps(json.loads(plan.to_json()), separators=(",", ":"))
        lines.append(f"PLAN workload={workload} json={compact}")
        lines.append(
            f"RESULT framework=embshard bench=emb workload={workload} world=2 plan=planner ms_per_step={ms:.5f} "
            "counts=host"
        )
    (tmp_path / "emb.log").write_text("\n".join(lines) + "\n")
    out = tmp_path / "h100.yaml"
    cmd = [sys.executable, "-m", "bench.planner_predict", "--refit", "--device", "h100"]
    run = subprocess.run(
        [*cmd, "--steps", str(tmp_path / "emb.log"), "--out", str(out)],
        capture_output=True, text=True, env=cpu_subprocess_env(), cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "step_overhead" in run.stdout and "uniform26  its plan, host" in run.stdout
    values = load_preset_file(out)
    assert values["step_overhead_s"] == pytest.approx(0.4e-3, rel=1e-3)
    before = load_preset_file(preset_path("h100"))
    assert {k: v for k, v in values.items() if k != "step_overhead_s"} == {
        k: v for k, v in before.items() if k != "step_overhead_s"
    }
    text = out.read_text()
    assert "hbm_gbps: 2800.0  # device-to-device copy" in text
    assert re.search(r"step_overhead_us: [0-9.]+  # fitted to .*emb.log", text)
    wrong = subprocess.run(
        [*cmd[:-1], "h200", "--steps", str(tmp_path / "emb.log")],
        capture_output=True, text=True, env=cpu_subprocess_env(), cwd=ROOT,
    )  # fmt: skip
    assert wrong.returncode != 0 and "not on a h200" in wrong.stderr


def test_every_topology_field_has_one_file_form():
    """Topology and preset files write each field once: with a unit (units.UNITS) or as it is (PLAIN_FIELDS)."""
    from dataclasses import fields

    from embshard.planner.topology import Topology
    from embshard.planner.units import BY_YAML_KEY, PLAIN_FIELDS, UNITS

    names = {f.name for f in fields(Topology)}
    assert not set(UNITS) & set(PLAIN_FIELDS)
    assert names == set(UNITS) | set(PLAIN_FIELDS)
    written = Topology.preset("h200", 16, 8).to_dict()
    assert set(written) == set(BY_YAML_KEY) | set(PLAIN_FIELDS)
    assert Topology.from_dict(written).to_dict() == written
