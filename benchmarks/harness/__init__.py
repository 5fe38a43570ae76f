"""The benchmark harness behind benchmarks/run.py, one concern per module:

presets.py         the presets: cases, rounds and budget per device
suite.py           the cases of a preset and their interleaved timing
env_probe.py       the machine a run ran on
rows.py            records -> derived rows (us, GB/s, FLOP/s, ratios of one group)
targets.py         the PASS / MISS thresholds of the issues
tables.py          Markdown tables of the rows and targets
plot.py            overhead.png (or .svg without matplotlib)
report.py          summary.md, the RESULTS.md section, results.json
report_selftest.py renders a preset's report from made-up timings (no GPU needed)
training_step.py   the training-step benchmarks' models, options and interleaved timing
                   (watch_bench.py, training_guard_bench.py)
"""
