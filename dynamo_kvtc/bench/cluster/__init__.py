"""``bench cluster``: a trace-driven simulation of N workers behind a router, comparing per-node raw and kvtc tiers
with a cluster-wide raw or kvtc pool at equal memory. Costs come from measured JSON files (:mod:`.costs`)."""
