"""Every message that crosses a socket, as msgspec Structs grouped by flow (no torch needed).

- ``messages.control``: actor <-> runner lifecycle and heartbeats
- ``messages.rollout``: prompts, scored groups and training batches through the replay buffer
- ``messages.routing``: the router's envelope (id, pool; the body is opaque) and its workers'
  lifecycle
- ``messages.reward``: the reward pool's bodies: one scoring request per group, and its reply
- ``messages.teacher``: the teacher pool's bodies: a group's token ids, and the teacher's
  log-probs of its response tokens
- ``messages.weights``: versioned weights from the learner to samplers
- ``messages.learner_ranks``: rank 0 of the learner to its other ranks (over torch.distributed)
- ``messages.tensor``: tensors as (dtype, shape, bytes)
- ``messages.codec``: the per-socket decoder
"""
