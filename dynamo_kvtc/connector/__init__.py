"""Serving integration: Dynamo KV-router events and Prometheus metrics for the compressed tiers.

(The vLLM ``KvtcConnector`` itself lands here too; see the connector issue.)
"""

from .events import RouterEvents
from .metrics import KvtcMetrics

__all__ = ["KvtcMetrics", "RouterEvents"]
