"""The configuration reference is the schema's: ``runner.py keys`` and docs/configuration.md."""

from __future__ import annotations

import subprocess
import sys

from actors.job.config.load import apply_overrides, decode_topology
from actors.job.config.reference import keys, markdown
from tests.jobs import ROOT


def test_the_reference_file_is_the_schemas():
    written = (ROOT / "docs" / "configuration.md").read_text()
    assert written == markdown(), ("docs/configuration.md is stale: python runner.py keys "
                                   "--markdown > docs/configuration.md")


def test_every_key_has_a_doc_and_can_be_set():
    found = keys()
    assert len(found) > 200
    undocumented = [k.path for k in found if not k.doc]
    assert not undocumented, undocumented
    # each plain key accepts its own default as an override (the reference names real keys)
    for k in found:
        if "[" in k.path or not k.default or k.default.startswith(("(", '"""')):
            continue
        decode_topology(apply_overrides({}, [f"{k.path}={k.default}"]))


def test_keys_prints_a_section_and_refuses_an_unknown_prefix():
    done = subprocess.run([sys.executable, "runner.py", "keys", "learner.lr"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("learner.lr: float > 0 = 1e-05\n")
    bad = subprocess.run([sys.executable, "runner.py", "keys", "learner.lrz"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "learner.lrz" in bad.stderr
