"""Summary table of bench/device_e2e.sh's log: the RESULT lines of TorchRec's and embshard's runs.

    python bench/e2e_table.py e2e.log

Pairs are the i-th TorchRec run and the i-th embshard run tagged fp32 (interleaved A B A B ...); prints every run,
the ratio of each pair (embshard samples/s over TorchRec's), their median and spread, the bf16 runs per GPU against
the 2.0 M samples/s goal, each run's held-out AUC against the fp32 runs' median, and embshard's plan+build time.
"""

from __future__ import annotations

import statistics
import sys


def parse(path: str) -> list[dict[str, str]]:
    runs = []
    for line in open(path):
        if line.startswith("RESULT "):
            runs.append(dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv))
    return runs


def main() -> None:
    runs = parse(sys.argv[1])
    tr = [r for r in runs if r.get("framework") == "torchrec"]
    es = [r for r in runs if r.get("framework") == "embshard"]
    fp32 = [r for r in es if r.get("tag") == "fp32"]
    print(
        "| run | pipeline | precision | pooled | ms/step | samples/s | per GPU | build s | peak GiB | GPU busy | AUC |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in runs:
        world = int(r.get("world", 2))
        sps = float(r["samples_per_s"])
        print(
            f"| {r['framework']} {r.get('tag', '')} | {r.get('pipeline', '')} | {r.get('precision', r.get('dtype', ''))} "
            f"| {r.get('pooled', '')} | {float(r['ms_per_step']):.2f} | {sps:,.0f} | {sps / world:,.0f} "
            f"| {r.get('build_s', '')} | {r.get('peak_gib', '')} | {r.get('gpu_busy', '')} | {r.get('auc', '')} |"
        )
    ratios = [float(e["samples_per_s"]) / float(t["samples_per_s"]) for t, e in zip(tr, fp32)]
    if ratios:
        print(
            f"\nembshard fp32 / TorchRec TrainPipelineSparseDist (fp32), {len(ratios)} interleaved pairs: "
            f"{', '.join(f'{x:.3f}' for x in ratios)}; median {statistics.median(ratios):.3f}, spread "
            f"{min(ratios):.3f}..{max(ratios):.3f} (goal >= 1.3)"
        )
    aucs = [float(r["auc"]) for r in fp32 if r.get("auc", "nan") != "nan"]
    ref_auc = statistics.median(aucs) if aucs else float("nan")
    for r in es:
        if r.get("tag") == "fp32":
            continue
        per_gpu = float(r["samples_per_s"]) / int(r.get("world", 2))
        auc = float(r.get("auc", "nan"))
        print(
            f"embshard {r.get('tag')}: {per_gpu / 1e6:.3f} M samples/s per GPU (goal >= 2.0 for bf16), AUC {auc:.5f} "
            f"vs fp32 median {ref_auc:.5f}: diff {auc - ref_auc:+.5f} (goal |diff| <= 0.001)"
        )
    builds = [float(r["build_s"]) for r in es if "build_s" in r]
    if builds:
        print(f"embshard plan+build of the full-size model: median {statistics.median(builds):.2f} s (goal < 10 s)")


if __name__ == "__main__":
    main()
