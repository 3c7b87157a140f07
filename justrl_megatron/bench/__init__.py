"""Benchmarks behind `justrl-bench --phase ...` (train: `bench.train.bench_train`)."""
