"""The teacher pool of on-policy distillation: workers behind the router (pool ``teacher``) that
return a served model's log-probs of the tokens a student sampled (``worker.py``: the actor;
``model.py``: the model and its forward)."""
