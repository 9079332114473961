"""The step's time broken down (verl's ``timing_s/*``), the FLOPs count behind MFU, memory."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from actors.job.metrics import format_step, time_breakdown
from actors.learner.perf import dense_parameters, peak_flops, peak_of, train_flops
from tests.learner_cases import make_trainer
from tests.test_learner import make_groups

PARTS = ("old_log_prob", "ref", "values", "adv", "update_actor", "update_critic")


def test_a_step_reports_where_its_time_went(tiny_model, tmp_path):
    t = make_trainer(tiny_model, tmp_path, "algorithm.adv_estimator=gae", "learner.ppo_epochs=2",
                     "algorithm.use_kl_loss=true")
    m = t.train_step(make_groups(t, behaviour_offset=-0.1))
    for part in PARTS:
        assert m[f"timing_s/{part}"] >= 0, part
    assert m["timing_s/update_actor"] > 0
    assert sum(m[f"timing_s/{p}"] for p in PARTS) <= m["timing_s/step"]
    assert "timing_s/gen" in m and "timing_s/weight_sync" in m
    assert m["perf/tflops/actor"] > 0
    assert "perf/mfu/actor" not in m  # no peak on a CPU (actors/learner/perf.py says why)
    assert m["perf/cpu_max_rss_gb"] > 0
    assert "perf/max_memory_allocated_gb" not in m
    line = format_step(1, {**m, "timing_s/wait_batch": 1.25, "timing_s/weight_publish": 0.5}, 3, 1)
    assert f"upd {m['timing_s/update_actor']:.1f}" in line and "| wait 1.2 pub 0.5 gen" in line


def test_a_step_without_batch_wide_passes_reports_none():
    """The default job's step computes π_old inline: no old_log_prob, ref or values time."""
    line = time_breakdown({"timing_s/adv": 0.01, "timing_s/update_actor": 7.94})
    assert line == "adv 0.0 upd 7.9"


def test_dense_parameters_are_the_models_matrices():
    """verl's N counts every weight matrix (the LM head apart from the embedding): it is the
    model's own count of 2-D parameters when they are not tied."""
    config = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=352,
                         num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                         tie_word_embeddings=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    assert dense_parameters(config) == matrices
    flops = train_flops(config, [10, 30])
    assert flops == 6 * matrices * 40 + 6 * (100 + 900) * 16 * 8 * 3
    assert peak_flops(torch.device("cpu")) is None
    assert peak_of("NVIDIA H200") == 989e12 and peak_of("NVIDIA H20") == 148e12
    assert peak_of("NVIDIA A100-SXM4-80GB") == 312e12 and peak_of("Some GPU") is None


def test_the_live_panel_shows_where_the_step_went():
    from actors.job.liveview import View
    from tests.test_liveview import STEP, text_of

    view = View(total_steps=30, max_staleness=1, run_dir="runs/x", started=0.0)
    view.record("train", 1, {**STEP, "timing_s/adv": 0.01, "timing_s/update_actor": 14.2,
                             "timing_s/wait_batch": 2.0, "timing_s/weight_publish": 0.4,
                             "timing_s/gen": 9.5}, now=20.0)
    text, _ = text_of(view, now=21.0)
    assert "step time (s): adv 0.0 upd 14.2 | wait 2.0 pub 0.4 gen 9.5" in text
