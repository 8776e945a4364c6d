"""Trace-driven performance model of an expert-streaming box (the QuietBox 2 reference and what-ifs on it)."""
