"""``runner.py bundle RUN_DIR --step N -o FILE``: one file with what rerunning step N needs, and
``runner.py rerun FILE`` in any directory, checkout or machine.

The file is a tar archive of a small run directory: the run's topology; the checkpoint the
rerun starts from (the newest of a step ≤ N−1, as ``rerun`` picks it; none: the base model with
a fresh optimizer); the recorded batches and metrics of the steps from there to N and the groups
those batches hold; the base model's files, unless it is the embedded default model every
install has (a reference model or a base-model rerun reads them); the file of a user's own loss
or estimator (``name = "custom"``; alone: a neighbour it imports is not packed); and ``bundle.json``: the step,
the run it came from, and the versions of Python, torch, transformers and flowrl, the machine
and the learner's thread count it was made with. ``rerun FILE`` unpacks it into a temporary
folder, says where those differ from its own, and reruns the step there: exact where they
match, else each quantity's difference is in its table.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import TextIO

import pyarrow as pa

from actors.model_store import DEFAULT_MODEL, model_dir
from actors.offline.recorded import OfflineError, open_run, span
from actors.offline.rerun import checkpoint_before, rerun
from actors.runtime.recording import SCHEMAS, last_by, part_file, read_table
from actors.runtime.rundir import CHECKPOINTS, RECORD_DIR, TOPOLOGY

MANIFEST = "bundle.json"
ROOT = "bundle"  # the folder the archive holds


def versions(threads: int) -> dict[str, str]:
    """What a rerun's exactness depends on besides its inputs."""
    import torch
    import transformers

    try:
        flowrl = metadata.version("flowrl")
    except metadata.PackageNotFoundError:
        flowrl = "unknown"
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "flowrl": flowrl,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "learner threads": str(threads)}


def bundle(run_dir: str | Path, step: int, out_file: str | Path) -> Path:
    """Write the archive of step ``step`` of ``run_dir`` to ``out_file``; returns its path."""
    run = open_run(run_dir)
    if step not in run.batches or step not in run.metrics:
        raise OfflineError(f"step {step} is not recorded in {run.run_dir} "
                           f"(recorded steps: {span(run.steps)})")
    ckpt, start = checkpoint_before(run.run_dir, step)
    steps = set(range(start + 1, step + 1))
    if missing := sorted(steps - set(run.batches)):
        raise OfflineError(f"steps {span(missing)} (between the checkpoint of step {start} and "
                           f"step {step}) are not recorded: the bundle could not rebuild them")
    groups = {g for s in steps for g in run.batches[s]["group_ids"]}
    topology = json.loads((run.run_dir / TOPOLOGY).read_text())
    model = topology["model"]["path"]
    with tempfile.TemporaryDirectory() as tmp:
        mini = Path(tmp) / ROOT
        (mini / RECORD_DIR).mkdir(parents=True)
        for table, key, keep in (("batches", "step", steps), ("metrics", "step", steps),
                                 ("groups", "group_id", groups)):
            rows = [row for k, row in last_by(read_table(run.run_dir, table), key).items()
                    if k in keep]
            (mini / RECORD_DIR / table).mkdir()
            data, name = part_file(pa.Table.from_pylist(rows, schema=SCHEMAS[table]), "0", 0)
            (mini / RECORD_DIR / table / name).write_bytes(data)
        (mini / TOPOLOGY).write_text(json.dumps(topology))
        if ckpt is not None:
            shutil.copytree(ckpt, mini / CHECKPOINTS / ckpt.name)
        code = _user_code(topology["algorithm"], mini)
        default = model == DEFAULT_MODEL or Path(model).resolve() == model_dir(DEFAULT_MODEL)
        if not default:
            shutil.copytree(model, mini / "model")
        (mini / MANIFEST).write_text(json.dumps({
            "step": step, "run": str(run.run_dir), "from": ckpt.name if ckpt else "base model",
            "model": DEFAULT_MODEL if default else "model", "code": code,
            "versions": versions(run.topology.learner.threads)}, indent=1))
        out = Path(out_file)
        with tarfile.open(out, "w") as tar:
            tar.add(mini, arcname=ROOT)
    return out


def _user_code(algorithm: dict, mini: Path) -> dict[str, str]:
    """Copy the files of the run's own loss and estimator (``name = "custom"``) into the bundle
    (``code/KEY/NAME.py``); their names there, by key. A file that changed since the run is
    refused here, as the rerun would refuse it."""
    from actors.runtime.config import file_sha256

    code = {}
    for key in ("policy_loss", "adv_estimator"):
        row = algorithm.get(key)
        if not isinstance(row, dict) or not row.get("path"):
            continue
        path = Path(row["path"])
        if not path.is_file() or file_sha256(path) != row.get("sha256"):
            raise OfflineError(f"algorithm.{key}.path: {path} is gone or changed since the run "
                               "(its sha256 is not the one recorded): the bundle could not rerun")
        name = f"code/{key}/{path.name}"
        (mini / name).parent.mkdir(parents=True)
        shutil.copy(path, mini / name)
        code[key] = name
    return code


def rerun_bundle(path: str | Path, step: int | None = None, *, overrides: Sequence[str] = (),
                 dump: Sequence[str] = (), dump_dir: str | None = None,
                 out: TextIO = sys.stdout) -> int:
    """Unpack a bundle into a temporary folder and rerun its step (or ``step``) there."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with tarfile.open(path) as tar:
                tar.extractall(tmp, filter="data")
            mini = Path(tmp) / ROOT
            manifest = json.loads((mini / MANIFEST).read_text())
        except (tarfile.TarError, OSError, ValueError) as exc:
            raise OfflineError(f"{path} is not a bundle of runner.py bundle ({exc})") from None
        made = manifest["versions"]
        here = versions(json.loads((mini / TOPOLOGY).read_text())["learner"]["threads"])
        print(f"=== bundle of step {manifest['step']} of {manifest['run']} (from its "
              f"{manifest['from']})", file=out)
        unlike = [f"{k} {made[k]} there, {here.get(k)} here" for k in made
                  if made[k] != here.get(k) and k != "flowrl"]
        if made.get("flowrl") != here["flowrl"]:
            unlike.append(f"flowrl {made.get('flowrl')} there, {here['flowrl']} here")
        print("=== made where this is run: exact agreement expected" if not unlike else
              "=== made elsewhere (" + "; ".join(unlike) + "): expect differences of float "
              "rounding, each quantity's in the table", file=out)
        model = str(mini / "model") if manifest["model"] == "model" else manifest["model"]
        code = [f"algorithm.{key}.path={mini / name}"
                for key, name in manifest.get("code", {}).items()]
        return rerun(mini, manifest["step"] if step is None else step,
                     overrides=[f"model.path={model}", *code, *overrides], dump=dump,
                     dump_dir=dump_dir, out=out)
