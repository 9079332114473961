"""The shm transport's files: real safetensors files, each version written into the file of a
version the learner dropped when no sampler holds that file, and never into one a sampler
holds (its link), so a version a sampler is loading cannot change under it."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open

from actors.runtime.transports.shm import ShmReceiver, ShmSender
from actors.runtime.transports.sources import SharedWeights, mapped


def weights(version: int) -> list[tuple[str, torch.Tensor]]:
    """Every dtype a policy's weights come in, odd sizes included (their offsets must stay
    aligned), with values that tell the versions apart."""
    g = torch.Generator().manual_seed(version)
    return [("embed.weight", torch.randn(7, 5, generator=g).to(torch.bfloat16)),
            ("layer.weight", torch.randn(3, 3, generator=g)),
            ("layer.bias", torch.randn(3, generator=g, dtype=torch.float64)),
            ("head.weight", torch.randn(5, generator=g).to(torch.float16)),
            ("steps", torch.tensor([version], dtype=torch.int64)),
            ("mask", torch.tensor([True, False, version % 2 == 1])),
            ("codes", torch.arange(3, dtype=torch.uint8) + version)]


def assert_holds(path, version: int) -> None:
    with safe_open(path, framework="pt") as f:  # safetensors' own reader
        assert sorted(f.keys()) == sorted(n for n, _ in weights(version))
        for name, t in weights(version):
            assert torch.equal(f.get_tensor(name), t), name
    views = SharedWeights(str(path))  # the engines' reader: views of this process's mapping
    assert all(torch.equal(views[n], t) for n, t in weights(version))


@pytest.fixture
def sender():
    sender = ShmSender()
    yield sender
    sender.close()


def test_versions_go_into_dropped_files_and_read_back_exactly(sender):
    inodes = []
    for version in range(6):
        path = sender.write(version, weights(version))
        assert_holds(path, version)
        inodes.append(path.stat().st_ino)
    assert [p.name for p in sender.shm_files] == ["v4.safetensors", "v5.safetensors"]
    # three files in turn: the two kept and the one being written
    assert len(set(inodes)) == 3 and inodes[3:] == inodes[:3]
    assert (sender.made, sender.reused) == (3, 3)
    for version in (4, 5):
        assert_holds(sender.shm_dir / f"v{version}.safetensors", version)


def test_a_file_a_sampler_holds_is_not_written_again_until_it_lets_go(sender):
    receiver = ShmReceiver()
    try:
        first = sender.write(0, weights(0))
        held = receiver.claim(str(first))  # the sampler received version 0
        receiver.taking(held)  # and its engine is loading it
        for version in (1, 2, 3, 4):
            sender.write(version, weights(version))
            assert_holds(held.path, 0)  # version 0 stays whole in the sampler's link
        assert not first.exists()  # the learner dropped it all the same
        made = sender.made
        newer = receiver.claim(str(sender.shm_files[-1]))  # version 4 arrives
        receiver.taking(newer)  # taken: version 0 is loaded by now, its link goes
        assert not os.path.exists(held.path) and len(os.listdir(receiver.shm_dir)) == 1
        for version in (5, 6, 7):
            sender.write(version, weights(version))
        assert sender.made == made + 1  # version 4's file is held: one new file, then reuse
        assert_holds(newer.path, 4)
    finally:
        receiver.close()


def test_a_file_is_mapped_once_by_each_reader(sender):
    path = sender.write(0, weights(0))
    inode, first = path.stat().st_ino, mapped(str(path))
    sender.write(1, weights(1))
    sender.write(2, weights(2))
    again = sender.write(3, weights(3))  # version 0's file, written again
    assert again.stat().st_ino == inode and mapped(str(again)) is first
    assert_holds(again, 3)


def test_a_dtype_the_file_cannot_hold_is_refused_naming_the_tensor(sender):
    with pytest.raises(TypeError, match="odd.weight is torch.complex64"):
        sender.write(0, [("odd.weight", torch.zeros(2, dtype=torch.complex64))])


def test_the_same_version_again_replaces_its_file_and_mapping(sender):
    first = sender.write(3, weights(3))
    held = first.stat().st_ino
    again = sender.write(3, weights(4))
    assert again == first and again.stat().st_ino != held and held not in sender.maps
    assert [p.name for p in sender.shm_files] == ["v3.safetensors"]
    assert_holds(again, 4)
