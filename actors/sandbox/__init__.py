"""Child processes for user code: sandboxed children (``children.Children``), each with memory and CPU limits
and a per-call timeout, that load functions by file or module and call them with keyword
arguments. A hang, crash or exception in user code becomes an error outcome, never a dead
actor. Reward functions use it today (``actors/scoring``)."""
