"""Reward scoring, one module per source, each owning its options beside its code.

- ``rules``: the built-in scorers (gsm8k, math, exact_match, answer_tag, arithmetic,
  repeat_letter, calculator) and DAPO's overlong penalty.
- ``scorer``: ``Scoring``, the rule workers': built-ins and users' verl-style functions (in
  sandboxed children, ``actors/sandbox``), weights, errors, penalty, counters.
- ``reward_model``, ``judge``: what scores with the served models of ``[[reward.models]]`` (their
  options, the tagged union's kinds ``RewardModelConfig`` and ``JudgeConfig``, are the config's:
  ``actors/runtime/config/pools.py``).
- ``served``: ``ServedScoring``, a served model's replica: batching (``batching``), sleep
  (``sleep``), counters.
- ``items``, ``combine``: a request's items, and the pools' replies added up in the sampler.

This package's ``__init__`` imports nothing, so a child starts without the worker's imports.
"""
