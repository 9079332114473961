"""The vLLM engine with images: the prompt it sends (each image's run of image tokens cut to the
one token vLLM expands, the decoded images beside it) and, where vLLM can run Qwen2.5-VL, its
behaviour log-probs against the learner's recomputation with the same images.

vLLM's CPU build cannot load Qwen2.5-VL without torchvision (``docs/vision.md``), so the parity
test is marked ``vllm`` and skips, naming why, where torchvision is missing; the request tests
need neither vLLM nor torchvision.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

from actors.data.chat import ChatTokenizer
from actors.sampler.engines.base import GenerateRequest
from actors.sampler.engines.vllm.images import check_expanded, collapse, tokens_prompt
from messages.rollout import ChatMessage, SamplingParams
from tests.tiny_vlm import solid_png

RED, BLUE = (230, 20, 20), (20, 20, 230)


def ask(text: str = "<image>colour?") -> list[ChatMessage]:
    return [ChatMessage("user", text)]


def test_each_images_run_of_tokens_is_sent_as_the_one_token_vllm_expands(tiny_vlm):
    from actors.sampler.engines.vllm.engine import VLLMEngine, VLLMSettings

    tok = ChatTokenizer(tiny_vlm)
    images = [solid_png(RED, 56), solid_png(BLUE, 28)]  # 4 image tokens, then 1
    expanded = tok.prompt_ids(ask("<image> or <image>?"), images=images)
    engine = VLLMEngine(Path(tiny_vlm), "float32", 0, VLLMSettings({}))  # not started
    try:
        pad = engine.image_token
        assert pad == tok.processor.image_token_id
        [prompt, text] = engine._prompts([
            GenerateRequest(expanded, SamplingParams(), 2, images=tuple(images)),
            GenerateRequest(tok.prompt_ids(ask("no image")), SamplingParams())])
    finally:
        engine.loop.close()
    sent = prompt["prompt_token_ids"]
    assert expanded.count(pad) == 5 and sent.count(pad) == 2
    assert [t for t in expanded if t != pad] == [t for t in sent if t != pad]
    assert [im.size for im in prompt["multi_modal_data"]["image"]] == [(56, 56), (28, 28)]
    assert text == {"prompt_token_ids": tok.prompt_ids(ask("no image"))}


def test_a_prompt_whose_image_tokens_do_not_fit_its_images_is_refused():
    with pytest.raises(ValueError, match="1 run"):
        collapse([1, 7, 7, 2], 7, 2)
    with pytest.raises(ValueError, match="no image_token_id"):
        tokens_prompt([1, 7, 2], ["an image"], None)
    assert tokens_prompt([1, 7, 2], [], None) == {"prompt_token_ids": [1, 7, 2]}


def test_another_expansion_by_vllm_than_the_samplers_is_an_error():
    check_expanded([1, 7, 7, 2], [1, 7, 7, 2])
    check_expanded([1, 7, 7, 2], None)  # an output without its prompt: nothing to compare
    with pytest.raises(ValueError, match="into 5 prompt tokens, the sampler into 4"):
        check_expanded([1, 7, 7, 2], [1, 7, 7, 7, 2])


def vision_problem() -> str | None:
    """Why vLLM cannot load Qwen2.5-VL here (None: it can)."""
    from actors.runtime.config import vllm_problem

    if (problem := vllm_problem()) is not None:
        return str(problem)
    try:  # vLLM's Qwen2-VL module imports smart_resize from here, which imports torchvision
        import transformers.models.qwen2_vl.image_processing_qwen2_vl  # noqa: F401
    except ImportError as exc:
        return f"vLLM's Qwen2-VL model module needs torchvision ({exc})"
    return None


@pytest.mark.vllm
def test_vllm_behaviour_logprobs_with_images_equal_the_learners(tmp_path):
    """The same bound as the text parity test (``tests/test_vllm.py``: float32, kernels that
    sum in another order), on prompts with one, two and no images; and the image counts."""
    if (problem := vision_problem()) is not None:
        pytest.skip(problem)
    import msgspec

    from actors.data.vision import ImageProcessor
    from actors.learner.batch import build_batch
    from actors.learner.objective import response_logprobs
    from actors.model_store import PolicyModel
    from actors.runtime.config import VLLMOptions
    from actors.sampler.engines.vllm.engine import VLLMEngine, VLLMSettings
    from tests.test_vision import as_groups
    from tests.test_vllm import TOLERANCE
    from tests.tiny_vlm import build_tiny_vlm

    model_dir = build_tiny_vlm(tmp_path / "vlm", hidden=128)  # head size 32 for vLLM's CPU
    options = VLLMOptions(max_model_len=256, kv_cache_memory_bytes=64 << 20).engine_args(gpu=False)
    tok = ChatTokenizer(model_dir)
    prompts = [(ask(), [solid_png(RED, 56)]),
               (ask("<image> or <image>?"), [solid_png(BLUE, 56), solid_png(RED, 28)]),
               (ask("no image"), [])]
    ids = [tok.prompt_ids(m, images=i) for m, i in prompts]
    params = SamplingParams(temperature=1.0, max_tokens=8)

    async def generate():
        engine = await VLLMEngine.start(model_dir, "float32", 0, VLLMSettings(options))
        try:
            return await engine.generate([GenerateRequest(p, params, 2, images=tuple(i))
                                          for p, (_, i) in zip(ids, prompts, strict=True)])
        finally:
            await engine.aclose()

    groups = as_groups(anyio.run(generate, backend="trio"), prompts, ids, params)
    model = PolicyModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = ImageProcessor(model_dir)
    batch = build_batch(groups, 0, processor)
    at = batch.response_mask.bool()
    with torch.no_grad():
        learner = response_logprobs(model, batch, 1.0)
        swapped = [msgspec.structs.replace(groups[0], prompt=msgspec.structs.replace(
            groups[0].prompt, images=[solid_png(BLUE, 56)]))]
        other = response_logprobs(model, build_batch(swapped, 0, processor), 1.0)
    diff = (learner - batch.behaviour_logprobs)[at].abs()
    print(f"\nvllm with images: {diff.numel()} tokens, max |diff| {float(diff.max()):.2e}, "
          f"mean {float(diff.mean()):.2e}")
    assert float(diff.max()) < TOLERANCE
    w = other.shape[1]
    assert float((other - learner[:2, :w])[at[:2, :w]].abs().max()) > 1e-3
