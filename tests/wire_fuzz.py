"""Hostile frames at every socket a running job binds, with the count each actor must show.

A :class:`WireFuzzer` reads a job's ``topology.json`` and connects one DEALER to each socket the
job binds: the replay buffer's ROUTER, the router's client and worker ROUTERs, the learner's
weights ROUTER and the runner's control ROUTER. (Samplers and reward workers bind nothing: what
reaches them comes through those; garbage request bodies in valid envelopes go through the
router to the reward workers.) It then sends, as fast as the sockets take them:

- random bytes; msgpack headers that claim huge lengths (``oversized``);
- truncated and bit-flipped copies of real frames: those it captured from the job (its replies,
  routed score replies) and one valid message of every type;
- valid messages of a type the socket does not take, and messages of an unknown type (a newer
  protocol's);
- replays of old frames that decode and must be refused: a group the learner has trained
  (``GroupsDone``, read from the recording), a batch request for a step already served, a
  weights notice older than the current version (``VersionUpdate``), a score reply already
  answered (to the router's worker socket).

An eighth of the damaged frames come from a second socket per target that never reads what the
job answers (its queue stays full: the job must drop those answers, not wait for room).

Every non-replay frame is checked before it is sent with a fresh ``Codec`` of the socket's union
(and the router's frame-count rules): a frame the socket would accept is not sent (it would be
a forgery, not damage), so each frame sent must be rejected, and ``expected()`` is the exact
count each actor's status must reach. ``curve_key`` (a ``.key_secret`` file): the fuzzer's
sockets use that key; ``outsider``: a second set of sockets with a key the job does not know,
whose frames must never reach decoding (the job's ``auth_refused`` grows, nothing else).

Seeded: the same seed sends the same frames in the same order (what the job answers, and so
what is captured, follows the job's timing).
"""

from __future__ import annotations

import collections
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import zmq

from actors.runtime.recording import read_table
from actors.runtime.security import CurveKeys, load_secret
from messages.codec import Codec, DecodeError, encode
from messages.control import ToRunner
from messages.reward import ScoreReply, ScoreResult, ToRewardWorker
from messages.rollout import BatchRequest, GroupsDone, ToReplay, VersionUpdate
from messages.routing import (
    Envelope,
    ToClient,
    ToRouterFromClient,
    ToRouterFromWorker,
    ToWorker,
    WorkerBye,
)
from messages.weights import ToLearnerWeights
from tests.helpers import CASES, routed, sample_group, score_request

SETTLE_S = 1.0  # frames sent this long before the fuzzer stopped were read by the job's end

HUGE = [b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xffabc", b"\xdd\xff\xff\xff\xff\x01",
        b"\xdf\xff\xff\xff\xff\xa4type", b"\xc5\xff\xff", b"\x81\xa4type\xdb\x7f\xff\xff\xffab"]


def reads_last(union: Any) -> Callable[[list[bytes]], bool]:
    """The rejection rule of a socket that decodes the last frame (replay, learner, runner)."""
    codec = Codec(union)

    def rejects(parts: list[bytes]) -> bool:
        try:
            codec.decode(parts[-1] if parts else b"")
        except DecodeError:
            return True
        return False
    return rejects


def router_rejects(union: Any, whole: Callable[[Any], int]) -> Callable[[list[bytes]], bool]:
    """The router's rule: frame 0 decodes as ``union`` and the message has ``whole(msg)`` frames."""
    codec = Codec(union)

    def rejects(parts: list[bytes]) -> bool:
        try:
            msg = codec.decode(parts[0] if parts else b"")
        except DecodeError:
            return True
        return len(parts) != whole(msg)
    return rejects


@dataclass
class Target:
    """One socket of the job: where it is, what it takes, the rule by which it refuses."""

    name: str
    address: str
    union: Any
    rejects: Callable[[list[bytes]], bool]
    sock: zmq.Socket | None = None
    deaf: zmq.Socket | None = None  # never reads what the job answers
    outsider: zmq.Socket | None = None


@dataclass
class Tally:
    """What was sent: ``bad[target]`` frames that must each be rejected and counted there."""

    bad: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)  # by kind of damage, all targets
    bodies: int = 0  # garbage request bodies routed to the reward workers
    bodies_answered: int = 0  # their replies back (ScoreReply with no results)
    group_replays: int = 0  # trained groups sent again
    stale: int = 0  # batch requests of served steps and old version notices
    score_replays: int = 0  # answered score replies sent again to the router's workers socket
    score_replays_seen: int = 0  # of those, the ones the router has certainly read (a barrier)
    outsider: int = 0  # frames queued on sockets with an unknown key (none may be decoded)
    outsider_connections: int = 0  # their connections (each one a handshake the job refuses)
    dropped: int = 0  # frames a full socket did not take (never sent: not counted anywhere)
    captured: int = 0  # real frames received from the job
    # the counts above as they stood SETTLE_S before the fuzzer stopped: what each actor must
    # have read by the job's end (the last second's frames may still be queued when it stops)
    settled: Counter = field(default_factory=Counter)

    def counts(self) -> Counter:
        return Counter({**self.bad, "stale": self.stale})

    def total(self) -> int:
        return sum(self.bad.values()) + self.bodies + self.group_replays + self.stale \
            + self.score_replays


class WireFuzzer:
    """Sends hostile frames to a running job's sockets; ``run`` until ``stop()`` (any thread)."""

    def __init__(self, run_dir: Path, seed: int, *, curve_key: Path | None = None,
                 outsider: Path | None = None) -> None:
        self.run_dir = run_dir
        self.rng = random.Random(seed)
        self.seed = seed
        self.tally = Tally()
        self.stopped = False
        topo = msgspec.json.decode((run_dir / "topology.json").read_bytes())
        server = topo["security"]["server_key"].encode() if topo["security"]["curve"] else b""
        self.keys = self._keys(server, curve_key)
        self.outsider_keys = self._keys(server, outsider)
        self.targets = [
            Target("replay", topo["replay"]["address"], ToReplay, reads_last(ToReplay)),
            Target("router clients", topo["router"]["address"], ToRouterFromClient,
                   router_rejects(ToRouterFromClient, lambda m: 2)),
            Target("router workers", topo["router"]["worker_address"], ToRouterFromWorker,
                   router_rejects(ToRouterFromWorker, lambda m: 2 if isinstance(m, Envelope) else 1)),
            Target("learner weights", topo["learner"]["weights_address"], ToLearnerWeights,
                   reads_last(ToLearnerWeights)),
            Target("runner control", topo["control_address"], ToRunner, reads_last(ToRunner)),
        ]
        self.frames = [encode(m) for _, m in CASES]  # real frames of every type, grown by captures
        self.body_rejected = reads_last(ToRewardWorker)  # a reward worker's rule for a body
        self.replies: Codec[Any] = Codec(ToClient)
        self.to_worker: Codec[Any] = Codec(ToWorker)
        self.barriers: dict[str, int] = {}  # a barrier's name: the score replays sent before it
        self.zmq = zmq.Context()
        self.trained: list[int] = []  # prompt ids of trained groups, from the recording
        self.served_step = self.version = 0  # from the recording: what may be replayed as old
        self.next_read = 0.0

    @staticmethod
    def _keys(server: bytes, key: Path | None) -> CurveKeys | None:
        if key is None or not server:
            return None
        public, secret = load_secret(key)
        return CurveKeys(server, public, secret)

    def _socket(self, address: str, keys: CurveKeys | None, identity: bytes,
                rcvhwm: int = 1000) -> zmq.Socket:
        sock = self.zmq.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 200)
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        sock.setsockopt(zmq.IDENTITY, identity)
        if keys is not None:
            keys.configure(sock, server=False)
        sock.connect(address)
        return sock

    def connect(self) -> None:
        for i, t in enumerate(self.targets):
            t.sock = self._socket(t.address, self.keys, f"fuzz-{self.seed}-{i}".encode())
            t.deaf = self._socket(t.address, self.keys, f"deaf-{self.seed}-{i}".encode(), rcvhwm=1)
        self.reconnect_outsider()

    def reconnect_outsider(self) -> None:
        """Fresh sockets with the unknown key: libzmq does not retry a refused handshake, so
        new connections keep the job's ZAP handlers refusing."""
        if self.outsider_keys is None:
            return
        for i, t in enumerate(self.targets):
            if t.outsider is not None:
                t.outsider.close(linger=0)
            t.outsider = self._socket(t.address, self.outsider_keys, f"outsider-{i}".encode())
            self.tally.outsider_connections += 1

    def close(self, linger_s: float = 30.0) -> None:
        """Close, once what was queued has left (at most ``linger_s``): a frame counted as sent
        and dropped here would be missing from its actor's count. The outsider's never leave."""
        for t in self.targets:
            if t.outsider is not None:
                t.outsider.close(linger=0)
        self.zmq.destroy(linger=int(linger_s * 1000))

    def stop(self) -> None:
        self.stopped = True

    # ------------------------------------------------------------ what to send

    def damaged(self) -> tuple[str, list[bytes]]:
        """One damaged message: (its kind, its frames)."""
        rng = self.rng
        kind = rng.choice(["random", "truncated", "bitflip", "wrong type", "unknown type",
                           "oversized", "extra frames"])
        real = rng.choice(self.frames)
        match kind:
            case "random":
                return kind, [rng.randbytes(rng.randrange(0, 256))]
            case "truncated":
                return kind, [real[: rng.randrange(0, max(1, len(real)))]]
            case "bitflip":
                frame = bytearray(real)
                for _ in range(rng.randint(1, 4)):
                    if frame:
                        frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
                return kind, [bytes(frame)]
            case "wrong type":
                return kind, [encode(rng.choice(CASES)[1])]
            case "unknown type":
                value = msgspec.to_builtins(rng.choice(CASES)[1])
                if isinstance(value, dict):
                    value["type"] = f"{value.get('type', 'X')}V2"
                return kind, [encode(value)]
            case "oversized":
                return kind, [rng.choice(HUGE)]
            case _:
                return kind, [real, *(rng.choice(self.frames) for _ in range(rng.randint(1, 3)))]

    def replays(self) -> list[tuple[Target, list[bytes], str]]:
        """Old frames, valid, that the job must refuse (none before a step was trained)."""
        replay, workers = self.targets[0], self.targets[2]
        out: list[tuple[Target, list[bytes], str]] = []
        if self.trained:
            g = sample_group()
            prompt = msgspec.structs.replace(g.prompt, prompt_id=self.rng.choice(self.trained))
            out.append((replay, [encode(GroupsDone([msgspec.structs.replace(g, prompt=prompt)]))],
                        "group"))
        if self.served_step >= 2:
            out.append((replay, [encode(BatchRequest(self.rng.randrange(self.served_step - 1),
                                                     0, 1))], "stale"))
        if self.version >= 2:
            out.append((replay, [encode(VersionUpdate(self.rng.randrange(self.version - 1)))],
                        "stale"))
        out.append((workers, [encode(Envelope(self.rng.randrange(1 << 20))),
                              encode(ScoreReply([ScoreResult(1.0)]))], "score"))
        return out

    # ------------------------------------------------------------ the loop

    def refresh(self) -> None:
        """What the recording says was trained and served (read every half second at most):
        the groups' fates, which the replay buffer writes before it sends their batch."""
        now = time.monotonic()
        if now < self.next_read:
            return
        self.next_read = now + 0.5
        fates = read_table(self.run_dir, "fates", ["group_id", "fate", "step"]).to_pylist()
        trained = [f for f in fates if f["fate"] == "trained"]
        if trained:
            self.trained = sorted({f["group_id"] for f in trained})
            self.served_step = max(f["step"] for f in trained)
            self.version = self.served_step - 1  # the learner has published one per step before

    def send(self, target: Target, parts: list[bytes], sock: zmq.Socket | None = None) -> bool:
        try:
            (sock or target.sock).send_multipart(parts, flags=zmq.NOBLOCK)  # type: ignore[union-attr]
        except zmq.Again:
            self.tally.dropped += 1
            return False
        return True

    def drain(self) -> None:
        """Read the job's answers: they keep its sockets from filling, and are real frames."""
        for t in self.targets:
            for _ in range(256):
                try:
                    parts = t.sock.recv_multipart(flags=zmq.NOBLOCK)  # type: ignore[union-attr]
                except zmq.Again:
                    break
                self.tally.captured += 1
                if len(self.frames) < 2000:
                    self.frames.extend(parts)
                if t.name == "router clients" and len(parts) == 2 and \
                        self.replies.decode(parts[0]).request_id < 0:  # a garbage body's
                    self.tally.bodies_answered += 1
                if t.name == "router workers":
                    self.passed_barrier(parts)

    def passed_barrier(self, parts: list[bytes]) -> None:
        """A barrier's ack from the router: every frame sent before it on that connection has
        been read (one pipe, in order), so the score replays sent before it were counted."""
        try:
            msg = self.to_worker.decode(parts[0])
        except DecodeError:
            return
        if isinstance(msg, WorkerBye) and msg.name in self.barriers:
            self.tally.score_replays_seen = max(self.tally.score_replays_seen,
                                                self.barriers.pop(msg.name))

    def step(self, burst: int = 64) -> None:
        """One burst: damaged frames to every target, a garbage body and the replays."""
        tally = self.tally
        for _ in range(burst):
            target = self.rng.choice(self.targets)
            kind, parts = self.damaged()
            if not target.rejects(parts):
                continue
            if self.send(target, parts, target.deaf if self.rng.random() < 0.125 else None):
                tally.bad[target.name] += 1
                tally.kinds[kind] += 1
            if target.outsider is not None and self.send(target, parts, target.outsider):
                tally.outsider += 1
        body = self.damaged()[1][0]
        # negative request ids, each its own: the router takes a held id again as a re-send
        if self.body_rejected([body]) and self.send(self.targets[1],
                                                    routed(-1 - tally.bodies, body)):
            tally.bodies += 1
        for target, parts, what in self.replays():
            if self.send(target, parts):
                tally.group_replays += what == "group"
                tally.stale += what == "stale"
                tally.score_replays += what == "score"
        # a barrier behind them: a bye from a worker the router never knew, which it acks (the
        # job may end before it reads the last bursts; only the replays it read must be counted)
        name = f"barrier-{self.seed}-{tally.score_replays}"
        if self.send(self.targets[2], [encode(WorkerBye(name))]):
            self.barriers[name] = tally.score_replays
        self.drain()

    def probe(self) -> None:
        """A real request through the router: its reply is a real frame to damage later."""
        self.send(self.targets[1], routed(1, score_request("aaa", data_source="repeat_letter",
                                                           ground_truth="aaa")))

    def run(self, until: Callable[[], bool] = lambda: False) -> Tally:
        """Fuzz until ``stop()`` or ``until()``; the tally of what was sent."""
        self.connect()
        self.probe()
        bursts = 0
        history: collections.deque[tuple[float, Counter]] = collections.deque()
        while not self.stopped and not until():
            self.refresh()
            self.step()
            bursts += 1
            if bursts % 50 == 0:
                self.reconnect_outsider()
            now = time.monotonic()
            history.append((now, self.tally.counts()))
            while len(history) > 1 and history[1][0] <= now - SETTLE_S:
                history.popleft()
        if history and history[0][0] <= time.monotonic() - SETTLE_S:
            self.tally.settled = history[0][1]
        deadline = time.monotonic() + 5.0  # the last answers (the garbage bodies' replies)
        while self.tally.bodies_answered < self.tally.bodies and time.monotonic() < deadline:
            self.drain()
            time.sleep(0.01)
        return self.tally


def summary(tally: Tally) -> dict[str, Any]:
    return {"sent": tally.total(), "rejected_expected": dict(tally.bad), "by_kind": dict(tally.kinds),
            "bodies": tally.bodies, "bodies_answered": tally.bodies_answered,
            "group_replays": tally.group_replays, "stale": tally.stale,
            "score_replays": tally.score_replays, "score_replays_seen": tally.score_replays_seen,
            "outsider": tally.outsider,
            "outsider_connections": tally.outsider_connections,
            "dropped_full": tally.dropped, "captured": tally.captured}


def audit(run_dir: Path, tally: Tally, rc: int) -> dict[str, bool]:
    """The checks of a fuzzed job, from what it recorded: it finished, no actor restarted,
    nothing was lost or trained twice, and each actor counted the frames sent to it that it
    must reject: every one sent by ``SETTLE_S`` before the fuzzer stopped, and none more than
    were sent (the job may end before it reads the last second's; ``rejected`` groups and
    router ``duplicates`` may also count the job's own late copies, so those are exact only
    when nothing was re-sent or re-issued)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [json.loads(x) for x in (run_dir / "status.jsonl").read_text().splitlines()][-1]
    replay, router, learner = last["replay-0"], last["router-0"], last["learner-0"]
    rewards = [v for k, v in last.items() if k.startswith("reward-")]
    batches = read_table(run_dir, "batches", ["step", "group_ids"]).to_pylist()
    trained = [g for b in batches for g in b["group_ids"]]
    own_copies = replay.get("reissued_silent", 0) + replay.get("reissued_restarted", 0)
    sent = tally.counts()

    def within(counted: int, *names: str) -> bool:
        """Every frame sent by SETTLE_S before the end counted, and none more than was sent."""
        return sum(tally.settled[n] for n in names) <= counted <= sum(sent[n] for n in names)
    return {
        "job finished (exit 0)": rc == 0 and last.get("outcome") == "finished",
        "no actor restarted": all(v.get("restarts", 0) == 0 for v in last.values()
                                  if isinstance(v, dict) and "restarts" in v),
        "every metrics line balances": all(
            r["replay/issued"] == r["replay/trained"] + r["replay/dropped"] + r["replay/in_flight"]
            for r in rows),
        "each step one batch": sorted(b["step"] for b in batches) == [r["step"] for r in rows],
        "no group trained twice": len(trained) == len(set(trained)),
        "replay counted each frame sent to it": within(replay.get("rejected_frames", 0),
                                                       "replay"),
        "router counted each frame sent to it": within(router.get("rejected_frames", 0),
                                                       "router clients", "router workers"),
        "learner counted each frame sent to it": within(learner.get("rejected_frames", 0),
                                                        "learner weights"),
        "runner counted each frame sent to it": within(last.get("rejected_frames", 0),
                                                       "runner control"),
        "reward workers counted each garbage body": sum(r.get("rejected_bodies", 0)
                                                        for r in rewards) == tally.bodies,
        "old batch requests and notices refused": within(replay.get("stale_refused", 0), "stale"),
        "trained groups sent again refused": replay.get("rejected", 0) >= tally.group_replays
        and (own_copies > 0 or replay.get("rejected", 0) == tally.group_replays),
        # each replay the router read (those before its last acked barrier at least) refused
        "answered score replies refused": router.get("duplicates", 0) >= tally.score_replays_seen
        > 0 and (router.get("resent", 0) > 0 or router.get("duplicates", 0) <= tally.score_replays),
    }
