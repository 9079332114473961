"""The docs cannot rot: what README.md, docs/ and BENCHMARKS.md show is checked against the code.

Every fenced ``toml`` block parses against the schema (a block whose first comment line says
``fragment`` is merged onto ``topology.toml`` first; any other block is a whole topology), every
relative link resolves (a ``#anchor`` into a Markdown file names one of its headings), every
``python runner.py VERB`` shown is a verb of ``runner.py``, every backticked dotted key
(``learner.weights_transport``) is a key of the schema, and the README stays short enough to read
in ten minutes. The README's "Train your own" blocks are run as a job, as written.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from actors.job.config.load import decode_topology
from actors.job.config.reference import keys
from actors.runtime.config import ConfigError
from tests.jobs import ROOT, metrics

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "BENCHMARKS.md"]
README_MAX_LINES = 250

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
RUNNER = re.compile(r"python runner\.py ([^\s`|\\]+)")
FILE_ENDINGS = {"py", "md", "toml", "json", "jsonl", "parquet", "log", "png", "pt", "key", "txt"}


def fenced(path: Path, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(path.read_text()) if lang == language]


def prose(path: Path) -> str:
    """A page without its fenced blocks (what inline code spans are read from)."""
    return FENCE.sub("", path.read_text())


def merged(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(
            out.get(key), dict) else value
    return out


def is_fragment(block: str) -> bool:
    first = next((ln for ln in block.splitlines() if ln.strip().startswith("#")), "")
    return "fragment" in first.lower()


def toml_blocks() -> list[tuple[str, str]]:
    return [(f"{p.relative_to(ROOT)}#{i}", b) for p in PAGES for i, b in enumerate(fenced(p, "toml"))]


def files_named(data: object) -> list[str]:
    """The relative file paths a block names (``path = "data.jsonl"``, at any depth)."""
    if isinstance(data, list):
        return [f for item in data for f in files_named(item)]
    if not isinstance(data, dict):
        return []
    named = [v for k, v in data.items() if k.endswith("path") and isinstance(v, str)
             and v and not v.startswith(("/", "~")) and v != "default"]
    return named + [f for v in data.values() for f in files_named(v)]


@pytest.mark.parametrize(("where", "block"), toml_blocks(), ids=[w for w, _ in toml_blocks()])
def test_every_toml_block_is_a_topology(where, block, tmp_path, monkeypatch):
    """Decoded and checked as a start checks it; the files it names exist (empty) in the
    directory it is read from, since what they hold is the pre-flight's to check."""
    data = tomllib.loads(block)
    if is_fragment(block):
        data = merged(tomllib.loads((ROOT / "topology.toml").read_text()), data)
    monkeypatch.chdir(tmp_path)
    environments = verifiers_files(data)
    if environments:  # the check loads a verifiers environment: the tests' own stands in
        if VERIFIERS_DIR.is_dir() and str(VERIFIERS_DIR) not in sys.path:
            sys.path.append(str(VERIFIERS_DIR))
        pytest.importorskip("verifiers.v1", reason="verifiers: bash .ci/setup.sh --tests")
    app = openenv_app(data)
    if app:  # the check finds the module of an OpenEnv app and the library: stand-ins for both
        if OPENENV_DIR.is_dir() and str(OPENENV_DIR) not in sys.path:
            sys.path.append(str(OPENENV_DIR))
        pytest.importorskip("openenv", reason="openenv-core: bash .ci/setup.sh --tests")
        module = tmp_path / (app.partition(":")[0].replace(".", "/") + ".py")
        module.parent.mkdir(parents=True, exist_ok=True)
        module.write_text("")
    for name in files_named(data):
        if name in environments:
            (tmp_path / name).write_text((ROOT / "tests" / "verifiers_addition.py").read_text())
        else:
            write_stand_in(tmp_path / name)
    try:
        decode_topology(data)
    except ConfigError as exc:  # a model directory of the reader's own (/models/...) is not here
        key = str(exc).split(":", 1)[0]
        assert key.endswith("path") and "/" in str(exc), exc


VERIFIERS_DIR = ROOT / ".venv" / "verifiers-0.4.0"  # where .ci/setup.sh --tests installs it
OPENENV_DIR = ROOT / ".venv" / "openenv-0.3.0"  # the same for openenv-core


def openenv_app(data: dict) -> str:
    """The ``agent.env.openenv.app`` a block names ("" when none)."""
    return str(data.get("agent", {}).get("env", {}).get("openenv", {}).get("app", ""))


def verifiers_files(data: object) -> set[str]:
    """The environment files a block's ``verifiers = { path = ... }`` tables name."""
    if isinstance(data, list):
        return {f for item in data for f in verifiers_files(item)}
    if not isinstance(data, dict):
        return set()
    own = {data["verifiers"].get("path", "")} if isinstance(data.get("verifiers"), dict) else set()
    return (own - {""}) | {f for v in data.values() for f in verifiers_files(v)}


ROW = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "What is 2 + 3?"}],
       "reward_model": {"style": "rule", "ground_truth": "5"}, "extra_info": {"index": 0},
       "question": "What is 2 + 3?", "answer": "5"}  # verl's columns, and a plain file's


def write_stand_in(path: Path) -> None:
    """A file a block names, holding what its kind needs to pass the start's checks: one verl
    row for a dataset; user code is loaded only by the pre-flight, so it stays empty."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text(json.dumps(ROW) + "\n")
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([ROW]), path)
    else:
        path.touch()


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(prose(page)):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto: are not the repository's
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists() or ROOT not in [path, *path.parents]:
                broken.append(f"{page.name}: {target}")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def runner_verbs() -> set[str]:
    """The verbs ``runner.py`` dispatches to a command (its ``VERBS`` table)."""
    from runner import VERBS

    return set(VERBS)


def test_the_runners_help_lists_every_verb_and_no_arguments_say_what_to_name():
    shown = subprocess.run([sys.executable, "runner.py", "--help"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    listed = {line.split()[0] for line in shown.stdout.split("verbs (")[1].splitlines()[1:]
              if line.startswith("  ")}
    assert listed == runner_verbs()
    bare = subprocess.run([sys.executable, "runner.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert bare.returncode == 2 and "required" not in bare.stderr, bare.stderr
    assert bare.stderr.splitlines()[-1] == ("error: name a topology file (python runner.py "
                                            "topology.toml) or a verb")


def test_every_runner_command_shown_exists():
    verbs = runner_verbs()
    assert {"rerun", "check", "keys", "attach", "inspect", "validate", "export", "keygen"} <= verbs
    assert "replay" not in verbs
    wrong = []
    for page in PAGES:
        for first in RUNNER.findall(page.read_text()):
            if first in verbs or first.endswith(".toml") or first.strip('"$').isupper():
                continue  # a verb, a topology file, or a placeholder (TOPOLOGY, "$TOPOLOGY")
            wrong.append(f"{page.name}: python runner.py {first}")
    assert not wrong, wrong


def schema_keys() -> set[str]:
    return {re.sub(r"\[[^\]]*\]", "", k.path) for k in keys()}


def dotted_keys(span: str, sections: set[str]) -> list[str]:
    """Dotted names in an inline code span that start with a section of the topology."""
    head = "|".join(sorted(sections))
    found = re.findall(rf"(?<![\w./-])((?:{head})(?:\[[^\]]*\])?(?:\.\w+(?:\[[^\]]*\])?)+)", span)
    out = []
    for name in found:
        plain = re.sub(r"\[[^\]]*\]", "", name)
        last = plain.rsplit(".", 1)[-1]
        if last in FILE_ENDINGS or last == "key":  # a file (reward.py), a placeholder (reward.key)
            continue
        out.append(plain)
    return out


def test_every_backticked_key_is_a_key_of_the_schema():
    known = schema_keys()
    sections = {k.split(".", 1)[0] for k in known}
    unknown = []
    for page in PAGES:
        for span in CODE_SPAN.findall(prose(page)):
            if "unknown" in span or span.startswith("error"):
                continue  # an error message quoting a wrong key on purpose
            for name in dotted_keys(span, sections):
                if name not in known and not any(k.startswith(name + ".") for k in known):
                    unknown.append(f"{page.name}: {name} (in `{span}`)")
    assert not unknown, unknown


def test_the_key_check_sees_a_wrong_key():
    sections = {"learner", "reward"}
    assert dotted_keys("learner.weights_transport = \"shm\"", sections) == ["learner.weights_transport"]
    assert dotted_keys("reward.models[1].template", sections) == ["reward.models.template"]
    assert dotted_keys("actors/learner.py reward.py reward.key=value", sections) == []


def test_the_readme_is_short_and_keeps_its_two_first_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    assert "bash .ci/setup.sh && . .venv/bin/activate && python runner.py topology.toml\n" in text
    assert "bash .ci/setup.sh --tests && .venv/bin/python -m pytest -q\n" in text


# -- the newcomer's path, as the README writes it ------------------------------------------------

SECTION = "## Train your own"
QUICK = ["learner.total_steps=2", "learner.groups_per_step=1", "sampler.prompts_per_request=1",
         "algorithm.n=2", "sampler.max_tokens=8", "run.status_interval=0",
         "run.heartbeat_interval=0.5"]  # 2 steps of 2 short samples; the rest as the README has it


def train_your_own() -> tuple[str, list[list[str]]]:
    """The README's "Train your own" section: its TOML blocks joined into one file, and the
    ``python runner.py`` commands of its shell block (comments dropped)."""
    text = README.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start:end if end > 0 else None]
    blocks = [body for lang, body in FENCE.findall(section) if lang == "toml"]
    commands = [shlex.split(line, comments=True)
                for lang, body in FENCE.findall(section) if lang == "bash"
                for line in body.splitlines() if line.startswith("python runner.py")]
    return "\n".join(blocks), commands


def test_the_readme_train_your_own_files_run(tiny_model, tmp_path):
    """The README's model, data and reward blocks, verbatim, in a directory holding what they
    name: ``my-model`` (a user's Hugging Face directory: the tests' tiny llama, with the
    embedded model's tokenizer and chat template; the embedded model itself runs in the slow
    default job), ``data.jsonl`` (20 verl rows of this test's own) and ``reward.py`` (a
    five-line ``compute_score``); then its commands, the job for 2 short steps."""
    topology, commands = train_your_own()
    assert "my-model" in topology and "data.jsonl" in topology and "reward.py" in topology
    assert [c[:3] for c in commands] == [["python", "runner.py", "check"],
                                         ["python", "runner.py", "my_job.toml"]]
    (tmp_path / "my_job.toml").write_text(topology)
    (tmp_path / "my-model").symlink_to(tiny_model)
    rows = [{"data_source": "sums", "prompt": [{"role": "user", "content": f"What is {a} + 2?"}],
             "reward_model": {"style": "rule", "ground_truth": str(a + 2)},
             "extra_info": {"split": "train", "index": a}} for a in range(20)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "reward.py").write_text(
        "import re\n\n\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 1.0 if ground_truth in re.findall(r\"\\d+\", solution_str) else 0.0\n")
    run_dir = tmp_path / "run"
    for command in commands:
        argv = [sys.executable, str(ROOT / "runner.py"), *command[2:]]
        if command[2] != "check":
            argv += [*QUICK, f"run.dir={run_dir}"]
        done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert [r["step"] for r in metrics(run_dir)] == [1, 2]
    assert all("critic/score/mean" in r for r in metrics(run_dir))
