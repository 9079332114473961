"""Threads lent between the actors of one host (actors/runtime/cores.py): the table is shared
between real processes, a lender lends only while none of its calls runs, and the learner's
hooks take the lent threads before each layer's forward and backward and give them back as
soon as the lender has work, with the same loss and gradients as without borrowing; a
sampler's transformers engine lends between its calls and borrows what a waiting learner
lends."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable

import pytest
import torch
from transformers import LlamaForCausalLM

from actors.runtime.cores import (
    LEARNERS,
    SAMPLERS,
    Borrower,
    CoreTable,
    LayerHooks,
    Lender,
    RerunThreads,
    remove_table,
    table_path,
)
from actors.sampler.engines.base import GenerateRequest
from actors.sampler.engines.hf import HFEngine
from actors.sampler.lending import lend_idle
from messages.rollout import SamplingParams
from tests.tiny_model import tiny_config


def test_the_table_is_shared_between_processes_and_named_per_run_and_host(tmp_path):
    path = table_path(tmp_path / "run")
    assert path == table_path(tmp_path / "run") and path != table_path(tmp_path / "other")
    table = CoreTable(path)
    try:
        child = ("import sys; from pathlib import Path; from actors.runtime.cores import CoreTable;"
                 "t = CoreTable(Path(sys.argv[1])); t.lend(1, 3); t.lend(2, 1); t.close()")
        subprocess.run([sys.executable, "-c", child, str(path)], check=True, timeout=60)
        assert table.lent(range(3)) == 4 and table.lent(range(2)) == 3
        assert table.lent(range(3, 10)) == 0
    finally:
        table.close()
        remove_table(tmp_path / "run")
    assert not path.exists()


def test_a_lender_lends_only_while_none_of_its_calls_runs(tmp_path):
    table = CoreTable(table_path(tmp_path))
    try:
        table.lend(0, 5)  # left by a lender that died while lending
        lender = Lender(table, 0, threads=2)
        assert table.lent(range(1)) == 0  # a new lender clears its slot
        with lender.working():
            assert table.lent(range(1)) == 0
            with lender.working():  # overlapping calls (a continuous engine)
                pass
            assert table.lent(range(1)) == 0 and lender.active == 1
        assert table.lent(range(1)) == 2 and lender.active == 0
        with lender.working():
            assert table.lent(range(1)) == 0
        assert lender.lent_s > 0.0
        lender.close()
        assert table.lent(range(1)) == 0  # closed: nothing lent
        waiting = Lender(table, LEARNERS[0], threads=1)  # the other way: lent while idle
        with waiting.idle():
            assert table.lent(LEARNERS) == 1 and table.lent(SAMPLERS) == 0
        assert table.lent(LEARNERS) == 0
    finally:
        table.close()
        remove_table(tmp_path)


def test_borrower_splits_what_is_lent_between_the_ranks_of_the_host(tmp_path):
    table = CoreTable(table_path(tmp_path))
    try:
        table.lend(0, 2)
        table.lend(1, 1)
        assert [Borrower(table, range(2), 1, rank=r, ranks=2).share() for r in (0, 1)] == [2, 1]
        assert Borrower(table, range(1), 1).share() == 2  # only the lenders it is given
    finally:
        table.close()
        remove_table(tmp_path)


def _train_once(model, borrower: LayerHooks | None, seen: list[tuple[str, int]],
                reclaim_at: int | None = None, table: CoreTable | None = None,
                start: Callable[[], None] | None = None):
    """One forward and backward in a fresh thread (as the learner's worker thread runs a
    step), ``start`` called first there; records the thread count each layer ran its forward
    and backward with."""
    result = {}

    def record(i):
        def forward(_m, _inp, out):
            seen.append(("forward", torch.get_num_threads()))
            if reclaim_at is not None and i == reclaim_at:
                table.lend(0, 0)  # the sampler's next prompts came: it takes its thread back
            out = out[0] if isinstance(out, tuple) else out
            out.register_hook(lambda g: seen.append(("backward", torch.get_num_threads())))
        return forward

    if borrower is not None:
        borrower.attach(model)  # first: its hooks run before the recording ones
    handles = [layer.register_forward_hook(record(i))
               for i, layer in enumerate(model.model.layers)]

    def run():
        torch.set_num_threads(1)
        if start is not None:
            start()
        torch.manual_seed(0)
        ids = torch.randint(0, model.config.vocab_size, (4, 12))
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        result["loss"] = loss.detach()
        result["grads"] = [p.grad.clone() for p in model.parameters()]

    try:
        t = threading.Thread(target=run)
        t.start()
        t.join()
    finally:
        for h in handles:
            h.remove()
        if borrower is not None:
            borrower.detach()
    return result


def test_the_learner_takes_lent_threads_per_layer_and_gives_them_back(tmp_path):
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(layers=4))
    table = CoreTable(table_path(tmp_path))
    try:
        plain: list[tuple[str, int]] = []
        base = _train_once(model, None, plain)
        assert {n for _, n in plain} == {1}

        table.lend(0, 1)
        borrowed: list[tuple[str, int]] = []
        borrower = Borrower(table, range(1), own=1)
        got = _train_once(model, borrower, borrowed)
        assert borrowed == [("forward", 2)] * 4 + [("backward", 2)] * 4
        assert borrower.take_share() == 1.0 and borrower.take_share() == 0.0
        # the same loss and gradients as on one thread
        assert torch.equal(got["loss"], base["loss"])
        assert all(torch.equal(a, b) for a, b in zip(got["grads"], base["grads"], strict=True))

        # reclaimed after layer 1's forward: from layer 2 on (and all of backward) one thread
        reclaimed: list[tuple[str, int]] = []
        borrower = Borrower(table, range(1), own=1)
        _train_once(model, borrower, reclaimed, reclaim_at=1, table=table)
        assert reclaimed == [("forward", 2)] * 2 + [("forward", 1)] * 2 + [("backward", 1)] * 4
        assert borrower.changes == 2  # up at the first layer, down at the third
    finally:
        table.close()
        remove_table(tmp_path)


def test_a_rerun_sets_the_thread_counts_the_live_step_had_at_each_layer(tmp_path):
    """The trace a borrowing step records (``threads`` of its batches row), set again by the
    rerun: the same count at every layer, with nothing lent to the rerun."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(layers=4))
    table = CoreTable(table_path(tmp_path))
    try:
        table.lend(0, 1)
        live: list[tuple[str, int]] = []
        borrower = Borrower(table, range(1), own=1, keep_trace=True)
        got = _train_once(model, borrower, live, reclaim_at=1, table=table, start=borrower.check)
        assert live == [("forward", 2)] * 2 + [("forward", 1)] * 2 + [("backward", 1)] * 4
        trace = borrower.take_trace()
        # the step's start and layers 0-1 forward on two threads; the rest on one
        assert trace == [2, 3, 1, 6] and borrower.take_trace() == []
        unkept = Borrower(table, range(1), own=1)  # a sampler's, a learner's other ranks'
        unkept.check()
        assert unkept.take_trace() == []

        again: list[tuple[str, int]] = []
        threads = RerunThreads(own=1)
        rerun = _train_once(model, threads, again, start=lambda: threads.start(trace))
        assert again == live and threads.finish() == ""
        assert torch.equal(rerun["loss"], got["loss"])
        assert all(torch.equal(a, b) for a, b in zip(rerun["grads"], got["grads"], strict=True))

        # a trace of another step's shape (an override changed the micro-batches): said
        short = RerunThreads(own=1)
        _train_once(model, short, [], start=lambda: short.start([2, 3]))
        assert "checked at 9 places, in the live step at 3" in short.finish()
        # a step recorded without borrowing runs on ``own`` threads
        plain: list[tuple[str, int]] = []
        none = RerunThreads(own=1)
        _train_once(model, none, plain, start=lambda: none.start(None))
        assert {n for _, n in plain} == {1} and none.finish() == ""
    finally:
        table.close()
        remove_table(tmp_path)


@pytest.mark.anyio
async def test_a_sampler_engine_lends_between_calls_and_borrows_a_waiting_learners(tiny_model,
                                                                                    tmp_path):
    engine = HFEngine(tiny_model, "float32", seed=0)
    seen: list[int] = []
    for layer in engine.model.model.layers:
        layer.register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))
    lending = lend_idle(engine, tmp_path, index=0, count=1, threads=1,
                        device=torch.device("cpu"))
    table = CoreTable(table_path(tmp_path))
    learner = Lender(table, LEARNERS[0], threads=1)
    request = [GenerateRequest([5, 6, 7], SamplingParams(temperature=1.0, max_tokens=4), n=2)]
    try:
        assert table.lent(SAMPLERS) == 0  # nothing lent before the first call ends
        await lending.generate(request)
        assert seen and set(seen) == {1}
        assert table.lent(SAMPLERS) == 1  # between calls: lent
        seen.clear()
        with learner.idle():  # the learner waits for its batch
            await lending.generate(request)
        assert seen and set(seen) == {2}
        assert lending.share.lender.lent_s > 0 and "lent_s" in lending.statistics()
    finally:
        await lending.aclose()
        assert table.lent(SAMPLERS) == 0  # closed: nothing lent any more
        table.close()
        remove_table(tmp_path)
