"""Multi-turn rollouts keep the prompt's images across turns, on the tiny random Qwen2.5-VL with
the HF engine and an environment in a sandboxed child: every turn's request carries the images,
so the learner's log-probs of every model turn (the first and the later ones, read on the group's
prompt with its images) equal the engine's behaviour log-probs."""

from __future__ import annotations

import textwrap

import anyio
import torch

from actors.data.chat import ChatTokenizer
from actors.data.vision import ImageProcessor
from actors.job.config.load import apply_overrides, decode_topology
from actors.learner.batch import build_batch
from actors.learner.objective import response_logprobs
from actors.model_store import PolicyModel
from actors.runtime.tensors import to_wire
from actors.sampler.agent.loop import AgentLoop
from actors.sampler.engines.hf import HFEngine
from messages.rollout import ChatMessage, Prompt, Sample, SamplingParams, ScoredGroup
from tests.tiny_vlm import solid_png

ENV = textwrap.dedent('''
    class Looker:
        """Asks twice to look again; done after the third answer."""

        def __init__(self):
            self.n = 0

        def reset(self, prompt):
            return None

        def step(self, action):
            self.n += 1
            return "look again", 0.0, self.n >= 3
''')


def test_every_turn_sees_the_prompts_images_and_the_learner_trains_on_them(tiny_vlm, tmp_path):
    (tmp_path / "env.py").write_text(ENV)
    cfg = decode_topology(apply_overrides({}, [f"agent.env.path={tmp_path / 'env.py'}",
                                               "agent.env.name=Looker", "agent.processes=1",
                                               "agent.max_turns=3"])).agent
    tok = ChatTokenizer(tiny_vlm)
    engine = HFEngine(tiny_vlm, "float32", seed=0)
    engine.version = 0
    loop = AgentLoop(engine, tok, cfg)
    prompts = [Prompt(0, [ChatMessage("user", "<image>colour?")], "colour", "red",
                      images=[solid_png((230, 20, 20), 28)]),
               Prompt(1, [ChatMessage("user", "<image> or <image>?")], "colour", "blue",
                      images=[solid_png((20, 20, 230), 56), solid_png((20, 200, 20), 28)])]
    # short turns: each ends at a digit (no special token's text holds one), so episodes have
    # several
    params = SamplingParams(max_tokens=96, stop=tuple("0123456789"))

    async def main():
        await loop.start()
        try:
            ids = [loop.prompt_ids(p) for p in prompts]
            return ids, await loop.generate(prompts, ids, 2, params)
        finally:
            await loop.aclose()

    ids, out = anyio.run(main, backend="trio")
    pad = tok.processor.image_token_id
    assert [i.count(pad) for i in ids] == [1, 5]
    assert ids == [tok.prompt_ids(p.messages, images=p.images) for p in prompts]  # single turn's
    turns = [sum(t.role == "assistant" for t in g.turns) for row in out for g in row]
    assert max(turns) >= 2, turns  # later turns were generated (on the images)
    # a model turn that writes the image token ends its episode (in any turn, the first too)
    # unless the budget ran out inside it
    assert loop.statistics()["image_stops"] == sum(
        pad in g.token_ids.tolist() for row in out for g in row if g.finish_reason != "length")

    # the groups as the replay buffer serves them: the issued prompt's images put back
    groups = [ScoredGroup(p, to_wire(torch.tensor(i, dtype=torch.int32)),
                          [Sample(to_wire(g.token_ids), to_wire(g.logprobs), g.version, "",
                                  g.finish_reason, token_versions=to_wire(g.versions),
                                  loss_mask=to_wire(g.loss_mask), turns=g.turns) for g in row],
                          "s", sampling=params)
              for p, i, row in zip(prompts, ids, out, strict=True)]
    batch = build_batch(groups, 0, ImageProcessor(tiny_vlm))
    model = PolicyModel.from_pretrained(tiny_vlm, dtype=torch.float32).eval()
    with torch.no_grad():
        learner = response_logprobs(model, batch, 1.0)
    at = batch.response_mask.bool()
    later = torch.zeros_like(at)  # the model's tokens of its second and later turns
    for r, g in enumerate(g for row in out for g in row):
        start = int(batch.attention_mask[r].sum()) - len(g.token_ids) - 1  # column of token 0
        for t in [t for t in g.turns if t.role == "assistant"][1:]:
            later[r, start + t.start:start + t.end] = True
    diff = float((learner - batch.behaviour_logprobs)[at].abs().max())
    print(f"\nagent turns {turns}: behaviour vs learner max diff {diff:.2e} over {int(at.sum())} "
          f"tokens, {int((later & at).sum())} of them in later turns")
    assert int((later & at).sum()) > 0 and diff < 1e-5
