"""`cacheblend-rag bench`: TTFT, quality and agreement of every method on MuSiQue-style data.

Modules in reading (and import) order: `datasets` (questions and their passages) → `metrics` (F1, ROUGE-L,
KL, percentiles) → `methods` (what to run) → the runners (`chains`, `engine_bench`, `breakdown`, `load`,
`loading_bench`) → `report` (tables, plots, files) → `command` (the command line; nothing imports it but
`cacheblend_rag.cli`).
"""
