"""specserve kernels package."""
