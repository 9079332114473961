"""What a user rollout runs inside a sandboxed child: its function, given an OpenAI client.

``run_episode`` loads ``async def rollout(client, row)`` from the user's file once per child,
binds an ``openai.AsyncOpenAI`` to the episode's own address on the sampler's endpoint
(``http://HOST:PORT/episodes/ID/v1``) and awaits the function on the child's event loop
(``protocol._resolve``: asyncio, which the OpenAI client and the agent frameworks built on it
need). The client does not retry: a refused call is the episode's to handle, once. Each
episode's client is new but shares the child's one TLS context: building a default one reads the
system's certificate store, which cost more CPU than a tiny model's episode.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from functools import cache
from typing import Any

from actors.sandbox.child import load
from actors.sandbox.protocol import FunctionSpec

_loaded: dict[tuple[str, str], Callable[..., Any]] = {}  # (path, name) -> the user's function


async def run_episode(base_url: str, row: dict[str, Any], rollout_path: str,
                      rollout_name: str, call_timeout_s: float) -> Any:
    import openai

    key = (rollout_path, rollout_name)
    if key not in _loaded:
        _loaded[key] = load(FunctionSpec(path=rollout_path, name=rollout_name), len(_loaded))
    async with openai.AsyncOpenAI(base_url=base_url, api_key="flowrl", max_retries=0,
                                  timeout=call_timeout_s,
                                  http_client=openai.DefaultAsyncHttpxClient(verify=_tls())) as client:
        return await _loaded[key](client, row)


@cache
def _tls() -> ssl.SSLContext:
    """The child's TLS context (the default one, certificates verified), built once."""
    return ssl.create_default_context()
