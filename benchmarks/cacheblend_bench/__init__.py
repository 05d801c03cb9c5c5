"""The benchmarks of cacheblend-rag (`cacheblend-rag bench`, `cacheblend-bench`): TTFT, quality and agreement of
every method on MuSiQue-style data.

Modules in reading (and import) order: `datasets` (questions and their passages) → `metrics` (F1, ROUGE-L,
KL, percentiles) → `methods` (what to run) → the runners (`chains`, `engine_bench`, `breakdown`, `load`,
`loading_bench`) → `report` (tables, plots, files) → `command` (the bench's options) → `cli` (the
registrars the core CLI finds by entry point, and `cacheblend-bench`). Test support the bench shares with
the tests: `replicas` (server and Redis processes), `faults`. The core package never imports this one.
"""
