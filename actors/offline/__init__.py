"""Offline tools over a recorded run (``RUN_DIR/record/``), no live actor needed.

- ``recorded``: opening a run directory: its resolved topology and recorded tables, with clear
  errors (``OfflineError``, exit status 2) for a missing run, recording or step.
- ``rerun``: ``runner.py rerun RUN_DIR --step N``: rebuild the learner as it was before step
  N, train step N again on its recorded batch and compare every metric with the recorded one.
- ``rescore``: ``runner.py rerun RUN_DIR --rescore file.py[:name]``: score the recorded
  completions with another reward function and show what changed.
- ``inspection``: ``runner.py inspect RUN_DIR``: a summary of the run, its best and worst
  samples, the staleness histogram and PNG plots.
"""
