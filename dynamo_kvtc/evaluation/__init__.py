"""Offline accuracy harness (``dynamo-kvtc eval``): methods that reconstruct a KV cache, tasks that score a model
reading the reconstructed cache, and the report (JSON, Markdown table, PNG plot).

Layering: uses ``codec`` and ``calibration``; nothing in the serving path imports it.
"""
