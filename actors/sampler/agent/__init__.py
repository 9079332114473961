"""Multi-turn rollouts: the model calls tools (or acts in an environment), reads the answers
and goes on, token in and token out (``loop.py``).

- ``parsers.py``: tool calls out of a turn's text (hermes JSON, or one XML tag per tool).
- ``render.py``: the tokens the chat template puts after a model turn, rendered once.
- ``toolbox.py``: tools in sandboxed children (schemas, calls, failures as error answers).
- ``env.py``: a user's environment class, one object per episode, in sandboxed children.

An environment's first observation (``reset``'s return value, when not empty) is rendered like
any observation, after an empty model turn: every sample of a group shares the prompt's tokens.
"""
