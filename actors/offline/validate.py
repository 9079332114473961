"""Validate a saved checkpoint offline: ``python runner.py validate RUN_DIR [--checkpoint
step_N] [validation.*=...]``.

No learner, sampler or reward worker is started: the checkpoint (default the newest; ``base``:
the model the run started from) is loaded into a transformers engine in this process, the
validation prompts of the run's topology (with the ``validation.*`` overrides given: other
datasets, ``n``, ``temperature``) are generated and scored by the reward worker's own
``Scoring`` (the run's reward functions, timeouts and limits), and the metrics are those of a
live validation (``actors/validation/metrics.py``), printed next to the ones the run recorded
for that step when it has them (sampling differs between the two runs, so they agree only in
distribution). ``--out FILE`` writes the metrics and every sample as JSON; nothing is written
into the run directory.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import msgspec

from actors.offline.export import is_adapter, merge_adapter
from actors.offline.recorded import OfflineError, excerpt
from actors.runtime.config import ConfigError, Topology, apply_overrides, decode_topology
from actors.runtime.recording import last_by, read_table
from actors.runtime.rundir import TOPOLOGY, checkpoint_dir, latest_checkpoint, read_state
from actors.validation.metrics import ScoredPrompt, validation_metrics
from actors.validation.prompts import validation_prompts, validation_sampling

CHUNK = 8  # prompts per engine call


def load_topology_of(run_dir: Path, overrides: list[str]) -> Topology:
    topo_file = run_dir / TOPOLOGY
    if not topo_file.is_file():
        raise OfflineError(f"no {topo_file}: not the run directory of a job started with runner.py")
    bad = [o for o in overrides if not o.split("=", 1)[0].strip().startswith("validation.")]
    if bad:
        raise OfflineError(f"only validation.* keys can be overridden here: {', '.join(bad)}")
    try:
        return decode_topology(apply_overrides(json.loads(topo_file.read_text()), overrides))
    except (ConfigError, ValueError, msgspec.DecodeError) as exc:
        raise OfflineError(f"bad topology {topo_file}: {exc}") from None


def pick_checkpoint(run_dir: Path, topology: Topology, name: str | None) -> tuple[Path, int]:
    """``(model directory, step)`` of ``--checkpoint`` (a ``step_N`` name, N, a path, or
    ``base``; default the newest checkpoint)."""
    if name == "base":
        return Path(topology.model.path), 0
    if name is None:
        found = latest_checkpoint(run_dir)
        if found is None:
            raise OfflineError(f"no checkpoint in {run_dir} (--checkpoint base validates the "
                               "model the run started from)")
        path = found
    elif Path(name).is_dir():
        path = Path(name)
    else:
        step = name.removeprefix("step_")
        if not step.isdigit():
            raise OfflineError(f"--checkpoint {name!r}: expected step_N, N, a directory or base")
        path = checkpoint_dir(run_dir, int(step))
        if not path.is_dir():
            left = sorted(p.name for p in path.parent.glob("step_*")) if path.parent.is_dir() else []
            raise OfflineError(f"no checkpoint {path} (kept: {', '.join(left) or 'none'})")
    return path, int(read_state(path)["step"])


def validate(run_dir: str | Path, checkpoint: str | None = None, overrides: list[str] | None = None,
             out_file: str | None = None, threads: int = 0, out: TextIO = sys.stdout) -> int:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise OfflineError(f"no run directory {run_dir}")
    topo = load_topology_of(run_dir, list(overrides or []))
    prompts = validation_prompts(topo)
    if not prompts:
        raise OfflineError("no validation prompts: the run's topology has no "
                           "[[validation.datasets]]; give some, e.g. "
                           "'validation.datasets=[{builtin=\"arithmetic\", size=32}]'")
    path, step = pick_checkpoint(run_dir, topo, checkpoint)
    params, n = validation_sampling(topo), topo.validation.n
    print(f"=== validating {path} (the policy after {step} steps): {len(prompts)} prompts x {n} "
          f"samples, temperature {params.temperature:g}, top_p {params.top_p:g}, "
          f"max_tokens {params.max_tokens}", file=out, flush=True)
    started = time.monotonic()
    samples = _generate_and_score(topo, path, prompts, params, n, threads or topo.sampler.threads)
    scored = [ScoredPrompt(s["data_source"], s["rewards"], s["answers"], s["lengths"],
                           s["clipped"], s["extras"]) for s in samples]
    metrics = validation_metrics(scored, topo.validation.pass_threshold)
    metrics["timing_s/validation"] = time.monotonic() - started
    recorded = {}
    try:
        rows = last_by(read_table(run_dir, "validation_metrics"), "step")
        recorded = dict(rows[step]["metrics"]) if step in rows else {}
    except (OSError, ValueError):
        pass
    _report(metrics, recorded, samples, out)
    if out_file:
        Path(out_file).write_text(json.dumps({
            "run_dir": str(run_dir), "checkpoint": str(path), "step": step,
            "metrics": metrics, "recorded": recorded, "samples": samples}, indent=1))
        print(f"written: {out_file}", file=out)
    return 0


def _generate_and_score(topo: Topology, model: Path, prompts, params, n: int,
                        threads: int) -> list[dict[str, Any]]:
    import anyio
    import torch

    from actors.data.chat import ChatTokenizer
    from actors.sampler.engines.base import GenerateRequest
    from actors.sampler.engines.hf import HFEngine
    from actors.scoring.items import ScoreItem
    from actors.scoring.scorer import Scoring

    torch.set_num_threads(threads)
    merged = None
    if is_adapter(model):  # a LoRA checkpoint: its adapter merged into the base, for the engine
        import tempfile
        merged = Path(tempfile.mkdtemp(prefix="flowrl-validate-"))
        model = merge_adapter(model, merged, topo.model.dtype)
    engine = HFEngine(model, topo.model.dtype, topo.run.seed * 1009 + 7919)
    tokenizer = ChatTokenizer(model)
    if merged is not None:  # both are in memory now
        import shutil
        shutil.rmtree(merged, ignore_errors=True)

    async def main() -> list[dict[str, Any]]:
        scoring = Scoring(topo.reward)
        out: list[dict[str, Any]] = []
        try:
            for i in range(0, len(prompts), CHUNK):
                chunk = prompts[i:i + CHUNK]
                groups = await engine.generate([GenerateRequest(
                    tokenizer.prompt_ids(p.messages), params, n) for p in chunk])
                items, texts = [], []
                for p, group in zip(chunk, groups, strict=True):
                    for c in group:
                        text = tokenizer.decode(c.token_ids.tolist())
                        texts.append(text)
                        items.append(ScoreItem(p.data_source, text, p.ground_truth,
                                               p.extra_info, len(c.token_ids), p.messages))
                results = await scoring.score(items, params.max_tokens)
                k = 0
                for p, group in zip(chunk, groups, strict=True):
                    rs, ts = results[k:k + len(group)], texts[k:k + len(group)]
                    k += len(group)
                    out.append({"prompt_id": p.prompt_id, "data_source": p.data_source,
                                "prompt": p.messages[-1].content, "ground_truth": p.ground_truth,
                                "completions": ts, "rewards": [r.score for r in rs],
                                "answers": [r.answer for r in rs],
                                "errors": [r.error for r in rs], "extras": [r.extra for r in rs],
                                "lengths": [len(c.token_ids) for c in group],
                                "clipped": [c.finish_reason == "length" for c in group]})
        finally:
            await scoring.aclose()
        return out

    return anyio.run(main, backend="trio")


def _report(metrics: dict[str, float], recorded: dict[str, float],
            samples: list[dict[str, Any]], out: TextIO) -> None:
    shown = sorted(k for k in metrics if not k.endswith("/std"))
    print(f"{'metric':<52} {'offline':>10} {'recorded':>10}", file=out)
    for k in shown:
        rec = f"{recorded[k]:>10.4f}" if k in recorded else f"{'-':>10}"
        print(f"{k:<52} {metrics[k]:>10.4f} {rec}", file=out)
    errors = [e for s in samples for e in s["errors"] if e]
    print(f"reward errors: {len(errors)} of {sum(len(s['rewards']) for s in samples)} samples",
          file=out)
    for e in errors[:3]:
        print(f"  {excerpt(e, 120)}", file=out)
