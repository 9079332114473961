"""Reward scoring: built-in rules, users' verl-style functions, and the child processes that
keep user code from hurting the job.

- ``rules``: the built-in scorers (gsm8k, math, exact_match, answer_tag, arithmetic,
  repeat_letter) and DAPO's overlong penalty.
- ``protocol``: the calling convention and the msgspec frames to and from a child.
- ``child``: the child process's main loop (limits, loading, calling).
- ``pool``: the worker's side: a pool of children with a per-call timeout and replacement.
- ``reward_model``: a sequence-classification checkpoint as a scorer, batched on a thread.
- ``scorer``: ``Scoring``, which the reward worker uses: weights, errors, penalty, counters.

This package's ``__init__`` imports nothing, so a child starts without the worker's imports.
"""
