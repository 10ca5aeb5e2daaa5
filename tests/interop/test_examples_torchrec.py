"""The three migration steps of docs/torchrec.md (examples/torchrec/), run on 2 processes (gloo, CPU) in one spawn:
embshard's plan in TorchRec's DMP, TorchRec's model and checkpoint trained on in embshard, embshard's checkpoint
back into TorchRec (under TorchRec's own plan) with the loss embshard computes."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from dist_harness import device_kind, run_distributed

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "torchrec"
pytestmark = pytest.mark.skipif(device_kind() != "cpu", reason="the examples' CPU run (gloo)")


def _steps(rank: int, world: int, device: torch.device, out: str) -> dict:
    sys.path.insert(0, str(EXAMPLES))
    import step1_plan
    import step2_train
    import step3_export

    return {
        "step1": step1_plan.main(out, device),
        "step2": step2_train.main(out, device),
        "step3": step3_export.main(out, device),
    }


def test_migration_examples(tmp_path):
    results = run_distributed(_steps, 2, str(tmp_path))
    plan = results[0]["step1"]["plan"]
    types = {t.table: t.sharding_type.value for t in plan.tables}
    assert types == {"user": "column_wise", "item": "row_wise", "category": "table_wise"}  # TorchRec's constraints
    assert (tmp_path / "plan.torchrec.json").is_file()
    for r in results:
        assert len(r["step1"]["losses"]) == 4 and len(r["step2"]["losses"]) == 4
        assert all(math.isfinite(x) for x in r["step1"]["losses"] + r["step2"]["losses"])
        assert r["step3"]["theirs"] == pytest.approx(r["step3"]["ours"], rel=1e-5)
