"""``specgate bench``: throughput of backends side by side (a measurement, not a check)."""
