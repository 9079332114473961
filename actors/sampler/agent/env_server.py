"""An OpenEnv server a sampler serves itself (``agent.env.openenv.app``): the library's app run
by uvicorn in a child process, on a port of the sampler's own.

The sampler opens the listening socket and hands it to the server (uvicorn's ``fd``), so the
address is known and taking connections before the server has imported its app: a session
opened early waits in the socket's backlog, never refused, and no readiness poll is needed.
A server that has died is started again on the same socket when the next episode begins
(``restarts`` counts them); the agent loop plays the episodes it held once more. It is
started from the sampler's event loop (its main thread), whose end the kernel's parent-death
signal follows.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

# The server dies with the sampler (PR_SET_PDEATHSIG, then a check that the sampler is still
# its parent: it may have died before the call); its log holds its own failures only (a
# session's client leaving is logged as an error too).
SERVE = """
import sys
from actors.runtime.lifetime import die_with_parent
if not die_with_parent(int(sys.argv[3])):
    sys.exit(0)
import uvicorn
uvicorn.run(sys.argv[1], fd=int(sys.argv[2]), log_level="critical")
"""


class EnvServer:
    def __init__(self, app: str) -> None:
        self.app = app
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen(256)
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        self.restarts = 0
        self.process = self._start()

    def _start(self) -> subprocess.Popen:
        # the app is named from where the runner was started, as every user file is
        path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
        fd = self.socket.fileno()
        return subprocess.Popen([sys.executable, "-c", SERVE, self.app, str(fd), str(os.getpid())],
                                pass_fds=(fd,),
                                env={**os.environ, "PYTHONPATH": path},
                                stdin=subprocess.DEVNULL)

    def keep_up(self) -> None:
        """Start the server again if it has died."""
        if self.process.poll() is not None:
            self.restarts += 1
            self.process = self._start()

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.socket.close()
