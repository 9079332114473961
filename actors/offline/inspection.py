"""A recorded run at a glance: ``python runner.py inspect RUN_DIR [--step N] [--plots DIR]``.

Prints a summary table (steps, wall time, reward and response length first/last, groups
trained and dropped by reason, reward errors), the best and worst samples of one step (default
the last), the staleness histogram of every trained sample (learner version at its step minus
the policy version that generated it), the validations (``val-core`` metrics per data source,
first and last), and writes PNG plots over steps (reward, response length, KL, entropy,
importance weights, and the validation curve: ``mean@N``, ``maj@N`` and ``best@N`` of each
data source with the training reward beside them) with matplotlib's Agg backend, to
``RUN_DIR/plots`` by default: the one thing it writes (with, for a vision-language run, the
image each shown sample answered, under ``plots/images``).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from actors.offline.recorded import OfflineError, RecordedRun, excerpt, open_run, span
from actors.runtime.recording import last_by, read_table
from actors.runtime.versions import staleness
from messages.rollout import Turn

# file -> (title, y label, [(metric, legend)])
PLOTS = {
    "reward.png": ("Reward", "score", [("critic/score/mean", "mean"), ("critic/score/max", "max"),
                                       ("critic/score/min", "min")]),
    "response_length.png": ("Response length", "tokens", [
        ("response_length/mean", "mean"), ("response_length/max", "max")]),
    "kl.png": ("KL", "nats/token", [
        ("rollout_corr/kl", "mismatch k1 (behaviour vs proximal)"),
        ("rollout_corr/k3_kl", "mismatch k3"), ("actor/ppo_kl", "ppo_kl"),
        ("actor/kl_loss", "kl_loss (vs reference)"),
        ("actor/reward_kl_penalty", "in-reward KL penalty")]),
    "entropy.png": ("Entropy", "nats/token", [("actor/entropy", "policy entropy")]),
    "importance.png": ("Importance weights", "weight", [
        ("rollout_corr/is_weight_mean", "mean"), ("rollout_corr/is_weight_min", "min"),
        ("rollout_corr/is_weight_max", "max"), ("rollout_corr/ess", "ESS"),
        ("rollout_corr/is_clip_frac", "clipped fraction")]),
}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def inspect_run(run_dir: str | Path, *, step: int | None = None, plots: str | None = None,
                top: int = 3, out: TextIO = sys.stdout) -> int:
    run = open_run(run_dir)
    steps = run.steps
    step = steps[-1] if step is None else step
    if step not in run.batches:
        raise OfflineError(f"step {step} is not recorded in {run.run_dir} "
                           f"(recorded steps: {span(steps)})")
    folder = Path(plots) if plots else run.run_dir / "plots"
    _summary(run, out)
    _samples(run, step, top, out, folder / "images")
    _staleness(run, out)
    validations = recorded_validations(run.run_dir)
    _validations(validations, out)
    written = write_plots(run, folder) + [plot_validation(run, validations, folder)]
    print(f"\nplots: {', '.join(str(p) for p in written)}", file=out)
    return 0


def _summary(run: RecordedRun, out: TextIO) -> None:
    steps = run.steps
    m = [run.metrics.get(s, {}) for s in steps]

    def series(key: str) -> list[float]:
        return [x[key] for x in m if key in x]

    reward, length = series("critic/score/mean"), series("response_length/mean")
    incarnations = {b["incarnation"] for b in run.batches.values()}
    step_time = series("timing_s/step")
    rows = [
        ("run", str(run.run_dir)),
        ("steps", f"{len(steps)} recorded ({span(steps)}); {len(incarnations)} incarnation(s)"),
        ("wall time", f"{_wall_time(run):.1f} s (first prompt to last step); "
                      f"{_mean(step_time):.2f} s per learner step"),
        ("reward", f"first {reward[0]:.3f}, last {reward[-1]:.3f}; mean of first 5 "
                   f"{_mean(reward[:5]):.3f}, last 5 {_mean(reward[-5:]):.3f}" if reward else "-"),
        ("response length", f"first {length[0]:.1f}, last {length[-1]:.1f} tokens" if length else "-"),
        *_group_rows(run),
    ]
    last = m[-1] if m else {}
    if "agent/num_turns/mean" in last:  # a multi-turn run
        rows += _multi_turn_rows(series, last)
    for key in ("actor/entropy", "rollout_corr/kl", "rollout_corr/is_weight_mean",
                "staleness/mean"):
        if key in last:
            rows.append((f"last {key}", f"{last[key]:.4f}"))
    width = max(len(k) for k, _ in rows)
    print("=== run summary", file=out)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}", file=out)


def _wall_time(run: RecordedRun) -> float:
    """Seconds from the first prompt issued (or the first metric) to the last metric."""
    prompts = read_table(run.run_dir, "prompts", ["time"])["time"].to_pylist()
    metric_times = read_table(run.run_dir, "metrics", ["time"])["time"].to_pylist()
    start = min(prompts) if prompts else min(metric_times, default=0.0)
    return max(metric_times, default=start) - start


def _group_rows(run: RecordedRun) -> list[tuple[str, str]]:
    """The summary's rows about groups: recorded, trained, served, dropped (by reason) and
    retired, and the samples whose reward failed."""
    fates: dict[int, dict[str, str]] = {}  # group -> fate -> reason (a reused group has several)
    for f in read_table(run.run_dir, "fates", ["group_id", "fate", "reason"]).to_pylist():
        fates.setdefault(f["group_id"], {})[f["fate"]] = f["reason"]
    trained = sum(1 for f in fates.values() if "trained" in f)
    dropped = Counter(f["dropped"] or "unknown" for f in fates.values()
                      if "dropped" in f and "trained" not in f)
    retired = sum(1 for f in fates.values() if "retired" in f)
    serves = sum(len(b["group_ids"]) for b in run.batches.values())
    groups = run.groups()
    errors = Counter(e for g in groups.values() for e in g["reward_errors"] if e)
    n_samples = sum(len(g["rewards"]) for g in groups.values())
    return [
        ("groups", f"{len(groups)} recorded, {trained} trained ({serves} serves), "
                   f"{sum(dropped.values())} dropped"
                   + "".join(f"; dropped {k}: {v}" for k, v in sorted(dropped.items()))
                   + (f"; {retired} retired after training" if retired else "")),
        ("reward errors", f"{sum(errors.values())} of {n_samples} samples"
                          + (f"; most common: {excerpt(errors.most_common(1)[0][0], 60)!r}"
                             if errors else "")),
    ]


def _multi_turn_rows(series: Callable[[str], list[float]],
                     last: dict[str, float]) -> list[tuple[str, str]]:
    """The summary's rows of a multi-turn run: turns, tool calls and their failures."""
    calls = series("agent/tool_calls")
    share = series("agent/tool_call_share")
    return [
        ("multi-turn", f"turns per sample {last['agent/num_turns/mean']:.2f} "
                       f"(max {last['agent/num_turns/max']:.0f}) in the last step; "
                       f"tool calls {sum(calls):.0f}, failed "
                       f"{sum(series('agent/tool_errors')):.0f}, timed out "
                       f"{sum(series('agent/tool_timeouts')):.0f} over all steps"),
        ("samples calling a tool", f"first {share[0]:.3f}, last {share[-1]:.3f}; "
                                   f"tool tokens {last['agent/tool_token_share']:.1%} "
                                   "of the last step's responses"),
    ]


def extremes(ordered: list[tuple], top: int) -> tuple[list[tuple], list[tuple]]:
    """The ``top`` best of ``ordered`` (reward first in each, best first) and the ``top`` worst of
    the others, lowest first, those below the top reward only: none when every sample scored
    alike (a step where all scored 1.0 has no worst samples to show)."""
    best, rest = ordered[:top], ordered[top:]
    return best, [x for x in rest[::-1][:top] if x[0] < ordered[0][0]]


def _samples(run: RecordedRun, step: int, top: int, out: TextIO, images: Path) -> None:
    """The best and worst samples of ``step``; the images their prompt showed (a
    vision-language run) are written into ``images``, each sample's named under it."""
    groups = run.groups()
    samples = []
    for gid in run.batches[step]["group_ids"]:
        g = groups.get(gid)
        if g is None:
            continue
        for j, (text, r, err) in enumerate(zip(g["completions"], g["rewards"], g["reward_errors"],
                                               strict=True)):
            samples.append((r, gid, j, len(g["response_ids"][j]), text, err, g["ground_truth"]))
    if not samples:
        print(f"\n=== no samples of step {step}", file=out)
        return
    ordered = sorted(samples, key=lambda x: (-x[0], x[1], x[2]))
    for title, chosen in zip(("best", "worst"), extremes(ordered, top), strict=True):
        if not chosen:  # (the worst only: the best are never empty)
            print(f"\n=== worst: none; no other sample of step {step} scored below "
                  f"{ordered[0][0]:.3f} (of {len(samples)})", file=out)
            continue
        print(f"\n=== {title} {len(chosen)} samples of step {step} (of {len(samples)})", file=out)
        for r, gid, j, n, text, err, truth in chosen:
            note = f"  error: {excerpt(err, 50)}" if err else ""
            print(f"  {r:7.3f}  group {gid}:{j}  {n:3d} tok  truth {excerpt(truth, 12)!r}  "
                  f"{excerpt(text)!r}{note}", file=out)
            group = run.group(groups[gid]["message"])
            for line in transcript(group.samples[j].turns):
                print(f"             {line}", file=out)
            for path in write_images(group.prompt.images, images, f"group_{gid}"):
                print(f"             image: {path}", file=out)


def write_images(images: list[bytes], folder: Path, stem: str) -> list[Path]:
    """``images`` (encoded) as files ``STEM_K.EXT`` in ``folder``, their format's extension."""
    import io

    from PIL import Image

    paths = []
    for k, data in enumerate(images):
        try:
            kind = (Image.open(io.BytesIO(data)).format or "bin").lower()
        except OSError:
            kind = "bin"
        path = folder / f"{stem}_{k}.{kind}"
        folder.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        paths.append(path)
    return paths


def call_summary(request: str, response: str) -> str:
    """One endpoint call in a line: the request's messages (or prompt) and settings, and the
    response's choices; ``request`` and ``response`` are the bodies as recorded."""
    try:
        req, resp = json.loads(request), json.loads(response) if response else {}
    except ValueError:
        return f"request {excerpt(request, 60)!r}"
    settings = "".join(f" {k}={req[k]}" for k in ("n", "temperature", "max_tokens",
                                                   "tool_choice", "stream") if k in req)
    if "messages" in req:
        last = req["messages"][-1] if req["messages"] else {}
        asked = (f"{len(req['messages'])} messages, last {last.get('role')}: "
                 f"{excerpt(str(last.get('content') or ''), 30)!r}")
        if req.get("tools"):
            asked += f", {len(req['tools'])} tools"
    else:
        asked = f"prompt {excerpt(str(req.get('prompt')), 30)!r}"
    answers = [c.get("finish_reason") for c in resp.get("choices", [])]
    return (f"{asked}{settings} -> {len(answers)} choices {answers}, "
            f"policy v{resp.get('policy_version', '?')}")


def transcript(turns: list[Turn]) -> list[str]:
    """A multi-turn sample, one line per turn: the model's text, each tool call with its
    arguments and what it answered (or its error), an environment's observations and rewards."""
    lines = []
    for t in turns:
        where = f"{t.start}:{t.end}"
        if t.role == "assistant":
            reward = f"  (reward {t.reward:g})" if t.reward is not None else ""
            lines.append(f"[model {where:>7}] {excerpt(t.content, 60)!r}{reward}")
            if t.request:  # an endpoint call: what the agent sent and read
                lines.append(f"  [call] {call_summary(t.request, t.response)}")
        elif t.role == "tool":
            answer = f"ERROR {t.failure}: {excerpt(t.error, 40)}" if t.error else \
                repr(excerpt(t.content, 40))
            lines.append(f"[tool  {where:>7}] {t.name or '?'}({excerpt(t.arguments, 30)}) -> "
                         f"{answer}  {t.latency_s:.3f} s")
        else:
            answer = f"ERROR {t.failure}: {excerpt(t.error, 40)}" if t.error else \
                repr(excerpt(t.content, 50))
            lines.append(f"[env   {where:>7}] {answer}  {t.latency_s:.3f} s")
    return lines


def _staleness(run: RecordedRun, out: TextIO) -> None:
    groups = run.groups()
    counts: Counter[int] = Counter()
    for s, b in run.batches.items():
        for gid in b["group_ids"]:
            for v in groups[gid]["policy_versions"] if gid in groups else ():
                counts[staleness(s - 1, v)] += 1  # step s trains with version s - 1
    total = sum(counts.values())
    print(f"\n=== staleness of the {total} trained samples (versions behind the learner)",
          file=out)
    for lag in sorted(counts):
        share = counts[lag] / total
        print(f"  {lag:>3}  {counts[lag]:>7}  {100 * share:5.1f}%  {'#' * round(40 * share)}",
              file=out)


def recorded_validations(run_dir: Path) -> dict[int, dict[str, float]]:
    """``step -> metrics`` of every recorded validation (the last record of a step wins)."""
    rows = last_by(read_table(run_dir, "validation_metrics"), "step")
    return {step: dict(row["metrics"]) for step, row in sorted(rows.items())}


def core_series(validations: dict[int, dict[str, float]]) -> dict[str, dict[str, list]]:
    """``{"src mean@N": {"steps": [...], "values": [...]}, ...}``: the ``val-core`` reward
    metrics (mean@N, maj@N/mean, best@N/mean) of each data source over the validations."""
    out: dict[str, dict[str, list]] = {}
    for step, metrics in validations.items():
        for key, value in metrics.items():
            parts = key.split("/", 3)
            if parts[0] == "val-core" and len(parts) == 4 and not key.endswith("/std"):
                label = f"{parts[1]} {parts[3].removesuffix('/mean')}"
                series = out.setdefault(label, {"steps": [], "values": []})
                series["steps"].append(step)
                series["values"].append(value)
    return out


def _validations(validations: dict[int, dict[str, float]], out: TextIO) -> None:
    print(f"\n=== validations: {len(validations)} (steps {span(sorted(validations))})", file=out)
    for label, series in sorted(core_series(validations).items()):
        first, last = series["values"][0], series["values"][-1]
        print(f"  {label:<40} step {series['steps'][0]:>4}: {first:.3f}   "
              f"step {series['steps'][-1]:>4}: {last:.3f}", file=out)


def plot_validation(run: RecordedRun, validations: dict[int, dict[str, float]],
                    folder: Path) -> Path:
    """``validation.png``: the validation curve of each data source, the training reward
    (the mean over each step's batch) beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, series in sorted(core_series(validations).items()):
        style = "-" if " mean@" in label else "--" if " best@" in label else ":"
        ax.plot(series["steps"], series["values"], style, marker="o", label=f"val {label}")
    xs = [s for s in run.steps if "critic/score/mean" in run.metrics.get(s, {})]
    if xs:
        ax.plot(xs, [run.metrics[s]["critic/score/mean"] for s in xs], color="grey", alpha=0.5,
                label="training reward (batch mean)")
    if not validations:
        ax.text(0.5, 0.5, "no validation in this run", ha="center", va="center",
                transform=ax.transAxes)
    ax.legend(fontsize=8)
    ax.set(title="Validation", xlabel="step", ylabel="score")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = folder / "validation.png"
    tmp = folder / ".validation.png.tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return path


def write_plots(run: RecordedRun, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (title, ylabel, keys) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(7, 4))
        for key, legend in keys:
            xs = [s for s in run.steps if key in run.metrics.get(s, {})]
            if xs:
                ax.plot(xs, [run.metrics[s][key] for s in xs], marker=".", label=legend)
        if not ax.lines:
            ax.text(0.5, 0.5, "not recorded in this run", ha="center", va="center",
                    transform=ax.transAxes)
        else:
            ax.legend(fontsize=8)
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = folder / name
        tmp = folder / f".{name}.tmp.png"
        fig.savefig(tmp, dpi=100)
        plt.close(fig)
        tmp.replace(path)
        written.append(path)
    return written
