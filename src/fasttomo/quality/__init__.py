"""Metrics, scores, plots and the report: how good a volume is, with or without a truth."""
