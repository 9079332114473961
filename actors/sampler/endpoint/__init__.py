"""Agents from outside: an OpenAI-compatible endpoint per episode for the user's own agent code
(``[agent.rollout]``), every call recorded as token ids, behaviour log-probs and versions.

- ``strategy.py``: the rollout strategy (episodes in sandboxed children, the group's samples,
  the batch engine's batching of concurrent calls).
- ``episodes.py``: one episode's segments, token in and token out.
- ``api.py``: the OpenAI wire format (requests, chat template, tool calls, responses).
- ``images.py``: ``image_url`` content parts read into encoded images (data URLs, paths).
- ``server.py``: the Starlette app on Hypercorn's trio worker.
"""
