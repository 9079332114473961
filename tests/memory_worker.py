"""A learner's measured peak memory against its estimate, in a process of its own (its peak RSS is
this run's alone): ``python -m tests.memory_worker DIR`` builds two decoder layers of the
embedded model's shape (SmolLM2-135M: its 49,152-token vocabulary, so the LM head's logits
weigh as in the default job) under DIR, trains three steps of the learner tests' groups, and
prints one JSON line: the bytes the process grew by from after its imports to its peak, and
``memory.estimate``'s device total for the step's largest micro-batch."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

from transformers import LlamaConfig, LlamaForCausalLM

from actors.learner.memory import estimate
from tests.learner_cases import make_trainer
from tests.test_learner import make_groups
from tests.tiny_model import tiny_tokenizer


def rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def main(where: Path) -> None:
    base = rss()  # torch, transformers and the learner imported: not the estimate's
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         tie_word_embeddings=True, pad_token_id=0, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(where / "model")
    tiny_tokenizer().save_pretrained(where / "model")
    trainer = make_trainer(where / "model", where / "run")
    seen: list[int] = []
    trainer.on_first_batch = lambda tokens, patches: seen.append(tokens)
    groups = make_groups(trainer)
    for _ in range(3):
        trainer.train_step(groups)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base  # (kB on Linux)
    e = estimate(trainer.policy.model.config, tokens=seen[0])
    print(json.dumps({"tokens": seen[0], "peak": peak, "estimate": e.device_total}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
