"""A user's own policy loss or advantage estimator from a file (``name = "custom"``): the examples
of docs/algorithms.md, run as written, give exactly the built-ins they re-implement (loss,
gradient, metrics; advantages; a whole learner step); a bad file, function, signature or option
is one line at ``check``; a function that raises names its file; a tiny job trains with a loss
from a file and ``rerun --step`` reproduces a step exactly, or says the file changed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from actors.job.config.load import apply_overrides, decode_topology, load_topology
from actors.runtime.config import ConfigError, UserCodeError
from actors.runtime.config.estimators import Grpo
from actors.runtime.config.losses import Vanilla
from actors.sandbox.preflight import check_function
from kernels.advantages import compute_advantages
from kernels.policy_losses import policy_loss
from tests.jobs import ROOT, command, metrics
from tests.learner_cases import make_trainer
from tests.test_learner import make_groups, params

DOCS = ROOT / "docs" / "algorithms.md"
LOSS = ["algorithm.policy_loss.name=custom", "algorithm.policy_loss.function=my_loss"]
ESTIMATOR = ["algorithm.adv_estimator.name=custom",
             "algorithm.adv_estimator.function=my_estimator"]


def example(name: str) -> str:
    """The docs' Python block whose first line is ``# NAME``."""
    blocks = re.findall(r"^```python\n(.*?)^```", DOCS.read_text(), re.M | re.S)
    (found,) = [b for b in blocks if b.startswith(f"# {name}\n")]
    return found


@pytest.fixture
def files(tmp_path) -> Path:
    for name in ("my_loss.py", "my_estimator.py"):
        (tmp_path / name).write_text(example(name))
    return tmp_path


def topology(*overrides: str):
    return decode_topology(apply_overrides({}, list(overrides)))


def inputs(seed: int, dtype=torch.float32):
    """Per-token tensors (B, T) with padding, a few large log-ratios and negative advantages."""
    gen = torch.Generator().manual_seed(seed)
    shape = (6, 9)
    lp = (torch.randn(shape, generator=gen, dtype=dtype) - 1.0).requires_grad_()
    old = lp.detach() + 0.4 * torch.randn(shape, generator=gen, dtype=dtype)
    old[0, 0] += 25.0  # past the ±20 clamp
    adv = torch.randn(shape[0], 1, generator=gen, dtype=dtype).expand(shape).contiguous()
    mask = (torch.rand(shape, generator=gen) > 0.25).to(dtype)
    mask[5] = 0  # an all-padding row
    weights = torch.rand(shape, generator=gen, dtype=dtype) * 2
    return lp, old, adv, mask, weights


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-sum",
                                  "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("weighted", [False, True])
def test_the_docs_loss_is_vanillas_loss_and_gradient(files, mode, dual_clip, weighted):
    row = topology(f"algorithm.policy_loss.path={files / 'my_loss.py'}", *LOSS).algorithm \
        .policy_loss
    got = {}
    for which, loss_fn in (("vanilla", Vanilla()), ("custom", row)):
        lp, old, adv, mask, weights = inputs(0)
        loss, m = policy_loss(loss_fn, lp, old, adv, mask, clip_low=0.2, clip_high=0.28,
                              dual_clip=dual_clip, weights=weights if weighted else None,
                              loss_agg_mode=mode, token_count=40, seq_count=5, norm_constant=9.0)
        loss.backward()
        got[which] = (loss.detach(), lp.grad, m)
    (a, ga, ma), (b, gb, mb) = got["vanilla"], got["custom"]
    assert torch.equal(a, b) and torch.equal(ga, gb)
    assert set(mb) < set(ma) and all(torch.equal(ma[k], mb[k]) for k in mb)


def test_the_docs_loss_takes_its_option(files):
    row = topology(f"algorithm.policy_loss.path={files / 'my_loss.py'}", *LOSS,
                   "algorithm.policy_loss.kwargs={negative_scale=0.5}").algorithm.policy_loss
    lp, old, adv, mask, _ = inputs(1)
    half, _ = policy_loss(row, lp, old, adv, mask, clip_low=0.2, clip_high=0.2,
                          dual_clip=None, loss_agg_mode="token-sum")
    whole, _ = policy_loss(Vanilla(), lp, old, torch.where(adv < 0, adv * 0.5, adv), mask,
                           clip_low=0.2, clip_high=0.2, loss_agg_mode="token-sum")
    assert torch.equal(half, whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_docs_estimator_is_grpos(files, dtype):
    row = topology(f"algorithm.adv_estimator.path={files / 'my_estimator.py'}", *ESTIMATOR) \
        .algorithm.adv_estimator
    gen = torch.Generator().manual_seed(2)
    rewards = torch.zeros(12, 7, dtype=dtype)
    mask = (torch.rand(12, 7, generator=gen) > 0.2).float()
    mask[:, 0] = 1
    last = mask.cumsum(-1).argmax(-1)  # each row's last response token
    rewards[torch.arange(12), last] = torch.randn(12, generator=gen, dtype=dtype)
    rewards[torch.arange(4, 8), last[4:8]] = 0.3  # a group with one reward: no signal
    a = compute_advantages(Grpo(), rewards, mask, group_size=4)
    b = compute_advantages(row, rewards, mask, group_size=4)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert (b[0][4:8] == 0).all()


def test_a_learner_step_with_the_docs_loss_and_estimator_is_the_builtins(tiny_model, tmp_path,
                                                                         files):
    """The learner calls them with the built-ins' inputs: a whole step (two epochs, the
    correction's importance weights, dual clip) moves the weights exactly as vanilla and grpo."""
    shared = ["learner.ppo_epochs=2", "algorithm.clip_ratio_high=0.28"]
    custom = [f"algorithm.policy_loss.path={files / 'my_loss.py'}", *LOSS,
              f"algorithm.adv_estimator.path={files / 'my_estimator.py'}", *ESTIMATOR]
    steps = {}
    for which, extra in (("builtin", []), ("custom", custom)):
        t = make_trainer(tiny_model, tmp_path / which, *shared, *extra)
        m = t.train_step(make_groups(t, behaviour_offset=-0.1))
        steps[which] = (m, params(t))
    (ma, pa), (mb, pb) = steps["builtin"], steps["custom"]
    assert ma["actor/pg_clipfrac"] > 0 and ma["rollout_corr/is_weight_mean"] != 1.0
    assert {k: v for k, v in mb.items() if not k.startswith(("timing_s/", "perf/"))} == \
        {k: v for k, v in ma.items() if k in mb and not k.startswith(("timing_s/", "perf/"))}
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


# what ``check`` says, one line each (the sandboxed child's check, run here in-process)
BAD = [
    ("import torch\nimport nonexistent_module\n", "my_loss", [],
     "my_loss.py line 2: ModuleNotFoundError: No module named 'nonexistent_module'"),
    ("def other(*a, **k): pass\n", "my_loss", [], "has no 'my_loss' (it defines: other)"),
    ("def my_loss(logprobs, old_logprobs, advantages):\n    pass\n", "my_loss", [],
     "cannot be called as the learner calls a policy loss"),
    ("def my_loss(logprobs, old_logprobs, advantages, mask, **kw):\n    pass\n", "my_loss",
     [], ""),
    ("def my_loss(logprobs, old_logprobs, advantages, mask, *, clip_low, clip_high, dual_clip,"
     " weights, loss_agg_mode, token_count, seq_count, norm_constant, scale=1.0):\n    pass\n",
     "my_loss", ["scale", "tau"], "takes no option 'tau' (kwargs)"),
    ("my_loss = 3\n", "my_loss", [], "my_loss is a int, not a function"),
    ("def my_loss(logprobs, old_logprobs, advantages, mask, **kw):\n    pass\n", "my_loss",
     ["clip_low"], "my_loss.py: its kwargs name 'clip_low', which the learner passes itself to "
     "a policy loss"),
]


@pytest.mark.parametrize(("source", "name", "kwargs", "said"), BAD)
def test_check_says_what_is_wrong_in_one_line(tmp_path, source, name, kwargs, said):
    (tmp_path / "my_loss.py").write_text(source)
    problem = check_function(str(tmp_path / "my_loss.py"), "", name, "policy_loss", kwargs)
    assert said in problem and "\n" not in problem
    assert not said or "my_loss" in problem


def test_an_estimator_is_checked_against_the_estimators_call(tmp_path):
    (tmp_path / "e.py").write_text("def e(token_level_rewards, response_mask):\n    pass\n")
    problem = check_function(str(tmp_path / "e.py"), "", "e", "adv_estimator", [])
    assert problem.startswith("e.py: e(token_level_rewards, response_mask) cannot be called as "
                              "the learner calls an advantage estimator")


def test_the_path_is_relative_to_the_topology_files_directory(files, tmp_path, monkeypatch):
    (files / "topology.toml").write_text('[algorithm.policy_loss]\nname = "custom"\n'
                                         'path = "my_loss.py"\nfunction = "my_loss"\n')
    monkeypatch.chdir(ROOT)  # elsewhere
    row = load_topology(files / "topology.toml").algorithm.policy_loss
    assert row.path == str(files / "my_loss.py")
    assert len(row.sha256) == 64
    with pytest.raises(ConfigError, match=r"^algorithm\.policy_loss\.path: no file '/.*/gone\.py'$"):
        load_topology(files / "topology.toml", ["algorithm.policy_loss.path=gone.py"])
    with pytest.raises(ConfigError, match=r"^algorithm\.adv_estimator\.name: 'mine' is not one of .*"
                                          r", custom \(a function of your own from a file: "
                                          r"name = \"custom\", function = 'mine'\)$"):
        decode_topology({"algorithm": {"adv_estimator": {"name": "mine", "path": "x.py"}}})
    with pytest.raises(ConfigError, match=r"^algorithm\.policy_loss\.function: must be set$"):
        decode_topology({"algorithm": {"policy_loss": {"name": "custom", "path": "x.py"}}})


def test_runner_check_names_the_key_and_the_file(files):
    (files / "my_loss.py").write_text("def my_loss(logprobs):\n    pass\n")
    res = subprocess.run([sys.executable, "runner.py", "check", "topology.toml",
                          f"algorithm.policy_loss.path={files / 'my_loss.py'}", *LOSS],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stdout + res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("error: bad topology: algorithm.policy_loss: my_loss.py: my_loss("
                           "logprobs) cannot be called as the learner calls a policy loss")


def test_a_loss_that_raises_names_its_file_and_line(tiny_model, tmp_path):
    (tmp_path / "bad.py").write_text(
        "def my_loss(logprobs, old_logprobs, advantages, mask, **kw):\n"
        "    raise ValueError('no loss today')\n")
    t = make_trainer(tiny_model, tmp_path, f"algorithm.policy_loss.path={tmp_path / 'bad.py'}",
                     *LOSS)
    with pytest.raises(UserCodeError) as caught:
        t.train_step(make_groups(t))
    assert str(caught.value) == (f"algorithm.policy_loss: my_loss in {tmp_path / 'bad.py'} "
                                 "raised: bad.py line 2: ValueError: no loss today")


@pytest.mark.parametrize(("role", "body", "said"), [
    ("policy_loss", "return logprobs.sum(-1), {}",
     "returned (a tensor of shape (6,), dict), not (loss, metrics): a scalar tensor and a dict"),
    ("policy_loss", "return logprobs.sum()",
     "returned Tensor, not (loss, metrics): a scalar tensor and a dict"),
    ("adv_estimator", "return logprobs[:, :1], logprobs[:, :1]",
     "returned (a tensor of shape (6, 1), a tensor of shape (6, 1)), not (advantages, returns): "
     "two tensors of the rewards' shape (6, 9)")])
def test_a_result_of_the_wrong_shape_names_the_file(tmp_path, role, body, said):
    (tmp_path / "f.py").write_text(f"def f(logprobs, *args, **kw):\n    {body}\n")
    key = "policy_loss" if role == "policy_loss" else "adv_estimator"
    row = topology(f"algorithm.{key}.path={tmp_path / 'f.py'}", f"algorithm.{key}.name=custom",
                   f"algorithm.{key}.function=f")
    fn = getattr(row.algorithm, key).load()
    with pytest.raises(UserCodeError) as caught:
        fn(inputs(0)[0], None, None)
    assert str(caught.value) == f"algorithm.{key}: f in {tmp_path / 'f.py'} {said}"


def test_a_file_edited_during_the_run_changes_nothing_once_loaded(files):
    """The learner reads the file once (its first load, hash checked); the kernel asks the row
    for its function at every micro-batch and gets that one, so editing the file while the run
    goes on neither changes the loss nor stops the run."""
    row = topology(f"algorithm.policy_loss.path={files / 'my_loss.py'}", *LOSS).algorithm \
        .policy_loss
    first = row.load()
    (files / "my_loss.py").write_text("def my_loss(*args, **kwargs):\n    raise ValueError\n")
    assert row.load() is first
    lp, old, adv, mask, _ = inputs(0)
    loss, _ = policy_loss(row, lp, old, adv, mask, clip_low=0.2, clip_high=0.2,
                          loss_agg_mode="token-mean")
    want, _ = policy_loss(Vanilla(), lp, old, adv, mask, clip_low=0.2, clip_high=0.2,
                          loss_agg_mode="token-mean")
    assert torch.equal(loss, want)


def test_a_changed_file_is_refused_by_the_learner(tiny_model, tmp_path, files):
    topo = [f"algorithm.policy_loss.path={files / 'my_loss.py'}", *LOSS]
    row = topology(*topo).algorithm.policy_loss
    (files / "my_loss.py").write_text(example("my_loss.py") + "\n# edited\n")
    with pytest.raises(UserCodeError, match=r"algorithm\.policy_loss\.path: .*my_loss\.py "
                                            r"changed since the topology was loaded"):
        make_trainer(tiny_model, tmp_path, *topo, f"algorithm.policy_loss.sha256={row.sha256}")


def test_a_job_trains_with_a_loss_from_a_file_and_reruns_exactly(tiny_model, tmp_path, files):
    run_dir = tmp_path / "run"
    res = subprocess.run(command(tiny_model, run_dir, "learner.total_steps=2", "algorithm.n=4",
                                 f"algorithm.policy_loss.path={files / 'my_loss.py'}", *LOSS,
                                 "algorithm.policy_loss.kwargs={negative_scale=0.5}"),
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert [r["step"] for r in metrics(run_dir)] == [1, 2]

    def rerun(*overrides: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "runner.py", "rerun", str(run_dir), "--step", "2",
                               *overrides], cwd=ROOT, capture_output=True, text=True, timeout=300)

    again = rerun()
    assert again.returncode == 0 and "result: match — all" in again.stdout, \
        again.stdout[-4000:] + again.stderr[-4000:]
    # a bundle carries the file: it reruns exactly wherever the file is not
    packed = subprocess.run([sys.executable, "runner.py", "bundle", str(run_dir), "--step", "2",
                             "-o", str(tmp_path / "step2.tar")], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert packed.returncode == 0, packed.stdout + packed.stderr
    (files / "my_loss.py").rename(files / "away.py")
    bundled = subprocess.run([sys.executable, str(ROOT / "runner.py"), "rerun",
                              str(tmp_path / "step2.tar")], cwd=tmp_path, capture_output=True,
                             text=True, timeout=300)
    assert bundled.returncode == 0 and "result: match — all" in bundled.stdout, \
        bundled.stdout[-4000:] + bundled.stderr[-4000:]
    (files / "away.py").rename(files / "my_loss.py")
    (files / "my_loss.py").write_text(example("my_loss.py").replace("negative_scale=1.0",
                                                                    "negative_scale=2.0"))
    changed = rerun()
    assert changed.returncode == 2
    (line,) = changed.stderr.strip().splitlines()
    assert line.startswith("error: algorithm.policy_loss.path: ") and \
        "my_loss.py changed since the topology was loaded" in line
    # on purpose: the new file (the same computation here: the run sets negative_scale)
    assert rerun('algorithm.policy_loss.sha256=""').returncode == 0
    # a resume with the file edited trains on with it, and says so once
    more = subprocess.run(command(tiny_model, run_dir, "learner.total_steps=3", "algorithm.n=4",
                                  f"algorithm.policy_loss.path={files / 'my_loss.py'}", *LOSS,
                                  "algorithm.policy_loss.kwargs={negative_scale=0.5}"),
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert more.returncode == 0, more.stdout[-4000:] + more.stderr[-4000:]
    said = [line for line in more.stdout.splitlines() if "changed since this run's last" in line]
    assert len(said) == 1 and said[0].startswith(
        f"=== algorithm.policy_loss.path: {files / 'my_loss.py'} changed since this run's last "
        "start (sha256 "), more.stdout[-3000:]
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3]
