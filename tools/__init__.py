"""Measurement and one-off tools, apart from the runtime: python -m tools.report."""
