"""A vision-language job's sampled images in the trackers: the learner picks a few samples with
images every ``run.image_interval`` steps and reports them with the step; tensorboard shows each
image (its image plugin) with the answer (its text plugin) and wandb each as a ``wandb.Image``
captioned with the answer. Read back from the files the trackers wrote (``tests/trackers.py``)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from actors.job.config.load import decode_topology
from actors.job.metrics import Background, JsonlSink, Metrics, Resume
from actors.job.trackers import TensorBoardSink, WandbSink
from actors.learner.vision import image_samples
from actors.runtime.tensors import to_wire
from messages.codec import Codec
from messages.control import ImageSample, StepReport
from messages.rollout import ChatMessage, Prompt, Sample, ScoredGroup
from tests.tiny_model import tiny_tokenizer
from tests.tiny_vlm import solid_png
from tests.trackers import tensorboard_images, tensorboard_texts, wandb_runs

RED, BLUE, GREEN = solid_png((230, 20, 20), 56), solid_png((20, 20, 230)), solid_png((20, 200, 20))
SAMPLES = [ImageSample([RED], "red", 1.0, 3), ImageSample([BLUE, GREEN], "b", 0.0, 4)]


def test_tensorboard_shows_each_image_with_its_answer(tmp_path):
    sink = TensorBoardSink(tmp_path, Resume())
    sink.write("train", 10, {"critic/score/mean": 0.5})
    sink.write_samples(10, SAMPLES)
    sink.close("finished")
    images = tensorboard_images(tmp_path / "tensorboard")
    assert images == {"samples/0/image": [(10, 56, 56, RED)],
                      "samples/1/image": [(10, 28, 28, BLUE)],
                      "samples/1/image/1": [(10, 28, 28, GREEN)]}
    assert tensorboard_texts(tmp_path / "tensorboard") == {
        "samples/0/answer": [(10, "prompt 3, reward 1: red")],
        "samples/1/answer": [(10, "prompt 4, reward 0: b")]}


def test_wandb_logs_each_image_captioned_with_its_answer(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink(tmp_path, decode_topology({}), Resume(), "vlmimage")
    try:
        sink.write("train", 10, {"critic/score/mean": 0.5})
        sink.write_samples(10, SAMPLES)
    finally:
        sink.close("finished")
        import wandb

        wandb.teardown()
    [run] = wandb_runs(tmp_path)
    [shown] = [r for r in run["history"] if "samples/0/image/_type" in r]
    assert shown["step"] == 10
    assert {k: shown[f"{k}/caption"] for k in ("samples/0/image", "samples/1/image",
                                                "samples/1/image/1")} == {
        "samples/0/image": "prompt 3, reward 1: red", "samples/1/image": "prompt 4, reward 0: b",
        "samples/1/image/1": "prompt 4, reward 0: b"}
    assert (shown["samples/0/image/width"], shown["samples/1/image/width"]) == (56, 28)
    [media] = (tmp_path / "wandb").glob("offline-run-*/files/media/images")
    assert sorted(p.read_bytes() for p in media.rglob("*.png")) == sorted([RED, BLUE, GREEN])


def test_the_learner_reports_a_few_samples_with_images_and_the_runner_hands_them_on(tmp_path):
    tok = tiny_tokenizer()

    def group(k: int, images: list[bytes], answer: str, reward: float) -> ScoredGroup:
        ids = torch.tensor(tok(answer, add_special_tokens=False)["input_ids"], dtype=torch.int32)
        samples = [Sample(to_wire(ids), to_wire(torch.zeros(len(ids))), 0, "", "stop",
                          reward=reward)] * 2
        return ScoredGroup(Prompt(k, [ChatMessage("user", "<image>?" * len(images))], "c", "r",
                                  images=images), to_wire(torch.tensor([1], dtype=torch.int32)),
                           samples, "s")

    groups = [group(0, [], "text", 0.0), group(1, [RED], "red", 1.0),
              group(2, [BLUE, GREEN], "blue", 0.0), group(3, [GREEN], "green", 1.0)]
    shown = image_samples(groups, tok, 2)
    assert shown == [ImageSample([RED], "red", 1.0, 1), ImageSample([BLUE, GREEN], "blue", 0.0, 2)]
    report = msgspec.msgpack.encode(StepReport(step=10, metrics={"a": 1.0}, samples=shown))
    assert Codec(StepReport).decode(report).samples == shown  # as the runner reads it

    class Showing:
        name = "showing"

        def __init__(self) -> None:
            self.shown: list = []

        def write(self, kind, step, metrics) -> None:
            pass

        def write_samples(self, step, samples) -> None:
            self.shown.append((step, list(samples)))

        def close(self, outcome) -> None:
            pass

    showing = Showing()
    hub = Metrics([Background(showing), JsonlSink(tmp_path, Resume())], report=pytest.fail)
    hub.write_samples(10, shown)  # the jsonl sink shows no images: left out, not failed
    hub.close("finished")
    assert showing.shown == [(10, shown)] and not hub.failed
