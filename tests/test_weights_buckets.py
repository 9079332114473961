"""Weights travel in buckets: a version is several messages of at most ``bucket_bytes`` each,
none dropped when the sampler's queue is full, assembled whole on the sampler's side; a broken
bucket costs that version, not the channel; an older version sent again is not loaded."""

from __future__ import annotations

import anyio
import pytest
import torch
import zmq

from actors.runtime.tensors import meta, raw_bytes
from actors.runtime.transports.shm import ShmReceiver, ShmSender
from actors.runtime.transports.zmq import ZmqSender, split_buckets
from actors.runtime.weights import WeightsPublisher, WeightsSubscriber
from actors.runtime.zmq_bridge import make_socket
from messages.codec import Codec, encode
from messages.weights import WeightsHeader, WeightsPoll


def tensors(version: int) -> list[tuple[str, torch.Tensor]]:
    return [(f"layer{i}.weight", torch.full((16, 16), float(version * 100 + i))) for i in range(7)]


def test_split_buckets():
    ts = [("a", torch.zeros(10)), ("b", torch.zeros(10)), ("c", torch.zeros(30)), ("d", torch.zeros(1))]
    sizes = [[n for n, _ in b] for b in split_buckets(ts, 80)]  # float32: 40, 40, 120, 4 bytes
    assert sizes == [["a", "b"], ["c"], ["d"]]  # a tensor over the limit travels alone
    assert [[n for n, _ in b] for b in split_buckets(ts, 0)] == [["a", "b", "c", "d"]]
    assert split_buckets([], 80) == [[]]


@pytest.mark.anyio
async def test_a_version_in_buckets_arrives_whole_through_full_queues(sockets):
    zctx = zmq.Context()
    address = f"ipc://{sockets}/weights"
    with anyio.fail_after(60):
        # high-water marks of one message: a publisher that dropped on a full queue would lose
        # buckets here; ROUTER_MANDATORY makes it wait instead
        with make_socket(zctx, zmq.ROUTER, bind=address, hwm=1) as learner_sock, \
             make_socket(zctx, zmq.DEALER, connect=address, hwm=1) as sampler_sock:
            publisher = WeightsPublisher(learner_sock, ZmqSender())
            subscriber = WeightsSubscriber(sampler_sock)
            async with anyio.create_task_group() as tg:
                tg.start_soon(publisher.serve)
                tg.start_soon(subscriber.serve)
                for version in (0, 1):
                    await publisher.publish(version, tensors(version), bucket_bytes=2 * 16 * 16 * 4)
                    assert len(publisher.messages) == 4  # 7 tensors, 2 per bucket
                    await subscriber.wait_for(version)
                    got_version, got = subscriber.take()
                    assert got_version == version
                    assert list(got) == [n for n, _ in tensors(version)]
                    assert all(torch.equal(got[n], t) for n, t in tensors(version))
                assert publisher.sent == 2 and not subscriber.error
                tg.cancel_scope.cancel()
    zctx.destroy(linger=0)


def bucket(version: int, i: int, of: int, ts: list[tuple[str, torch.Tensor]]) -> list:
    header = WeightsHeader(version=version, tensors=[meta(n, t) for n, t in ts], bucket=i,
                           buckets=of)
    return [encode(header), *(raw_bytes(t) for _, t in ts)]


@pytest.mark.anyio
async def test_a_broken_bucket_costs_its_version_not_the_channel(sockets):
    """Bucket 1 of 3 has a frame missing: the sampler reports it, skips bucket 2 (the rest of
    the version it gave up on) without taking it for an answer, polls again and takes the next
    version whole."""
    zctx = zmq.Context()
    address = f"ipc://{sockets}/weights"
    polls: Codec[WeightsPoll] = Codec(WeightsPoll)
    ts = tensors(3)
    with anyio.fail_after(60):
        with make_socket(zctx, zmq.ROUTER, bind=address) as learner, \
             make_socket(zctx, zmq.DEALER, connect=address) as sampler_sock:
            subscriber = WeightsSubscriber(sampler_sock)
            async with anyio.create_task_group() as tg:
                tg.start_soon(subscriber.serve)
                peer, frame = await learner.recv_multipart()
                assert polls.decode(frame).have_version == -1
                await learner.send_multipart([peer, *bucket(3, 0, 3, ts[:2])])
                await learner.send_multipart([peer, *bucket(3, 1, 3, ts[2:4])[:-1]])  # a frame short
                await learner.send_multipart([peer, *bucket(3, 2, 3, ts[4:])])
                peer, frame = await learner.recv_multipart()  # the next poll, after the rest
                assert polls.decode(frame).have_version == -1
                assert "does not match its frames" in subscriber.error
                assert subscriber.received == -1
                await learner.send_multipart([peer, *bucket(4, 0, 1, tensors(4))])
                await subscriber.wait_for(4)
                version, got = subscriber.take()
                assert version == 4 and torch.equal(got["layer6.weight"], tensors(4)[6][1])
                tg.cancel_scope.cancel()
    zctx.destroy(linger=0)


@pytest.mark.anyio
async def test_an_older_version_sent_again_is_refused_not_loaded(sockets):
    """A weights message of a version the sampler has (a replayed one: the learner answers each
    poll once, with a newer version) is counted and dropped, whole with its buckets; it is no
    answer, so no poll goes out for it, and the next version still arrives."""
    zctx = zmq.Context()
    address = f"ipc://{sockets}/weights"
    polls: Codec[WeightsPoll] = Codec(WeightsPoll)
    with anyio.fail_after(60):
        with make_socket(zctx, zmq.ROUTER, bind=address) as learner, \
             make_socket(zctx, zmq.DEALER, connect=address) as sampler_sock:
            subscriber = WeightsSubscriber(sampler_sock)
            async with anyio.create_task_group() as tg:
                tg.start_soon(subscriber.serve)
                peer, frame = await learner.recv_multipart()
                await learner.send_multipart([peer, *bucket(3, 0, 1, tensors(3))])
                await subscriber.wait_for(3)
                assert subscriber.take()[0] == 3
                peer, frame = await learner.recv_multipart()
                assert polls.decode(frame).have_version == 3
                await learner.send_multipart([peer, *bucket(2, 0, 2, tensors(2)[:3])])  # old
                await learner.send_multipart([peer, *bucket(2, 1, 2, tensors(2)[3:])])
                await learner.send_multipart([peer, *bucket(3, 0, 1, tensors(3))])  # again
                await learner.send_multipart([peer, *bucket(4, 0, 1, tensors(4))])
                await subscriber.wait_for(4)
                version, got = subscriber.take()
                assert version == 4 and torch.equal(got["layer6.weight"], tensors(4)[6][1])
                assert subscriber.stale == 2 and subscriber.take() is None
                peer, frame = await learner.recv_multipart()  # the poll after 4, none between
                assert polls.decode(frame).have_version == 4
                tg.cancel_scope.cancel()
    zctx.destroy(linger=0)


@pytest.mark.anyio
async def test_shared_memory_versions_outlive_the_learners_files(sockets):
    """shm transport: the learner writes a version once and sends its path; the sampler holds
    its own link to it, so a version it received still loads after the learner dropped its file
    (a newer version replaced it, or the learner exited: seen as a vLLM sampler that never got
    the last step's weights to validate). Each side removes its own folder."""
    zctx = zmq.Context()
    address = f"ipc://{sockets}/weights"
    with anyio.fail_after(60):
        with make_socket(zctx, zmq.ROUTER, bind=address) as learner_sock, \
             make_socket(zctx, zmq.DEALER, connect=address) as sampler_sock:
            sender, receiver = ShmSender(), ShmReceiver()
            publisher = WeightsPublisher(learner_sock, sender)
            subscriber = WeightsSubscriber(sampler_sock)
            subscriber.receivers["shm"] = receiver
            async with anyio.create_task_group() as tg:
                tg.start_soon(publisher.serve)
                tg.start_soon(subscriber.serve)
                for version in (0, 1, 2, 3):
                    await publisher.publish(version, tensors(version))
                    await subscriber.wait_for(version)
                assert len(sender.shm_files) == 2  # the learner keeps the newest 2
                publisher.close()  # the learner exits: its folder goes
                assert not sender.shm_dir.exists()
                got_version, got = subscriber.take()
                assert got_version == 3 and got.path.startswith(str(receiver.shm_dir))
                assert all(torch.equal(t, dict(tensors(3))[n]) for n, t in got.items())
                assert list(receiver.links) == ["taken"] and not subscriber.error
                tg.cancel_scope.cancel()
            subscriber.close()
            assert not receiver.shm_dir.exists()
    zctx.destroy(linger=0)


@pytest.mark.anyio
async def test_a_gone_sampler_is_not_waited_for_at_the_end(sockets):
    """A sampler killed while waiting for the next version (a restarted one polls under a new
    identity): the publish that finds it gone forgets it, so the learner's wait for every
    sampler to hold the last weights (``wait_received``) ends with the live ones, not after its
    timeout."""
    from zmq.utils.monitor import recv_monitor_message

    zctx = zmq.Context()
    address = f"ipc://{sockets}/weights"
    with anyio.fail_after(60):
        with make_socket(zctx, zmq.ROUTER, bind=address) as learner_sock, \
             make_socket(zctx, zmq.DEALER, connect=address) as live_sock:
            monitor = learner_sock.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            publisher = WeightsPublisher(learner_sock, ZmqSender())
            live = WeightsSubscriber(live_sock)
            async with anyio.create_task_group() as tg:
                tg.start_soon(publisher.serve)
                tg.start_soon(live.serve)
                with make_socket(zctx, zmq.DEALER, connect=address) as gone_sock:
                    gone = WeightsSubscriber(gone_sock)
                    async with anyio.create_task_group() as its_own:
                        its_own.start_soon(gone.serve)
                        await publisher.publish(0, tensors(0))
                        await live.wait_for(0)
                        await gone.wait_for(0)
                        while len(publisher.waiting) < 2:  # both asked for the next version
                            await publisher._polled.wait()
                        its_own.cancel_scope.cancel()
                # its socket closed: the learner's side sees the peer disconnect
                assert await anyio.to_thread.run_sync(monitor.poll, 30_000)
                assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
                await publisher.publish(1, tensors(1))
                await live.wait_for(1)
                assert await publisher.wait_received(timeout_s=30)
                assert len(publisher.have) == 1
                tg.cancel_scope.cancel()
            learner_sock.socket.disable_monitor()
            monitor.close(linger=0)
    zctx.destroy(linger=0)


@pytest.mark.anyio
async def test_the_last_weights_are_waited_for_until_a_sampler_starts_polling(sockets):
    """A learner resumed with no step left to train publishes the last weights before any
    sampler polls; the last validation needs them, so ``wait_received(first=True)`` holds until
    a sampler that connects later has them (without ``first`` it returns at once: nobody is
    waited for, and a job whose learner left then waits for that validation forever)."""
    zctx = zmq.Context()
    address = f"ipc://{sockets}/weights"
    with anyio.fail_after(60):
        with make_socket(zctx, zmq.ROUTER, bind=address) as learner_sock:
            publisher = WeightsPublisher(learner_sock, ZmqSender())
            async with anyio.create_task_group() as tg:
                tg.start_soon(publisher.serve)
                await publisher.publish(3, tensors(3))
                assert await publisher.wait_received(timeout_s=30)  # at once: nobody polled
                waited: list[bool] = []
                returned = anyio.Event()

                async def wait_first() -> None:
                    waited.append(await publisher.wait_received(timeout_s=30, first=True))
                    returned.set()

                tg.start_soon(wait_first)
                await anyio.wait_all_tasks_blocked()
                assert waited == []  # no sampler yet: still waiting
                with make_socket(zctx, zmq.DEALER, connect=address) as sock:
                    late = WeightsSubscriber(sock)
                    async with anyio.create_task_group() as its_own:
                        its_own.start_soon(late.serve)
                        await late.wait_for(3)
                        await returned.wait()
                        its_own.cancel_scope.cancel()
                    late.close()
                assert waited == [True] and publisher.have == {next(iter(publisher.have)): 3}
                tg.cancel_scope.cancel()
    zctx.destroy(linger=0)
