"""qvl's benchmarks: plain modules run from the repository root as ``python -m bench.<module>``.

``harness`` holds what every benchmark shares (device and peaks, timing, counting, reports);
``workloads`` the Qwen3-VL shapes; one ``bench_<kernel>`` module per kernel family compares qvl's op
with what a user would pick instead, and ``bench_tower`` the whole tower with transformers'.
``python -m bench`` (``run_all``) runs them all in one call. ``microbench.py`` exposes the kernel
cases to pytest-benchmark.
"""
