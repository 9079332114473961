"""The job's runner: everything that starts, places, supervises and records a job, and nothing
an actor process imports (``tests/test_structure.py`` checks it).

``config/`` reads and checks a topology (``load``, ``checks``, ``hosts``, ``capacity``,
``layout``, ``preflight``); ``launch`` resolves it and starts the job; ``supervisor`` (the job:
control socket, status, console, signals, end conditions) and ``processes`` (each process's
lifecycle: spawn, restart, attach, detach) supervise its processes; ``multihost`` links the
runners of a job over several hosts; ``attach`` joins one more worker to a running job;
``metrics``, ``trackers``, ``loggers`` and ``liveview`` are where the job's numbers go. The
library every actor uses is ``actors/runtime/``.
"""
