"""The live panel, rendered to a string (rich's recording console): progress and ETA, the last
step's numbers, the last validation, one line per actor with its figures, problems called out.
No terminal and no sleeps: the panel is a function of what the runner knows and the time."""

from __future__ import annotations

import io
import re

from rich.console import Console

from actors.job.liveview import ActorRow, LiveView, View, clock, render
from actors.job.metrics import format_validation

STEP = {"critic/score/mean": 0.4688, "response_length/mean": 19.8, "rollout_corr/kl": 0.0025,
        "rollout_corr/is_weight_mean": 0.999, "staleness/mean": 1.0, "perf/throughput": 91.8,
        "timing_s/step": 17.0}
VAL = {"val-core/arithmetic/reward/mean@4": 0.5625, "val-core/arithmetic/reward/maj@4/mean": 0.6,
       "val-core/arithmetic/reward/best@4/mean": 0.84, "val-aux/arithmetic/reward/pass@1": 0.5625,
       "val-aux/arithmetic/reward/pass@4": 0.8438, "val-aux/prompts": 32.0,
       "timing_s/validation": 41.0}


def text_of(view: View, now: float) -> tuple[str, Console]:
    console = Console(record=True, width=150, file=io.StringIO(), color_system="truecolor")
    console.print(render(view, now))
    return console.export_text(clear=False), console


def rows(**changes) -> list[ActorRow]:
    out = [
        ActorRow("replay-0", "replay", True, 0, 0.5, {"state": "running", "held": 4,
                                                       "in_flight": 8, "trained": 48, "dropped": 0,
                                                       "val_step": 10, "val_done": 12,
                                                       "val_total": 32}),
        ActorRow("router-0", "router", True, 0, 0.5, {
            "pending": 0, "worker/reward-0": {"in_flight": 2, "capacity": 4, "p99_ms": 12.3}}),
        ActorRow("learner-0", "learner", True, 0, 0.5, {"state": "training step 13", "step": 12,
                                                         "version": 12, "wait_batch_s": 0.4}, 3.0),
        ActorRow("reward-0", "reward", True, 0, 0.5, {"requests_done": 96, "score_errors": 0,
                                                       "requests_in_flight": 2}),
        ActorRow("sampler-0", "sampler", True, 0, 0.5, {"tokens_per_s": 88.1, "in_flight": 4,
                                                         "version": 11, "groups": 52}),
    ]
    for name, change in changes.items():
        row = next(r for r in out if r.name == name.replace("_", "-"))
        for k, v in change.items():
            if k in ("restarts", "silent_s"):
                setattr(row, k, v)
            else:
                row.status = {**row.status, k: v}
    return out


def view_at_step_12() -> View:
    view = View(total_steps=30, max_staleness=1, run_dir="runs/x", started=0.0)
    for step in range(3, 13):  # one step every 17 s, from t = 100 s
        view.record("train", step, STEP, now=100.0 + 17 * (step - 3))
    view.record("validation", 10, VAL, now=240.0)
    view.actors = rows()
    return view


def test_the_panel_shows_progress_eta_the_last_step_validation_and_every_actor():
    view = view_at_step_12()
    assert view.seconds_per_step() == 17.0 and view.eta_s() == 17.0 * 18
    text, _ = text_of(view, now=253.0)
    assert "step 12/30" in text and " 40%" in text
    assert "elapsed 4:13" in text and f"ETA {clock(17 * 18)}" in text and "ETA 5:06" in text
    assert "last step: reward 0.469  len 19.8  kl +0.0025  is_w 0.999  stale 1.00/1" in text
    assert "validation @10: arithmetic mean@4 0.562 maj@4 0.600 pass@4 0.844" in text
    lines = {line.split()[0]: line for line in text.splitlines() if line.split()}
    assert "held 4  in flight 8  trained 48  dropped 0  validating @10: 12/32" in lines["replay-0"]
    assert "reward-0 2/4 p99 12ms" in lines["router-0"]
    assert "training step 13 3s" in lines["learner-0"] and "waited 0.4s" in lines["learner-0"]
    assert "done 96" in lines["reward-0"]
    assert "88.1 tok/s  in flight 4  v11  groups 52" in lines["sampler-0"]
    assert "problems" not in text


def test_problems_stand_out():
    view = view_at_step_12()
    view.actors = rows(sampler_0={"restarts": 1, "score_failed": 2},
                       reward_0={"score_errors": 3, "score_timeouts": 1},
                       replay_0={"dropped": 5, "dropped_stale": 5},
                       router_0={"waiting": "no live worker for reward"},
                       learner_0={"silent_s": 60.0})
    text, console = text_of(view, now=253.0)
    problems = " ".join(text[text.index("problems: "):text.index("run directory")].split())
    for expected in ("sampler-0: restarted 1x", "sampler-0: unscored groups 2",
                     "reward-0: score errors 3", "reward-0: score timeouts 1",
                     "replay-0: dropped stale 5", "router-0: no live worker for reward",
                     "learner-0: silent 60s"):
        assert expected in problems
    # each of those actors' own line is red, the others are not
    html = console.export_html(inline_styles=True)
    for name in ("sampler-0", "reward-0", "replay-0", "router-0", "learner-0"):
        assert re.search(f'<span style="color: #800000[^"]*">{name} *</span>', html), name
    calm, console = text_of(view_at_step_12(), now=253.0)
    assert not re.search('<span style="color: #800000', console.export_html(inline_styles=True))


def test_before_the_second_step_there_is_no_eta_and_a_startup_shows_states():
    view = View(total_steps=30, max_staleness=1, run_dir="runs/x", started=0.0)
    view.actors = [ActorRow("learner-0", "learner", False, 0, 1.0, {"state": "loading model"},
                            12.0)]
    text, _ = text_of(view, now=14.0)
    assert "step 0/30" in text and "ETA --:--" in text and "loading model 12s" in text
    view.note = "waiting for the validation of step 30"
    assert "waiting for the validation of step 30" in text_of(view, now=15.0)[0]


def test_the_live_logger_prints_step_and_validation_lines_above_the_panel():
    out = io.StringIO()
    view = View(total_steps=3, max_staleness=1, run_dir="runs/x", started=0.0)
    live = LiveView(view, Console(file=out, width=150, force_terminal=False))
    live.start()
    live.write("train", 1, STEP)
    live.write("validation", 1, VAL)
    live.close("finished")
    text = out.getvalue()
    assert "step    1/3 | reward 0.469" in text
    assert format_validation(1, VAL) in text
    assert view.step == 1 and view.validation == (1, VAL)


def test_scoring_failures_show_in_red_with_their_count_and_the_first_error():
    view = view_at_step_12()
    view.actors = rows(sampler_0={"score_errors": 2, "first_score_error":
                                  "flaky.compute_score: ValueError: flaky"},
                       replay_0={"dropped_score_errors": 4, "stopped_for":
                                 "scoring failed on 32 of 32 samples (100%) of the batch of step 1"})
    text, console = text_of(view, now=253.0)
    problems = " ".join(text[text.index("problems: "):text.index("run directory")].split())
    for expected in ("sampler-0: score errors 2",
                     "sampler-0: first: flaky.compute_score: ValueError: flaky",
                     "replay-0: scoring failed on 32 of 32 samples (100%) of the batch of step 1",
                     "replay-0: dropped score errors 4"):
        assert expected in problems, problems
    html = console.export_html(inline_styles=True)
    assert re.search('<span style="color: #800000[^"]*">sampler-0 *</span>', html)


def test_a_finished_actor_shows_as_finished_not_as_silent():
    """The learner done with its last step sends no heartbeat while the final validation runs:
    its row (as the runner builds it, ``Proc.row``) says finished, in no problem and not red;
    the same silence from a learner that has not finished is a problem."""
    from actors.job.processes import Proc

    now = 1000.0
    done = Proc("learner", 0, ready=True, finished=True, last_seen=now - 16.0,
                status={"state": "finished", "step": 30, "version": 30},
                state=("training step 30", now - 40.0))
    view = view_at_step_12()
    view.actors = [r for r in rows() if r.name != "learner-0"] + [done.row(now)]
    text, console = text_of(view, now=253.0)
    line = next(t for t in text.splitlines() if t.startswith("learner-0"))
    assert "finished" in line and "silent" not in line and "finished 40s" not in line
    assert "problems" not in text
    assert not re.search('<span style="color: #800000', console.export_html(inline_styles=True))
    hung = Proc("learner", 0, ready=True, last_seen=now - 16.0, status={"state": "training"})
    view.actors = [r for r in rows() if r.name != "learner-0"] + [hung.row(now)]
    assert "learner-0: silent 16s" in text_of(view, now=253.0)[0]


def test_the_panel_shows_the_last_sampled_images_answers():
    from messages.control import ImageSample
    from tests.tiny_vlm import solid_png

    out = io.StringIO()
    view = view_at_step_12()
    live = LiveView(view, Console(file=out, width=150, force_terminal=False))
    red, blue = solid_png((220, 30, 30), 56), solid_png((30, 30, 220), 28)
    assert "images @" not in text_of(view, now=253.0)[0]  # a text job shows no such line
    live.write_samples(10, [ImageSample([red], "red, I think", 1.0, 3),
                            ImageSample([blue, red], "a very long answer that goes on and on", 0.0,
                                        4)])
    text = text_of(view, now=253.0)[0]
    assert ("images @10: [56x56] 'red, I think' 1.00 | [28x28 56x56] 'a very long answer that…' "
            "0.00") in text, text


def test_off_a_terminal_a_long_validation_round_says_how_far_it_has_got():
    from actors.job.supervisor import VALIDATION_PROGRESS_S, validation_progress

    status = {"val_step": 0, "val_done": 12, "val_total": 64}
    shown, line = validation_progress(status, set(), (-1, 0.0), now=100.0)
    assert (shown, line) == ((0, 100.0), "")  # the round's start: nothing yet
    shown, line = validation_progress(status, set(), shown, now=100.0 + VALIDATION_PROGRESS_S - 1)
    assert line == ""
    shown, line = validation_progress(status, set(), shown, now=100.0 + VALIDATION_PROGRESS_S)
    assert line == "... validation of step 0: 12/64 prompts scored"
    assert shown == (0, 100.0 + VALIDATION_PROGRESS_S)  # the next one a period later
    # a round done, reported, or none running: nothing to say
    for done in ({**status, "val_done": 64}, {**status, "val_step": -1}, {}):
        assert validation_progress(done, set(), (0, 0.0), now=1e6)[1] == ""
    assert validation_progress(status, {0}, (0, 0.0), now=1e6)[1] == ""
