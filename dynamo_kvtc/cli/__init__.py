"""Command-line interface: ``dynamo-kvtc demo | calibrate | bench codec | inspect``."""
