"""``shm``: one safetensors file per version in ``/dev/shm`` (samplers on the learner's host).

The learner writes each version once and the message carries only its path; every sampler maps
the file (``SharedWeights``), and a vLLM engine loads it straight from there. One write per step
instead of one model-sized message per sampler. The newest ``SHM_KEEP`` versions are kept (a
sampler that took an older one finds it gone and waits for the next); the folder is removed
when the learner exits, and a killed learner's folder by the next one.

A version's file never changes once published, and a sampler reads it through a hard link of
its own (no copy): the version it is loading, and the newest it received, stay readable after
the learner drops them. Links must work in ``SHM_ROOT`` (tmpfs's always do).

Writing a new file costs more than the copy itself: a fresh tmpfs file's pages are allocated
and zeroed as they are first written (about three times the copy on a CPU; BENCHMARKS.md,
"Weights transports"). So the learner writes each version into the file of a version it
dropped, already allocated and mapped in its memory, when no sampler still holds that file:
it renames the dropped file first (a sampler can no longer link it) and then reads its link
count; a file a sampler still holds is left to it and a new one is made. Samplers keep their
mappings too (``sources.SharedWeights``), so a version reaches an engine as one memory copy on
each side.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import tempfile
from pathlib import Path

import anyio
import torch

from actors.runtime.transports.base import Receiver, Sender
from actors.runtime.transports.sources import (
    SAFETENSORS_DTYPES,
    AdapterWeights,
    SharedWeights,
    WeightsSource,
    writable_view,
)
from messages.codec import encode
from messages.weights import AdapterSpec, WeightsHeader

SHM_ROOT = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
SHM_PREFIX = "flowrl-weights-"
SHM_KEEP = 2  # versions kept in shared memory
SPARE = "spare"  # the file of a dropped version, written again as the next one

ST_DTYPES = {getattr(torch, name): code for code, name in SAFETENSORS_DTYPES.items()}


def remove_orphaned_shm() -> None:
    """Remove the shared-memory folders of learners and samplers that are gone (kill -9)."""
    for d in SHM_ROOT.glob(f"{SHM_PREFIX}*"):
        pid = d.name.removeprefix(SHM_PREFIX).split("-")[0]  # a learner's, or a sampler's links
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)


def layout(tensors: list[tuple[str, torch.Tensor]]) -> tuple[bytes, list[tuple[int, int]]]:
    """A safetensors file's header for ``tensors`` (its 8-byte length and JSON, padded so the
    data starts 8-aligned) and each tensor's (start, end) in the file, in ``tensors``' order.
    The data is laid out widest dtype first, so every tensor starts aligned to its own width
    (a view of the mapping in its dtype needs that)."""
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i][1].element_size())
    entries: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    spans: list[tuple[int, int]] = [(0, 0)] * len(tensors)
    at = 0
    for i in order:
        name, t = tensors[i]
        if t.dtype not in ST_DTYPES:
            raise TypeError(f"weights: {name} is {t.dtype}, which the shm transport cannot "
                            f"write (it writes {', '.join(map(str, ST_DTYPES))})")
        size = t.numel() * t.element_size()
        entries[name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape),
                         "data_offsets": [at, at + size]}
        spans[i] = (at, at + size)
        at += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    header = len(text).to_bytes(8, "little") + text
    return header, [(len(header) + a, len(header) + b) for a, b in spans]


class ShmSender(Sender):
    name = "shm"
    reads_at_prepare = True  # the file is written before prepare returns

    def __init__(self) -> None:
        self.shm_dir = SHM_ROOT / f"{SHM_PREFIX}{os.getpid()}"  # this learner's files
        self.shm_files: list[Path] = []  # the versions kept, oldest first
        self.maps: dict[int, mmap.mmap] = {}  # this learner's mappings, by inode
        self.reused = 0  # versions written into a dropped version's file
        self.made = 0  # versions written into a new file

    async def prepare(self, version: int, tensors: list[tuple[str, torch.Tensor]], *,
                      bucket_bytes: int = 0, adapter: AdapterSpec | None = None
                      ) -> list[list]:
        path = await anyio.to_thread.run_sync(self.write, version, tensors)
        return [[encode(WeightsHeader(version=version, tensors=[], path=str(path),
                                      transport=self.name, adapter=adapter))]]

    def write(self, version: int, tensors: list[tuple[str, torch.Tensor]]) -> Path:
        """Write ``version`` as one file (under another name until whole: a sampler never
        maps a half-written one), into the spare file when there is one of the right size,
        and drop the files past the newest ``SHM_KEEP``."""
        self.shm_dir.mkdir(exist_ok=True)
        header, spans = layout(tensors)
        size = max((end for _, end in spans), default=len(header))
        spare = self.shm_dir / SPARE
        mapping = self._spare(spare, size)
        if mapping is None:
            mapping = self._new(spare, size)
            self.made += 1
        else:
            self.reused += 1
        mapping[:len(header)] = header
        data = writable_view(mapping)
        for (_, t), (start, end) in zip(tensors, spans, strict=True):
            data[start:end].view(t.dtype).view(t.shape).copy_(t.detach())
        path = self.shm_dir / f"v{version}.safetensors"
        self._drop(path)  # the same version again: its older file's mapping goes with it
        os.replace(spare, path)
        self.shm_files = [f for f in self.shm_files if f != path] + [path]
        while len(self.shm_files) > SHM_KEEP:
            self._retire(self.shm_files.pop(0), spare)
        return path

    def _spare(self, spare: Path, size: int) -> mmap.mmap | None:
        """This learner's mapping of the spare file when it can take ``size`` bytes."""
        try:
            st = spare.stat()
        except FileNotFoundError:
            return None
        mapping = self.maps.get(st.st_ino)
        if mapping is None or st.st_size != size or st.st_nlink != 1:
            self._drop(spare)
            return None
        return mapping

    def _new(self, path: Path, size: int) -> mmap.mmap:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)
            self.maps[os.fstat(fd).st_ino] = mapping
        finally:
            os.close(fd)
        return mapping

    def _retire(self, path: Path, spare: Path) -> None:
        """Make a dropped version's file the spare when no sampler holds it (renamed first:
        a sampler that had not linked it by then cannot any more), else leave it to them."""
        self._drop(spare)  # (none in a steady state: the next version took it)
        try:
            os.replace(path, spare)
            if spare.stat().st_nlink == 1:
                return
        except FileNotFoundError:
            return
        self._drop(spare)

    def _drop(self, path: Path) -> None:
        try:
            ino = path.stat().st_ino
            path.unlink()
        except FileNotFoundError:
            return
        mapping = self.maps.pop(ino, None)
        if mapping is not None:
            mapping.close()

    def close(self) -> None:
        """Remove the files (the samplers that mapped one keep their mapping)."""
        for mapping in self.maps.values():
            mapping.close()
        self.maps.clear()
        shutil.rmtree(self.shm_dir, ignore_errors=True)


class ShmReceiver(Receiver):
    name = "shm"

    def __init__(self) -> None:
        # this sampler's own links to the learner's files: the version the engine took last
        # (it may still be reading it) and the newest received, so that neither can change or
        # go while it may be read, and no other keeps a dropped file alive
        self.shm_dir = SHM_ROOT / f"{SHM_PREFIX}{os.getpid()}-links"
        self.links: dict[str, Path] = {}  # "taken" and "newest"

    async def receive(self, header: WeightsHeader, parts: dict[str, torch.Tensor]
                      ) -> WeightsSource:
        """FileNotFoundError: a newer version replaced the file already (poll again)."""
        return await anyio.to_thread.run_sync(self.claim, header.path)

    def claim(self, path: str) -> SharedWeights:
        """The learner's file of a version, through a hard link of this sampler's own (same
        filesystem: no copy), so that the learner can neither remove nor reuse it."""
        self.shm_dir.mkdir(exist_ok=True)
        own = self.shm_dir / f"{Path(path).stem}-{os.urandom(4).hex()}.safetensors"
        try:
            os.link(path, own)  # FileNotFoundError: gone already (a newer version replaced it)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise OSError(f"weights: the sampler cannot hard-link the learner's file {path} "
                          f"into {self.shm_dir} ({exc}); the shm transport needs both in one "
                          f"filesystem that allows links (a tmpfs such as /dev/shm)") from exc
        self._replace("newest", own)
        return SharedWeights(str(own))

    def taking(self, source: WeightsSource) -> None:
        """The engine takes ``source`` (the newest received): the version it took before is
        loaded by now, so its link goes."""
        if isinstance(source, AdapterWeights):
            source = source.tensors  # type: ignore[assignment]  # (its file, when over shm)
        if isinstance(source, SharedWeights) and source.path == str(self.links.get("newest")):
            self._replace("taken", self.links.pop("newest"))

    def _replace(self, role: str, path: Path) -> None:
        old = self.links.get(role)
        self.links[role] = path
        if old is not None and old not in self.links.values():
            old.unlink(missing_ok=True)

    def close(self) -> None:
        """Remove this sampler's links (an engine that mapped one keeps its mapping)."""
        shutil.rmtree(self.shm_dir, ignore_errors=True)
