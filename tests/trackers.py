"""Readers of what the trackers wrote, for tests: tensorboard event files, an offline wandb run's
``.wandb`` files, an mlflow file store. Each returns plain data, so tests assert on values."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """``tag -> [(step, value)]`` as TensorBoard shows them (purged steps dropped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tensorboard_images(log_dir: Path) -> dict[str, list[tuple[int, int, int, bytes]]]:
    """``tag -> [(step, width, height, encoded image)]`` as TensorBoard's image plugin reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"images": 0})
    acc.Reload()
    return {tag: [(e.step, e.width, e.height, e.encoded_image_string) for e in acc.Images(tag)]
            for tag in acc.Tags()["images"]}


def tensorboard_texts(log_dir: Path) -> dict[str, list[tuple[int, str]]]:
    """``tag -> [(step, text)]`` of the text plugin's summaries."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]
            for tag in acc.Tags()["tensors"]
            if acc.SummaryMetadata(tag).plugin_data.plugin_name == "text"}


def _wandb_records(path: Path) -> list:
    """The protobuf records of a ``.wandb`` file: a 7-byte header, then LevelDB-log blocks of
    32 KiB holding records (crc32 4 bytes, length 2, type 1: full, first, middle, last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    block, pos, pending, out = 32768, 7, b"", []
    while pos < len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and length == 0:  # zero padding up to the block's end
            pos += left - 7
            continue
        pending += data[pos:pos + length]
        pos += length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def wandb_runs(run_dir: Path) -> list[dict]:
    """Every offline wandb run under ``run_dir/wandb`` (one per incarnation, oldest first):
    ``{"id", "config", "history": [{key: value, ...}, ...]}``."""
    out = []
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        (path,) = folder.glob("run-*.wandb")
        run: dict = {"id": None, "config": {}, "history": []}
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"] = record.run.run_id
                run["config"].update({i.key: json.loads(i.value_json)
                                      for i in record.run.config.update})
            elif kind == "config":
                run["config"].update({i.key: json.loads(i.value_json)
                                      for i in record.config.update})
            elif kind == "history":
                run["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                       for i in record.history.item})
        out.append(run)
    return out


def mlflow_run(run_dir: Path) -> tuple[object, object]:
    """``(client, run)`` of the mlflow run ``trackers.json`` names."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    ids = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=ids["tracking_uri"])
    return client, client.get_run(ids["run_id"])


def mlflow_history(run_dir: Path, key: str) -> list[tuple[int, float]]:
    client, run = mlflow_run(run_dir)
    return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
