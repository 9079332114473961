"""Images through the OpenAI-compatible endpoint on the tiny random Qwen2.5-VL: the real
``openai`` client sends ``image_url`` parts (data URLs, paths, file:// URLs), the call renders
through the model's processor as a dataset prompt does, the engine generates with the images,
the sample keeps them, and the learner's log-probs on them equal the behaviour log-probs; a
bad image is a 400 naming the message and the part."""

from __future__ import annotations

import re
from pathlib import Path

import anyio
import msgspec
import openai
import pytest
import torch

from actors.data.chat import ChatTokenizer
from actors.data.vision import ImageProcessor
from actors.learner.batch import build_batch
from actors.learner.objective import response_logprobs
from actors.model_store import PolicyModel
from actors.runtime.config import AgentConfig, AgentRollout
from actors.sampler.endpoint.episodes import Episode
from actors.sampler.endpoint.images import data_url, openai_messages
from actors.sampler.endpoint.strategy import EndpointRollout
from actors.sampler.engines.hf import HFEngine
from actors.sampler.rollout import Generated, Rollout, own_prompt
from actors.sandbox.protocol import Outcome
from messages.rollout import ChatMessage, Prompt, SamplingParams, ScoredGroup
from tests.tiny_vlm import solid_png

RED, BLUE, GREEN = solid_png((230, 20, 20), 28), solid_png((20, 20, 230), 56), \
    solid_png((20, 200, 20), 28)  # 1, 4 and 1 image tokens


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def make(model: Path, **kw) -> EndpointRollout:
    cfg = AgentConfig(rollout=AgentRollout(path="", **kw), processes=1)
    r = EndpointRollout(HFEngine(model, "float32", seed=0), ChatTokenizer(model), cfg)
    r.engine.version = 0
    return r


def run_with_endpoint(r: EndpointRollout, body) -> None:
    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(r.serve)
            try:
                await body(openai.AsyncOpenAI(base_url=f"{r.base_url}/episodes/a/v1",
                                              api_key="x", max_retries=0))
            finally:
                tg.cancel_scope.cancel()
                await r.aclose()

    anyio.run(main, backend="trio")


def test_image_parts_render_like_a_dataset_prompt_and_the_learner_sees_them(tiny_vlm, tmp_path):
    """Two calls with the same images make one sample (token in, token out); a third that adds
    an image starts a sample on its own prompt with every image. Both samples carry their
    images to the learner, whose log-probs (padded and packed) equal the engine's."""
    (tmp_path / "blue.png").write_bytes(BLUE)
    (tmp_path / "red.png").write_bytes(RED)
    r = make(tiny_vlm, branches="train")
    ep = r.episodes["a"] = Episode(SamplingParams(max_tokens=24), max_calls=8)
    first_messages = [{"role": "user", "content": [
        image(data_url(RED)), text("and"), image(str(tmp_path / "blue.png")), text(" colour?")]}]
    seen: dict = {}

    async def body(client: openai.AsyncOpenAI) -> None:
        first = await client.chat.completions.create(model="policy", messages=first_messages,
                                                     max_tokens=4)
        seen["first"], seen["seg"] = first, ep.last[0]
        again = [{"role": "user", "content": [  # the same images, one as a file:// URL
            image((tmp_path / "red.png").as_uri()), text("and"), image(data_url(BLUE)),
            text(" colour?")]},
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "more"}]
        second = await client.chat.completions.create(model="policy", messages=again,
                                                      max_tokens=4)
        seen["second"], seen["branches"] = second, ep.branches
        later = again + [{"role": "assistant", "content": second.choices[0].message.content},
                         {"role": "user", "content": [text("and this?"), image(data_url(GREEN))]}]
        await client.chat.completions.create(model="policy", messages=later, max_tokens=4)

    run_with_endpoint(r, body)
    tok = r.tok
    pad = tok.processor.image_token_id
    dataset = tok.prompt_ids([ChatMessage("user", "<image>and<image> colour?")], images=[RED, BLUE])
    first, seg = seen["first"], seen["seg"]
    assert first.prompt_token_ids == dataset and dataset.count(pad) == 5
    assert seg.images == (RED, BLUE) and seg.prompt == dataset
    assert seen["branches"] == 0  # the same images: the second call went on with the sample
    assert seen["second"].prompt_token_ids[:len(dataset)] == dataset
    assert seen["second"].prompt_token_ids.count(pad) == 5
    assert ep.branches == 1  # the new image started a sample on its own prompt
    last = ep.last[0]
    assert last.images == (RED, BLUE, GREEN) and last.prompt.count(pad) == 6
    assert pad not in last.t.ids and pad not in ep.done[0].t.ids  # image tokens: prompt only

    # the group as the sampler hands it on: the episode's samples on their own prompts with
    # their images (the dataset prompt here is text only)
    prompt = Prompt(0, [ChatMessage("user", "colour?")], "colour", "red")
    ids = tok.prompt_ids(prompt.messages)
    completions = r.group(ids, [(ep, Outcome(score=1.0))])
    rollout = Rollout(r.engine, tok, None, params=ep.params, n=1, greedy_baseline=False,  # type: ignore[arg-type]
                      sampler="s", agent=r)
    group = anyio.run(rollout.score_group, Generated(prompt, ids, completions, None, 0.0),
                      backend="trio")
    group = msgspec.msgpack.decode(msgspec.msgpack.encode(group), type=ScoredGroup)  # the wire
    assert [s.images for s in group.samples] == [[RED, BLUE], [RED, BLUE, GREEN]]
    assert all(s.prompt_ids is not None for s in group.samples)

    model = PolicyModel.from_pretrained(tiny_vlm, dtype=torch.float32).eval()
    batch = build_batch([group], 0, ImageProcessor(tiny_vlm))
    assert batch.vision is not None and batch.vision.images_per_row.tolist() == [2, 3]
    at = batch.response_mask.bool()
    with torch.no_grad():
        padded = response_logprobs(model, batch, 1.0)
        batch.packed = True
        packed = response_logprobs(model, batch, 1.0)
    d_padded = float((padded - batch.behaviour_logprobs)[at].abs().max())
    d_packed = float((packed - batch.behaviour_logprobs)[at].abs().max())
    print(f"\nendpoint images: behaviour vs learner max diff padded {d_padded:.2e} "
          f"packed {d_packed:.2e} over {int(at.sum())} tokens")
    assert int(at.sum()) > 0 and d_padded < 1e-5 and d_packed < 1e-5


BAD = [
    (image("data:image/png;base64,!!not base64"), r"the data URL's base64 does not decode"),
    (image(data_url(b"hello")), r"\(5 bytes\) is not an image PIL can read"),
    (image("data:image/png,rawbytes"), r"a data URL must be base64"),
    (image("/no/such/picture.png"), r"cannot read the image file '/no/such/picture.png'"),
    (image("https://example.com/cat.png"), r"remote image URLs are not fetched"),
    ({"type": "image_url", "image_url": {}}, r"\.image_url: expected \{'url'"),
]


def test_a_bad_image_is_a_400_naming_the_message_and_part(tiny_vlm):
    r = make(tiny_vlm)
    r.episodes["a"] = Episode(SamplingParams(max_tokens=8), max_calls=len(BAD) + 1)
    seen: dict = {"errors": []}

    async def body(client: openai.AsyncOpenAI) -> None:
        for part, _ in BAD:
            messages = [{"role": "system", "content": "look"},
                        {"role": "user", "content": [text("what is"), part]}]
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(model="policy", messages=messages)
            seen["errors"].append(err.value.body["message"])
        # the endpoint goes on: a good call in the same episode is served
        ok = await client.chat.completions.create(
            model="policy", max_tokens=2,
            messages=[{"role": "user", "content": [image(data_url(RED)), text("?")]}])
        seen["ok"] = ok.choices[0].token_ids

    run_with_endpoint(r, body)
    for error, (_, reason) in zip(seen["errors"], BAD, strict=True):
        assert error.startswith("messages[1].content[1]") and re.search(reason, error), error
    assert r.stats["bad_calls"] == len(BAD) and len(seen["ok"]) >= 1


def test_a_text_only_policy_refuses_an_image_part(tiny_model):
    r = make(tiny_model)
    r.episodes["a"] = Episode(SamplingParams(max_tokens=8), max_calls=8)
    seen: dict = {}

    async def body(client: openai.AsyncOpenAI) -> None:
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model="policy", messages=[
                {"role": "user", "content": [image(data_url(RED)), text("?")]}])
        seen["error"] = err.value.body["message"]

    run_with_endpoint(r, body)
    assert seen["error"] == ("messages[0].content[0]: an image for a text-only policy (its "
                             "config.json has no vision tower)")


def test_a_dataset_prompts_images_reach_the_agent_and_its_sample_trains_on_the_groups(tiny_vlm):
    """The row an episode gets holds the prompt's images as ``image_url`` parts: sent back
    unchanged, they make the dataset prompt's tokens, so the sample needs no prompt of its own
    and trains on the group's prompt and images (which the replay buffer puts back)."""
    r = make(tiny_vlm)
    ep = r.episodes["a"] = Episode(SamplingParams(max_tokens=8), max_calls=8)
    prompt = Prompt(0, [ChatMessage("system", "look"), ChatMessage("user", "<image>and<image>?")],
                    "colour", "red", images=[RED, BLUE])
    row = openai_messages(prompt.messages, prompt.images)
    assert row[1]["content"][0]["image_url"]["url"] == data_url(RED) and row[0]["content"] == "look"
    seen: dict = {}

    async def body(client: openai.AsyncOpenAI) -> None:
        seen["first"] = await client.chat.completions.create(model="policy", messages=row,
                                                             max_tokens=3)

    run_with_endpoint(r, body)
    ids = r.prompt_ids(prompt)
    assert seen["first"].prompt_token_ids == ids
    (sample,) = r.group(ids, [(ep, Outcome(score=1.0))])
    assert own_prompt(sample, ids, prompt.images) == (None, [])

