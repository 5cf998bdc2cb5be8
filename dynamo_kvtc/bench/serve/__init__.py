"""``dynamo-kvtc bench serve``: a trace-driven multi-turn serving benchmark (workloads, systems, the engine loop).

Modules: :mod:`.workloads` (the traces, JSONL), :mod:`.systems` (no offload, raw tier, kvtc tiers, ratio policy at a
host budget), :mod:`.engine` (the continuous-batching loop and its metrics), :mod:`.run` (sweeps, JSON, plot)."""
