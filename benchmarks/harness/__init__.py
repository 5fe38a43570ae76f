"""The benchmark harness behind benchmarks/run.py: the cases and their timing (suite), and
what is made of the timings (the rows, targets, tables, plot and RESULTS.md section)."""
