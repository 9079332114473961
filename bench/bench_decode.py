"""The transformers engine's decoding modes side by side (``sampler.engine.decode``): eager, and a
static KV cache compiled by torch.compile (inductor), on the same batch, through the engine's
own ``generate``.

    python bench/bench_decode.py                          # the default job's batch, on CUDA
    python bench/bench_decode.py --shape 1.5b             # gpu_check's hf tokens batch
    python bench/bench_decode.py --device cpu --shape thin

Shapes: ``default`` is the embedded SmolLM2-135M with the default job's batch (4 arithmetic
prompts x 8 samples, its sampler.max_tokens, temperature 1.0); ``thin`` the same batch on the
thin model (``bench/shaped_model.py``: the default's 30 layers and vocabulary, hidden 64);
``1.5b`` a Qwen2 of 1.5B shape with random weights (bf16), 32 random 64-token prompts x 8
samples x 256 new tokens, as gpu_check's ``hf tokens`` row. Each mode gets a fresh engine and
compile state; its first call (the compile and the graphs' capture included) is reported apart
from the median of the timed calls after it, and one more call runs under torch.profiler for the
ops each decoding step dispatches (each step decodes one token of every sequence of the batch;
``actors/runtime/profiling.py``'s count). Printed: tokens/s per mode and its ratio to eager, the
ops per decoding step and their ratio, and the load before and after.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def default_batch(where: Path | None = None) -> tuple[Path, list[list[int]], int, int]:
    from actors.data.chat import ChatTokenizer
    from actors.data.sources import make_task
    from actors.job.config.load import load_topology
    from actors.model_store import resolve_model_path

    topo = load_topology(ROOT / "topology.toml")
    model = resolve_model_path(topo.model.path)
    tok = ChatTokenizer(model)
    task = make_task(topo.task, seed=0)
    prompts = [tok.prompt_ids(task.prompt(i, i).messages)
               for i in range(topo.learner.groups_per_step)]
    return model, prompts, topo.algorithm.n, topo.sampler.max_tokens


def wide_batch(where: Path) -> tuple[Path, list[list[int]], int, int]:
    import torch
    from gpu_check import QWEN2_1_5B
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.tiny_model import tiny_tokenizer

    torch.manual_seed(0)
    config = Qwen2Config(**QWEN2_1_5B, pad_token_id=0, eos_token_id=2, bos_token_id=None)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(where)
    tiny_tokenizer().save_pretrained(where)
    del model
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 150, (64,), generator=gen).tolist() for _ in range(32)]
    return where, prompts, 8, 256


def thin_batch(where: Path, layers: int | None = None) -> tuple[Path, list[list[int]], int, int]:
    from shaped_model import THIN, shaped_model

    _, prompts, n, max_tokens = default_batch()
    return shaped_model(where, hidden=THIN, layers=layers), prompts, n, max_tokens


def measure(model: Path, prompts: list[list[int]], n: int, max_tokens: int, device: str,
            dtype: str, mode: str, repeats: int) -> dict:
    import torch
    import trio

    from actors.sampler.engines.base import GenerateRequest
    from actors.sampler.engines.hf import HFEngine
    from messages.rollout import SamplingParams

    torch._dynamo.reset()
    engine = HFEngine(model, dtype, seed=0, device=device, decode=mode)
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens)
    requests = [GenerateRequest(p, params, n) for p in prompts]

    def call() -> tuple[float, int]:
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        groups = trio.run(engine.generate, requests)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started, sum(len(g.token_ids) for gr in groups for g in gr)

    if mode == "eager":  # nothing to compile: a small call warms the kernels
        small, requests = requests, [GenerateRequest(prompts[0], params.__class__(
            temperature=1.0, max_tokens=4), 1)]
        first, _ = call()
        requests = small
    else:
        first, _ = call()
    timed = [call() for _ in range(repeats)]
    seconds = statistics.median(t for t, _ in timed)
    tokens = statistics.median(k for _, k in timed)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
    with tempfile.TemporaryDirectory(prefix="bench-decode-profile-") as where:
        engine.profile, engine.profiles = {engine.batches + 1}, Path(where)
        call()
        (counted,) = Path(where).glob("step_*[0-9].json")
        ops = json.loads(counted.read_text())
    return {"mode": mode, "first_s": first, "seconds": seconds, "tokens": tokens,
            "tokens_per_s": tokens / seconds, "peak_gib": peak,
            "ops_per_step": ops["ops"] / max(ops["decode_steps"], 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=["default", "thin", "1.5b"], default="default")
    p.add_argument("--modes", default="eager,inductor")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=None,
                   help="thin: this many of its layers (gpu_check's dry run: a check, not a figure)")
    p.add_argument("--max-tokens", type=int, default=0, help="cut the batch's sampler.max_tokens")
    args = p.parse_args()
    import torch

    print(f"load before: {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-decode-") as tmp:
        where = Path(tmp) / "model"
        model, prompts, n, max_tokens = (thin_batch(where, args.layers) if args.shape == "thin"
                                         else {"default": default_batch, "1.5b": wide_batch}
                                         [args.shape](where))
        max_tokens = min(max_tokens, args.max_tokens or max_tokens)
        dtype = "bfloat16" if args.device == "cuda" else "float32"
        rows = []
        for mode in args.modes.split(","):
            try:
                rows.append(measure(model, prompts, n, max_tokens, args.device, dtype, mode,
                                    args.repeats))
            except Exception as exc:  # a mode that fails is reported; the others still run
                traceback.print_exc(limit=-6)
                print(f"{mode}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                      flush=True)
                continue
            finally:  # the engine of this mode is gone: its memory back for the next
                gc.collect()
                if args.device == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
            r = rows[-1]
            print(f"{mode}: first call {r['first_s']:.2f} s; then {r['tokens']:.0f} tokens in "
                  f"{r['seconds']:.3f} s, {r['tokens_per_s']:,.0f} tokens/s, peak "
                  f"{r['peak_gib']:.1f} GiB, {r['ops_per_step']:,.0f} ops per decoding step",
                  flush=True)
    base = next((r for r in rows if r["mode"] == "eager"), None)
    print(f"\n{args.shape} shape, {len(prompts)} prompts x {n} samples x <= {max_tokens} tokens, "
          f"{args.device}, {dtype}:")
    print("| decode | first call s | s/batch | tokens/s | vs eager | ops per decoding step "
          "| vs eager | peak GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        ops = f"{r['ops_per_step'] / base['ops_per_step']:.2f}x" if base else "-"
        print(f"| {r['mode']} | {r['first_s']:.2f} | {r['seconds']:.3f} | "
              f"{r['tokens_per_s']:,.0f} | {ratio} | {r['ops_per_step']:,.0f} | {ops} | "
              f"{r['peak_gib']:.1f} |")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
