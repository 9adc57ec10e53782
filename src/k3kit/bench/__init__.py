"""`k3kit bench`: measure what a model actually does on this machine, in llama-bench's terms.

config (flags and `--sweep` -> configurations), workloads (prompts), runner (k3kit rows),
llama_cpp (the peer's AR rows), concurrency (`k3kit serve` under N clients, HTTP only),
profile (`--profile-experts`), report (results.json, report.md, md/json/jsonl/csv, PNG plots).
"""
