"""The CPU backend's BLAS: OpenBLAS for MLX's sgemm and its adaptive thread count."""
