"""Damage on disk, tried many times over on a real run's files: what each kind is found as.

    python bench/damage.py                      # a tiny job's run, then every case below
    python bench/damage.py --flips 200 --cuts 100 --seed 1

A tiny job (the tests' random model, 4 steps, a checkpoint at steps 2 and 4) writes a run
directory; then each of its files is damaged in turn, a copy put back after each case:

- the recording's part files (every table): one bit flipped at ``--flips`` positions of each
  (every byte of a part shorter than that), and the file cut short at ``--cuts`` lengths. Each
  case is read with ``read_part`` (what ``rerun``, ``inspect`` and a resume read): it is found
  (``RecordingDamaged``, naming the file), or it reads back exactly what was written (a flipped
  bit in a header's statistics that nothing reads). Read back different without an error: the
  count that must be 0.
- the newest checkpoint's files: one bit flipped at ``--flips`` positions spread over its files,
  each file cut short at ``--cuts`` lengths, each file removed. Each case goes through
  ``damage`` (what a resume checks before it loads): found, or missed (must be 0).
- the run's jsonl records (``metrics``, ``status``, ``validation``): cut at ``--cuts`` lengths,
  as a kill mid-write leaves them; ``cut_torn_line`` (a resume's first step) must leave whole
  lines only, each one of the file's own.

What a resume then does with a damaged checkpoint or part (sets it aside and resumes from the
one before, or stops naming the file) is tested on whole jobs: ``tests/test_offline.py``.
Figures: BENCHMARKS.md, "Reliability".
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from actors.runtime.recording import RECORD_DIR, RecordingDamaged, read_part  # noqa: E402
from actors.runtime.rundir import checkpoints, cut_torn_line, damage  # noqa: E402


def flipped(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 1 << (at % 8)
    return bytes(out)


def positions(size: int, k: int, rng: random.Random) -> list[int]:
    return list(range(size)) if size <= k else sorted(rng.sample(range(size), k))


def recording_cases(run: Path, flips: int, cuts: int, rng: random.Random) -> Counter:
    tally: Counter = Counter()
    for part in sorted((run / RECORD_DIR).glob("*/part-*.parquet")):
        whole = part.read_bytes()
        written = read_part(part)
        cases = [("flip", at, flipped(whole, at)) for at in positions(len(whole), flips, rng)]
        cases += [("cut", n, whole[:n]) for n in positions(len(whole), cuts, rng)]
        try:
            for kind, at, data in cases:
                part.write_bytes(data)
                try:
                    same = read_part(part).equals(written)
                except RecordingDamaged as exc:
                    assert part.name in str(exc), exc
                    tally[f"{kind} found"] += 1
                    continue
                tally[f"{kind} {'read back whole' if same else 'READ WRONG'}"] += 1
                if not same:
                    print(f"  read wrong: {part.relative_to(run)} ({len(whole):,} bytes), "
                          f"{kind} at byte {at:,}")
        finally:
            part.write_bytes(whole)
        tally["parts"] += 1
    return tally


def checkpoint_cases(ckpt: Path, flips: int, cuts: int, rng: random.Random) -> Counter:
    tally: Counter = Counter()
    files = sorted(p for p in ckpt.rglob("*") if p.is_file())
    tally["files"] = len(files)
    sizes = [p.stat().st_size for p in files]
    for _ in range(flips):  # a position over all the bytes, so big files get more
        at = rng.randrange(sum(sizes))
        i = 0
        while at >= sizes[i]:
            at, i = at - sizes[i], i + 1
        whole = files[i].read_bytes()
        files[i].write_bytes(flipped(whole, at))
        try:
            tally["flip " + ("found" if damage(ckpt) else "MISSED")] += 1
        finally:
            files[i].write_bytes(whole)
    for path in files:
        whole = path.read_bytes()
        try:
            for n in positions(len(whole), max(1, cuts // len(files)), rng):
                path.write_bytes(whole[:n])
                tally["cut " + ("found" if damage(ckpt) else "MISSED")] += 1
            path.unlink()
            tally["removed " + ("found" if damage(ckpt) else "MISSED")] += 1
        finally:
            path.write_bytes(whole)
    assert damage(ckpt) is None, "the checkpoint was not put back whole"
    return tally


def torn_line_cases(run: Path, cuts: int, rng: random.Random) -> Counter:
    tally: Counter = Counter()
    for name in ("metrics.jsonl", "status.jsonl", "validation.jsonl"):
        path = run / name
        if not path.exists():  # (no validation rounds)
            continue
        whole = path.read_bytes()
        lines = whole.decode().splitlines()
        try:
            for n in positions(len(whole), cuts, rng):
                path.write_bytes(whole[:n])
                cut_torn_line(path)
                kept = path.read_text().splitlines()
                ok = kept == lines[:len(kept)] and all(json.loads(x) is not None for x in kept)
                tally["cut " + ("whole lines kept" if ok else "LEFT TORN")] += 1
        finally:
            path.write_bytes(whole)
    return tally


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--flips", type=int, default=400, help="bit flips per part / checkpoint")
    ap.add_argument("--cuts", type=int, default=100, help="lengths cut to per file")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    from tests.jobs import command
    from tests.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-damage-") as tmp:
        model, run = build_tiny_model(Path(tmp) / "model"), Path(tmp) / "run"
        done = subprocess.run(command(model, run, "learner.total_steps=4", "learner.save_every=2",
                                      'validation.datasets=[{builtin="repeat_letter", size=2}]',
                                      "validation.every=2"),
                              cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"the job failed ({done.returncode}):\n{done.stdout[-3000:]}")
        started = time.monotonic()
        ckpt = checkpoints(run)[-1][1]
        rows = [("recording parts", recording_cases(run, args.flips, args.cuts, rng)),
                (f"checkpoint {ckpt.name}", checkpoint_cases(ckpt, args.flips, args.cuts, rng)),
                ("jsonl records", torn_line_cases(run, args.cuts, rng))]
        wrong = 0
        for what, tally in rows:
            print(f"{what}: " + ", ".join(f"{k} {v:,}" for k, v in sorted(tally.items())))
            wrong += sum(v for k, v in tally.items() if k.isupper() or "WRONG" in k
                         or "MISSED" in k or "TORN" in k)
        cases = sum(v for _, t in rows for k, v in t.items() if k not in ("parts", "files"))
        print(f"{cases:,} cases in {time.monotonic() - started:.0f} s; read wrong or missed: {wrong}")
        shutil.rmtree(run, ignore_errors=True)
        sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
