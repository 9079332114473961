"""A sandboxed child process: ``python -m actors.sandbox.child``, driven over stdin/stdout.

It limits itself (RLIMIT_AS for memory, RLIMIT_CPU re-armed before every call), loads the
functions named in the ``Setup`` frame, answers ``Ready``, then serves one ``Call`` at a time
until stdin closes. An exception (MemoryError included) or a bad return value becomes an
``Outcome`` with an error; anything worse (a hang, a segfault, ``os._exit``) is the worker's to
notice: it kills and replaces the child. The protocol owns the original stdin and stdout file
descriptors; user code printing to stdout writes to stderr instead.
"""

from __future__ import annotations

import importlib.util
import os
import resource
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import msgspec

from actors.sandbox.protocol import (
    HEADER,
    MAX_FRAME,
    Call,
    FunctionSpec,
    Outcome,
    Outcomes,
    Ready,
    Setup,
    ToChild,
    describe,
    frame,
    run_call,
)


def load(spec: FunctionSpec, index: int) -> Callable[..., Any]:
    for dependency in spec.preload:
        importlib.import_module(dependency)
    if spec.module:
        fn = getattr(importlib.import_module(spec.module), spec.name, None)
        if not callable(fn):
            raise AttributeError(f"module {spec.module} has no function {spec.name!r}")
        return fn
    path = Path(spec.path)
    module_name = f"_user_function_{index}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    sys.path.insert(0, str(path.parent))  # so the file can import its neighbours
    module_spec.loader.exec_module(module)
    fn = getattr(module, spec.name, None)
    if not callable(fn):
        raise AttributeError(f"{path} has no function {spec.name!r}")
    return fn


def _arm_cpu_limit(cpu_s: int) -> None:
    """Allow ``cpu_s`` more CPU seconds from now; past them the kernel sends SIGXCPU (fatal)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(usage.ru_utime + usage.ru_stime) + 1 + cpu_s
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _read_frame(stream: IO[bytes]) -> bytes | None:
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None  # the worker closed our stdin: time to go
    (size,) = HEADER.unpack(header)
    if size > MAX_FRAME:
        raise ValueError(f"frame of {size} bytes from the worker")
    body = stream.read(size)
    return body if len(body) == size else None


def _watch_parent(parent: int) -> None:
    """Exit when the worker is gone, even while user code hangs on the main thread."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def main() -> None:
    proto_in = os.fdopen(os.dup(0), "rb")
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    decoder = msgspec.msgpack.Decoder(ToChild)

    def send(message: msgspec.Struct) -> None:
        proto_out.write(frame(message))
        proto_out.flush()

    body = _read_frame(proto_in)
    if body is None:
        return
    setup = decoder.decode(body)
    assert isinstance(setup, Setup)
    if setup.memory_mb:
        limit = setup.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    functions: list[Callable[..., Any] | None] = []
    errors: list[str] = []
    for i, spec in enumerate(setup.functions):
        try:
            functions.append(load(spec, i))
            errors.append("")
        except (Exception, SystemExit) as exc:
            functions.append(None)
            errors.append(f"loading {spec.label} failed: {describe(exc)}")
    send(Ready(errors))
    while (body := _read_frame(proto_in)) is not None:
        call = decoder.decode(body)
        assert isinstance(call, Call)
        fn, spec = functions[call.function], setup.functions[call.function]
        if fn is None:
            send(Outcomes([Outcome(error=errors[call.function])] * call.items))
            continue
        if setup.cpu_s:
            _arm_cpu_limit(setup.cpu_s)
        try:
            outcomes = run_call(fn, spec, call)
        except MemoryError as exc:  # raised while building outcomes: the call's memory is gone now
            outcomes = [Outcome(error=describe(exc), failure="raised")] * call.items
        if setup.memory_mb:
            hint = f" (over {setup.limits_key}.memory_mb = {setup.memory_mb})"
            outcomes = [msgspec.structs.replace(o, error=o.error + hint)
                        if o.error.startswith("MemoryError") else o for o in outcomes]
        send(Outcomes(outcomes))


if __name__ == "__main__":
    main()
