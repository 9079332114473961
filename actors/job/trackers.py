"""Experiment trackers as metric sinks: tensorboard, wandb, mlflow (``run.loggers``).

Each is opened by the runner before any actor starts, so a tracker that cannot start (not
installed, no credentials, an unreachable server) stops the job with a clear error naming it;
after that each runs on its own thread (``metrics.Background``) and a failure is reported and
the job goes on without it.

A run directory keeps the identity of its tracker runs in ``trackers.json``, so a resumed job
(the same ``run.dir``) continues the same wandb run and mlflow run, and writes tensorboard
events into the same folder. How each treats the steps a resume trains again is in
``actors/job/metrics.py``: tensorboard purges them (its ``SessionLog.START`` at the first
redone step, what ``SummaryWriter(purge_step=...)`` writes), wandb and mlflow skip the records
they already hold (their histories are append-only: wandb's rewind is a preview feature its
server must enable, and does not work with the ``step`` axis below; mlflow has no call that
replaces a logged value); on the CPU a redone step's training metrics are the same numbers
anyway (the step is seeded and its batch recorded). mlflow is asked which records it holds;
wandb cannot be (offline), so ``metrics.jsonl`` stands for it: after a ``kill -9`` of the
runner, the few records wandb had not yet written out are missing from it, never doubled.

wandb and mlflow get the resolved topology as the run's config (mlflow: every key as a param,
dotted, and ``topology.json`` as an artifact). wandb reads its usual ``WANDB_*`` variables
(``WANDB_MODE=offline`` logs with no network); mlflow logs to ``MLFLOW_TRACKING_URI``, default
a file store in ``RUN_DIR/mlruns``. Validation records are plotted against the same ``step``
as training ones (wandb: the ``step`` metric is every chart's x axis, since a validation
arrives after later training steps).
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from actors.job.metrics import MARKERS, Background, Kind, MetricSink, Resume
from actors.runtime.config import Topology
from actors.runtime.rundir import TENSORBOARD, TOPOLOGY, TRACKERS
from messages.control import ImageSample

TRACKERS_EXTRA = "pip install 'flowrl[trackers]'"  # what installs all three


class TrackerError(RuntimeError):
    """A tracker named in ``run.loggers`` could not start."""


def caption(sample: ImageSample) -> str:
    """What a tracker shows beside a sample's images."""
    return f"prompt {sample.prompt_id}, reward {sample.reward:g}: {sample.answer}"


def image_size(data: bytes) -> tuple[int, int, int]:
    """Width, height and channels of an encoded image (its header read, not its pixels)."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.width, image.height, len(image.getbands())


def _run_name(topology: Topology, run_dir: Path) -> str:
    return topology.run.experiment_name or Path(run_dir).name


class TensorBoardSink:
    """Scalars in ``RUN_DIR/tensorboard/``, one event per record (every metric at its step)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, resume: Resume) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.Event, self.Summary = Event, Summary
        self.writer = EventFileWriter(str(Path(run_dir) / TENSORBOARD), max_queue_size=100)
        # TensorBoard drops every event of a step >= this one written before it (all files of
        # the folder): the steps a resume trains again
        self.writer.add_event(Event(step=resume.step + 1, wall_time=time.time(),
                                    session_log=SessionLog(status=SessionLog.START)))
        self.writer.flush()

    def write(self, kind: Kind, step: int, metrics: Mapping[str, float]) -> None:
        values = [self.Summary.Value(tag=k, simple_value=float(v)) for k, v in metrics.items()]
        self.writer.add_event(self.Event(wall_time=time.time(), step=step,
                                         summary=self.Summary(value=values)))
        self.writer.flush()  # TensorBoard shows a step as soon as it is taken

    def write_samples(self, step: int, samples: Sequence[ImageSample]) -> None:
        """Each sample's images (``samples/K/image``, ``add_image``'s summary: the encoded bytes
        as they are) and its answer (``samples/K/answer``, the text plugin's)."""
        from tensorboard.plugins.text.summary_v2 import text_pb

        values = []
        for k, s in enumerate(samples):
            for j, data in enumerate(s.images):
                width, height, channels = image_size(data)
                values.append(self.Summary.Value(
                    tag=f"samples/{k}/image" + (f"/{j}" if j else ""),
                    image=self.Summary.Image(height=height, width=width, colorspace=channels,
                                             encoded_image_string=data)))
            values.extend(text_pb(f"samples/{k}/answer", caption(s)).value)
        self.writer.add_event(self.Event(wall_time=time.time(), step=step,
                                         summary=self.Summary(value=values)))
        self.writer.flush()

    def close(self, outcome: str) -> None:
        self.writer.close()


class WandbSink:
    """A wandb run (the same one across resumes), every metric plotted against ``step``."""

    name = "wandb"

    def __init__(self, run_dir: Path, topology: Topology, resume: Resume, run_id: str) -> None:
        import wandb

        self.resume = resume
        # this process's own wandb service: one inherited through WANDB_SERVICE (a parent that
        # used wandb) would still hold the run of a runner killed before, refusing its resume
        os.environ.pop("WANDB_SERVICE", None)
        self.run = wandb.init(
            project=topology.run.project_name, name=_run_name(topology, run_dir), id=run_id,
            resume="allow", dir=str(run_dir), entity=os.environ.get("WANDB_ENTITY") or None,
            # console="off": wandb would otherwise wrap the runner's stdout (the live panel's)
            settings=wandb.Settings(console="off", silent=True))
        self.run.config.update(msgspec.to_builtins(topology), allow_val_change=True)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.id = self.run.id

    def write(self, kind: Kind, step: int, metrics: Mapping[str, float]) -> None:
        if not self.resume.redone(kind, step):
            self.run.log({**metrics, "step": step})

    def write_samples(self, step: int, samples: Sequence[ImageSample]) -> None:
        """Every image of the samples as a ``wandb.Image`` captioned with its sample's answer
        and reward, each under its own key (tensorboard's tags: wandb draws a list of images of
        different sizes wrongly) at ``step``."""
        if self.resume.redone("train", step):
            return
        import wandb

        from actors.data.vision import decode

        self.run.log({f"samples/{k}/image" + (f"/{j}" if j else ""):
                      wandb.Image(decode(data, j), caption=caption(s))
                      for k, s in enumerate(samples) for j, data in enumerate(s.images)}
                     | {"step": step})

    def close(self, outcome: str) -> None:
        self.run.finish(exit_code=0 if outcome == "finished" else
                        130 if outcome == "interrupted" else 1)


_MLFLOW_INVALID = re.compile(r"[^/\w.\- :]")  # mlflow's allowed key characters, inverted


def mlflow_key(key: str) -> str:
    """A metric name as mlflow accepts it, the way verl's mlflow logger makes it (``@`` becomes
    ``_at_``, other characters mlflow refuses become ``_``)."""
    return _MLFLOW_INVALID.sub("_", re.sub("/+", "/", key.replace("@", "_at_")))


def flat_params(data: Any, prefix: str = "") -> dict[str, str]:
    """The topology as mlflow params: dotted keys (the override syntax), values as text."""
    if isinstance(data, dict):
        out: dict[str, str] = {}
        for k, v in data.items():
            out.update(flat_params(v, f"{prefix}{k}."))
        return out
    value = data if isinstance(data, str) else json.dumps(data)
    return {mlflow_key(prefix[:-1]): value[:6000]}


class MlflowSink:
    """An mlflow run (the same one across resumes) with the topology as its params."""

    name = "mlflow"

    def __init__(self, run_dir: Path, topology: Topology, resume: Resume,
                 saved: Mapping[str, str]) -> None:
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (Path(run_dir) / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):  # mlflow 3 wants this opt-in to its file store
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        self.resume = resume
        self.uri = uri
        if saved.get("tracking_uri") == uri and saved.get("run_id"):
            self.run_id = saved["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            # what the store holds is what to skip (records still queued when a runner was
            # killed never reached it: they are logged now)
            self.resume = Resume(resume.step, frozenset(
                (kind, m.step) for kind, key in MARKERS.items()
                for m in self.client.get_metric_history(self.run_id, mlflow_key(key))))
        else:
            project = topology.run.project_name
            found = self.client.get_experiment_by_name(project)
            experiment = found.experiment_id if found else self.client.create_experiment(project)
            run = self.client.create_run(experiment, run_name=_run_name(topology, run_dir))
            self.run_id = run.info.run_id
            params = [Param(k, v) for k, v in
                      sorted(flat_params(msgspec.to_builtins(topology)).items())]
            for i in range(0, len(params), 100):  # mlflow takes at most 100 params per batch
                self.client.log_batch(self.run_id, params=params[i:i + 100])
        if (Path(run_dir) / TOPOLOGY).is_file():
            self.client.log_artifact(self.run_id, str(Path(run_dir) / TOPOLOGY))

    def write(self, kind: Kind, step: int, metrics: Mapping[str, float]) -> None:
        if self.resume.redone(kind, step):
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(mlflow_key(k), float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(rows), 1000):  # mlflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=rows[i:i + 1000])

    def close(self, outcome: str) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if outcome == "finished" else
                                   "KILLED" if outcome == "interrupted" else "FAILED")


def read_ids(run_dir: Path) -> dict[str, dict[str, str]]:
    """``trackers.json``: the tracker runs this run directory logs to (empty when none)."""
    try:
        return json.loads((Path(run_dir) / TRACKERS).read_text())
    except (FileNotFoundError, ValueError):
        return {}


def _write_ids(run_dir: Path, ids: dict[str, dict[str, str]]) -> None:
    path = Path(run_dir) / TRACKERS
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(ids, indent=1) + "\n")
    os.replace(tmp, path)


def open_trackers(names: tuple[str, ...], topology: Topology, run_dir: Path, resume: Resume,
                  continue_runs: bool = True) -> list[MetricSink]:
    """The tracker sinks of ``names`` (others are ignored), each on its own thread; with
    ``continue_runs`` the tracker runs of ``trackers.json`` are continued, else new ones begin.
    Raises ``TrackerError`` naming the tracker that could not start (the ones started are closed)."""
    ids = read_ids(run_dir) if continue_runs else {}
    opened: list[MetricSink] = []
    for name in names:
        if name not in ("tensorboard", "wandb", "mlflow"):
            continue
        try:
            sink: MetricSink
            if name == "tensorboard":
                sink = TensorBoardSink(run_dir, resume)
            elif name == "wandb":
                sink = WandbSink(run_dir, topology, resume,
                                 ids.get("wandb", {}).get("id") or uuid.uuid4().hex[:8])
                ids["wandb"] = {"id": sink.id}
            else:
                sink = MlflowSink(run_dir, topology, resume, ids.get("mlflow", {}))
                ids["mlflow"] = {"run_id": sink.run_id, "tracking_uri": sink.uri}
        except ImportError as exc:
            _close_all(opened)
            raise TrackerError(f"run.loggers: {name} is not installed ({exc}); "
                               f"{TRACKERS_EXTRA} installs the trackers") from None
        except Exception as exc:
            _close_all(opened)
            raise TrackerError(f"run.loggers: {name} failed to start: "
                               f"{type(exc).__name__}: {exc}") from None
        opened.append(sink)
    if opened:
        _write_ids(run_dir, ids)
    return [Background(s) for s in opened]


def _close_all(sinks: list[MetricSink]) -> None:
    for sink in sinks:
        try:
            sink.close("failed: another tracker did not start")
        except Exception:  # noqa: S110 - already failing; the first error is the one to show
            pass
