"""Judge and teacher pools on prompts with images (the tiny random Qwen2.5-VL): a judge of a
vision-language model reads the prompt's images through its processor and its engine; a
text-only judge reads the prompt's text and counts what it could not see; a vision-language
teacher's log-probs are the learner's on the same images; a text-only teacher, or one whose
processor counts image tokens otherwise, is refused before the start naming ``teacher.path``."""

from __future__ import annotations

import json

import anyio
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from actors.data.chat import ChatTokenizer
from actors.data.vision import ImageProcessor
from actors.job.config.preflight import preflight
from actors.learner.batch import build_batch
from actors.learner.objective import response_logprobs
from actors.model_store import PolicyModel
from actors.runtime.config import ConfigError
from actors.runtime.tensors import to_wire
from actors.scoring.items import ScoreItem, items_of
from actors.scoring.served import ServedScoring
from actors.teacher.model import TeacherModel
from messages.reward import Response, ScoreRequest
from messages.rollout import ChatMessage, Prompt, Sample, ScoredGroup
from tests.helpers import live_topology
from tests.test_pools import models, topology
from tests.tiny_vlm import VOCAB, build_tiny_vlm, solid_png, tiny_vlm_tokenizer

RED, BLUE = solid_png((230, 20, 20), 28), solid_png((20, 20, 230), 56)
ASK = [ChatMessage("user", "<image>colour?")]


def image_items(images: list[bytes], n: int = 2) -> list[ScoreItem]:
    request = ScoreRequest("colour", "red", [Response(f"it is {c}") for c in "rb"[:n]],
                           prompt=ASK, images=images)
    return items_of(request)


def test_a_vision_judge_reads_the_prompts_images_and_a_text_judge_counts_them_unseen(
        tiny_vlm, tiny_model):
    async def main() -> None:
        topo = topology(models(f'name="j", kind="judge", path="{tiny_vlm}", max_tokens=3'))
        scoring = ServedScoring(topo.reward.models[0], topo)
        await scoring.load()
        try:
            judge = scoring.model
            red, blue = image_items([RED]), image_items([BLUE])
            ids = judge.prompt_ids(red[0])
            pad = judge.processor.image_token_id
            # the template's {prompt} holds the prompt's <image>: the judge's processor expands it
            assert ids.count(pad) == 1 and judge.prompt_ids(blue[0]).count(pad) == 4
            text = judge.cfg.template.format(prompt="<image>colour?", response="it is r",
                                             problem="", solution="", ground_truth="",
                                             data_source="")
            assert ids == ChatTokenizer(tiny_vlm).prompt_ids([ChatMessage("user", text)], images=[RED])
            outcomes = await scoring.score(red + blue)  # the hf engine generates with the images
            assert len(outcomes) == 4 and scoring.status()["judge_answers"] == 4
            assert scoring.status()["judge_images_unseen"] == 0
        finally:
            await scoring.aclose()

        text_topo = topology(models(f'name="t", kind="judge", path="{tiny_model}", max_tokens=2'))
        text_judge = ServedScoring(text_topo.reward.models[0], text_topo)
        await text_judge.load()
        try:
            seen = text_judge.model.tokenizer.decode(  # (its vocabulary has no < > ?)
                text_judge.model.prompt_ids(image_items([RED])[0]))
            assert "image<pad>colour" in seen  # the prompt's text, the placeholder as written
            await text_judge.score(image_items([RED]))
            assert text_judge.status()["judge_images_unseen"] == 2
        finally:
            await text_judge.aclose()

    anyio.run(main, backend="trio")


def test_a_vision_teachers_logprobs_are_the_learners_on_the_same_images(tiny_vlm, tiny_model):
    """A teacher with the student's weights: its log-probs on a prompt with images equal the
    learner's recomputation (float32 on the CPU), and another image gives others."""
    tok = ChatTokenizer(tiny_vlm)
    prompt = tok.prompt_ids(ASK, images=[BLUE])
    responses = [[40, 41, 42, tok.eos_token_id], [43], [44, 45]]
    teacher = TeacherModel(tiny_vlm, device="cpu", dtype="float32", model_dtype="float32",
                           threads=1, batch_size=2)
    teacher.load()
    got = teacher.logprobs(prompt, responses, [BLUE])
    assert [len(t) for t in got] == [len(r) for r in responses]

    samples = [Sample(to_wire(torch.tensor(r, dtype=torch.int32)),
                      to_wire(torch.zeros(len(r))), 0, "", "stop") for r in responses]
    group = ScoredGroup(Prompt(0, ASK, "colour", "blue", images=[BLUE]),
                        to_wire(torch.tensor(prompt, dtype=torch.int32)), samples, "s")
    batch = build_batch([group], 0, ImageProcessor(tiny_vlm))
    model = PolicyModel.from_pretrained(tiny_vlm, dtype=torch.float32).eval()
    with torch.no_grad():
        learner = response_logprobs(model, batch, 1.0)
    at = batch.response_mask.bool()
    diff = float((torch.cat(got) - learner[at]).abs().max())
    print(f"\nteacher vs learner on images: max diff {diff:.2e}")
    assert diff < 1e-5
    other = teacher.logprobs(tok.prompt_ids(ASK, images=[RED]), responses, [RED])
    assert float((torch.cat(other) - torch.cat(got)).abs().max()) > 1e-3
    with pytest.raises(ValueError, match=r"the prompt has 4 image tokens and the teacher's "
                                         r"processor makes 1 for its 1 image"):
        teacher.logprobs(prompt, responses, [RED])  # the student expanded another image

    text_teacher = TeacherModel(tiny_model, device="cpu", dtype="float32", model_dtype="float32",
                                threads=1, batch_size=2)
    text_teacher.load()
    with pytest.raises(ValueError, match=r"a prompt with images for a text-only teacher"):
        text_teacher.logprobs([1, 2, 3], [[4]], [RED])


@pytest.mark.slow
def test_a_teacher_that_cannot_see_the_images_is_refused_before_the_start(
        tiny_vlm, tiny_model, tmp_path, sockets):
    """Preflight (sandboxed children loading the models: several seconds)."""
    rows = [{"data_source": "colour", "prompt": [{"role": "user", "content": "<image>colour?"}],
             "images": [{"bytes": RED, "path": None}], "reward_model": {"ground_truth": "red"}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "colours.parquet")
    data = f"task.datasets=[{{path = \"{tmp_path / 'colours.parquet'}\"}}]"

    def job(teacher) -> object:
        return live_topology(sockets, f"model.path={tiny_vlm}", f"teacher.path={teacher}", data)

    preflight(job(build_tiny_vlm(tmp_path / "same", seed=3)))  # other weights, same processor
    text = tmp_path / "text"  # a text-only Qwen2 with the student's tokenizer
    Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
        eos_token_id=VOCAB["<|im_end|>"])).save_pretrained(text)
    tiny_vlm_tokenizer().save_pretrained(text)
    with pytest.raises(ConfigError, match=rf"teacher.path: the teacher {text} is a text-only "
                                          r"model and task.datasets\[0\] has images"):
        preflight(job(text))
    other = build_tiny_vlm(tmp_path / "other", seed=5)
    pre = json.loads((other / "preprocessor_config.json").read_text())
    pre.update(max_pixels=28 * 28, size={"shortest_edge": 28 * 28, "longest_edge": 28 * 28})
    (other / "preprocessor_config.json").write_text(json.dumps(pre))
    with pytest.raises(ConfigError, match=r"teacher.path: the teacher .* process images "
                                          r"differently: a 200x120 image is 1 image tokens"):
        preflight(job(other))
