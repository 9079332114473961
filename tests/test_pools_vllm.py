"""A judge pool on the vLLM engine (vLLM's CPU build here): the same answers as on the hf
engine (greedy, fp32, the same tiny model), every response of a batch in one engine call
(vLLM runs them at once), unreadable answers recorded as errors. The tiny random model's
greedy answer is the same run of newlines for every prompt, so this checks the path (engine
start from the pool's config, templating, decoding, parsing), not the numerics (those are
tests/test_vllm.py's). Its sleep is vLLM's own (GPU only: tests/test_vllm_sleep.py)."""

from __future__ import annotations

import pytest

from actors.job.config.load import apply_overrides, decode_topology
from actors.runtime.config import vllm_problem
from actors.scoring.served import ServedScoring
from tests.test_pools import items

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(vllm_problem() is not None, reason=str(vllm_problem()))]


VLLM_OPTIONS = ", max_model_len=256, kv_cache_memory_bytes=67108864"  # the judge's own


def judge(engine: str, model) -> ServedScoring:
    topo = decode_topology(apply_overrides({}, [
        "sampler.engine=hf",
        f'reward.models=[{{name="j", kind="judge", path="{model}", engine={{name="{engine}"'
        f'{VLLM_OPTIONS if engine == "vllm" else ""}}}, '
        'parser="yes_no", max_tokens=8, template="q {prompt} a {response}"}]']))
    return ServedScoring(topo.reward.models[0], topo, label=f"judge-{engine}")


@pytest.mark.anyio
async def test_a_vllm_judge_answers_as_the_hf_judge_does(tiny_vllm_model):
    answers = {}
    for engine in ("hf", "vllm"):
        scoring = judge(engine, tiny_vllm_model)
        await scoring.load()
        try:
            answers[engine] = await scoring.model.generate(items(4))
            results = await scoring.score(items(4))
        finally:
            await scoring.aclose()
        assert len(results) == 4 and len(answers[engine]) == 4
        # a random model's answers: none says yes or no, each is a recorded error
        assert all(r.error.startswith("judge j: parser yes_no read no score") and r.score == 0.0
                   for r in results)
    assert answers["vllm"] == answers["hf"]
