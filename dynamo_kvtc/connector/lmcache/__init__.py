"""The ``kvtc`` serde for LMCache's L2 adapters (:mod:`.serde`); :mod:`.server` starts LMCache's server with it.

Importing this package does not import LMCache.
"""
