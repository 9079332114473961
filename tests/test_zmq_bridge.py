"""Tests for actors.runtime.zmq_bridge on real zmq sockets (ipc:// and inproc://)."""

from __future__ import annotations

import itertools
import shutil
import tempfile
import threading

import anyio
import anyio.lowlevel
import pytest
import zmq

from actors.runtime.zmq_bridge import AsyncSocket, SocketStatistics, make_socket

pytestmark = pytest.mark.anyio

TIMEOUT = 10
_counter = itertools.count()


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def endpoint():
    """Factory of fresh, short ipc:// endpoints (ipc paths must stay < ~100 chars)."""
    directory = tempfile.mkdtemp(prefix="zb", dir="/tmp")
    yield lambda: f"ipc://{directory}/{next(_counter)}"
    shutil.rmtree(directory, ignore_errors=True)


def pair(ctx, endpoint, kind_a=zmq.DEALER, kind_b=zmq.DEALER, *, hwm=1000, **kw_b):
    """Socket a binds, socket b connects."""
    addr = endpoint()
    a = make_socket(ctx, kind_a, bind=addr, hwm=hwm)
    b = make_socket(ctx, kind_b, connect=addr, hwm=hwm, **kw_b)
    return a, b


class EchoThread:
    """A blocking DEALER in a thread that echoes every message, at its own pace."""

    def __init__(self, ctx: zmq.Context, addr: str) -> None:
        self._ctx, self._addr = ctx, addr
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> EchoThread:
        self._thread.start()
        assert self._ready.wait(5)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._addr)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if sock.poll(20, zmq.POLLIN):
                    sock.send_multipart(sock.recv_multipart())
        finally:
            sock.close(linger=0)


async def until(predicate) -> None:
    """Yield to other tasks until predicate() holds (bounded by the test's fail_after)."""
    for _ in range(1_000_000):
        if predicate():
            return
        await anyio.lowlevel.checkpoint()
    raise AssertionError("condition never held")


async def fill(sock: AsyncSocket, make_msg) -> int:
    """Send with send_multipart_nowait until zmq.Again, then with a send that waits for room:
    the io threads and kernel buffers may still take data right after the first Again, and the
    waiting send goes through as soon as they do. Full is when it stays blocked for a while
    (cancelled, it sends nothing)."""
    sent = 0
    for _ in range(100_000):
        try:
            sock.send_multipart_nowait(make_msg(sent))
            sent += 1
            continue
        except zmq.Again:
            pass
        with anyio.move_on_after(0.05) as blocked:
            await sock.send_multipart(make_msg(sent))
            sent += 1
        if blocked.cancelled_caught:
            return sent
    raise AssertionError("the peer never pushed back")


async def echo_forever(sock: AsyncSocket) -> None:
    while True:
        await sock.send_multipart(await sock.recv_multipart())


# 1. Round trips ------------------------------------------------------------------------


async def test_push_pull_multipart(ctx, endpoint):
    push, pull = pair(ctx, endpoint, zmq.PUSH, zmq.PULL)
    with push, pull, anyio.fail_after(TIMEOUT):
        await push.send_multipart([b"a", b"", b"ccc"])
        assert await pull.recv_multipart() == [b"a", b"", b"ccc"]
        push.send_multipart_nowait([b"x"])
        assert await pull.recv_multipart() == [b"x"]


async def test_dealer_router_identity(ctx, endpoint):
    router, dealer = pair(ctx, endpoint, zmq.ROUTER, zmq.DEALER, identity=b"worker-1")
    with router, dealer, anyio.fail_after(TIMEOUT):
        await dealer.send_multipart([b"hello", b"world"])
        assert await router.recv_multipart() == [b"worker-1", b"hello", b"world"]
        await router.send_multipart([b"worker-1", b"reply"])
        assert await dealer.recv_multipart() == [b"reply"]


async def test_zero_copy_large_payload(ctx, endpoint):
    payload = bytes(range(256)) * (8 * 1024 * 1024 // 256)  # 8 MiB
    push, pull = pair(ctx, endpoint, zmq.PUSH, zmq.PULL)
    with push, pull, anyio.fail_after(TIMEOUT):
        await push.send_multipart([b"header", memoryview(payload)], copy=False)
        frames = await pull.recv_multipart(copy=False)
        assert all(isinstance(f, zmq.Frame) for f in frames)
        assert frames[0].bytes == b"header"
        assert len(frames[1]) == len(payload)
        assert frames[1].buffer == payload


async def test_nowait_recv_and_empty_socket(ctx, endpoint):
    push, pull = pair(ctx, endpoint, zmq.PUSH, zmq.PULL)
    with push, pull, anyio.fail_after(TIMEOUT):
        with pytest.raises(zmq.Again):
            pull.recv_multipart_nowait()
        await push.send_multipart([b"m"])
        assert await pull.recv_multipart() == [b"m"]


# 2. Streaming and concurrent use of one socket -----------------------------------------


async def test_stream_many_messages(ctx, endpoint):
    n = 5000
    push, pull = pair(ctx, endpoint, zmq.PUSH, zmq.PULL, hwm=50)
    received: list[int] = []

    async def produce():
        for i in range(n):
            await push.send_multipart([b"%d" % i, b"x" * 100])

    async def consume():
        for _ in range(n):
            head, _body = await pull.recv_multipart()
            received.append(int(head))

    with push, pull, anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            tg.start_soon(produce)
    assert received == list(range(n))


async def test_recv_blocked_while_other_task_sends_same_socket_thread_peer(ctx, endpoint):
    # The receiving task is the FD waiter whenever the sender sends: each send may eat
    # the FD edge that announces the reply, which the bridge must still notice.
    addr = endpoint()
    with make_socket(ctx, zmq.DEALER, bind=addr) as sock, EchoThread(ctx, addr):
        with anyio.fail_after(TIMEOUT):
            for _round in range(20):
                n = 100
                got: list[int] = []

                async def receive(n=n, got=got):
                    for _ in range(n):
                        got.append(int((await sock.recv_multipart())[0]))

                async with anyio.create_task_group() as tg:
                    tg.start_soon(receive)
                    for i in range(n):
                        await anyio.lowlevel.checkpoint()  # let the receiver block first
                        await sock.send_multipart([b"%d" % i])
                assert got == list(range(n))


async def test_ping_pong_receiver_always_waiting(ctx, endpoint):
    # Strict lock-step: the receiver is parked in recv before every send.
    a, b = pair(ctx, endpoint)
    replies_send, replies_recv = anyio.create_memory_object_stream[bytes](1)

    async def receive():
        while True:
            [msg] = await a.recv_multipart()
            await replies_send.send(msg)

    with a, b, replies_send, replies_recv, anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(echo_forever, b)
            tg.start_soon(receive)
            for i in range(1000):
                await until(lambda: a.statistics().tasks_waiting_receive == 1)
                await a.send_multipart([b"%d" % i])
                assert await replies_recv.receive() == b"%d" % i
            tg.cancel_scope.cancel()


async def test_full_duplex_stream_same_socket(ctx, endpoint):
    # One socket both streams out and receives echoes concurrently, small HWMs so
    # the sender and the receiver both block on the same FD.
    a, b = pair(ctx, endpoint, hwm=4)
    n = 3000
    got: list[int] = []

    async def receive():
        for _ in range(n):
            got.append(int((await a.recv_multipart())[0]))

    with a, b, anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(echo_forever, b)
            async with anyio.create_task_group() as inner:
                inner.start_soon(receive)
                for i in range(n):
                    await a.send_multipart([b"%d" % i])
            tg.cancel_scope.cancel()
    assert got == list(range(n))


# 3. Backpressure -----------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["inproc", "ipc"])
async def test_backpressure(ctx, endpoint, transport):
    addr = f"inproc://bp-{next(_counter)}" if transport == "inproc" else endpoint()
    size = 16 if transport == "inproc" else 256 * 1024  # ipc: fill the kernel buffers too
    pull = make_socket(ctx, zmq.PULL, bind=addr, hwm=2)
    push = make_socket(ctx, zmq.PUSH, connect=addr, hwm=2)
    with push, pull, anyio.fail_after(TIMEOUT):
        await push.send_multipart([b"first"])  # connection is up once this arrives
        assert await pull.recv_multipart() == [b"first"]
        sent = await fill(push, lambda i: [b"%d" % i, b"x" * size])
        assert sent > 0

        # A blocked send does not complete, and its cancellation sends nothing.
        with anyio.move_on_after(0.3) as scope:
            await push.send_multipart([b"%d" % sent, b"x" * size])
        assert scope.cancelled_caught
        assert push.statistics() == SocketStatistics(0, 0)

        done = anyio.Event()

        async def blocked_send():
            await push.send_multipart([b"%d" % sent, b"x" * size])
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(blocked_send)
            with anyio.move_on_after(0.3):
                await done.wait()
            assert not done.is_set()
            assert push.statistics().tasks_waiting_send == 1
            got = []
            for _ in range(sent + 1):
                frames = await pull.recv_multipart()
                got.append(int(frames[0]))
        assert done.is_set()
        assert got == list(range(sent + 1))  # nothing lost, nothing duplicated
        with pytest.raises(zmq.Again):
            pull.recv_multipart_nowait()


async def test_router_mandatory_full_peer_blocks_without_spinning(ctx):
    # ROUTER_MANDATORY reports POLLOUT while any peer has room, yet a send to a full
    # peer raises Again: the send must wait (not spin) and finish once that peer reads.
    addr = f"inproc://rm-{next(_counter)}"
    router = make_socket(ctx, zmq.ROUTER, bind=addr, hwm=2)
    router.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    slow = make_socket(ctx, zmq.DEALER, connect=addr, hwm=2, identity=b"slow")
    fast = make_socket(ctx, zmq.DEALER, connect=addr, hwm=2, identity=b"fast")
    with router, slow, fast, anyio.fail_after(TIMEOUT):
        for peer in (slow, fast):
            await peer.send_multipart([b"hi"])
        assert sorted([(await router.recv_multipart())[0] for _ in range(2)]) == [b"fast", b"slow"]
        sent = 0
        with pytest.raises(zmq.Again):
            for _ in range(1000):
                router.send_multipart_nowait([b"slow", b"%d" % sent])
                sent += 1
        assert router.socket.getsockopt(zmq.EVENTS) & zmq.POLLOUT  # the contradiction

        done = anyio.Event()
        ticks = 0

        async def blocked_send():
            await router.send_multipart([b"slow", b"%d" % sent])
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(blocked_send)
            with anyio.move_on_after(0.3):
                while not done.is_set():
                    ticks += 1
                    await anyio.lowlevel.checkpoint()
            assert not done.is_set()
            # Other tasks still get to run, and the fast peer is still reachable.
            await router.send_multipart([b"fast", b"ok"])
            assert await fast.recv_multipart() == [b"ok"]
            got = [int((await slow.recv_multipart())[0]) for _ in range(sent + 1)]
        assert done.is_set()
        assert got == list(range(sent + 1))
        assert ticks > 100


# 4. Cancellation -----------------------------------------------------------------------


async def test_cancelled_recv_leaves_socket_usable(ctx, endpoint):
    push, pull = pair(ctx, endpoint, zmq.PUSH, zmq.PULL)
    with push, pull, anyio.fail_after(TIMEOUT):
        for _ in range(3):
            with anyio.move_on_after(0.05) as scope:
                await pull.recv_multipart()
            assert scope.cancelled_caught
        assert pull.statistics() == SocketStatistics(0, 0)

        async with anyio.create_task_group() as tg:
            tg.start_soon(pull.recv_multipart)
            await anyio.wait_all_tasks_blocked()
            assert pull.statistics().tasks_waiting_receive == 1
            tg.cancel_scope.cancel()

        await push.send_multipart([b"after"])
        assert await pull.recv_multipart() == [b"after"]


async def test_cancel_fd_waiter_hands_over_to_parked_receiver(ctx, endpoint):
    push, pull = pair(ctx, endpoint, zmq.PUSH, zmq.PULL)
    result: list[list[bytes]] = []

    async def second():
        result.append(await pull.recv_multipart())

    with push, pull, anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            first_scope = anyio.CancelScope()

            async def first():
                with first_scope:
                    await pull.recv_multipart()

            tg.start_soon(first)  # becomes the FD waiter
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(second)  # parks
            await anyio.wait_all_tasks_blocked()
            assert pull.statistics().tasks_waiting_receive == 2
            first_scope.cancel()
            await anyio.wait_all_tasks_blocked()  # first has left; second waits on the FD now
            assert pull.statistics().tasks_waiting_receive == 1
            await push.send_multipart([b"for-second"])
        assert result == [[b"for-second"]]


async def test_cancelled_send_leaves_socket_usable(ctx):
    addr = f"inproc://cs-{next(_counter)}"
    pull = make_socket(ctx, zmq.PULL, bind=addr, hwm=1)
    push = make_socket(ctx, zmq.PUSH, connect=addr, hwm=1)
    with push, pull, anyio.fail_after(TIMEOUT):
        sent = 0
        with pytest.raises(zmq.Again):
            while True:
                push.send_multipart_nowait([b"%d" % sent, b"more", b"parts"])
                sent += 1
        for _ in range(3):
            with anyio.move_on_after(0.05) as scope:
                await push.send_multipart([b"cancelled", b"more", b"parts"])
            assert scope.cancelled_caught
        got = [await pull.recv_multipart() for _ in range(sent)]
        assert got == [[b"%d" % i, b"more", b"parts"] for i in range(sent)]
        await push.send_multipart([b"last", b"more", b"parts"])
        assert await pull.recv_multipart() == [b"last", b"more", b"parts"]
        with pytest.raises(zmq.Again):
            pull.recv_multipart_nowait()  # no partial/cancelled message ever arrived


async def test_already_cancelled_send_sends_nothing(ctx, endpoint):
    push, pull = pair(ctx, endpoint, zmq.PUSH, zmq.PULL)
    with push, pull, anyio.fail_after(TIMEOUT):
        with anyio.CancelScope() as scope:
            scope.cancel()
            await push.send_multipart([b"never"])
        await push.send_multipart([b"real"])
        assert await pull.recv_multipart() == [b"real"]


async def test_close_wakes_waiters(ctx, endpoint):
    push, pull = pair(ctx, endpoint, zmq.PUSH, zmq.PULL)
    errors: list[BaseException] = []

    async def waiter():
        try:
            await pull.recv_multipart()
        except anyio.ClosedResourceError as exc:
            errors.append(exc)

    with push, anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            assert pull.statistics().tasks_waiting_receive == 3
            pull.close()
        assert len(errors) == 3 and pull.closed
        with pytest.raises(anyio.ClosedResourceError):
            await pull.recv_multipart()


# 5. Many tasks on one socket -----------------------------------------------------------


@pytest.mark.parametrize("hwm", [2, 1000])
async def test_many_senders_two_receivers_one_socket(ctx, endpoint, hwm):
    a, b = pair(ctx, endpoint, hwm=hwm)
    senders, per_sender = 8, 200
    got: list[bytes] = []

    async def send(k: int):
        for i in range(per_sender):
            await a.send_multipart([b"%d-%d" % (k, i)])

    async def receive(count: int):
        for _ in range(count):
            got.append((await a.recv_multipart())[0])

    total = senders * per_sender
    with a, b, anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(echo_forever, b)
            async with anyio.create_task_group() as inner:
                inner.start_soon(receive, total // 2)
                inner.start_soon(receive, total - total // 2)
                for k in range(senders):
                    inner.start_soon(send, k)
            tg.cancel_scope.cancel()
    expected = [b"%d-%d" % (k, i) for k in range(senders) for i in range(per_sender)]
    assert sorted(got) == sorted(expected)
    assert a.statistics() == SocketStatistics(0, 0)


async def test_many_receivers_pull(ctx, endpoint):
    push, pull = pair(ctx, endpoint, zmq.PUSH, zmq.PULL, hwm=3)
    counts = [0] * 5
    n = 2000

    async def receive(idx: int):
        while True:
            await pull.recv_multipart()
            counts[idx] += 1

    with push, pull, anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            for idx in range(len(counts)):
                tg.start_soon(receive, idx)
            for i in range(n):
                await push.send_multipart([b"%d" % i])
            await until(lambda: sum(counts) == n)
            tg.cancel_scope.cancel()
    assert sum(counts) == n


# make_socket ---------------------------------------------------------------------------


def test_make_socket_options(ctx, endpoint):
    with make_socket(ctx, zmq.DEALER, bind=endpoint(), hwm=7, identity=b"me") as s:
        sock = s.socket
        assert sock.getsockopt(zmq.SNDHWM) == 7
        assert sock.getsockopt(zmq.RCVHWM) == 7
        assert sock.getsockopt(zmq.LINGER) == 0
        assert sock.getsockopt(zmq.IDENTITY) == b"me"
        assert s.statistics() == SocketStatistics(0, 0)
    assert s.closed and sock.closed
