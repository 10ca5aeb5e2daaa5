"""Benchmarks and GPU checks of embshard (bench/README.md): the suites' driver (`python -m bench.run`), the
scripts it runs (each `python -m bench.NAME`, or under `torchrun ... -m bench.NAME`), the results kept in
bench/results/ and the report that turns them into docs/benchmarks.md (`python -m bench.report`)."""
