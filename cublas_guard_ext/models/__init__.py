"""Whole models: guarded layers swapped in and back (swap.py: replace_linear, restore_linear),
what a model leaves unguarded (coverage), and transformers' mixtures of experts through the
guarded grouped GEMM (experts.py: the "cublas_guard" experts implementation)."""
