"""The console on a terminal: one live panel (rich), redrawn every second.

It shows a progress bar over the learner's steps with the elapsed time and an ETA, the last
step's key numbers (reward, length, KL, IS weight, staleness, tokens/s), the last validation,
the last sampled images' answers (a vision-language job: each image's size, the answer, its
reward; the trackers show the images themselves), and one line per actor with its state and the few figures that matter for its kind. Problems
stand out in red and are listed: an actor restarted or silent, score errors, groups dropped or
never scored, no live reward worker, broken weights. Step and validation lines and the runner's
messages scroll above the panel. Off a terminal the runner prints plain lines instead
(``metrics.ConsoleSink``) and the full status goes to ``status.jsonl`` only.

``render`` is a pure function of a ``View`` (what the runner knows) and the time, so the panel
is tested by rendering it to a string.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from actors.job.metrics import Kind, format_step, format_validation, headline, time_breakdown
from actors.job.trackers import image_size
from messages.control import ImageSample

IDLE_STATES = ("running", "finished")  # states that need no mention


@dataclass
class ActorRow:
    """One actor as the runner sees it (``supervisor.Proc``)."""

    name: str
    kind: str
    ready: bool
    restarts: int
    silent_s: float  # since its last message
    status: Mapping[str, Any]  # its last heartbeat's status
    since_s: float = 0.0  # in its current state
    finished: bool = False  # it reported its work done (Finished): silence is not a problem


@dataclass
class View:
    """What the panel shows, updated by the runner as reports and heartbeats come in."""

    total_steps: int
    max_staleness: int
    run_dir: str
    started: float  # the runner's start (monotonic)
    heartbeat_interval: float = 2.0
    step: int = 0
    first_step: int = 0  # the step this incarnation started from (a resume's checkpoint)
    step_times: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=11))
    last: Mapping[str, float] = field(default_factory=dict)  # the last step's metrics
    validation: tuple[int, Mapping[str, float]] | None = None  # the last validation
    actors: list[ActorRow] = field(default_factory=list)
    note: str = ""  # what the job is doing when that is not training (the final validation)
    samples: tuple[int, list[ImageSample]] | None = None  # the last sampled images, by step

    def record(self, kind: Kind, step: int, metrics: Mapping[str, float], now: float) -> None:
        if kind == "train":
            self.step, self.last = step, metrics
            self.step_times.append((now, step))
        else:
            self.validation = (step, metrics)

    def seconds_per_step(self) -> float | None:
        """Over the last (up to) 10 steps of this incarnation; None before two steps."""
        if len(self.step_times) < 2:
            return None
        (t0, s0), (t1, s1) = self.step_times[0], self.step_times[-1]
        return (t1 - t0) / (s1 - s0) if s1 > s0 else None

    def eta_s(self) -> float | None:
        per_step = self.seconds_per_step()
        return None if per_step is None else per_step * max(0, self.total_steps - self.step)


def clock(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def _num(status: Mapping[str, Any], key: str) -> float:
    value = status.get(key, 0)
    return value if isinstance(value, int | float) else 0


def actor_figures(row: ActorRow, heartbeat_interval: float) -> tuple[str, list[str]]:
    """The figures that matter for ``row``'s kind, and its problems (empty: none)."""
    s = row.status
    problems = []
    if row.restarts:
        problems.append(f"restarted {row.restarts}x")
    if row.ready and not row.finished and row.silent_s > max(10.0, 5 * heartbeat_interval):
        problems.append(f"silent {row.silent_s:.0f}s")
    for key in ("weights_error", "router_error", "body_error", "waiting"):
        if s.get(key):
            problems.append(str(s[key])[:60])
    parts: list[str] = []
    if row.kind == "sampler":
        parts = [f"{_num(s, 'tokens_per_s'):.1f} tok/s", f"in flight {int(_num(s, 'in_flight'))}",
                 f"v{int(_num(s, 'version'))}", f"groups {int(_num(s, 'groups'))}"]
        if _num(s, "val_groups"):
            parts.append(f"val groups {int(_num(s, 'val_groups'))}")
        for key, label in (("score_errors", "score errors"), ("score_failed", "unscored groups")):
            if _num(s, key):
                problems.append(f"{label} {int(_num(s, key))}")
        if _num(s, "score_errors") and s.get("first_score_error"):  # the first one says why
            problems.append(f"first: {str(s['first_score_error']).splitlines()[0][:100]}")
    elif row.kind == "router":
        for key, w in sorted(s.items()):
            if key.startswith("worker/") and isinstance(w, Mapping):
                parts.append(f"{key[7:]} {w.get('in_flight', 0)}/{w.get('capacity', 0)}"
                             f" p99 {w.get('p99_ms', 0):.0f}ms")
        parts.append(f"pending {int(_num(s, 'pending'))}")
        if _num(s, "failed"):
            problems.append(f"failed requests {int(_num(s, 'failed'))}")
    elif row.kind == "reward":
        parts = [f"done {int(_num(s, 'requests_done'))}",
                 f"in flight {int(_num(s, 'requests_in_flight'))}"]
        if isinstance(s.get("pool"), str):  # a model pool's replica (config/pools.py)
            parts.insert(0, f"pool {s['pool']}")
            if s.get("asleep") is True:
                parts.append(f"asleep ({_num(s, 'freed_mb'):.0f} MiB freed)")
        for key in ("score_errors", "score_timeouts", "score_crashes"):
            if _num(s, key):
                problems.append(f"{key.replace('_', ' ')} {int(_num(s, key))}")
    elif row.kind == "replay":
        parts = [f"held {int(_num(s, 'held'))}", f"in flight {int(_num(s, 'in_flight'))}",
                 f"trained {int(_num(s, 'trained'))}", f"dropped {int(_num(s, 'dropped'))}"]
        if _num(s, "val_step") >= 0 and _num(s, "val_total"):
            parts.append(f"validating @{int(_num(s, 'val_step'))}: "
                         f"{int(_num(s, 'val_done'))}/{int(_num(s, 'val_total'))}")
        if s.get("stopped_for"):  # scoring failed past reward.max_error_share
            problems.append(str(s["stopped_for"])[:120])
        for key in ("dropped_stale", "dropped_filtered", "dropped_score_failed",
                    "dropped_score_errors"):
            if _num(s, key):
                problems.append(f"{key.replace('_', ' ')} {int(_num(s, key))}")
    elif row.kind == "learner":
        parts = [f"step {int(_num(s, 'step'))}", f"v{int(_num(s, 'version'))}",
                 f"waited {_num(s, 'wait_batch_s'):.1f}s for its last batch"]
    return "  ".join(parts), problems


def samples_line(step: int, samples: list[ImageSample], width: int = 24) -> str:
    """``images @step: [WxH] "answer" reward | ...``: what the policy said to each sampled image,
    the answer cut to ``width`` characters."""
    def one(s: ImageSample) -> str:
        sizes = " ".join("{}x{}".format(*image_size(data)[:2]) for data in s.images)
        answer = " ".join(s.answer.split())
        answer = answer if len(answer) <= width else answer[:width - 1] + "…"
        return f"[{sizes}] {answer!r} {s.reward:.2f}"

    return f"images @{step}: " + " | ".join(one(s) for s in samples)


def render(view: View, now: float) -> RenderableType:
    """The panel, as of ``now`` (monotonic)."""
    head = Table.grid(padding=(0, 1))
    head.add_column()
    head.add_column(width=40)
    head.add_column()
    done = view.step
    share = 100 * done / view.total_steps if view.total_steps else 0
    head.add_row(Text(f"step {done}/{view.total_steps}", style="bold"),
                 ProgressBar(total=view.total_steps, completed=done, width=40),
                 Text(f"{share:3.0f}%  elapsed {clock(now - view.started)}  "
                      f"ETA {clock(view.eta_s())}"
                      + (f"  {view.seconds_per_step():.1f}s/step"
                         if view.seconds_per_step() else "")))
    lines: list[RenderableType] = [head]
    if view.last:
        m = view.last
        lines.append(Text(
            f"last step: reward {m.get('critic/score/mean', 0):.3f}"
            f"  len {m.get('response_length/mean', 0):.1f}"
            f"  kl {m.get('rollout_corr/kl', 0):+.4f}"
            f"  is_w {m.get('rollout_corr/is_weight_mean', 1):.3f}"
            f"  stale {m.get('staleness/mean', 0):.2f}/{view.max_staleness}"
            f"  {m.get('perf/throughput', 0):.1f} tok/s"
            f"  {m.get('timing_s/step', 0):.1f}s"))
        if breakdown := time_breakdown(m):
            lines.append(Text(f"step time (s): {breakdown}", style="dim"))
    if view.validation is not None:
        step, metrics = view.validation
        figures = "  ".join(f"{source} " + " ".join(f"{k} {v:.3f}" for k, v in f.items())
                            for source, f in sorted(headline(metrics).items()))
        lines.append(Text(f"validation @{step}: {figures}", style="cyan"))
    if view.samples is not None:
        lines.append(Text(samples_line(*view.samples), style="dim"))
    if view.note:
        lines.append(Text(view.note, style="bold yellow"))
    actors = Table.grid(padding=(0, 2))
    actors.add_column(no_wrap=True)
    actors.add_column(no_wrap=True)
    actors.add_column()
    problems = []
    for row in view.actors:
        figures, trouble = actor_figures(row, view.heartbeat_interval)
        state = str(row.status.get("state", "running" if row.ready else "starting"))
        if row.finished:  # done (its process may be gone): whatever it said last, it finished
            state = "finished"
        if state not in IDLE_STATES and row.since_s >= 1:
            state += f" {row.since_s:.0f}s"
        style = "red" if trouble else "dim" if row.finished else ""
        actors.add_row(Text(row.name, style=style or "bold"), Text(state, style=style),
                       Text(figures + ("  " + "; ".join(trouble) if trouble else ""),
                            style=style))
        problems += [f"{row.name}: {t}" for t in trouble]
    lines.append(actors)
    if problems:
        lines.append(Text("problems: " + " | ".join(problems), style="bold red"))
    lines.append(Text(f"run directory: {view.run_dir} (actors' output: logs/NAME.log)",
                      style="dim"))
    return Group(*lines)


class LiveView:
    """The ``console`` logger on a terminal: the panel, plus step and validation lines (and
    anything the runner prints) scrolling above it."""

    name = "console"

    def __init__(self, view: View, console: Console | None = None) -> None:
        self.view = view
        self.live = Live(get_renderable=lambda: render(self.view, time.monotonic()),
                         console=console, refresh_per_second=1, transient=False,
                         redirect_stdout=True, redirect_stderr=True)

    def start(self) -> None:
        self.live.start()

    def write(self, kind: Kind, step: int, metrics: Mapping[str, float]) -> None:
        self.view.record(kind, step, metrics, time.monotonic())
        line = (format_step(step, metrics, self.view.total_steps, self.view.max_staleness)
                if kind == "train" else format_validation(step, metrics))
        self.live.console.print(line, markup=False, highlight=False)

    def write_samples(self, step: int, samples: list[ImageSample]) -> None:
        self.view.samples = (step, list(samples))

    def close(self, outcome: str) -> None:
        self.live.refresh()
        self.live.stop()
