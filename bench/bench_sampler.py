"""The sampler's engines side by side, on the default model (the embedded SmolLM2-135M), fp32.

    python bench/bench_sampler.py                     # every part, 3 interleaved rounds
    python bench/bench_sampler.py --parts engines --rounds 5 --threads 1

Parts (each prints a table; results go in BENCHMARKS.md):

- ``engines``: the transformers engine (one ``generate`` per batch) against the vLLM engine
  (``actors/sampler/engines/vllm/engine.py``, all requests of the batch submitted at once) on the same
  prompts: ``--prompts`` arithmetic prompts × ``--n`` completions × up to ``--max-tokens``
  tokens. Tokens/s = generated tokens / wall seconds of the call.
- ``actor``: the sampler actor's own loop (``ContinuousSampler``: prompts admitted one by one,
  at most ``max_concurrent_prompts`` in the engine, each group templated, generated, decoded,
  scored and sent as soon as it is done) against vLLM alone (``AsyncLLM.generate`` for every
  completion of every prompt at once, nothing else) on the same prompts. The replay buffer,
  the reward router and the weights channel are stand-ins in this process that answer at once
  (a reward of 0), so what is measured is the actor, not its peers. Target: the actor reaches
  90% of vLLM alone.
- ``weights``: one weight update of the default model into the running vLLM engine, as the job
  does it: the learner writes the version to /dev/shm (``ShmSender``, the shm transport),
  the engine loads it (``load_weights``: file into the model, layerwise), and from tensors in
  memory (the zmq transport: the sampler writes the file itself first).

Rounds interleave the contenders (A B, B A, ...), so background load that comes and goes
hits both alike; the tables give the median and the best round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def prompts(tokenizer, count: int):
    from actors.data.sources import make_task
    from actors.runtime.config import TaskConfig

    task = make_task(TaskConfig(), seed=0)
    out = []
    for i in range(count):
        dataset, row = task.locate(i)
        out.append(task.prompt_at(dataset, row, prompt_id=i))
    return out, [tokenizer.prompt_ids(p.messages) for p in out]


def table(title: str, rows: dict[str, list[float]], unit: str) -> None:
    print(f"\n{title}")
    print(f"{'':<34}{'median':>10}{'best':>10}  rounds ({unit})")
    for name, values in rows.items():
        best = max(values) if unit == "tok/s" else min(values)
        print(f"{name:<34}{statistics.median(values):>10.1f}{best:>10.1f}  "
              + " ".join(f"{v:.1f}" for v in values))


async def bench_engines(args, model: Path, vllm_engine) -> None:
    import torch

    from actors.data.chat import ChatTokenizer
    from actors.sampler.engines.base import GenerateRequest
    from actors.sampler.engines.hf import HFEngine
    from messages.rollout import SamplingParams

    hf = HFEngine(model, "float32", seed=0)
    await hf.load_weights(0, {})
    _, ids = prompts(ChatTokenizer(model), args.prompts)
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens)
    reqs = [GenerateRequest(i, params, args.n) for i in ids]
    rows: dict[str, list[float]] = {"hf (transformers generate)": [], "vllm (VLLMEngine)": []}
    await vllm_engine.generate(reqs[:1])  # warm-up of both
    await hf.generate(reqs[:1])
    for r in range(args.rounds):
        order = [("hf (transformers generate)", hf), ("vllm (VLLMEngine)", vllm_engine)]
        for name, engine in (order if r % 2 == 0 else order[::-1]):
            started = time.perf_counter()
            out = await engine.generate(reqs)
            seconds = time.perf_counter() - started
            rows[name].append(sum(len(c.token_ids) for g in out for c in g) / seconds)
    table(f"engines: {args.prompts} prompts x {args.n} completions x <= {args.max_tokens} tokens, "
          f"torch threads {torch.get_num_threads()}", rows, "tok/s")


class _Replay:
    """Stands in for the replay buffer's socket: prompts on request until ``total``, groups
    counted as they come back; with no prompt left, a request waits (as for admission)."""

    def __init__(self, all_prompts, done) -> None:
        import anyio

        self.prompts, self.done = list(all_prompts), done
        self.replies, self.inbox = anyio.create_memory_object_stream[bytes](16)
        self.groups = 0
        self.total = len(all_prompts)

    async def send_multipart(self, frames) -> None:
        from messages.codec import Codec, encode
        from messages.rollout import GroupsDone, PromptBatch, PromptRequest, ToReplay

        msg = Codec(ToReplay).decode(frames[-1])
        if isinstance(msg, PromptRequest) and self.prompts:
            give, self.prompts = self.prompts[:msg.max_prompts], self.prompts[msg.max_prompts:]
            await self.replies.send(encode(PromptBatch(prompts=give, version=0)))
        elif isinstance(msg, GroupsDone):
            self.groups += len(msg.groups)
            if self.groups == self.total:
                self.done.set()

    async def recv_multipart(self):
        return [await self.inbox.receive()]


class _Scoring:
    timeout_s, attempts, router_error = 1.0, 1, ""

    async def score(self, request):
        from messages.reward import ScoreReply, ScoreResult

        return ScoreReply(results=[ScoreResult(0.0) for _ in request.responses])

    def statistics(self):
        from actors.sampler.scoring_client import ClientStatistics

        return ClientStatistics(0, 0, 0, 0, 0, 0)


class _Weights:
    """The engine already holds version 0; no newer one ever comes."""

    error = ""
    received = 0

    async def wait_for(self, version: int) -> None:
        import anyio

        if version > 0:
            await anyio.sleep_forever()

    def take(self):
        return None


async def run_actor(args, model: Path, engine, all_prompts) -> tuple[float, int]:
    """The ``ContinuousSampler`` over ``engine`` until every prompt's group is sent."""
    import anyio
    import zmq

    from actors.data.chat import ChatTokenizer
    from actors.job.config.load import apply_overrides, decode_topology
    from actors.runtime.actor import ActorContext
    from actors.sampler.actor import ContinuousSampler, sampling_params
    from actors.sampler.rollout import Rollout

    topo = decode_topology(apply_overrides({}, [
        f"model.path={model}", f"sampler.max_tokens={args.max_tokens}", f"algorithm.n={args.n}",
        f"sampler.max_concurrent_prompts={args.concurrent}", "sampler.engine=hf"]))
    ctx = ActorContext(kind="sampler", index=0, topology=topo, run_dir=Path("/tmp"),
                       zmq=zmq.Context.instance())
    done = anyio.Event()
    replay = _Replay(all_prompts, done)
    rollout = Rollout(engine, ChatTokenizer(model), _Scoring(), params=sampling_params(ctx),  # type: ignore[arg-type]
                      n=args.n, greedy_baseline=False, sampler="bench")
    sampler = ContinuousSampler(ctx, engine, rollout, replay, _Weights(),  # type: ignore[arg-type]
                                _Scoring())  # type: ignore[arg-type]
    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(sampler.run, tg)
        await done.wait()
        seconds = time.perf_counter() - started
        tg.cancel_scope.cancel()
    return seconds, sampler.tokens


async def run_vllm_alone(args, engine, ids) -> tuple[float, int]:
    """Every completion of every prompt straight into ``AsyncLLM``, at once."""
    import asyncio

    from vllm import SamplingParams as VSamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    async def one(prompt_ids, seed):
        sp = VSamplingParams(temperature=1.0, max_tokens=args.max_tokens, logprobs=0, seed=seed,
                             output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False)
        async for out in engine.llm.generate(TokensPrompt(prompt_token_ids=prompt_ids), sp,
                                             request_id=f"alone-{seed}-{time.monotonic_ns()}"):
            final = out
        return len(final.outputs[0].token_ids)

    async def everything():
        started = time.perf_counter()
        counts = await asyncio.gather(*(one(p, 10_000 + k * args.n + i)
                                        for k, p in enumerate(ids) for i in range(args.n)))
        return time.perf_counter() - started, sum(counts)

    return await engine.loop.call(everything())


async def bench_actor(args, model: Path, engine) -> None:
    from actors.data.chat import ChatTokenizer

    all_prompts, ids = prompts(ChatTokenizer(model), args.actor_prompts)
    rows: dict[str, list[float]] = {"vllm alone (AsyncLLM)": [],
                                    f"sampler actor (concurrent {args.concurrent})": []}
    for r in range(args.rounds):
        runs = [("vllm alone (AsyncLLM)", lambda: run_vllm_alone(args, engine, ids)),
                (f"sampler actor (concurrent {args.concurrent})",
                 lambda: run_actor(args, model, engine, all_prompts))]
        for name, fn in (runs if r % 2 == 0 else runs[::-1]):
            seconds, tokens = await fn()
            rows[name].append(tokens / seconds)
    table(f"actor: {args.actor_prompts} prompts x {args.n} completions x <= {args.max_tokens} "
          f"tokens", rows, "tok/s")
    alone, actor = (statistics.median(v) for v in rows.values())
    print(f"actor / alone (medians): {actor / alone:.1%}")


async def bench_weights(args, model: Path, engine) -> None:
    import anyio
    from transformers import AutoModelForCausalLM

    from actors.runtime.transports.shm import ShmSender
    from actors.runtime.transports.sources import SharedWeights

    hf = AutoModelForCausalLM.from_pretrained(model, dtype="float32")
    tensors = [(n, p.detach().clone()) for n, p in hf.named_parameters()]
    mib = sum(t.numel() * t.element_size() for _, t in tensors) / 2**20
    publisher = ShmSender()
    rows: dict[str, list[float]] = {"learner: write to /dev/shm": [],
                                    "engine: load from /dev/shm": [],
                                    "engine: load from memory (zmq)": []}
    version = engine.version
    try:
        for _ in range(args.rounds):
            version += 1
            started = time.perf_counter()
            path = await anyio.to_thread.run_sync(publisher.write, version, tensors)
            rows["learner: write to /dev/shm"].append(time.perf_counter() - started)
            started = time.perf_counter()
            await engine.load_weights(version, SharedWeights(str(path)))
            rows["engine: load from /dev/shm"].append(time.perf_counter() - started)
            version += 1
            started = time.perf_counter()
            await engine.load_weights(version, dict(tensors))
            rows["engine: load from memory (zmq)"].append(time.perf_counter() - started)
    finally:
        publisher.close()
    table(f"weights: {len(tensors)} tensors, {mib:.0f} MiB", rows, "s")


async def main_async(args) -> None:
    import torch

    from actors.model_store import resolve_model_path
    from actors.runtime.config import VLLMOptions
    from actors.sampler.engines.vllm.engine import VLLMEngine, VLLMSettings

    torch.set_num_threads(args.threads)
    model = resolve_model_path("default")
    engine = await VLLMEngine.start(model, "float32", 0, VLLMSettings(
        VLLMOptions().engine_args(gpu=torch.cuda.is_available()), threads=args.threads))
    try:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model, dtype="float32")
        await engine.load_weights(0, dict(hf.named_parameters()))
        del hf
        for part in args.parts.split(","):
            await {"engines": bench_engines, "actor": bench_actor,
                   "weights": bench_weights}[part](args, model, engine)
    finally:
        await engine.aclose()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="engines,actor,weights")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads (sampler.threads)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--actor-prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--concurrent", type=int, default=8, help="sampler.max_concurrent_prompts")
    args = p.parse_args()
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    import trio

    trio.run(main_async, args)


if __name__ == "__main__":
    main()
