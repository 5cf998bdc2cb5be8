"""Command-line interface ``dynamo-kvtc``: argument parsing and a dispatch table (``main.COMMANDS``), one module per
command with ``HELP``, ``add_arguments(parser)`` and ``run(args)``. The work lives in the packages the ``run``
functions import when they run (``demo``, ``calibration.build``, ``bench``, ``reliability``, ``evaluation.sweep``).
"""
