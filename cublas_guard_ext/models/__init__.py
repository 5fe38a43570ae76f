"""Whole models: guarded layers swapped in and back (swap.py: replace_linear, restore_linear)
and what a model leaves unguarded (coverage)."""
