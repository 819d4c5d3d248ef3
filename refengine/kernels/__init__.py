"""Tree kernels: torch references (the CPU path) and Triton kernels checked against them."""
