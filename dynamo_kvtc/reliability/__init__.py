"""Reliability: the fault-injection harness behind ``dynamo-kvtc bench chaos`` (docs/reliability.md).

Modules: ``ledger`` (the counts), ``world`` (synthetic model, stores, reference KV), one module per fault family
(``disk_faults``, ``memory_faults``, ``process``, ``nixl_faults``, ``transfer_faults``, ``calibration_faults``,
``soak``) and ``runner`` (the plan and the command). Nothing here is imported by the serving path; importing this
package imports nothing (``ledger`` is torch-free, so the command line can list the fault kinds cheaply).
"""
