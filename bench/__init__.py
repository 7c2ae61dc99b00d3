"""tidal benchmarks: each prints a table and writes JSON to bench/results/ (not tests)."""
