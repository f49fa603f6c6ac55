"""Benchmarks: task files (`tasks.py`), scoring by log-likelihood and by generated answers (`scoring.py`), the
built-in held-out benchmark (`builtin.py`), degeneration metrics (`degeneration.py`), `nanolm eval --task`
(`runner.py`) and the lm-evaluation-harness model `nanolm` (`harness.py`)."""
