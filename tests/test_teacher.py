"""The teacher pool (``actors/teacher/``): its log-probs, its worker behind the router, its checks.

- ``TeacherModel.logprobs`` equals the plain forward (full logits, ``log_softmax``, gather) on
  each response, batched or not.
- A teacher worker behind the real router answers a routed request with those log-probs; a
  worker that takes a request and dies (a DEALER that said hello to the ``teacher`` pool, took
  the request and went silent) has it re-sent by the router to the live teacher worker.
- A teacher whose tokenizer is not the student's is a config error naming both models.
"""

from __future__ import annotations

import anyio
import pytest
import torch
import zmq
from transformers import AutoModelForCausalLM

from actors.job.config.preflight import preflight
from actors.router.actor import router_actor
from actors.runtime.actor import serve_actor
from actors.runtime.config import ConfigError
from actors.runtime.tensors import from_wire, to_wire
from actors.runtime.zmq_bridge import make_socket
from actors.teacher.model import TeacherModel
from actors.teacher.worker import teacher_actor
from messages.codec import Codec, encode
from messages.routing import Envelope, ToClient, ToWorker, WorkerHello
from messages.teacher import TeacherReply, TeacherRequest, ToTeacherClient
from tests.helpers import actor_context, live_topology, routed, wait_for
from tests.tiny_model import VOCAB, build_tiny_model

PROMPT = [1, 5, 6, 7, 2, 3]
RESPONSES = [[8, 9, 10, 2], [11], [12, 13, 14, 15, 16, 17, 2], []]


@pytest.fixture(scope="module")
def teacher_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("teacher") / "model", seed=7)


def reference(path, prompt: list[int], response: list[int]) -> torch.Tensor:
    """The plain way: the whole sequence's logits, log_softmax, the response tokens' entries."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()  # (L-1, V)
    lp = logits.log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0]
    return lp[len(prompt) - 1:]


def test_logprobs_are_the_plain_forwards(teacher_model):
    for batch_size in (16, 1):
        model = TeacherModel(teacher_model, device="cpu", dtype="auto", model_dtype="float32",
                             threads=1, batch_size=batch_size)
        model.load()
        got = model.logprobs(PROMPT, RESPONSES)
        assert [len(t) for t in got] == [len(r) for r in RESPONSES]
        for lp, r in zip(got, RESPONSES, strict=True):
            expected = reference(teacher_model, PROMPT, r)
            diff = (lp - expected).abs()
            assert diff.numel() == 0 or float(diff.max()) < 1e-5, (batch_size, float(diff.max()))


@pytest.mark.anyio
async def test_a_dead_teacher_workers_request_is_resent_to_a_live_one(teacher_model, tmp_path,
                                                                      sockets):
    topo = live_topology(sockets, f"teacher.path={teacher_model}", "router.request_timeout=1.0")
    request = TeacherRequest(to_wire(torch.tensor(PROMPT, dtype=torch.int32)),
                             [to_wire(torch.tensor(r, dtype=torch.int32)) for r in RESPONSES])
    zctx = zmq.Context()
    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                router_ctx = actor_context("router", topo, zctx, tmp_path)
                await tg.start(serve_actor, router_ctx, router_actor, None)
                # a teacher worker that takes the request and then dies (never answers, silent)
                with make_socket(zctx, zmq.DEALER, connect=topo.router.worker_address,
                                 identity=b"teacher-doomed") as doomed, \
                        make_socket(zctx, zmq.DEALER, connect=topo.router.address) as client:
                    await doomed.send_multipart([encode(WorkerHello("teacher-doomed", "teacher", 1))])
                    await wait_for("the doomed worker joined",
                                   lambda: "worker/teacher-doomed" in router_ctx.status)
                    await client.send_multipart(routed(5, request, pool="teacher"))
                    frames = await doomed.recv_multipart()  # it holds the request now
                    assert isinstance(Codec(ToWorker).decode(frames[0]), Envelope)
                    # the live teacher joins; the doomed one's request times out and is re-sent
                    await tg.start(serve_actor, actor_context("teacher", topo, zctx, tmp_path),
                                   teacher_actor, None)
                    envelope, body = await client.recv_multipart()
                assert Codec(ToClient).decode(envelope) == Envelope(5)
                reply = Codec(ToTeacherClient).decode(body)
                assert isinstance(reply, TeacherReply) and reply.error == ""
                for lp, r in zip(reply.logprobs, RESPONSES, strict=True):
                    expected = reference(teacher_model, PROMPT, r)
                    assert from_wire(lp).shape == expected.shape
                    assert torch.allclose(from_wire(lp), expected, rtol=0, atol=1e-5)
                status = router_ctx.status  # refreshed on the router's timer
                await wait_for("the router's record of the re-send",
                               lambda: status.get("worker/teacher-0", {}).get("done") == 1)
                assert status["resent"] == 1 and status["answered"] == 1
                assert status["worker/teacher-doomed"]["failed"] == 1
                tg.cancel_scope.cancel()
    finally:
        zctx.destroy(linger=0)


def test_a_teacher_with_another_tokenizer_is_a_config_error_naming_both(tiny_model, tmp_path,
                                                                         sockets):
    other = build_tiny_model(tmp_path / "other", words=("<tool_call>",))  # one more token
    topo = live_topology(sockets, f"model.path={tiny_model}", f"teacher.path={other}")
    with pytest.raises(ConfigError, match=rf"teacher.path: the teacher {other} and the student "
                       rf"{tiny_model} \(model.path\) do not share a tokenizer: 1 vocabulary"):
        preflight(topo)
    same = live_topology(sockets, f"model.path={tiny_model}",
                         f"teacher.path={build_tiny_model(tmp_path / 'same', seed=3)}")
    preflight(same)  # the same tokenizer, other weights: fine
    with pytest.raises(ConfigError, match=r"teacher.path: .*/x. does not exist"):
        preflight(live_topology(sockets, f"model.path={tiny_model}", f"teacher.path={tmp_path}/x"))
    with pytest.raises(ConfigError, match=r"teacher.replicas: must be >= 1"):
        live_topology(sockets, "teacher.replicas=0")
    with pytest.raises(ConfigError, match=r"teacher.device: 'gpu' is not auto"):
        live_topology(sockets, "teacher.device=gpu")
    assert len(VOCAB) == 44


def test_teachers_are_placed_by_the_samplers_rules(tmp_path, sockets, teacher_model):
    from tests.test_placement import envs, topology

    cpu = {"CUDA_VISIBLE_DEVICES": "", "FLOWRL_DEVICE": "cpu"}
    on = f"teacher.path={teacher_model}"
    # GPUs no learner rank or sampler has: one each
    got = envs(topology(sockets, "sampler.engine=hf", on, "teacher.replicas=2"), tmp_path,
               ["0", "1", "2", "3"])
    assert got["teacher-0"] == {"CUDA_VISIBLE_DEVICES": "2", "FLOWRL_DEVICE": "cuda:0"}
    assert got["teacher-1"] == {"CUDA_VISIBLE_DEVICES": "3", "FLOWRL_DEVICE": "cuda:0"}
    # none free: shared from the first GPU, with a memory share
    got = envs(topology(sockets, "sampler.engine=hf", on), tmp_path, ["0", "1"])
    assert got["teacher-0"] == {"CUDA_VISIBLE_DEVICES": "0", "FLOWRL_DEVICE": "cuda:0",
                                "FLOWRL_GPU_MEMORY_SHARE": "0.45"}
    assert got["learner-0"]["FLOWRL_GPU_MEMORY_SHARE"] == "0.45"
    # cpu beside GPUs, and no GPU at all
    assert envs(topology(sockets, "sampler.engine=hf", on, "teacher.device=cpu"), tmp_path,
                ["0", "1", "2"])["teacher-0"] == cpu
    assert envs(topology(sockets, "sampler.engine=hf", on), tmp_path, [])["teacher-0"] == cpu
    # no teacher.path: no teacher process
    assert "teacher-0" not in envs(topology(sockets, "sampler.engine=hf"), tmp_path, ["0"])
    with pytest.raises(ConfigError, match=r"teacher.replicas: 10 processes on GPU 0 would get 9%"):
        envs(topology(sockets, "sampler.engine=hf", on, "teacher.replicas=8"), tmp_path, ["0"])


@pytest.mark.anyio
async def test_an_idle_teacher_sleeps_and_a_request_wakes_it_with_the_same_logprobs(
        teacher_model, tmp_path, sockets):
    """``teacher.sleep_idle_s``: an idle worker gives its weights' memory back (on a CPU the
    parameters emptied, read again from the checkpoint on wake), reports the sleep, and the next
    routed request wakes it and is answered with the same log-probs as before the sleep."""
    topo = live_topology(sockets, f"teacher.path={teacher_model}", "teacher.sleep_idle_s=0.3")
    request = TeacherRequest(to_wire(torch.tensor(PROMPT, dtype=torch.int32)),
                             [to_wire(torch.tensor(r, dtype=torch.int32)) for r in RESPONSES])
    zctx = zmq.Context()
    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                await tg.start(serve_actor, actor_context("router", topo, zctx, tmp_path),
                               router_actor, None)
                teacher_ctx = actor_context("teacher", topo, zctx, tmp_path)
                await tg.start(serve_actor, teacher_ctx, teacher_actor, None)
                replies = []
                with make_socket(zctx, zmq.DEALER, connect=topo.router.address) as client:
                    for rid in (1, 2):
                        await wait_for("the teacher asleep",  # idle since its start, then again
                                       lambda: teacher_ctx.status.get("asleep") is True)
                        assert teacher_ctx.status["sleeps"] == rid
                        assert teacher_ctx.status["freed_mb"] > 0
                        await client.send_multipart(routed(rid, request, pool="teacher"))
                        envelope, body = await client.recv_multipart()
                        assert Codec(ToClient).decode(envelope) == Envelope(rid)
                        reply = Codec(ToTeacherClient).decode(body)
                        assert isinstance(reply, TeacherReply) and reply.error == ""
                        replies.append([from_wire(lp) for lp in reply.logprobs])
                        assert teacher_ctx.status["wake_ms"] > 0
                for first, second, r in zip(*replies, RESPONSES, strict=True):
                    assert torch.equal(first, second)  # the same weights after the wake
                    expected = reference(teacher_model, PROMPT, r)
                    assert torch.allclose(first, expected, rtol=0, atol=1e-5)
                tg.cancel_scope.cancel()
    finally:
        zctx.destroy(linger=0)
