"""A LoRA checkpoint is the PEFT adapter alone (``PeftModel.from_pretrained`` loads it on the
base), resumes the learner, and ``runner.py export --merge`` turns it into one Hugging Face
model whose logits are the adapted model's."""

from __future__ import annotations

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from runner import main
from tests.learner_cases import make_trainer
from tests.test_learner import make_groups


def test_a_lora_checkpoint_is_a_peft_adapter_and_exports_merged(tiny_model, tmp_path, capsys):
    t = make_trainer(tiny_model, tmp_path, "learner.lora.rank=4", "learner.lora.alpha=32")
    t.train_step(make_groups(t))
    ckpt = t.policy.save_checkpoint()
    assert (ckpt / "adapter_config.json").is_file() and not (ckpt / "model.safetensors").exists()
    adapter_bytes = (ckpt / "adapter_model.safetensors").stat().st_size
    assert adapter_bytes < (tiny_model / "model.safetensors").stat().st_size / 4

    x = torch.randint(3, 30, (2, 9))
    t.policy.model.eval()
    with torch.no_grad():
        trained = t.policy.model(input_ids=x).logits
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), ckpt)
        adapted = peft.eval()(input_ids=x).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model)(input_ids=x).logits
    assert float((adapted - trained).abs().max()) < 1e-5
    assert float((adapted - base).abs().max()) > 1e-3  # the step moved the adapter

    assert main(["export", str(tmp_path), "--step", "1", "--merge"]) == 0
    merged_dir = tmp_path / "export" / "step_1-merged"
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        got = merged(input_ids=x).logits
    print(f"merged vs PEFT logits: max |diff| {float((got - adapted).abs().max()):.2e}")
    assert float((got - adapted).abs().max()) < 1e-5
    assert (merged_dir / "tokenizer_config.json").is_file()

    assert main(["export", str(tmp_path), "--step", "1"]) == 0  # the adapter as it is
    assert (tmp_path / "export" / "step_1" / "adapter_model.safetensors").is_file()
    assert main(["export", str(tmp_path), "--step", "7", "--merge"]) == 2
    assert "no checkpoint" in capsys.readouterr().err
