"""What decides pass or fail: the reference oracle, expected outputs, golden traces, memory
invariants, distribution and sampling laws, statistics, the graph tier's properties and the
kernel tier's inputs."""
