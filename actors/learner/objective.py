"""The learner's loss for one micro-batch, and the batch-level quantities it needs first.

Everything here composes ``kernels/`` functions; the only state is the models passed in.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch

from actors.data.vision_inputs import (
    VisionRows,
    idle_tower,
    packed_embeddings,
    packed_positions,
    padded_inputs,
)
from actors.learner.batch import RolloutBatch
from actors.learner.distributed import is_sharded
from actors.learner.packing import pack
from actors.runtime.config import AlgorithmConfig, Gae
from kernels.aggregate import aggregate
from kernels.kl import kl_estimate
from kernels.lm_head_logprobs import lm_head_logprobs
from kernels.policy_losses import policy_loss
from kernels.rollout_corr import rollout_correction
from kernels.value_loss import value_loss
from kernels.varlen_attention import packed_call

FORWARD = "flowrl_response_logprobs"  # the method a sharded model computes log-probs with


def response_logprobs(model, batch: RolloutBatch, temperature: float, *,
                      with_entropy: bool = False, with_sum_pi_squared: bool = False):
    """Log-probs (N, W-1) of the response tokens, 0 elsewhere; alone, or followed by the
    entropies and verl's ``sum_pi_squared`` (sum over the vocabulary of π², no gradient) when
    asked, each (N, W-1).

    Hidden states are gathered at response positions before the LM head (the prompt is most of
    each sequence here), and ``kernels.lm_head_logprobs`` walks them in chunks so no float32
    (tokens, V) logits exist at once (a fused Triton kernel on CUDA). A model sharded with FSDP
    runs this as one of its forward methods (``attach_forward``), so its parameters are gathered
    for it and its gradients reduced after it.

    A ``packed`` batch runs the model on its rows packed into one (``actors/learner/packing.py``);
    the values come back in the same padded layout. A batch with images (``batch.vision``) runs
    the vision tower on them and reads its features at the prompts' image tokens, with 3-D
    M-RoPE positions, padded or packed alike (``actors/data/vision_inputs.py``).
    """
    at = batch.response_mask.bool()  # (N, W-1)
    forward = getattr(model, FORWARD, None)
    args = (batch.input_ids, batch.attention_mask, at, temperature, with_entropy,
            with_sum_pi_squared, batch.packed, batch.vision, batch.shared, batch.lengths)
    out = forward(*args) if forward is not None else _forward(model, *args)

    def scatter(values: torch.Tensor) -> torch.Tensor:  # (R,) -> (N, W-1), 0 off the response
        return torch.zeros(at.shape, dtype=values.dtype, device=values.device).masked_scatter(at, values)

    if isinstance(out, torch.Tensor):
        return scatter(out)
    return tuple(scatter(t) for t in out)


def _forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, at: torch.Tensor,
             temperature: float, with_entropy: bool, with_sum_pi_squared: bool, packed: bool,
             vision: VisionRows | None, shared: tuple[int, ...] = (),
             lengths: tuple[int, ...] = ()):
    """The values at the response positions ``at`` (N, W-1) of right-padded rows
    ``input_ids`` (N, W), each (R,); ``packed``: the rows are read packed into one, each
    group's common prefix once where ``shared`` says (``RolloutBatch.shared``)."""
    core = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wrapper
    head = core.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("LM heads with a bias are not supported by the log-prob kernels")
    base = core.base_model
    # a rank without images runs the tower as the others do, first, as they do (idle_tower)
    idle = idle_tower(base) if vision is None and getattr(base, "visual", None) is not None \
        and is_sharded(model) else None
    if not packed:
        inputs = (dict(input_ids=input_ids, attention_mask=attention_mask) if vision is None
                  else padded_inputs(base, input_ids, attention_mask, vision))
        hidden = base(**inputs).last_hidden_state
        hidden, targets = hidden[:, :-1][at], input_ids[:, 1:][at]  # (R, H), (R,)
    else:  # kernels/varlen_attention.py: per-sequence attention, or transformers' own path
        rows = pack(input_ids, attention_mask, shared, lengths)
        where = rows.index(at.shape[1])[0][at]  # (R,) packed positions of the response columns
        if vision is None:
            inputs = packed_call(core.config, rows.input_ids, rows.position_ids, rows.tree)
        else:  # (4, 1, T) positions: the text ones bound the sequences, or the tree does
            inputs = packed_call(core.config, rows.input_ids, packed_positions(
                base, input_ids, attention_mask, vision, rows.source), rows.tree)
            inputs["inputs_embeds"] = packed_embeddings(base, input_ids, vision, rows.source)
            del inputs["input_ids"]
        hidden = base(**inputs).last_hidden_state[0]  # (T, H)
        # (a shared prefix's last position is followed by one row's rest: each row's own next
        # token is read from its padded row)
        hidden, targets = hidden[where], input_ids[:, 1:][at]  # (R, H), (R,)
    if idle is not None:
        hidden = hidden + idle
    return lm_head_logprobs(hidden, head.weight, targets,
                            temperature=temperature, with_entropy=with_entropy,
                            with_sum_pi_squared=with_sum_pi_squared)  # (R,) each


def attach_forward(model) -> None:
    """Make ``response_logprobs`` a forward method of an FSDP-sharded ``model``: FSDP gathers
    the root's parameters (embeddings, final norm, LM head) around it, as around ``forward``."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    setattr(model, FORWARD, types.MethodType(_forward, model))
    register_fsdp_forward_method(model, FORWARD)


@dataclass
class Correction:
    """Per-token loss weights and the mask after rejection, for the batch or a micro-batch."""

    weights: torch.Tensor | None  # (N, W-1) detached, None in bypass mode or is_level = none
    keep: torch.Tensor  # (N, W-1) response mask after rejection rules
    metrics: dict[str, float]


def correction_options(algo: AlgorithmConfig) -> dict:
    """``algorithm.correction`` as the options of ``kernels.rollout_corr.rollout_correction``
    (and of the ``bypass_mode`` loss), verl's ``algorithm.rollout_correction`` names."""
    c = algo.correction
    return dict(rollout_is=None if c.is_level == "none" else c.is_level,
                rollout_is_threshold=c.is_cap if c.is_low is None else (c.is_low, c.is_cap),
                rollout_is_batch_normalize=c.normalize_weights,
                rollout_rs=c.rejection_rules() or None)


def correction(algo: AlgorithmConfig, old: torch.Tensor, behav: torch.Tensor,
               mask: torch.Tensor) -> Correction:
    """The correction of π_old against μ from proximal and behaviour log-probs (N, W-1): verl's
    pipeline, ``kernels.rollout_corr.rollout_correction``, which computes the IS weights, the
    rejection and the ``rollout_corr/`` metrics each on the original response ``mask`` (so
    sequence-level weights count every response token of a sequence, rejected or not); the
    loss uses ``keep`` as its mask and ``weights`` as per-token weights.

    In bypass mode there is no π_old: nothing is weighted or rejected here (the ``bypass_mode``
    loss corrects π_θ against μ itself).
    """
    if algo.correction.mode == "bypass":
        return Correction(None, mask, {})
    out = rollout_correction(old, behav, mask, **correction_options(algo))
    return Correction(out.weights, out.keep, out.metrics)


def loss_options(algo: AlgorithmConfig) -> dict:
    """What the learner adds to the options of ``algorithm.policy_loss``'s row (which the
    kernel hands its loss itself): a loss that corrects π_θ against μ itself (bypass_mode)
    takes the correction's."""
    if algo.policy_loss.takes_correction:
        return dict(loss_type=algo.correction.loss_type, **correction_options(algo))
    return {}


def micro_batch_loss(
    algo: AlgorithmConfig,
    lp: torch.Tensor,  # (B, W-1) with grad
    entropy: torch.Tensor,  # (B, W-1) with grad
    batch: RolloutBatch,
    advantages: torch.Tensor,  # (B, W-1)
    old: torch.Tensor,  # (B, W-1) PPO old log-probs
    corr: Correction,
    ref: torch.Tensor | None,  # (B, W-1) reference log-probs when a KL loss is used
    *,
    token_count: float,
    seq_count: int,
    norm_constant: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """pg_loss + kl_loss_coef·kl_loss − entropy_coeff·entropy, aggregated over the mini-batch."""
    counts = dict(token_count=token_count, seq_count=seq_count, norm_constant=norm_constant)
    mask = corr.keep
    loss, raw = policy_loss(
        algo.policy_loss, lp, old, advantages, mask, clip_low=algo.clip_ratio_low,
        clip_high=algo.clip_ratio_high, dual_clip=algo.clip_ratio_c or None, weights=corr.weights,
        loss_agg_mode=algo.loss_agg_mode, **counts, **loss_options(algo),
    )
    # bypass_mode returns rollout_corr/ metrics of this micro-batch; the trainer reports them
    # once per step, over the whole batch. The metrics stay on the device (float64, as the
    # Python floats they become once per step): reading each here would stop the host for the
    # device at every micro-batch
    metrics = {k: _kept(v) for k, v in raw.items() if not k.startswith("rollout_corr/")}
    metrics["actor/entropy"] = _kept((entropy.detach() * mask).sum() / mask.sum().clamp_min(1))
    if algo.entropy_coeff > 0:
        loss = loss - algo.entropy_coeff * aggregate(entropy, mask, algo.loss_agg_mode, **counts)
    if algo.use_kl_loss:
        assert ref is not None
        kl = kl_estimate(lp, ref, algo.kl_loss_type)  # (B, W-1)
        kl_loss = aggregate(kl, mask, algo.loss_agg_mode, **counts)
        loss = loss + algo.kl_loss_coef * kl_loss
        metrics["actor/kl_loss"] = _kept((kl.detach() * mask).sum() / mask.sum().clamp_min(1))
    return loss, metrics


def _kept(value: torch.Tensor | float) -> torch.Tensor | float:
    """A micro-batch's metric as the step sums it: a detached float64 tensor where the
    device has it (no host sync), a float as it came."""
    return value.detach().double() if isinstance(value, torch.Tensor) else float(value)


def critic_loss(algo: AlgorithmConfig, values: torch.Tensor, old_values: torch.Tensor,
                returns: torch.Tensor, mask: torch.Tensor, *, token_count: float,
                seq_count: int) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    if not isinstance(algo.adv_estimator, Gae):  # the one estimator with a critic
        raise TypeError(f"a critic's loss under adv_estimator {algo.adv_estimator.name!r}, "
                        "which has no critic")
    clip = algo.adv_estimator.cliprange_value
    loss, raw = value_loss(values, old_values, returns, mask, cliprange_value=clip,
                           loss_agg_mode=algo.loss_agg_mode, token_count=token_count,
                           seq_count=seq_count)
    return loss, {k: _kept(v) for k, v in raw.items()}
