"""Benchmarks behind ``dynamo-kvtc bench``: ``codec`` (per-stage throughput), ``tiers`` (offload/onboard),
``gpu`` (fused GPU path vs raw restore and recompute; its random decoder and CPU stand-in for ``torch.cuda`` are in
``gpu_model``), ``transfer`` (prefill->decode hand-off over NIXL in two processes), ``shapes`` (KV shapes of real
models), ``output`` (machine description, JSON). Importing this package imports nothing.
"""
