"""An actor process ends as a normal exit would (``exit_process``): its status, its other
threads' work finished, the atexit handlers run, buffered output written; and an executor it
left open does not keep it waiting (the interpreter's thread hooks run before the joins)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.jobs import ROOT

CHILD = textwrap.dedent("""
    import atexit, concurrent.futures, sys, threading, time
    from actors.runtime.actor import exit_process

    atexit.register(lambda: print("atexit ran", flush=True))
    pool = concurrent.futures.ThreadPoolExecutor(1)  # left open, as a library may leave one
    pool.submit(time.sleep, 0).result()
    sys.stdout.write("buffered, not flushed\\n")
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread done"))).start()  # joined
    exit_process(3)
""")


def test_an_actor_process_exits_as_a_normal_exit_would():
    res = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 3, res.stderr
    assert res.stdout.splitlines() == ["buffered, not flushed", "thread done", "atexit ran"], \
        res.stdout + res.stderr
