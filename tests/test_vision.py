"""Vision-language models on a tiny random Qwen2.5-VL: data rows with images, the processor's
expansion of image tokens, images kept by the replay buffer, the HF engine's behaviour
log-probs against the learner's recomputation on the same images (padded and packed, with
M-RoPE positions), and a packed learner step equal to the padded one."""

from __future__ import annotations

import json

import anyio
import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from actors.data.chat import ChatTokenizer
from actors.data.sources import make_task
from actors.data.vision import ImageError, ImageProcessor, structured
from actors.job.config.load import decode_topology
from actors.job.config.preflight import check_data
from actors.learner.batch import build_batch, common_prefixes
from actors.learner.objective import response_logprobs
from actors.learner.packing import pack
from actors.model_store import PolicyModel
from actors.replay.state import ReplayState
from actors.runtime.config import ConfigError
from actors.runtime.tensors import to_wire
from actors.sampler.engines.base import GenerateRequest
from actors.sampler.engines.hf import HFEngine
from actors.sampler.rollout import without_images
from kernels import varlen_attention
from messages.codec import Codec, encode
from messages.rollout import (
    ChatMessage,
    FromReplay,
    Prompt,
    PromptBatch,
    Sample,
    SamplingParams,
    ScoredGroup,
)
from tests.learner_cases import make_trainer, with_behaviour
from tests.test_packing import compare, gradients
from tests.tiny_vlm import solid_png

RED, BLUE, GREEN = (230, 20, 20), (20, 20, 230), (20, 200, 20)


def ask(text: str = "<image>colour?") -> list[ChatMessage]:
    return [ChatMessage("user", text)]


def test_the_processor_expands_each_image_into_its_tokens(tiny_vlm):
    tok = ChatTokenizer(tiny_vlm)
    assert tok.processor is not None
    pad = tok.processor.image_token_id
    small, large = solid_png(RED, 28), solid_png(BLUE, 56)  # grids 2x2 and 4x4 patches
    one = tok.prompt_ids(ask(), images=[small])
    four = tok.prompt_ids(ask(), images=[large])
    both = tok.prompt_ids(ask("<image> and <image>?"), images=[small, large])
    assert (one.count(pad), four.count(pad), both.count(pad)) == (1, 4, 5)
    assert len(four) == len(one) + 3
    assert tok.prompt_ids(ask("colour?")) == tok.prompt_ids(ask("colour?"), images=())
    assert structured(ask("a<image>b")) == [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}]}]
    with pytest.raises(ImageError, match=r"2 <image> placeholder\(s\) in the prompt for 1 image"):
        tok.prompt_ids(ask("<image><image>"), images=[small])
    with pytest.raises(ImageError, match=r"image 1 \(5 bytes\) is not an image PIL can read"):
        tok.prompt_ids(ask("<image><image>"), images=[small, b"hello"])


def image_rows(tmp_path):
    """verl's layout with an ``images`` column of {bytes, path} records."""
    return [{"data_source": "colour", "prompt": [{"role": "user", "content": "<image>What colour?"}],
             "images": [{"bytes": solid_png(c), "path": None}],
             "reward_model": {"style": "rule", "ground_truth": name}}
            for c, name in ((RED, "red"), (BLUE, "blue"))]


def topology(*datasets):
    return decode_topology({"task": {"datasets": list(datasets)}})


def test_verl_trl_and_jsonl_rows_bring_their_images(tmp_path):
    pq.write_table(pa.Table.from_pylist(image_rows(tmp_path)), tmp_path / "verl.parquet")
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "b.png").write_bytes(solid_png(BLUE))
    (tmp_path / "paths.jsonl").write_text(json.dumps({
        "data_source": "colour", "prompt": [{"role": "user", "content": "<image>What colour?"}],
        "images": ["pics/b.png"], "reward_model": {"ground_truth": "blue"}}) + "\n")
    # TRL: structured content parts and a single ``image`` column (here a path record)
    (tmp_path / "trl.jsonl").write_text(json.dumps({
        "data_source": "colour", "answer": "blue", "image": {"path": "pics/b.png"},
        "prompt": [{"role": "user", "content": [{"type": "image"},
                                                {"type": "text", "text": "What colour?"}]}]}) + "\n")
    # an image column but no placeholder: the images go before the user's text (as TRL does)
    (tmp_path / "plain.jsonl").write_text(json.dumps({
        "data_source": "colour", "question": "What colour?", "answer": "blue",
        "images": ["pics/b.png"]}) + "\n")
    cases = [({"path": str(tmp_path / "verl.parquet"), "shuffle": False}, solid_png(RED)),
             ({"path": str(tmp_path / "paths.jsonl")}, solid_png(BLUE)),
             ({"path": str(tmp_path / "trl.jsonl"), "answer_key": "answer"}, solid_png(BLUE)),
             ({"path": str(tmp_path / "plain.jsonl"), "prompt_key": "question",
               "answer_key": "answer"}, solid_png(BLUE))]
    for entry, image in cases:
        p = make_task(topology(entry).task, seed=0).prompt(0, prompt_id=0)
        assert p.images == [image], entry
        assert p.messages[-1].content == "<image>What colour?", entry
    with pytest.raises(ConfigError, match=r"task.datasets\[0\].image_key: no column 'picture'"):
        topology({"path": str(tmp_path / "verl.parquet"), "image_key": "picture"})


@pytest.mark.parametrize(("content", "images", "message"), [
    ("<image><image>What colour?", ["r.png"],
     r"2 <image> placeholder\(s\) in the prompt for 1 image\(s\)"),
    ("What colour? <image>", [], r"1 <image> placeholder\(s\) in the prompt for 0 image\(s\)"),
    ("<image>What colour?", ["missing.png"], r"image 0: no file 'missing.png'"),
    ("<image>What colour?", ["junk.png"],
     r"image 0 \(16 bytes\) is not an image PIL can read: cannot identify image file$"),
    ("<image>What colour?", [17], r"image 0 is neither bytes"),
])
def test_a_bad_image_row_stops_the_job_before_it_starts_naming_row_and_column(
        tmp_path, content, images, message):
    (tmp_path / "r.png").write_bytes(solid_png(RED))
    (tmp_path / "junk.png").write_bytes(b"GIF89a-truncated")
    good = {"data_source": "colour", "prompt": [{"role": "user", "content": "<image>Colour?"}],
            "images": ["r.png"], "reward_model": {"ground_truth": "red"}}
    bad = {**good, "prompt": [{"role": "user", "content": content}], "images": images}
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (good, good, bad)))
    topo = topology({"path": str(path), "shuffle": False})
    with pytest.raises(ConfigError, match=r"task.datasets\[0\] \(.*bad.jsonl row 2\) column "
                                          r"'images': " + message):
        check_data(topo)  # the runner's preflight: every row, before any actor starts


def test_images_travel_to_the_sampler_once_and_the_replay_buffer_gives_them_to_the_learner(
        tmp_path):
    pq.write_table(pa.Table.from_pylist(image_rows(tmp_path)), tmp_path / "verl.parquet")
    task = make_task(topology({"path": str(tmp_path / "verl.parquet")}).task, seed=0)
    state = ReplayState(task=task, groups_per_step=1, max_staleness=1, capacity=4)
    [prompt] = state.issue(b"s", 1)
    assert len(prompt.images) == 1
    wire = Codec(FromReplay).decode(encode(PromptBatch([prompt])))  # raw bytes on the wire
    assert wire.prompts[0].images == prompt.images
    sample = Sample(to_wire(torch.tensor([7], dtype=torch.int32)),
                    to_wire(torch.zeros(1)), 0, "r", "stop", reward=1.0)
    group = ScoredGroup(without_images(prompt), to_wire(torch.tensor([1, 2], dtype=torch.int32)),
                        [sample], "s")
    assert group.prompt.images == [] and group.prompt.prompt_id == prompt.prompt_id
    assert state.accept(group)
    [held] = state.take_batch(1)
    assert held.prompt.images == prompt.images  # put back from the issued prompt
    [lost] = state.issue(b"s", 1)  # a sampler that dies holding a prompt: it is issued again
    assert state.requeue_from(b"s") == 1
    assert state.issue(b"t", 1) == [lost] and lost.images  # with its images
    [row] = [r for table, r in state.records if table == "groups"]
    assert msgspec.msgpack.decode(row["message"], type=ScoredGroup).prompt.images \
        == prompt.images  # recorded with the run


def engine_groups(tiny_vlm, prompts: list[tuple[list[ChatMessage], list[bytes]]], n: int = 2,
                  max_tokens: int = 6, device: str = "cpu") -> list[ScoredGroup]:
    """Groups generated by the HF engine on the tiny VLM (float32, on the CPU by default)."""
    tok = ChatTokenizer(tiny_vlm)
    engine = HFEngine(tiny_vlm, "float32", seed=0, device=device)
    engine.version = 0
    ids = [tok.prompt_ids(m, images=i) for m, i in prompts]
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens)

    async def generate():
        return await engine.generate([GenerateRequest(p, params, n, images=tuple(i))
                                      for p, (_, i) in zip(ids, prompts, strict=True)])

    return as_groups(anyio.run(generate, backend="trio"), prompts, ids, params)


def as_groups(out, prompts, ids: list[list[int]], params: SamplingParams,
              version: int = 0) -> list[ScoredGroup]:
    """An engine's completions of ``prompts`` (token ids ``ids``) as scored groups, the j-th
    sample of each rewarded j mod 2 (a spread the advantages need)."""
    return [ScoredGroup(Prompt(k, messages, "colour", "red", images=images),
                        to_wire(torch.tensor(ids[k], dtype=torch.int32)),
                        [Sample(to_wire(c.token_ids), to_wire(c.logprobs), version, "",
                                c.finish_reason, reward=float(j % 2))
                         for j, c in enumerate(completions)], "s", sampling=params)
            for k, (completions, (messages, images)) in enumerate(zip(out, prompts, strict=True))]


PROMPTS = [(ask(), [solid_png(RED, 28)]), (ask(), [solid_png(BLUE, 56)]),
           (ask("<image> or <image>?"), [solid_png(GREEN, 56), solid_png(RED, 28)]),
           (ask("no image"), [])]


@pytest.mark.parametrize("attn", ["sdpa", varlen_attention.NAME])
def test_behaviour_logprobs_equal_the_learners_padded_and_packed(tiny_vlm, attn):
    """float32 on the CPU: the engine's log-probs (transformers' ``generate`` with the
    processor's tensors) and the learner's (its own image embedding and M-RoPE positions)
    within 1e-5, padded and packed; and the images count (another image, other log-probs)."""
    groups = engine_groups(tiny_vlm, PROMPTS)
    model = PolicyModel.from_pretrained(tiny_vlm, dtype=torch.float32).eval()
    if attn != "sdpa":
        varlen_attention.choose(model, torch.device("cpu"))
    images = ImageProcessor(tiny_vlm)
    batch = build_batch(groups, 0, images)
    at = batch.response_mask.bool()
    with torch.no_grad():
        padded = response_logprobs(model, batch, 1.0)
        batch.packed = True
        if attn == "sdpa":  # rows packed whole, as the trainer packs them for sdpa
            batch.shared = ()
        else:  # each group's prompt, its image included, packed once
            assert any(batch.shared)
        packed = response_logprobs(model, batch, 1.0)
        swapped = [msgspec.structs.replace(g, prompt=msgspec.structs.replace(
            g.prompt, images=[solid_png(GREEN, 28)])) for g in groups[:1]]
        other = response_logprobs(model, build_batch(swapped, 0, images), 1.0)
    behaviour = batch.behaviour_logprobs
    d_padded = float((padded - behaviour)[at].abs().max())
    d_packed = float((packed - behaviour)[at].abs().max())
    print(f"\n{attn}: behaviour vs learner max diff padded {d_padded:.2e} packed {d_packed:.2e}")
    assert d_padded < 1e-5 and d_packed < 1e-5
    w = other.shape[1]
    assert float((other - padded[:2, :w])[at[:2, :w]].abs().max()) > 1e-3


@pytest.mark.gpu
def test_behaviour_logprobs_equal_the_learners_on_a_gpu(tiny_vlm):
    """The parity above on CUDA (float32, no TF32 in matmuls or the patch embedding's
    convolution): the engine's pixel tensors and the learner's, the vision tower and M-RoPE on
    the device, padded and packed."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    groups = engine_groups(tiny_vlm, PROMPTS, device="cuda")
    model = PolicyModel.from_pretrained(tiny_vlm, dtype=torch.float32).to("cuda").eval()
    batch = build_batch(groups, 0, ImageProcessor(tiny_vlm)).to(torch.device("cuda"))
    at = batch.response_mask.bool()
    with torch.no_grad():
        padded = response_logprobs(model, batch, 1.0)
        batch.packed = True
        batch.shared = ()  # rows packed whole, as the trainer packs them for sdpa
        packed = response_logprobs(model, batch, 1.0)
    behaviour = batch.behaviour_logprobs
    for name, lp in (("padded", padded), ("packed", packed)):
        diff = float((lp - behaviour)[at].abs().max())
        print(f"\n{name}: behaviour vs learner on CUDA max diff {diff:.2e}")
        assert diff < 1e-4, (name, diff)


def test_packed_rows_need_their_own_rope_positions(tiny_vlm):
    """The packed path's 3-D positions are each sequence's: image tokens sit on a 2-D grid
    (a 56-pixel image: 2x2 tokens sharing a temporal position), unlike text positions, so the
    parity above would fail with 1-D positions."""
    from actors.data.vision_inputs import packed_positions

    groups = engine_groups(tiny_vlm, PROMPTS[:2], n=1, max_tokens=2)
    model = PolicyModel.from_pretrained(tiny_vlm, dtype=torch.float32)
    batch = build_batch(groups, 0, ImageProcessor(tiny_vlm))
    rows = pack(batch.input_ids, batch.attention_mask)
    pos = packed_positions(model.model, batch.input_ids, batch.attention_mask, batch.vision,
                           rows.source)
    assert pos.shape == (4, 1, int(batch.attention_mask.sum()) - 2)  # each row's last left out
    second = int(batch.attention_mask[0].sum()) - 1  # where the second sequence starts
    assert pos[0, 0, second] == 0 and pos[1:, 0, second].tolist() == [0, 0, 0]
    image = (batch.input_ids[1] == model.config.image_token_id).nonzero().flatten()
    grid = pos[1:, 0, second + image]  # (3, 4): t, h, w of the four image tokens
    assert grid[0].unique().numel() == 1 and grid[1].tolist() == [grid[1, 0]] * 2 + [grid[1, 0] + 1] * 2
    assert grid[2].tolist() == [grid[2, 0], grid[2, 0] + 1] * 2


@pytest.mark.parametrize("share", ["true", "false"])
def test_packed_vlm_step_equals_padded_step(tiny_vlm, tmp_path, share):
    """One GRPO step with images, packed and padded: the same gradients (the vision tower's
    included) within 1e-6 of the largest, as for text (tests/test_packing.py); with shared
    prefixes each group's prompt, its image included, is packed once."""
    opts = ["learner.max_grad_norm=1e9", "learner.max_tokens_per_micro_batch=150",
            "algorithm.n=2", "learner.groups_per_step=4", "sampler.max_tokens=6"]
    padded = make_trainer(tiny_vlm, tmp_path / "padded", "learner.packing=false", *opts)
    packed = make_trainer(tiny_vlm, tmp_path / "packed", "learner.packing=true",
                          f"learner.share_prefixes={share}", *opts)
    g_padded, g_packed = gradients(padded), gradients(packed)
    noise = torch.Generator().manual_seed(3)
    groups = with_behaviour(padded, engine_groups(tiny_vlm, PROMPTS), lambda s, own: own - 0.4 *
                            torch.rand(own.shape, generator=noise))
    lengths = build_batch(groups, 0, packed.policy.processor).attention_mask.sum(1).tolist()
    parts = packed._micro_slices(lengths, 0, len(lengths))
    assert max(p.stop - p.start for p in parts) >= 2  # sequences with images share a packed row
    m_padded, m_packed = padded.train_step(groups), packed.train_step(groups)
    g_max, g_mean, g_scale = compare(g_padded[0], g_packed[0])
    vision = [k for k in g_padded[0] if k.startswith("model.visual.")]
    print(f"\nvlm: gradients max diff {g_max:.2e} mean {g_mean:.2e} (largest {g_scale:.2e}); "
          f"pg_loss {m_padded['actor/pg_loss']:+.8e} vs {m_packed['actor/pg_loss']:+.8e}")
    assert vision and all(float(g_padded[0][k].abs().max()) > 0 for k in vision[:3])
    assert g_scale > 1e-4 and g_max <= 1e-6 * g_scale, (g_max, g_scale)
    assert abs(m_padded["actor/pg_loss"] - m_packed["actor/pg_loss"]) <= 1e-6
    assert (m_packed["perf/shared_prefix_tokens"] > 0) == (share == "true")


def test_rows_whose_images_differ_share_no_prefix():
    """Two images of one size are the same image tokens: an endpoint's samples, each with a
    prompt and images of its own, share a prefix only where their images are the same."""
    seq = torch.tensor([1, 2, 3, 4, 5])
    red, green = [solid_png(RED, 28)], [solid_png(GREEN, 28)]
    assert common_prefixes([seq] * 4, [4], [red, red, green, green]) == (0, 4, 0, 4)
    assert common_prefixes([seq] * 4, [4]) == (0, 4, 4, 4)  # text: the tokens decide


def test_freeze_vision_trains_the_language_model_only(tiny_vlm, tiny_model, tmp_path):
    trainer = make_trainer(tiny_vlm, tmp_path / "frozen", "model.freeze_vision=true",
                           "algorithm.n=2", "learner.groups_per_step=4")
    before = {k: v.detach().clone() for k, v in trainer.policy.model.named_parameters()}
    trainer.train_step(engine_groups(tiny_vlm, PROMPTS))
    after = dict(trainer.policy.model.named_parameters())
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    vision = {k for k in before if k.startswith("model.visual.")}
    assert vision and not moved & vision
    assert any(k.startswith("model.language_model.") for k in moved)
    with pytest.raises(ValueError, match="model.freeze_vision: the model has no vision tower"):
        make_trainer(tiny_model, tmp_path / "text", "model.freeze_vision=true")


def test_the_memory_estimate_counts_the_vision_tower(tiny_vlm):
    from transformers import AutoConfig

    from actors.learner.memory import count_parameters, estimate

    model = PolicyModel.from_pretrained(tiny_vlm)
    total, per_layer = count_parameters(AutoConfig.from_pretrained(tiny_vlm))
    assert total == sum(p.numel() for p in model.parameters())
    assert per_layer == sum(p.numel() for p in model.model.language_model.layers[0].parameters())
    e = estimate(AutoConfig.from_pretrained(tiny_vlm), tokens=64)
    assert e.parameters == 4 * total


def test_the_preflight_takes_a_vision_language_model_and_still_refuses_a_classifier(
        tiny_vlm, tmp_path):
    from actors.sandbox.preflight import check_model
    from tests.tiny_model import build_tiny_reward_model

    assert check_model(str(tiny_vlm)) == ""
    assert "not a causal language model" in check_model(
        str(build_tiny_reward_model(tmp_path / "rm")))


def test_the_vision_page_job_is_a_topology_whose_data_passes_the_preflight(tiny_vlm, tmp_path,
                                                                           monkeypatch):
    import tomllib
    from pathlib import Path

    from actors.job.config.load import apply_overrides
    from tests.test_vision_job import colour_data

    page = (Path(__file__).resolve().parent.parent / "docs" / "vision.md").read_text()
    [block] = [b.split("```")[0] for b in page.split("```toml\n")[1:]]
    monkeypatch.chdir(tmp_path)
    colour_data(tmp_path / "data", images=True)
    topo = decode_topology(apply_overrides(tomllib.loads(block), [f"model.path={tiny_vlm}"]))
    assert topo.sampler.engine.name == "hf" and topo.task.datasets[0].path.endswith("colours.jsonl")
    check_data(topo)


def test_images_for_a_text_only_policy_are_refused_before_the_job_starts(tiny_model, tmp_path):
    """A text-only model (the embedded default is one) given a dataset with images: one line
    naming model.path and the dataset, exit 2 from the runner, not a sampler dying mid-run."""
    from actors.job.config.preflight import preflight

    pq.write_table(pa.Table.from_pylist(image_rows(tmp_path)), tmp_path / "verl.parquet")
    topo = decode_topology({"model": {"path": str(tiny_model)},
                            "task": {"datasets": [{"path": str(tmp_path / "verl.parquet")}]}})
    with pytest.raises(ConfigError, match=r"^model.path: .* is a text-only model \(its config.json "
                                          r"has no vision_config\) and task.datasets\[0\] has "
                                          r"images: the policy must see them"):
        preflight(topo)


def test_images_with_a_multi_turn_rollout_pass_the_preflight(tmp_path):
    """Agent loops keep the prompt's images across turns (``tests/test_agent_vision.py``)."""
    pq.write_table(pa.Table.from_pylist(image_rows(tmp_path)), tmp_path / "verl.parquet")
    topo = decode_topology({"task": {"datasets": [{"path": str(tmp_path / "verl.parquet")}]},
                            "agent": {"tools": [{"builtin": "calculator"}]}})
    assert check_data(topo) == "task.datasets[0]"


def test_validation_prompts_bring_their_images(tmp_path):
    from actors.validation.prompts import validation_prompts

    pq.write_table(pa.Table.from_pylist(image_rows(tmp_path)), tmp_path / "verl.parquet")
    topo = decode_topology({"validation": {"datasets": [{"path": str(tmp_path / "verl.parquet")}]}})
    prompts = validation_prompts(topo)
    assert sorted(p.images[0] for p in prompts) == sorted([solid_png(RED), solid_png(BLUE)])


def test_the_prompt_length_filter_counts_image_tokens(tiny_vlm):
    from actors.data.chat import prompt_token_counter

    count = prompt_token_counter(str(tiny_vlm))
    small = Prompt(0, ask(), "colour", "red", images=[solid_png(RED, 28)])
    large = Prompt(1, ask(), "colour", "red", images=[solid_png(RED, 56)])
    assert count(large) == count(small) + 3  # 4 image tokens against 1
