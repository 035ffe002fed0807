"""Optional GPU kernels, apart from the glue that decides when they run. Each module loads its
native part lazily and says through ``is_available()`` whether it can; callers keep a PyTorch
form for everywhere else."""
