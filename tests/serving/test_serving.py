"""Serving artifacts (embshard/serving): a small DLRM (shared table, mean pooling, weighted table) trained and
saved on 1 and 2 ranks, exported and served on the CPU. Parity: fp32 tables give the trained model's own eval
scores; fp16, int8 and int4 give exactly the pooled sums of FBGEMM's reference dequantization of the same rows;
the export of a 2-rank checkpoint is bitwise the export of the same model saved on 1 rank; damaged and crafted
artifacts are refused naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import serve_cases
import torch
from dist_harness import device_kind, run_distributed

from embshard.serving import artifact
from embshard.serving.export import export_serving
from embshard.serving.predictor import load
from embshard.serving.quantize import dequantize, quantize
from embshard.spec.tables import ConfigError

QUIET = {"say": lambda _s: None}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """World-1 checkpoint, its eval batches and logits, and its fp32 artifact."""
    root = tmp_path_factory.mktemp("serve")
    out = serve_cases.train_save(0, 1, torch.device("cpu"), str(root / "ck"))
    export_serving(root / "ck" / "step_3", root / "fp32", "fp32", **QUIET)
    return root, out


def reference_pooled(weights: dict[str, torch.Tensor], predictor, batch) -> torch.Tensor:
    """Pooled `[B, sum D]` of `weights` (fp32 per table) by plain indexing, features in the model's order."""
    kjt = batch.sparse
    cols = []
    for f in predictor.features:
        t = predictor.table_of[f]
        jt = kjt[f]
        w_t = weights[t.name]
        bags = []
        for b, ids in enumerate(torch.split(jt.values(), jt.lengths().tolist())):
            rows = w_t[ids.long()]
            if t.weighted:
                rows = rows * torch.split(jt.weights(), jt.lengths().tolist())[b][:, None]
            s = rows.sum(0) if len(ids) else torch.zeros(t.embedding_dim)
            bags.append(s / len(ids) if t.pooling.value == "mean" and len(ids) else s)
        cols.append(torch.stack(bags))
    return torch.cat(cols, 1)


def table_rows(folder: Path) -> dict[str, torch.Tensor]:
    man = artifact.read_manifest(folder)
    info = artifact.read_json(folder, man, artifact.MODEL)
    return {t["name"]: artifact.read_tensors(folder, man, t["file"])["rows"] for t in info["tables"]}


def test_fp32_scores_equal_the_trained_model(trained):
    root, out = trained
    predictor = load(root / "fp32")
    for batch, logits in zip(out["batches"], out["logits"]):
        torch.testing.assert_close(predictor.logits(batch), logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(predictor(batch), torch.sigmoid(logits), rtol=1e-5, atol=1e-6)


def test_quantized_tables_equal_fbgemm_reference(trained):
    root, out = trained
    fp32 = table_rows(root / "fp32")
    sizes = {}
    for dtype in ("fp16", "int8", "int4"):
        export_serving(root / "ck" / "step_3", root / dtype, dtype, **QUIET)
        stored = table_rows(root / dtype)
        for name, rows in stored.items():  # the export is FBGEMM's quantization of the trained rows
            assert torch.equal(rows, quantize(fp32[name], dtype)), (dtype, name)
        deq = {name: dequantize(rows, dtype) for name, rows in stored.items()}
        predictor = load(root / dtype)
        for batch, logits in zip(out["batches"], out["logits"]):
            torch.testing.assert_close(predictor.pooled(batch), reference_pooled(deq, predictor, batch),
                                       rtol=1e-5, atol=1e-5)  # fmt: skip
            err = (predictor(batch) - torch.sigmoid(logits)).abs().max().item()
            assert err < {"fp16": 1e-3, "int8": 1e-2, "int4": 5e-2}[dtype], (dtype, err)
        man = json.loads((root / dtype / "manifest.json").read_text())
        sizes[dtype] = sum(r["bytes"] for f, r in man["files"].items() if f.startswith("table."))
    man = json.loads((root / "fp32" / "manifest.json").read_text())
    sizes["fp32"] = sum(r["bytes"] for f, r in man["files"].items() if f.startswith("table."))
    assert 3.0 < sizes["fp32"] / sizes["int8"] < 4.0 and 5.0 < sizes["fp32"] / sizes["int4"] < 8.0, sizes


def test_world2_checkpoint_exports_as_world1(trained, tmp_path):
    results = run_distributed(serve_cases.train_save, 2, str(tmp_path / "ck2"))
    serve_cases.resave(str(tmp_path / "ck2"), str(tmp_path / "ck1"), 3)
    for dtype in ("fp32", "int4"):
        a = export_serving(tmp_path / "ck2" / "step_3", tmp_path / f"a2_{dtype}", dtype, **QUIET)
        b = export_serving(tmp_path / "ck1" / "step_3", tmp_path / f"a1_{dtype}", dtype, **QUIET)
        assert a["tables"] == b["tables"] and a["source"]["world_size"] == 2 and b["source"]["world_size"] == 1
        m2 = json.loads((tmp_path / f"a2_{dtype}" / "manifest.json").read_text())["files"]
        m1 = json.loads((tmp_path / f"a1_{dtype}" / "manifest.json").read_text())["files"]
        for name in m1:
            if name != artifact.MODEL:  # model.json names its source checkpoint
                assert m1[name] == m2[name], name  # bitwise: same bytes, same SHA-256
    predictor = load(tmp_path / "a2_fp32")
    for r in results:  # each rank's own held-out batches, scored as that rank's model scored them
        for batch, logits in zip(r["batches"], r["logits"]):
            torch.testing.assert_close(predictor.logits(batch), logits, rtol=1e-5, atol=1e-5)


def _rewrite(folder: Path, name: str, data: bytes) -> None:
    """Replace a file and fix its manifest record (a crafted artifact: checksums alone do not catch it)."""
    import hashlib

    (folder / name).write_bytes(data)
    man = json.loads((folder / "manifest.json").read_text())
    man["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(man))


def test_bad_artifacts_are_refused_naming_the_file(trained, tmp_path):
    import shutil

    root, out = trained

    def copy(tag: str) -> Path:
        dst = tmp_path / tag
        shutil.copytree(root / "fp32", dst)
        return dst

    d = copy("flipped")
    data = bytearray((d / "table.t_user.safetensors").read_bytes())
    data[-3] ^= 1
    (d / "table.t_user.safetensors").write_bytes(bytes(data))
    with pytest.raises(artifact.ArtifactDamaged, match=r"table\.t_user\.safetensors: SHA-256"):
        load(d)
    d = copy("missing")
    (d / "dense.safetensors").unlink()
    with pytest.raises(artifact.ArtifactDamaged, match="dense.safetensors: no such file"):
        load(d)
    d = copy("shape")
    from safetensors.torch import save

    _rewrite(d, "table.t_item.safetensors", save({"rows": torch.zeros(7, 16)}))
    with pytest.raises(artifact.ArtifactDamaged, match=r"t_item.*shape \[7, 16\], expected \[200"):
        load(d)
    d = copy("dense_shape")
    _rewrite(d, "dense.safetensors", save({"bottom.0.weight": torch.zeros(3, 3)}))
    with pytest.raises(artifact.ArtifactDamaged, match="dense.safetensors: tensor"):
        load(d)
    for bad in ("../outside", "/etc/passwd", "sub/x"):
        d = copy(f"path{len(bad)}")
        man = json.loads((d / "manifest.json").read_text())
        man["files"][bad] = {"bytes": 1, "sha256": "0" * 64}
        (d / "manifest.json").write_text(json.dumps(man))
        with pytest.raises(artifact.ArtifactDamaged, match="not a plain file name"):
            load(d)
    d = copy("dtype")
    info = json.loads((d / "model.json").read_text())
    info["tables"][0]["dtype"] = "int2"
    _rewrite(d, "model.json", json.dumps(info).encode())
    with pytest.raises(artifact.ArtifactDamaged, match="table type 'int2'"):
        load(d)
    d = copy("pickle")  # a pickle in place of safetensors is never unpickled
    _rewrite(d, "dense.safetensors", b"\x80\x04\x95" + b"cos\nsystem\n" + b"\x00" * 16)
    with pytest.raises(artifact.ArtifactDamaged, match="not a readable safetensors file"):
        load(d)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            load(root / "fp32", device="cuda")


def test_batches_checked_before_scoring(trained):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from embshard.data.common import Batch

    root, out = trained
    predictor = load(root / "fp32")
    batch = out["batches"][0]
    kjt = batch.sparse
    keys = kjt.keys()
    shuffled = kjt.permute(list(reversed(range(len(keys)))))  # feature order does not matter
    torch.testing.assert_close(predictor(Batch(batch.dense, shuffled, batch.labels)), predictor(batch))
    without = kjt.permute(list(range(1, len(keys))))
    with pytest.raises(ConfigError, match=rf"lacks the features \['{keys[0]}'\]"):
        predictor(Batch(batch.dense, without, batch.labels))
    with pytest.raises(ConfigError, match="dense features of shape"):
        predictor(Batch(batch.dense[:, :3], kjt, batch.labels))
    values = kjt.values().clone()
    values[0] = 10**6  # the first id: feature 'user' (t_user, 300 rows)
    bad = KeyedJaggedTensor(keys, values, kjt.weights_or_none(), lengths=kjt.lengths(), stride=kjt.stride())
    with pytest.raises(ValueError, match=r"feature 'user': id 1000000 is outside table 't_user'"):
        predictor(Batch(batch.dense, bad, batch.labels))
    dropping = load(root / "fp32", bounds_check="drop")
    with pytest.warns(RuntimeWarning, match="dropped 1 id"):
        scores = dropping(Batch(batch.dense, bad, batch.labels))
    assert dropping.dropped == {"user": 1} and scores.shape == (batch.size,)


def test_load_imports_no_training_code():
    """What `load` and scoring import (read from the sources, as tests/test_imports.py does: every module-level
    import, and the imports inside the functions of the load path's own modules) holds no optimizer update,
    sharding, lookup, training, retrieval, checkpoint or export module."""
    import test_imports

    from embshard.serving.model import KIND_MODULES

    load_path = {"embshard.serving.predictor", "embshard.serving.lookup", "embshard.serving.model"}
    edges: dict[str, set[str]] = {}
    for i in test_imports.all_imports():
        if not i.type_only and (not i.lazy or i.source in load_path):
            edges.setdefault(i.source, set()).update(
                ".".join(i.target.split(".")[:k]) for k in range(1, i.target.count(".") + 2)
            )
    seen, todo = set(), ["embshard.serving", *load_path, *KIND_MODULES.values()]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(edges.get(m, ()))
    banned = ("embshard.lookup", "embshard.sharding", "embshard.training", "embshard.retrieval", "embshard.checkpoint",
              "embshard.serving.export", "embshard.serving.choose", "embshard.collection.sharded")  # fmt: skip
    assert "embshard.collection.bounds" in seen and "embshard.models.dlrm" in seen  # the walk reaches them
    assert not sorted(m for m in seen if m.startswith(banned))


@pytest.mark.skipif(device_kind() != "cuda", reason="CUDA: EMBSHARD_TEST_DEVICE=cuda")
def test_cuda_scores_equal_cpu(trained):
    """The same artifacts served on the GPU (FBGEMM's CUDA inference TBE) give the CPU's scores."""
    root, out = trained
    for dtype in ("fp32", "fp16", "int8", "int4"):
        if not (root / dtype).exists():
            export_serving(root / "ck" / "step_3", root / dtype, dtype, **QUIET)
        cpu, gpus = load(root / dtype), [load(root / dtype, device="cuda")]
        if torch.cuda.device_count() >= 2:  # the tables over 2 GPUs, the biggest by rows
            gpus.append(load(root / dtype, "cuda:0", shard_over=["cuda:0", "cuda:1"], row_wise_gib=2000 / (1 << 30)))
        # fp32 alike to rounding; the quantized types' CUDA kernels dequantize and sum in their own order (fp16
        # scale and bias): pooled rows agree to 1e-3 (seen on 1 x H100: 1.8e-4 at most)
        tol = 1e-4 if dtype == "fp32" else 1e-3
        for gpu in gpus:
            for batch in out["batches"]:
                torch.testing.assert_close(gpu.pooled(batch).cpu(), cpu.pooled(batch), rtol=tol, atol=tol)
                torch.testing.assert_close(gpu(batch).cpu(), cpu(batch), rtol=tol, atol=tol / 10)


def _json_of(batch, lo: int, hi: int, weighted: tuple = ("query",)) -> dict:
    """The request body of samples lo..hi of a Batch (per-id weights of the weighted features)."""
    kjt = batch.sparse
    body = {"dense": batch.dense[lo:hi].tolist(), "sparse": {}, "weights": {}}
    for f in kjt.keys():
        jt = kjt[f]
        ids = torch.split(jt.values(), jt.lengths().tolist())
        body["sparse"][f] = [x.tolist() for x in ids[lo:hi]]
        if f in weighted:
            body["weights"][f] = [x.tolist() for x in torch.split(jt.weights(), jt.lengths().tolist())[lo:hi]]
    return body


def test_http_server_micro_batches_and_answers_errors(trained):
    """`embshard serve`'s server: concurrent requests (scored together when they arrive together) get their own
    rows' scores; a malformed request or an id outside its table gets 400 naming the problem."""
    import threading
    import urllib.error
    import urllib.request

    from embshard.serving.http import Server

    root, out = trained
    predictor = load(root / "fp32")
    server = Server(predictor, port=0, max_wait_ms=50.0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.port}"

    def post(body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(f"{url}/predict", json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    try:
        batch = out["batches"][0]
        expected = predictor(batch)
        cuts = [(0, 1), (1, 9), (9, 32)]
        got: dict = {}
        threads = [threading.Thread(target=lambda c=c: got.__setitem__(c, post(_json_of(batch, *c)))) for c in cuts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for lo, hi in cuts:
            status, body = got[(lo, hi)]
            assert status == 200, body
            torch.testing.assert_close(torch.tensor(body["scores"]), expected[lo:hi], rtol=1e-5, atol=1e-6)
        assert server.batches_scored < len(cuts)  # some were scored together
        with urllib.request.urlopen(f"{url}/health", timeout=30) as r:
            health = json.loads(r.read())
        assert health["ok"] and health["features"] == predictor.features and health["num_dense"] == 13
        assert health["scoring"] == predictor.describe() and "eager (cpu device" in health["scoring"]
        body = _json_of(batch, 0, 2)
        del body["sparse"]["user"]
        status, answer = post(body)
        assert status == 400 and "missing features ['user']" in answer["error"]
        body = _json_of(batch, 0, 2)
        body["sparse"]["device"][0] = [999]
        status, answer = post(body)
        assert status == 400 and "id 999 is outside table 't_device'" in answer["error"], answer
    finally:
        server.shutdown()


def test_tables_sharded_over_devices_score_as_one(trained):
    """Tables spread over 3 devices of one process (here 3 CPU devices: the same code as over GPUs), whole
    (table-wise) or the big ones split by rows (row-wise), give the one-device pooled embeddings and scores."""
    root, out = trained
    # row-wise over these bytes: fp32 rows are 64 bytes (t_user 19200, t_item 12800, t_history 9600, t_query
    # 6400), int4 rows 12 (t_user 3600, t_item 2400, t_history 1800)
    big = {"fp32": (8000, {"t_user", "t_item", "t_history"}), "int4": (2000, {"t_user", "t_item"})}
    for dtype, (limit, expected) in big.items():
        if not (root / dtype).exists():
            export_serving(root / "ck" / "step_3", root / dtype, dtype, **QUIET)
        one = load(root / dtype)
        for row_wise_gib in (None, limit / (1 << 30)):
            sharded = load(root / dtype, shard_over=["cpu"] * 3, row_wise_gib=row_wise_gib)
            rows = {t.name: t.num_embeddings for t in sharded.tables}
            split = {b.table for b in sharded.lookup.blocks if b.r1 - b.r0 < rows[b.table]}
            assert len({b.device for b in sharded.lookup.blocks}) == 3
            assert split == (set() if row_wise_gib is None else expected), split
            for batch in out["batches"]:
                torch.testing.assert_close(sharded.pooled(batch), one.pooled(batch), rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(sharded(batch), one(batch), rtol=1e-5, atol=1e-6)


def test_dcn_scores_equal_the_trained_model(tmp_path):
    """model.kind dlrm_dcnv2 (the pooled embeddings side by side into the cross network) served in fp32 and int8."""
    out = serve_cases.train_save(0, 1, torch.device("cpu"), str(tmp_path / "ck"), 1, ["model.kind=dlrm_dcnv2"])
    for dtype, tol in (("fp32", 1e-5), ("int8", 1e-2)):
        export_serving(tmp_path / "ck" / "step_1", tmp_path / dtype, dtype, **QUIET)
        predictor = load(tmp_path / dtype)
        assert predictor.kind == "dlrm_dcnv2"
        for batch, logits in zip(out["batches"], out["logits"]):
            torch.testing.assert_close(predictor(batch), torch.sigmoid(logits), rtol=tol, atol=tol)


def _random_batch(predictor, B: int, gen: torch.Generator, empty: float = 0.3):
    """A fresh batch of B samples for the predictor's features: 0..6 ids a bag (some bags empty), per-id weights."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from embshard.data.common import Batch

    F = len(predictor.features)
    lengths_FB = torch.randint(1, 7, (F, B), generator=gen) * (torch.rand(F, B, generator=gen) > empty)
    values = torch.cat([torch.randint(0, predictor.table_of[f].num_embeddings, (int(n),), generator=gen)
                        for f, n in zip(predictor.features, lengths_FB.sum(1))])  # fmt: skip
    weights = torch.rand(values.numel(), generator=gen)
    kjt = KeyedJaggedTensor(predictor.features, values, weights, lengths=lengths_FB.flatten(), stride=B)
    return Batch(torch.randn(B, predictor.num_dense, generator=gen), kjt, torch.zeros(B))


def test_padded_buckets_score_as_the_eager_path(trained):
    """The CUDA-graph path's device-independent part on the CPU: batches padded with empty bags to their bucket of
    batch size and id count (graphed.py, the capture off) score as the eager path, whatever an earlier batch left in
    the buffers; the graph body counts the ids outside their tables; batches the graphs do not take fall back."""
    from embshard.serving.graphed import GraphedScorer, batch_bucket, id_bucket

    assert [batch_bucket(b) for b in (0, 1, 2, 3, 5, 64, 65)] == [1, 1, 2, 4, 8, 64, 128]
    assert [id_bucket(v, 4, 6) for v in (0, 24, 25, 48, 49, 200)] == [24, 24, 48, 48, 96, 384]
    root, _ = trained
    gen = torch.Generator().manual_seed(7)
    for dtype in ("fp32", "int8"):
        if not (root / dtype).exists():
            export_serving(root / "ck" / "step_3", root / dtype, dtype, **QUIET)
        predictor = load(root / dtype)
        assert predictor.graphs is None and "eager (cpu device" in predictor.describe()
        F = len(predictor.features)
        scorer = GraphedScorer(predictor.padded_logits, F, predictor.num_dense, True, torch.device("cpu"),
                               max_batch=32, max_graphs=12, capture=False)  # fmt: skip
        for B in (32, 3, 1, 17, 5, 32):  # big batches first: the small ones' buffers hold stale ids and rows
            batch = _random_batch(predictor, B, gen)
            kjt = batch.sparse
            lengths_FB = kjt.lengths().view(F, B)
            got, bad = scorer.run(lengths_FB, kjt.values(), kjt.weights(), batch.dense, torch.sigmoid, True)
            assert bad == 0 and got.shape == (B,)
            torch.testing.assert_close(got, predictor(batch), rtol=1e-5, atol=1e-6)
            logits, _ = scorer.run(lengths_FB, kjt.values(), None, batch.dense)  # no weights: every weight 1
            plain = type(kjt)(kjt.keys(), kjt.values(), None, lengths=kjt.lengths(), stride=B)
            torch.testing.assert_close(logits, predictor.logits(type(batch)(batch.dense, plain, batch.labels)),
                                       rtol=1e-5, atol=1e-5)  # fmt: skip
        assert {b for b, _ in scorer.buckets} == {32, 4, 1, 8}, scorer.buckets
        assert all(v % (b * F) == 0 and (v // (b * F)).bit_count() == 1 for b, v in scorer.buckets), scorer.buckets
        values = kjt.values().clone()
        values[:3] = torch.tensor([-1, 10**6, predictor.table_of[predictor.features[0]].num_embeddings])
        _, bad = scorer.run(lengths_FB, values, None, batch.dense, count_bad=True)
        assert bad == min(3, int(lengths_FB[0].sum())), bad
        assert scorer.run(torch.zeros(F, 33, dtype=torch.int64), values[:0], None, torch.zeros(33, 13)) is None
        assert "33 samples" in scorer.last_fallback
    one = GraphedScorer(predictor.padded_logits, F, 13, False, torch.device("cpu"), max_graphs=1, capture=False)
    assert one.run(torch.ones(F, 1, dtype=torch.int64), torch.zeros(F, dtype=torch.int64), None, torch.zeros(1, 13))
    assert one.run(torch.zeros(F, 2, dtype=torch.int64), values[:0], None, torch.zeros(2, 13)) is None
    assert "max_graphs" in one.last_fallback and "1 of at most 1" in one.describe()
    with pytest.raises(ConfigError, match="cuda_graphs=True: CUDA graphs need a CUDA device"):
        load(root / "fp32", cuda_graphs=True)


def test_dense_part_in_half_types(trained):
    """dense_dtype fp16 / bf16: the pooled embeddings and the dense part in that type, the scores fp32 and near
    the fp32 model's."""
    root, out = trained
    full = load(root / "fp32")
    for dtype, torch_dtype, tol in (("fp16", torch.float16, 2e-3), ("bf16", torch.bfloat16, 2e-2)):
        half = load(root / "fp32", dense_dtype=dtype)
        assert f"dense part in {str(torch_dtype).removeprefix('torch.')}" in half.describe()
        for batch in out["batches"]:
            assert half.pooled(batch).dtype == torch_dtype
            scores = half(batch)
            assert scores.dtype == torch.float32
            torch.testing.assert_close(scores, full(batch), rtol=tol, atol=tol)
    with pytest.raises(ConfigError, match="dense_dtype='fp8': give one of fp32, fp16, bf16"):
        load(root / "fp32", dense_dtype="fp8")
    with pytest.raises(ConfigError, match="compile_dense='reduce-overhead': give one of default, max-autotune-no"):
        load(root / "fp32", compile_dense="reduce-overhead")  # it makes CUDA graphs of its own


@pytest.mark.skipif(device_kind() != "cuda", reason="CUDA: EMBSHARD_TEST_DEVICE=cuda")
def test_cuda_graphs_score_as_eager(trained):
    """On the GPU, scores through the CUDA graphs equal the eager path's, with the ids on the host or on the GPU;
    a call with host ids makes no host sync once its bucket is captured; an id outside its table still gets the
    bounds policy's error."""
    root, _ = trained
    gen = torch.Generator().manual_seed(3)
    tf32 = torch.backends.cuda.matmul.allow_tf32  # a training run in this process may have turned it on
    torch.backends.cuda.matmul.allow_tf32 = False  # padded and unpadded products then agree to rounding
    try:
        _graphed_as_eager(root, gen)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _graphed_as_eager(root: Path, gen: torch.Generator) -> None:
    for dtype in ("fp32", "int8"):
        if not (root / dtype).exists():
            export_serving(root / "ck" / "step_3", root / dtype, dtype, **QUIET)
        graphed, eager = load(root / dtype, "cuda"), load(root / dtype, "cuda", cuda_graphs=False)
        assert graphed.graphs is not None and eager.graphs is None, graphed.describe()
        for B in (1, 7, 64, 300):
            batch = _random_batch(graphed, B, gen)
            for b in (batch, batch.to("cuda")):
                want = eager(b)
                torch.testing.assert_close(graphed(b), want, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(graphed.logits(b), eager.logits(b), rtol=1e-5, atol=1e-5)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                graphed(batch)  # host ids, bucket captured: pinned copies and a replay, nothing waited for
            finally:
                torch.cuda.set_sync_debug_mode(0)
        assert graphed.graphs.replays >= 12 and graphed.graphs.last_fallback is None
        kjt = batch.sparse
        values = kjt.values().clone()
        values[0] = 10**6
        bad = type(kjt)(kjt.keys(), values, kjt.weights(), lengths=kjt.lengths(), stride=kjt.stride())
        for b in (type(batch)(batch.dense, bad, batch.labels), type(batch)(batch.dense, bad, batch.labels).to("cuda")):
            with pytest.raises(ValueError, match="id 1000000 is outside table"):
                graphed(b)
