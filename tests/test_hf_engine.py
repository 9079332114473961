"""The transformers engine on devices and settings the CPU suite otherwise never shows: every
tensor it makes during ``generate`` on the input's device, only the sampled tokens' log-probs
kept, and only the job's sampling parameters applied."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading

import anyio
import pytest
import torch
from transformers import GenerationConfig, StoppingCriteriaList

from actors.data.chat import ChatTokenizer
from actors.sampler.engines.base import GenerateRequest
from actors.sampler.engines.hf import HFEngine, _Abort, _TokenLogprobs, sampling_config
from kernels.logprobs import token_logprobs
from messages.rollout import ChatMessage, SamplingParams
from tests.jobs import ROOT


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_the_abort_criterion_answers_on_the_inputs_device(device):
    # meta stands for a device other than the default one (a CUDA tensor on a GPU): what the
    # criterion returns is ORed by transformers into a tensor on the input's device
    ids = torch.zeros(3, 5, dtype=torch.long, device=device)
    flag = threading.Event()
    done = _Abort(flag)(ids, None)
    assert done.device == ids.device and done.dtype == torch.bool and done.shape == (3,)
    assert StoppingCriteriaList([_Abort(flag)])(ids, None).device == ids.device


def test_the_logprob_recorder_keeps_its_rows_on_the_inputs_device():
    rec = _TokenLogprobs(0.7)
    ids = torch.zeros(2, 4, dtype=torch.long, device="meta")
    scores = torch.zeros(2, 11, device="meta")
    assert rec(ids, scores) is scores  # the scores pass through unchanged
    rec(torch.zeros(2, 5, dtype=torch.long, device="meta"), scores)
    out = rec.finish(torch.zeros(2, 6, dtype=torch.long, device="meta"), width=4)
    assert out.device.type == "meta" and out.shape == (2, 2)


def test_the_recorder_gives_the_log_prob_of_each_chosen_token():
    torch.manual_seed(0)
    steps = torch.randn(3, 2, 7)  # (R, B, V) raw logits of three steps
    chosen = torch.randint(0, 7, (2, 3))  # (B, R)
    prompt = torch.zeros(2, 4, dtype=torch.long)
    rec = _TokenLogprobs(0.7)
    for r in range(3):
        rec(torch.cat([prompt, chosen[:, :r]], 1), steps[r])
    got = rec.finish(torch.cat([prompt, chosen], 1), width=4)
    want = token_logprobs(steps.transpose(0, 1), chosen, 0.7)
    torch.testing.assert_close(got, want)


@pytest.mark.anyio
async def test_generate_keeps_no_per_step_logits(tiny_model):
    engine = HFEngine(tiny_model, "float32", seed=0)
    outputs = []
    real = engine.model.generate

    def generate(*args, **kwargs):
        outputs.append(out := real(*args, **kwargs))
        return out

    engine.model.generate = generate
    ids = ChatTokenizer(tiny_model).prompt_ids([ChatMessage("user", "say a")])
    (gens,) = await engine.generate([GenerateRequest(ids, SamplingParams(max_tokens=12), 3)])
    assert len(gens) == 3 and all(len(g.token_ids) == len(g.logprobs) for g in gens)
    (out,) = outputs
    assert out.logits is None and out.scores is None  # nothing (B, R, V) was held


def _greedy_picks_the_argmax(engine: HFEngine, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy completions of ``ids`` and, at each token, the log-prob of the model's argmax."""
    gens = engine._generate([ids], GenerateRequest(ids, SamplingParams(temperature=0,
                                                                        max_tokens=24), 1))[0]
    seq = torch.tensor(ids + gens[0].token_ids.tolist())[None]
    with torch.no_grad():
        logits = engine.model(seq).logits[0, len(ids) - 1:-1]  # (R, V) before each token
    best = logits.log_softmax(-1).max(-1).values
    return gens[0].logprobs, best


def test_the_models_own_generation_config_does_not_change_sampling(tiny_model, tmp_path):
    # Qwen2.5-Instruct ships repetition_penalty = 1.05: generate would apply it, while the
    # behaviour log-probs (and the learner) account for the temperature only
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    GenerationConfig(do_sample=True, repetition_penalty=1.05, top_k=20, no_repeat_ngram_size=2,
                     eos_token_id=2).save_pretrained(model)
    engine = HFEngine(model, "float32", seed=0)
    ids = ChatTokenizer(model).prompt_ids([ChatMessage("user", "say aaaa")])
    behaviour, best = _greedy_picks_the_argmax(engine, ids)
    # greedy under the job's parameters only: every token is the model's argmax
    torch.testing.assert_close(behaviour, best, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("key", "params"), [
    ("temperature", SamplingParams(temperature=-0.5)),
    ("top_p", SamplingParams(top_p=0.0)),
    ("top_k", SamplingParams(top_k=-1)),
    ("max_tokens", SamplingParams(max_tokens=0)),
])
def test_sampling_parameters_the_log_probs_cannot_stand_for_are_refused(key, params):
    with pytest.raises(ValueError, match=f"sampler.{key}"):
        sampling_config(params, 0, 2)


def test_the_generation_config_is_the_jobs_parameters_only():
    """generate picks greedily what the engine's processors drew: transformers' own warpers
    for the job's temperature, top-k and top-p, in its order, then ``_Draw``."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from actors.sampler.engines.hf import _Draw, sampling_processors

    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_tokens=9)
    cfg = sampling_config(params, 0, 2)
    assert not cfg.do_sample and cfg.max_new_tokens == 9
    assert cfg.repetition_penalty == 1.0 and cfg.no_repeat_ngram_size == 0
    cfg.validate(strict=True)  # nothing set that greedy decoding would ignore
    warpers = sampling_processors(params)
    assert [type(w) for w in warpers] == [TemperatureLogitsWarper, TopKLogitsWarper,
                                          TopPLogitsWarper, _Draw]
    assert (warpers[0].temperature, warpers[1].top_k, warpers[2].top_p) == (0.7, 5, 0.9)
    assert [type(w) for w in sampling_processors(SamplingParams())] == [_Draw]  # T 1, no cuts
    assert sampling_processors(SamplingParams(temperature=0)) == []  # generate's own argmax


def test_the_draw_samples_softmax_of_the_scores():
    """``_Draw``'s tokens follow ``softmax(scores)`` (a chi-square test over 40,000 draws of a
    row; -inf scores, as top-k leaves them, are never drawn), and generate's argmax of what it
    returns is the drawn token."""
    from actors.sampler.engines.hf import _Draw

    torch.manual_seed(0)
    scores = torch.tensor([[1.0, 0.0, -1.0, 2.0, float("-inf"), 0.5]]).repeat(40_000, 1)
    out = _Draw()(None, scores)
    drawn = out.argmax(-1)
    assert bool((out.max(-1).values == 0).all()) and int((out == 0).sum()) == 40_000
    counts = torch.bincount(drawn, minlength=6).double()
    expected = torch.softmax(scores[0].double(), -1) * 40_000
    assert counts[4] == 0
    live = expected > 0
    chi2 = float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())
    assert chi2 < 20.5, (counts.tolist(), expected.tolist())  # p = 0.001 at 4 degrees of freedom


def test_a_bf16_engine_computes_its_logits_in_float32(tiny_model):
    """The learner's fused kernel never rounds the logits to bf16; the engine's head must not
    either, or the ratios would correct for rounding instead of staleness."""
    engine = HFEngine(tiny_model, "bfloat16", seed=0)
    head = engine.model.get_output_embeddings()
    assert head.weight.dtype == torch.bfloat16  # the weights stay as loaded (and load by name)
    hidden = torch.randn(3, head.weight.shape[1]).to(torch.bfloat16)
    logits = head(hidden)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden.float() @ head.weight.float().T)
    ids = ChatTokenizer(tiny_model).prompt_ids([ChatMessage("user", "say ab")])
    [[gen]] = anyio.run(engine.generate, [GenerateRequest(ids, SamplingParams(max_tokens=4), 1)])
    assert len(gen.token_ids) >= 1 and gen.logprobs.dtype == torch.float32


GENERATE_TWICE = """
import sys, anyio
from actors.data.chat import ChatMessage, ChatTokenizer
from actors.sampler.engines.base import GenerateRequest
from actors.sampler.engines.hf import HFEngine
from messages.rollout import SamplingParams
from tests.jobs import ROOT
engine = HFEngine(sys.argv[1], "float32", seed=0)
ids = ChatTokenizer(sys.argv[1]).prompt_ids([ChatMessage("user", "say ab")])
for params in (SamplingParams(max_tokens=3), SamplingParams(temperature=0, max_tokens=3)):
    anyio.run(engine.generate, [GenerateRequest(ids, params, 2)])
"""


def test_generate_warns_of_nothing_it_was_given(tiny_model):
    """The job's config sets no pair of fields transformers warns about (min_length beside
    min_new_tokens printed a line into the console at every call). A fresh process: transformers
    prints some warnings once per process."""
    done = subprocess.run([sys.executable, "-c", GENERATE_TWICE, str(tiny_model)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "min_new_tokens" not in done.stdout + done.stderr, done.stderr[-2000:]


GRAPH_TREES_IN_A_THREAD = """
import sys, threading, time
import torch
from torch._inductor import cudagraph_trees
from actors.sampler.engines.hf import graph_trees_here

seen = {}

def worker():
    seen["before"] = torch._C._is_key_in_tls("tree_manager_containers")
    graph_trees_here()
    seen["after"] = torch._C._is_key_in_tls("tree_manager_containers")
    seen["container"] = type(cudagraph_trees.get_container(0)).__name__
    state = (cudagraph_trees.local.tree_manager_containers, cudagraph_trees.local.tree_manager_locks)
    # each held by the thread's local, the thread-local state, ``state``, ``x`` and the argument
    seen["held"] = [sys.getrefcount(x) for x in state]
    seen["state"] = state

for _ in range(3):  # a thread each time, which ends: its state is released
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    state = seen.pop("state")
    # the thread-local state goes after join returns, when the OS thread's own end runs its
    # destructors (nothing signals that): until then its reference stays
    deadline = time.monotonic() + 30
    while any(sys.getrefcount(x) > 3 for x in state) and time.monotonic() < deadline:
        time.sleep(0.001)
    print(seen, [sys.getrefcount(x) for x in state])  # ``state`` alone holds them now
"""


def test_a_worker_thread_gets_the_graph_trees_state_compiled_decode_replays_through():
    """Compiled decode (sampler.engine.decode) runs in run_compute's worker thread, where torch's
    CUDA graph trees find no thread-local state of their own (an AssertionError at the first
    replay on a GPU); ``graph_trees_here`` gives the thread its own. A worker thread ends when
    it has been idle a while, and its state is released then exactly once: torch 2.11 drops a
    reference it never took, which freed the state under the thread and corrupted the heap (a
    crash later, in another test). Its own process, so a release too many stays there."""
    done = subprocess.run([sys.executable, "-c", GRAPH_TREES_IN_A_THREAD], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    line = ("{'before': False, 'after': True, 'container': 'TreeManagerContainer', 'held': [5, 5]}"
            " [3, 3]")
    assert done.stdout.splitlines() == [line] * 3, done.stdout + done.stderr[-2000:]


@pytest.mark.slow  # inductor's C++ compile, tens of seconds on a fresh machine (no cache)
@pytest.mark.anyio
async def test_compiled_decoding_keeps_one_static_cache_per_shape_and_compiles_once(tiny_model):
    """transformers makes a new static cache at every ``generate``: new tensors, and CUDA graph
    trees record their graphs again whenever a static input's address changes, so every batch
    would capture anew. The engine keeps one cache per batch shape: batches of one shape reuse
    its tensors (same addresses), and nothing compiles after the first batch. (On a CPU the
    decode step compiles too, into inductor's C++ kernels.)"""
    from torch._dynamo.utils import counters

    engine = HFEngine(tiny_model, "float32", seed=0, decode="inductor")
    await engine.load_weights(0, {})
    params = SamplingParams(temperature=1.0, max_tokens=6)
    seen = []
    for prompts in ([[5, 6, 7], [9, 10]], [[5, 6], [9, 10, 11]], [[7], [8, 9]]):
        await engine.generate([GenerateRequest(p, params, 2) for p in prompts])
        (cache,) = engine.static_caches.caches.values()  # 4 rows, 64 + 6 long
        seen.append((engine.static_caches.made, cache.layers[0].keys.data_ptr(),
                     counters["stats"]["unique_graphs"]))
    assert [made for made, _, _ in seen] == [1, 1, 1]
    assert len({at for _, at, _ in seen}) == 1
    assert seen[0][2] >= 1 and seen[1][2] == seen[2][2] == seen[0][2]  # compiled once


@pytest.mark.slow  # inductor's C++ compile, tens of seconds on a fresh machine (no cache)
@pytest.mark.anyio
async def test_compiled_decoding_computes_each_prompt_once_and_decodes_as_eager(tiny_model):
    """Under compiled decoding too, each prompt goes through the model once (its cache then
    written into the static cache's rows of its n samples), not n times; greedy decoding gives
    eager's tokens and log-probs (eager shares the prompts' cache the same way)."""
    params = SamplingParams(temperature=0.0, max_tokens=6)
    prompts = [[5, 6, 7, 8], [9, 10]]
    out = {}
    for decode in ("eager", "inductor"):
        engine = HFEngine(tiny_model, "float32", seed=0, decode=decode)
        await engine.load_weights(0, {})
        rows: list[int] = []
        hook = engine.model.register_forward_pre_hook(
            lambda _m, _a, kw, rows=rows: rows.append(kw["input_ids"].shape[0]),
            with_kwargs=True)
        out[decode] = await engine.generate([GenerateRequest(p, params, 3) for p in prompts])
        hook.remove()
        assert rows[0] == 2, (decode, rows)  # the prompts' forward: 2 rows, not 2 x 3
    for eager, compiled in zip(out["eager"], out["inductor"], strict=True):
        for a, b in zip(eager, compiled, strict=True):
            assert torch.equal(a.token_ids, b.token_ids)
            assert float((a.logprobs - b.logprobs).abs().max()) < 1e-4


def test_static_caches_one_per_shape_the_latest_kept(tiny_model):
    from transformers import AutoConfig

    from actors.sampler.engines.hf import StaticCaches

    caches = StaticCaches(AutoConfig.from_pretrained(tiny_model))
    a = caches.get(4, 70)
    assert caches.get(4, 70) is a and caches.get(2, 70) is not a and caches.made == 2
    for rows in range(5, 5 + StaticCaches.KEEP):  # more shapes than it keeps: the oldest goes
        caches.get(rows, 70)
    assert (4, 70) not in caches.caches and len(caches.caches) == StaticCaches.KEEP
    assert caches.get(4, 70) is not a
