"""The conformance checks `specgate certify` runs (collected by the specgate pytest plugin)."""
