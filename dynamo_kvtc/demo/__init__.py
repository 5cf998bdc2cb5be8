"""The demos: ``serving`` (``dynamo-kvtc demo``: a real vLLM engine with ``KvtcConnector``, multi-turn chat restoring
history from the compressed tier), ``engine`` (that engine and its conversation runner, also used by the real-engine
tests) and ``codec`` (``dynamo-kvtc codec-demo``: calibrate -> encode -> decode, no engine). Importing this package
imports nothing.
"""
