"""The suites of `python -m bench.run`: a registry of named suites, each one's commands and summary in a module of
this package (checks, training, embedding, sequence, serving, rawids, single, exchange), and the suites table of bench/README.md
generated from it (`python -m bench.suites --update bench/README.md`; tests/test_bench.py checks it is current)."""

from __future__ import annotations

from pathlib import Path

from bench.suites import checks, embedding, exchange, rawids, sequence, serving, single, training
from bench.suites.common import Machine, Step, Suite

__all__ = ["SUITES", "Machine", "Step", "Suite", "readme_table", "replace_table"]

SUITES: dict[str, Suite] = {
    s.name: s
    for s in [
        Suite(
            "tests",
            "the test suite on the GPUs (NCCL, `EMBSHARD_TEST_DEVICE=cuda`); junit XML, the 30 slowest tests, "
            "every phase over 0.5 s in test_times.txt as it ends (kept when the time limit stops the run); a "
            "per-test limit when pytest-timeout is installed; a failed test's text in test_times.txt.failures as "
            "it happens (printed into the log at the end, also when the time limit stopped the run); tests spread"
            " over 8 pytest-xdist workers (`--dist loadgroup`: a module that defines a module-scoped fixture runs"
            " on one worker, the longest work first by tests/durations_gpu.txt: tests/conftest.py) on a GPU host "
            "of 16+ CPUs where xdist is installed (`--test-workers N`, 0: none)",
            "python -m bench.run tests --out DIR",
            "2",
            "4-5 min (2 x H100: 238 s over 8 workers)",
            checks.tests_steps,
            checks.tests_summary,
        ),
        Suite(
            "fuzz",
            "the parity fuzzer (tests/test_fuzz.py): 300 random cases on 2 GPUs, 100 on 1, then the fuzz regressions",
            "python -m bench.run fuzz --out DIR [--fuzz 2:300,1:100]",
            "2",
            "4-8 min (estimate)",
            checks.fuzz_steps,
            checks.fuzz_summary,
        ),
        Suite(
            "e2e",
            "MLPerf DLRM-DCNv2 training (configs/dlrm_dcnv2_mlperf.yaml, bench/train_e2e.py) against TorchRec's "
            "TrainPipelineSparseDist (bench/baselines/torchrec_dlrm_train.py): 3 interleaved rounds of fp32 and "
            "bf16: in bf16 embshard's defaults with `--precision bf16` alone (its fastest mode: the whole-step "
            "CUDA graph, bf16 pooled outputs, the compiled dense part; `--cuda-graph also` adds a run with the "
            "explicit flags and makes the plain run the eager step) against TorchRec's plain `--precision bf16` and against "
            "TorchRec at its best (`--precision bf16 --qcomm bf16 --emb-output bf16 --compile-dense`, "
            "`--no-torchrec-best`: without it), one ratio each; median ratio and spread, floor; `--data-law "
            "zipf-poisson` has both draw Zipf(1.05) ids and 1 + Poisson(size - 1) ids per bag instead of MLPerf's"
            " uniform ids and fixed sizes",
            "python -m bench.run e2e --out DIR [--pairs 3 --nproc 2 --scale F]",
            "2",
            "7 min",
            training.e2e_steps,
            training.compare_summary,
        ),
        Suite(
            "emb",
            "the embedding step alone: bench/embshard_dmp.py (automatic plan) against "
            "bench/baselines/torchrec_dmp.py on uniform26, overflow (16 GiB budget), hetero124 (TorchRec: "
            "`--hbm-gib <card> --force small-dp`), interleaved pairs, predicted beside measured, floor",
            "python -m bench.run emb --out DIR [--pairs 2 --workloads ...]",
            "2",
            "9.5 min (the limit may cut the last pair)",
            embedding.emb_steps,
            training.compare_summary,
        ),
        Suite(
            "seq",
            "sequence embeddings (one row per id): bench/embshard_ec.py (ShardedEmbeddingCollection, automatic "
            "plan) against bench/baselines/torchrec_ec.py (TorchRec's EmbeddingCollection under DMP) on seq4 "
            "(20M/5M/100k/1000 rows x 128, histories 1 + Poisson(99) capped at 512, batch 1024 per rank), uniform "
            "and Zipf ids, dedup off and on for both (each framework's best of the two compared), interleaved "
            "rounds; embshard's physical floor per run",
            "python -m bench.run seq --out DIR --nproc 1 [--pairs 2 --suite-minutes 20]",
            "1-2",
            "8 runs a round; 10-20 min for 2 rounds (estimate)",
            sequence.seq_steps,
            sequence.seq_summary,
        ),
        Suite(
            "serve",
            "serving: embshard's Predictor (FBGEMM's inference TBE, bench/serve_latency.py) against TorchRec's "
            "quantized EmbeddingBagCollection on the same int8 rows and dense model (26 tables x 20,000 x 64): the"
            " scores compared first (PASS/FAIL; on CUDA also against the CPU's, the CUDA-graph path against the "
            "eager one at padded and exact batch sizes, the host syncs of a call counted, and, with 2+ GPUs, the "
            "tables over every GPU against one), then p50/p99 latency at batch 1, 64, 512 and throughput at 8192, "
            "interleaved on the same batches (on CUDA the eager path and the fp16 dense part as extra sides); then "
            "bench/serve_quality.py: held-out AUC and table bytes of fp32, fp16, int8 and int4 exports of a trained "
            "DLRM, and of the int8 one with an fp16 and a bf16 dense part. `--device cpu|cuda` (default: cuda where "
            "there is a GPU)",
            "python -m bench.run serve --out DIR [--device cuda]",
            "0-1",
            "2-4 min (estimate)",
            serving.serve_steps,
            serving.serve_summary,
        ),
        Suite(
            "soak",
            "5,000 steps of uniform26: GPU memory allocated after step 100 and after step 5,000 (no growth)",
            "python -m bench.run soak --out DIR",
            "2",
            "1 min",
            embedding.soak_steps,
            embedding.soak_summary,
        ),
        Suite(
            "retrieval",
            "the full softmax over 1M x 64 items row-sharded on 2 GPUs (bench/full_softmax.py): peak memory "
            "against the materialized logits, parity",
            "python -m bench.run retrieval --out DIR",
            "2",
            "0.5 min",
            single.retrieval_steps,
            single.retrieval_summary,
        ),
        Suite(
            "ckpt",
            "checkpoint save (sync, async), verify and reload of hetero124 at 1/10 of its rows on 2 ranks "
            "(bench/checkpoint_bench.py), then tests/checkpoint on the GPUs",
            "python -m bench.run ckpt --out DIR [--ckpt-scale 0.1]",
            "2",
            "3.5 min",
            single.ckpt_steps,
            single.ckpt_summary,
        ),
        Suite(
            "loader",
            "the Parquet loader (bench/loader.py) with 0, 8, 16, 32 worker processes (up to the host's cores) "
            "beside TorchRec's in-memory Criteo reader",
            "python -m bench.run loader --out DIR",
            "0",
            "5 min",
            single.loader_steps,
            single.loader_summary,
        ),
        Suite(
            "kernels",
            "embshard's Triton kernels against FBGEMM: parity check, timings, fused cross-entropy "
            "(bench/kernels.py, bench/cross_entropy.py)",
            "python -m bench.run kernels --out DIR",
            "1",
            "5 min (estimate)",
            single.kernels_steps,
            single.kernels_summary,
        ),
        Suite(
            "tiers",
            "step time per memory tier (hbm, uvm, uvm_caching) and UVM-cache hit rates (bench/tiers.py)",
            "python -m bench.run tiers --out DIR",
            "1",
            "2-3 min (estimate)",
            single.tiers_steps,
            single.tiers_summary,
        ),
        Suite(
            "profile",
            "torch.profiler of one step of each framework per workload (bench/profile_step.py): top kernels, host"
            " syncs",
            "python -m bench.run profile --out DIR",
            "2",
            "3-4 min (estimate)",
            embedding.profile_steps,
            embedding.profile_summary,
        ),
        Suite(
            "interop",
            "embshard.interop (docs/torchrec.md): tests/interop under the machine's torchrec; TorchRec's runtime "
            "on its own plan against TorchRec's runtime on embshard's plan (`bench/torchrec_embshard_plan.py`, "
            "hetero124 and overflow, interleaved pairs); with `--interop-examples` also examples/torchrec's three"
            " migration steps on 2 GPUs; `--interop-no-tests` skips tests/interop (the tests suite runs it), "
            "`--numa-bind` runs every rank on its GPU's NUMA node's CPUs (each run prints the ranks' placement)",
            "python -m bench.run interop --out DIR",
            "2",
            "11-12 min for 3 pairs (2 x H100: hetero124 72-106 s a run, overflow 32-45 s)",
            exchange.interop_steps,
            exchange.interop_summary,
        ),
        Suite(
            "rawids",
            "raw-id tables ([docs/raw_ids.md](../docs/raw_ids.md)): tests/rawids on the GPUs (the map's step "
            "under CUDA's sync debug mode, parity), the map's step profiled in one process "
            "(`python -m bench.raw_ids_profile --device cuda --uniform26`: kernels, launches and host syncs per phase, "
            "into rawids_profile.txt), then uniform26 with every table `ids: raw` (capacity = rows) against "
            "static, interleaved on the same batches: ids within the rows, and from 10 x rows values (evicting "
            "every step); then TorchRec's managed-collision tables (bench/torchrec_mc.py: "
            "`ManagedCollisionEmbeddingBagCollection` with an LRU `MCHManagedCollisionModule` per table, capacity"
            " = rows, row-wise under DMP) against its static tables on the same id spaces, so the summary puts "
            "TorchRec's mc/static ratio beside embshard's raw/static",
            "python -m bench.run rawids --out DIR [--nproc 1]",
            "1-2",
            "6-9 min (estimate)",
            rawids.rawids_steps,
            rawids.rawids_summary,
        ),
        Suite(
            "build",
            "building the sharded module: `python -m bench.uvm_fill` (one GPU: FBGEMM's GPU fill of a managed buffer "
            "against host threads), then hetero124's build (`-m bench.embshard_dmp --build-only`) with FBGEMM's "
            "UVM first touch and with host threads (`EMBSHARD_UVM_FIRST_TOUCH=fbgemm|host`), interleaved pairs; "
            "every rank's build time",
            "python -m bench.run build --out DIR",
            "2",
            "3-5 min (estimate)",
            embedding.build_steps,
            embedding.build_summary,
        ),
        Suite(
            "scaling",
            "weak scaling of the MLPerf model at 8192 samples per GPU: embshard at 4 and 2 GPUs and TorchRec at 4"
            " GPUs in interleaved rounds per precision, then embshard at 1 GPU on tables at half their rows (97 "
            "GiB do not fit one card); samples/s per GPU at 1, 2 and 4 GPUs, 4 GPUs against 2, and the ratio to "
            "TorchRec at 4",
            "python -m bench.run scaling --out DIR [--pairs 2 --cuda-graph also]",
            "4",
            "6-8 min (estimate; one round took 7.4 min on 4 x H100)",
            training.scaling_steps,
            training.scaling_summary,
        ),
        Suite(
            "hier",
            "table-row-wise's output exchange, hierarchical against flat, 4 GPUs as 2 hosts x 2 "
            "(bench/hier_exchange.py): bytes per step inside and between hosts beside the planner's count, "
            "exchange and step ms, the planner's predictions; then the world-4 parity tests and 40 world-4 fuzz "
            "cases on the GPUs",
            "python -m bench.run hier --out DIR",
            "4",
            "3-6 min (estimate)",
            exchange.hier_steps,
            exchange.hier_summary,
        ),
        Suite(
            "bandwidth",
            "GPU memory copy, all-to-all and host-link bandwidths (`embshard calibrate --no-kernels`; e2e and emb"
            " run it first)",
            "python -m bench.run bandwidth --out DIR",
            "1-2",
            "15 s",
            single.bandwidth_steps,
            single.bandwidth_summary,
        ),
    ]
}
BEGIN = "<!-- suites:begin (python -m bench.suites --update bench/README.md) -->"
END = "<!-- suites:end -->"


def readme_table() -> str:
    """The suites table of bench/README.md, from SUITES (in its order)."""
    lines = [
        "| suite | what it measures | command | GPUs | typical time (2 x H100) |",
        "| --- | --- | --- | ---: | ---: |",
    ]
    for s in SUITES.values():
        lines.append(f"| `{s.name}` | {s.what} | `{s.command}` | {s.gpus} | {s.typical} |")
    return "\n".join(lines)


def replace_table(text: str, where: str = "bench/README.md") -> str:
    """`text` (bench/README.md) with the region between BEGIN and END replaced by readme_table()."""
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{where} has no suites table region: add the lines {BEGIN!r} and {END!r} where it goes")
    head, rest = text.split(BEGIN, 1)
    return f"{head}{BEGIN}\n{readme_table()}\n{END}{rest.split(END, 1)[1]}"


def update_readme(path: Path) -> bool:
    """Rewrite the table in `path`; whether it changed."""
    text = path.read_text()
    new = replace_table(text, str(path))
    if new != text:
        path.write_text(new)
    return new != text
