"""One episode's samples, token in and token out.

Each call of an episode is served on a context: the tokens of its rendered prompt. A call
whose rendered text extends the text of an earlier call's prompt plus one of its completions
exactly (the agent appended tool results or a user turn and sent the model's answer back
unchanged) continues that segment: the engine gets the segment's own tokens (the model's
exactly, never re-tokenized) plus the new text's tokens, which are the environment's (loss
mask 0). A call that does not extend (the agent edited its history, summarised, or branched)
starts a new segment on its own prompt, and the segment it left behind is done. A segment's
response keeps to the budget (``max_tokens``, the environment's tokens included): environment
tokens past it are cut, the call gets no tokens (``length``), and no later call extends that
segment.

An episode hands on its segments as samples of its group, as verl and prime-rl do: those
left behind (the first choice of the call before each branch) and its last one (the last
call's first choice); the group then has more than ``n`` samples (``agent.rollout.branches =
"train"``; ``"last"``: only the last segment, the others counted in ``branches``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from actors.sampler.agent.loop import Transcript
from actors.sampler.engines.base import Generation
from messages.rollout import SamplingParams, Turn


@dataclass
class Segment:
    """A prompt and the response after it (the model's turns and what came between them)."""

    prompt: list[int]
    text: str  # the text of prompt + response, as rendered: what the next call must extend
    t: Transcript = field(default_factory=Transcript)
    full: bool = False  # its budget is spent (the environment's tokens were cut): no call
    # extends it any more
    fresh: bool = False  # a call's new segment (it extends none): once answered, the previous
    # call's segment is left behind
    images: tuple[bytes, ...] = ()  # its prompt's images, in order (their tokens are prompt
    # tokens): every call that extends it sends these images and no other

    def extend(self, ids: list[int], turn: Turn, text: str, budget: int) -> None:
        """The environment's tokens between two calls, cut to what is left of ``budget``."""
        room = budget - len(self.t.ids)
        self.t.observation(ids[:max(room, 0)], turn)
        self.text = text
        self.full = len(ids) > room

    @property
    def context(self) -> list[int]:
        return self.prompt + self.t.ids

    def copy(self) -> Segment:
        t = Transcript()
        t.ids, t.logprobs = list(self.t.ids), list(self.t.logprobs)
        t.versions, t.mask, t.turns = list(self.t.versions), list(self.t.mask), list(self.t.turns)
        return Segment(list(self.prompt), self.text, t, self.full, images=self.images)


@dataclass
class Episode:
    """The state of one episode: its calls, the segments its last call made, its failure."""

    params: SamplingParams  # the rollout's: each call's defaults, and max_tokens the budget of
    # each segment's response (the environment's tokens included)
    max_calls: int
    calls: int = 0
    branches: int = 0  # segments left behind by a call that did not extend them
    last: list[Segment] = field(default_factory=list)  # one per choice of the last call
    done: list[Segment] = field(default_factory=list)  # left behind by a call that branched

    def base(self, text: str, encode, role: str, images: tuple[bytes, ...] = ()) -> Segment:
        """The segment a call on ``text`` with ``images`` continues (a copy, with the new tokens
        as the environment's), or a new one on ``text``'s own tokens. A call extends only a
        segment with the same images: an image added in a later turn would put image tokens
        in the response, so the call starts a new segment with every image in its prompt."""
        match = max((s for s in self.last
                     if not s.full and s.images == images and text.startswith(s.text)),
                    key=lambda s: len(s.text), default=None)
        if match is None:
            return Segment(encode(text), text, fresh=True, images=images)
        seg = match.copy()
        new = text[len(seg.text):]
        if new:
            seg.extend(encode(new), Turn(role, 0, 0, content=new), text, self.params.max_tokens)
        return seg

    def base_ids(self, ids: list[int], text: str) -> Segment:
        """As ``base`` for a prompt given as token ids (``/v1/completions``)."""
        match = max((s for s in self.last if not s.full and ids[:len(s.context)] == s.context),
                    key=lambda s: len(s.context), default=None)
        if match is None:
            return Segment(list(ids), text, fresh=True)
        seg = match.copy()
        new = ids[len(seg.context):]
        if new:
            seg.extend(list(new), Turn("user", 0, 0, content=text[len(seg.text):]), text,
                       self.params.max_tokens)
        return seg

    def _branch(self) -> None:
        """The previous call's segment is left behind (done only for an answered call: a call
        refused mid-way leaves the episode as it was)."""
        if self.last:
            self.branches += 1
            self.done.append(self.last[0])

    def room(self, seg: Segment) -> int:
        """Tokens the segment's next model turn may have."""
        return 0 if seg.full else max(self.params.max_tokens - len(seg.t.ids), 0)

    def answered(self, base: Segment, gens: list[Generation], texts: list[str],
                 request: str = "", response: str = "") -> None:
        """The call's choices, each continuing its own copy of ``base``; each model turn keeps
        the call's request and response bodies."""
        if base.fresh:
            self._branch()
        self.last = []
        for g, raw in zip(gens, texts, strict=True):
            seg = base.copy()
            seg.t.model_turn(g, raw)
            seg.t.turns[-1] = msgspec.structs.replace(seg.t.turns[-1], request=request,
                                                      response=response)
            seg.text = base.text + raw
            self.last.append(seg)

    def sample(self) -> Segment | None:
        """The episode's last segment (None: it made no call)."""
        return self.last[0] if self.last else None

    def samples(self, branches: str) -> list[Segment | None]:
        """The segments the episode hands on, in order, the last one last (``[None]``: it made
        no call): all of them (``branches = "train"``) or the last one."""
        return [*(self.done if branches == "train" else []), self.sample()]
