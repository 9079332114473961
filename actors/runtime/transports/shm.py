"""``shm``: one safetensors file per version in ``/dev/shm`` (samplers on the learner's host).

The learner writes each version once and the message carries only its path; every sampler maps
the file (``SharedWeights``), and a vLLM engine loads it straight from there. One write per step
instead of one model-sized message per sampler. The newest ``SHM_KEEP`` versions are kept (a
sampler that took an older one finds it gone and waits for the next); the folder is removed
when the learner exits, and a killed learner's folder by the next one. A sampler hard-links
each version it receives into a folder of its own (no copy), so the version it holds stays
loadable after the learner drops it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import anyio
import torch

from actors.runtime.transports.base import Receiver, Sender
from actors.runtime.transports.sources import SharedWeights, WeightsSource
from messages.codec import encode
from messages.weights import AdapterSpec, WeightsHeader

SHM_ROOT = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
SHM_PREFIX = "flowrl-weights-"
SHM_KEEP = 2  # versions kept in shared memory


def remove_orphaned_shm() -> None:
    """Remove the shared-memory folders of learners and samplers that are gone (kill -9)."""
    for d in SHM_ROOT.glob(f"{SHM_PREFIX}*"):
        pid = d.name.removeprefix(SHM_PREFIX).split("-")[0]  # a learner's, or a sampler's links
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)


class ShmSender(Sender):
    name = "shm"
    reads_at_prepare = True  # the file is written before prepare returns

    def __init__(self) -> None:
        self.shm_dir = SHM_ROOT / f"{SHM_PREFIX}{os.getpid()}"  # this learner's files
        self.shm_files: list[Path] = []  # the versions kept, oldest first

    async def prepare(self, version: int, tensors: list[tuple[str, torch.Tensor]], *,
                      bucket_bytes: int = 0, adapter: AdapterSpec | None = None
                      ) -> list[list]:
        path = await anyio.to_thread.run_sync(self.write, version, tensors)
        return [[encode(WeightsHeader(version=version, tensors=[], path=str(path),
                                      transport=self.name, adapter=adapter))]]

    def write(self, version: int, tensors: list[tuple[str, torch.Tensor]]) -> Path:
        """Write ``version`` as one file (atomically: a sampler never maps a half-written one)
        and drop the files past the newest ``SHM_KEEP``."""
        from safetensors.torch import save_file

        self.shm_dir.mkdir(exist_ok=True)
        path = self.shm_dir / f"v{version}.safetensors"
        tmp = path.with_suffix(".partial")
        save_file({n: t.contiguous() for n, t in tensors}, str(tmp))
        os.replace(tmp, path)
        self.shm_files.append(path)
        while len(self.shm_files) > SHM_KEEP:
            self.shm_files.pop(0).unlink(missing_ok=True)
        return path

    def close(self) -> None:
        """Remove the files (the samplers that mapped one keep their mapping)."""
        shutil.rmtree(self.shm_dir, ignore_errors=True)


class ShmReceiver(Receiver):
    name = "shm"

    def __init__(self) -> None:
        # this sampler's own links to the learner's files, the newest SHM_KEEP kept, so a
        # version received stays loadable when the learner drops it (a newer one, or its exit)
        self.shm_dir = SHM_ROOT / f"{SHM_PREFIX}{os.getpid()}-links"
        self.links: list[Path] = []

    async def receive(self, header: WeightsHeader, parts: dict[str, torch.Tensor]
                      ) -> WeightsSource:
        """FileNotFoundError: a newer version replaced the file already (poll again)."""
        return await anyio.to_thread.run_sync(self.claim, header.path)

    def claim(self, path: str) -> SharedWeights:
        """The learner's file of a version, through a hard link of this sampler's own (same
        filesystem: no copy), so that the learner removing its file cannot take it away."""
        own = self.shm_dir / Path(path).name
        self.shm_dir.mkdir(exist_ok=True)
        own.unlink(missing_ok=True)
        try:
            os.link(path, own)  # FileNotFoundError: gone already (a newer version replaced it)
        except OSError as exc:
            if isinstance(exc, FileNotFoundError):
                raise
            return SharedWeights(path)  # links refused here: read the learner's file itself
        if own in self.links:  # the same version again (a resumed learner): one entry, so
            self.links.remove(own)  # trimming an old entry never removes the new link
        self.links.append(own)
        while len(self.links) > SHM_KEEP:
            self.links.pop(0).unlink(missing_ok=True)
        return SharedWeights(str(own))

    def close(self) -> None:
        """Remove this sampler's links (an engine that mapped one keeps its mapping)."""
        shutil.rmtree(self.shm_dir, ignore_errors=True)

