"""Checks of user code and of the model, run once before a job starts, in a sandboxed child.

The runner (``actors/job/config/preflight.py``) calls these through ``Children``, so a
user's file is imported in a child process, never in the runner, and a file that hangs while
importing is killed at the children's timeout. Each check returns ``""`` when all is well, or one
line saying what is wrong, with the file and line of the error where there is one
(``syntax.py line 2: SyntaxError: invalid syntax``); the runner puts the key in front.

What each role needs (how the job calls it, ``actors/sandbox/protocol.run_call``):

- ``reward``: ``fn(data_source=, solution_str=, ground_truth=, extra_info=, **kwargs)`` (verl's
  ``compute_score``); ``reward_batch``: the same with lists (``data_sources=, solution_strs=,
  ground_truths=, extra_infos=``). Plain or ``async def``.
- ``tool``: a function (plain or ``async def``) taking its ``kwargs``, whose signature makes the
  JSON schema the model is shown (``actors/sandbox/tools.schema_of``).
- ``env``: a class taking its ``kwargs``, with ``reset(prompt)`` and ``step(action)``.
- ``rollout``: ``async def rollout(client, row)`` (``[agent.rollout]``, awaited on the child's
  asyncio loop).
- ``policy_loss`` / ``adv_estimator``: a user's own loss or estimator
  (``algorithm.policy_loss = {name = "custom"}``), called by the learner as the built-ins are
  (``actors/runtime/config/custom.py``), with its ``kwargs``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import traceback
from pathlib import Path
from typing import Any

from actors.runtime.config import ROLES, call_problem
from actors.sandbox.protocol import describe

REWARD_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")
BATCH_ARGUMENTS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")


def located(exc: BaseException, path: str) -> str:
    """``FILE line N: Error: message`` for an error raised while importing ``path``: the line of
    a syntax error, else of the innermost frame in a file other than the import machinery's."""
    if isinstance(exc, SyntaxError) and exc.lineno is not None:
        where = Path(exc.filename or path).name
        return f"{where} line {exc.lineno}: {type(exc).__name__}: {exc.msg}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(("<frozen", __file__))]
    if frames:
        return f"{Path(frames[-1].filename).name} line {frames[-1].lineno}: {describe(exc)}"
    return describe(exc)


def _load(path: str, module: str, name: str, index: int) -> tuple[Any, str]:
    """(the object ``name``, "") or (None, what went wrong)."""
    try:
        if module:
            target = importlib.import_module(module)
        else:
            spec = importlib.util.spec_from_file_location(f"_flowrl_preflight_{index}", path)
            if spec is None or spec.loader is None:
                return None, f"{Path(path).name} cannot be loaded as a Python module"
            target = importlib.util.module_from_spec(spec)
            sys.path.insert(0, str(Path(path).parent))  # as the job's children do
            spec.loader.exec_module(target)
    except (Exception, SystemExit) as exc:
        return None, located(exc, path)
    found = getattr(target, name, None)
    if found is None:
        defined = sorted(n for n, v in vars(target).items()
                         if callable(v) and not n.startswith("_")
                         and getattr(v, "__module__", None) == target.__name__)
        return None, (f"{Path(path).name if path else module} has no {name!r}"
                      f" (it defines: {', '.join(defined) or 'nothing callable'})")
    return found, ""


def _signature(obj: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without one: nothing to check
        return None


def _binds(obj: Any, name: str, arguments: tuple[str, ...], kwargs: list[str],
           how: str) -> str:
    signature = _signature(obj)
    if signature is None:
        return ""
    try:
        signature.bind(**dict.fromkeys((*arguments, *kwargs)))
    except TypeError as exc:
        shown = ", ".join((*arguments, *(f"{k}=..." for k in kwargs)))
        return f"{name}{signature} cannot be called as {how}: {name}({shown}): {exc}"
    return ""


def check_function(path: str, module: str, name: str, role: str, kwargs: list[str],
                   index: int = 0) -> str:
    """Import ``path`` (or ``module``), find ``name`` and check it fits ``role``: "" or why not."""
    obj, problem = _load(path, module, name, index)
    if problem:
        return problem
    if role == "env":
        if not inspect.isclass(obj):
            return f"{name} is a {type(obj).__name__}, not a class"
        missing = [m for m in ("reset", "step") if not callable(getattr(obj, m, None))]
        if missing:
            return f"class {name} has no {' and no '.join(missing)} method"
        return _binds(obj, name, (), kwargs, "the environment is made (agent.env.kwargs)")
    if not callable(obj):
        return f"{name} is a {type(obj).__name__}, not a function"
    if inspect.isasyncgenfunction(obj) or inspect.isgeneratorfunction(obj):
        return f"{name} is a generator function; it must return its value"
    match role:
        case "reward":
            return _binds(obj, name, REWARD_ARGUMENTS, kwargs,
                          "verl calls compute_score (keyword arguments)")
        case "reward_batch":
            return _binds(obj, name, BATCH_ARGUMENTS, kwargs,
                          "a batch reward function is called (reward.functions[].batch = true)")
        case "rollout":
            if not inspect.iscoroutinefunction(obj):
                return f"{name} is not an async def: the episode awaits rollout(client, row)"
            signature = _signature(obj)
            try:
                if signature is not None:
                    signature.bind(None, None)
            except TypeError as exc:
                return f"{name}{signature} cannot be called as rollout(client, row): {exc}"
            return ""
        case _ if role in ROLES:
            problem = call_problem(obj, role, kwargs)
            return f"{Path(path).name}: {problem}" if problem else ""
    signature = _signature(obj)  # a tool: its kwargs are bound by the job, the rest by the model
    if signature is not None:
        try:
            signature.bind_partial(**dict.fromkeys(kwargs))
        except TypeError as exc:
            return f"{name}{signature} does not take its kwargs: {exc}"
    return ""


CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def check_model(path: str, needs_chat: bool = True) -> str:
    """The model directory ``path`` as the actors load it: a causal LM's config, a tokenizer,
    and (``needs_chat``: prompts are chat messages) a chat template that renders a prompt."""
    try:
        from transformers import AutoConfig, AutoTokenizer
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
        )
    except ImportError as exc:
        return f"transformers does not import: {describe(exc)}"
    try:
        config = AutoConfig.from_pretrained(path)
    except (Exception, SystemExit) as exc:
        return f"{path}: config.json does not load: {describe(exc)}"
    architectures = [str(a) for a in (getattr(config, "architectures", None) or [])]
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    # a vision-language model generates text as a causal LM does (actors/model_store.py)
    vision = (getattr(config, "vision_config", None) is not None
              and config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    if not vision and (config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or architectures
                       and not any(a in causal or a.endswith(CAUSAL_SUFFIXES)
                                   for a in architectures)):
        return (f"{path} holds {', '.join(architectures) or config.model_type}, not a causal "
                "language model (transformers' AutoModelForCausalLM)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (Exception, SystemExit) as exc:
        return f"{path}: the tokenizer does not load: {describe(exc)}"
    if not needs_chat:
        return ""
    if not getattr(tokenizer, "chat_template", None):
        return (f"{path}: the tokenizer has no chat template (tokenizer_config.json "
                "chat_template, or chat_template.jinja); prompts are chat messages that it renders")
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "1 + 1"}],
                                      add_generation_prompt=True, tokenize=True)
    except (Exception, SystemExit) as exc:
        return f"{path}: the chat template fails on a user message: {describe(exc)}"
    return ""


def check_teacher(path: str, student: str, images: str = "") -> str:
    """``[teacher]``'s model ``path`` loads as a causal LM and tokenizes exactly as the student
    (``student``, model.path) does: the teacher scores the student's token ids, so one id must
    mean the same token to both (the same vocabulary and special tokens, ids the model covers).
    ``images`` (the key of a dataset with images): the teacher must see them too."""
    problem = check_model(path, needs_chat=False)
    if problem:
        return problem
    from transformers import AutoConfig, AutoTokenizer

    try:
        mine, theirs = AutoTokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(student)
        # a vision-language model's vocabulary is its text model's
        vocab_size = AutoConfig.from_pretrained(path).get_text_config().vocab_size
    except (Exception, SystemExit) as exc:
        return f"{path}: the tokenizers do not load: {describe(exc)}"
    a, b = mine.get_vocab(), theirs.get_vocab()
    differ = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])
    specials = [name for name in ("eos_token_id", "bos_token_id", "pad_token_id")
                if getattr(mine, name) != getattr(theirs, name)]
    why = ""
    if differ:
        token, index = differ[0]
        why = (f"{len(differ)} vocabulary entries differ (e.g. {token!r}: id {a.get(token)} for "
               f"the teacher, {b.get(token)} for the student)")
    elif specials:
        why = f"{specials[0]} differs ({getattr(mine, specials[0])} vs {getattr(theirs, specials[0])})"
    elif vocab_size < len(b):
        why = f"the teacher's vocab_size {vocab_size} < the student's {len(b)} tokens"
    if why:
        return (f"the teacher {path} and the student {student} (model.path) do not share a "
                f"tokenizer: {why}; the teacher scores the student's token ids, so they must")
    return teacher_images(path, student, images) if images else ""


def teacher_images(path: str, student: str, where: str) -> str:
    """A teacher of prompts with images (``where`` has them) is a vision-language model whose
    processor counts each image's tokens as the student's does: it scores the student's prompt
    tokens, where each image's tokens are expanded already. Probed on a few image sizes."""
    import io

    from PIL import Image

    from actors.data.vision import ImageProcessor, is_vision_model

    if not is_vision_model(path):
        return (f"the teacher {path} is a text-only model and {where} has images: it would read "
                "the student's image tokens without the images; use a vision-language teacher")
    try:
        mine, theirs = ImageProcessor(path), ImageProcessor(student)
    except (Exception, SystemExit) as exc:
        return f"{path}: the image processors do not load: {describe(exc)}"
    for size in ((28, 28), (200, 120), (640, 480), (1280, 720)):
        out = io.BytesIO()
        Image.new("RGB", size, (128, 128, 128)).save(out, format="PNG")
        a, b = (sum(p.tokens_per_image(p.pixels([out.getvalue()]).image_grid_thw))
                for p in (mine, theirs))
        if a != b:
            return (f"the teacher {path} and the student {student} (model.path) process images "
                    f"differently: a {size[0]}x{size[1]} image is {a} image tokens for the "
                    f"teacher and {b} for the student; the teacher scores the student's tokens")
    return ""
