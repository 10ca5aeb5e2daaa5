"""`embshard export serving` and `embshard predict` end to end on the Criteo sample (CSV, read with the run's own
data config; and the same rows as Parquet, read through a YAML `data:` section of a table source): a DLRM trained
3 steps on 1 rank and saved; the scores written to Parquet are the trained model's own (fp32 tables), in data
order, the same from either file format; --split held_out scores the run's 40 held-out rows; --dtype auto prints
its choice per table."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch
from paths import ROOT

from embshard.tools import export as export_cmd
from embshard.tools import predict as predict_cmd


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from embshard import simple_plan
    from embshard.checkpoint import Checkpointer, TrainState
    from embshard.config import load_config
    from embshard.data import build_source
    from embshard.models.build import RecModel
    from embshard.training.train import make_dense_optimizer

    root = tmp_path_factory.mktemp("predict")
    cfg = load_config(
        str(ROOT / "configs/dlrm_criteo.yaml"), ["planner={}", f"data.criteo.path={ROOT}/data/criteo_sample.txt"]
    )
    tables = list(cfg.model.tables)
    source = build_source(cfg.data, tables, 16, 0, 0, 1)
    model = RecModel(
        cfg.model, source.num_dense, simple_plan(tables, 1, 1), cfg.sparse_optimizer, torch.device("cpu"), 1
    )
    opt = make_dense_optimizer(cfg.dense_optimizer, model.dense_parameters())
    batches = source.train_batches(0)
    for _ in range(3):
        out = model.step(next(batches))
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
    ckpt = Checkpointer(TrainState.of_model(model, opt), str(root / "ck"), async_save=False, config=cfg)
    ckpt.save(3)
    ckpt.close()
    return root, model, cfg


def test_export_and_predict_end_to_end(checkpoint, capsys):
    from embshard.serving.batch_scoring import source_batches

    root, model, cfg = checkpoint
    export_cmd.main(["serving", str(root / "ck"), "--out", str(root / "art"), "--dtype", "fp32"])
    assert "26 tables" in capsys.readouterr().out
    import dataclasses
    import json

    import pyarrow as pa
    import pyarrow.csv as pacsv
    import yaml

    from embshard.data import table_config

    sample = ROOT / "data/criteo_sample.txt"  # CSV with a header, as the criteo preset reads it
    names = sample.read_text().splitlines()[0].split(",")
    types = {n: pa.string() if n.startswith("C") else pa.float64() for n in names}
    pq.write_table(pacsv.read_csv(sample, convert_options=pacsv.ConvertOptions(column_types=types)), root / "s.parquet")
    table = json.loads(json.dumps(dataclasses.asdict(table_config(cfg.data, cfg.model.tables))))
    table.update(files=[str(root / "s.parquet")], format="parquet")
    (root / "parquet.yaml").write_text(yaml.safe_dump({"data": {"source": "table", "table": table}}))
    scores = {}
    for name, data in (("csv", sample), ("parquet", root / "parquet.yaml")):
        out = root / f"{name}.parquet"
        predict_cmd.main([str(root / "art"), str(data), "--out", str(out), "--batch-size", "64", "--no-progress"])
        printed = capsys.readouterr().out
        assert "scored 200 samples" in printed and "samples/s" in printed and "AUC" in printed, printed
        table = pq.read_table(out).to_pydict()
        assert table["row"] == list(range(200))
        scores[name] = torch.tensor(table["score"])
    torch.testing.assert_close(scores["parquet"], scores["csv"], rtol=0, atol=0)
    with torch.no_grad():  # the trained model's own scores of the same rows
        batches = source_batches(cfg.data, [str(sample)], list(cfg.model.tables), 64, "all")
        expected = torch.cat([torch.sigmoid(model.step(b).scores) for b in batches])
    torch.testing.assert_close(scores["csv"], expected, rtol=1e-5, atol=1e-6)
    predict_cmd.main([str(root / "art"), str(sample), "--out", str(root / "h.parquet"), "--split", "held_out",
                      "--no-progress"])  # fmt: skip
    assert "scored 40 samples" in capsys.readouterr().out


def test_auto_dtype_and_errors(checkpoint, capsys):
    root, _, _ = checkpoint
    # 26 tables of 1000 x 16: 1.6 MiB fp32, 0.5 MiB int8: 0.4 MiB fits only with some tables in int4
    export_cmd.main(["serving", str(root / "ck"), "--out", str(root / "auto"), "--dtype", "auto", "--memory-gib",
                     str(0.4 / 1024)])  # fmt: skip
    out = capsys.readouterr().out
    assert out.count("dtype auto: t_C") == 26 and "to fit the budget" in out and "int4" in out, out
    with pytest.raises(SystemExit) as e:
        export_cmd.main(["serving", str(root / "ck"), "--out", str(root / "x"), "--dtype", "auto", "--memory-gib",
                         "0.0000001"])  # fmt: skip
    assert e.value.code == 2 and "even all in int4" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        predict_cmd.main([str(root / "nothing"), "x.csv", "--out", str(root / "y.parquet")])
    assert e.value.code == 2 and "is not a folder" in capsys.readouterr().err
