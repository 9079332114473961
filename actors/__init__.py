"""flowrl's actors and the libraries they share.

Actors: each folder (or module) below is the body of one kind of process in ``registry.KINDS``,
with what only that kind runs.

- ``replay/``: the replay buffer (admission, held groups, batches, the recording, resume).
- ``router/``: the router that forwards requests to the pools of workers.
- ``sampler/``: prompts in, generated and scored groups out (its engines in ``sampler/engines/``).
- ``learner/``: batches in, optimizer steps, versioned weights and checkpoints out.
- ``reward.py``: a reward worker (the rule workers and the served models' replicas).
- ``teacher/``: the teacher pool's workers of on-policy distillation.

Libraries: what several actors, the runner or the offline tools import.

- ``runtime/``: what every actor process runs on: the actor loop, the config schema
  (``runtime/config/``), devices, cores, weights transports, recording, security.
- ``job/``: the runner behind the top-level runner.py: loading and checking a topology,
  placing, starting and supervising processes; no actor process imports it.
- ``data/``: prompt sources, the one chat-template helper, images from a data set's row to a
  model's forward inputs.
- ``scoring/``: reward sources, one module each (rules, user functions, reward models, judges).
- ``sandbox/``: child processes that run user code under limits.
- ``validation/``: validation prompts and their summaries.
- ``offline/``: tools over a recorded run (``runner.py rerun``, ``inspect``, ``rescore``).
- ``registry.py`` (the actor kinds), ``main.py`` (an actor process's entry point),
  ``model_store.py`` (model paths, the embedded model), ``model_shape.py`` (a decoder layer's
  weight count).

``tests/test_structure.py`` keeps this map in step with the folders.
"""
