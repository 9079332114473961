"""kernels/ against verl 0.9.1's own code, value for value (and gradient for gradient).

Every advantage estimator, policy loss, aggregation mode, KL estimator, KL controller, IS and
rejection option and ``rollout_corr/`` metric of ours is run next to verl's function
(``verl/trainer/ppo/core_algos.py``, ``rollout_corr_helper.py``) on the random batches of
``tests/verl_reference.py`` (several seeds; groups of one; all-equal rewards including 0.3;
empty, one-token and multi-turn rows; log-ratios of ±25), in float64 and again in float32 for
the kernels that compute in float32 when given float32 (all of them). A difference beyond
1e-6 relative (``|ours - verl| <= 1e-6 * max(1, |verl|)``; 1e-5 in float32) fails, except the
deliberate differences below. Per-token outputs are compared on the response tokens (ours are
0 elsewhere, verl's not always), metrics key by key for every key verl returns. Skipped when
verl 0.9.1 cannot be imported; install it with ``pip install --no-deps verl==0.9.1`` and the
``verl-parity`` extra of pyproject.toml. ``pytest -s`` prints how many values were compared
and the largest difference seen.

Deliberate differences (each also in the docstring of the kernel concerned):

1. A group of two or more whose rewards are all equal gets advantages of exactly 0. verl
   computes ``r - mean`` and ``std`` in the input dtype; in float32 six rewards of 0.3 give
   verl's GRPO +0.029 each (1e-8 / (1e-8 + 1e-6)). In float64 verl's value is < 1e-10, within
   tolerance; the float32 comparisons skip such groups and check ours is 0
   (``test_constant_groups_get_exact_zeros``).
2. OPO on a group without a single response token: baseline 0 here, 0/0 = NaN in verl. No
   such group is compared.
3. An empty mask (no response token in the batch) gives NaN / 0.0 metrics and a zero loss
   here, and whitening a single response token gives 0; verl raises (masked_var,
   compute_is_metrics) or returns NaN. Not compared.
4. ``rollout_is_eff_sample_size`` when every IS weight is 0 (IcePop rejecting all): 0 here,
   ZeroDivisionError in verl. Not reached by the batches below.
5. verl's ``vanilla`` always applies the dual clip ``clip_ratio_c`` (default 3.0); ours
   only when ``dual_clip`` is given. Compared with ``dual_clip = clip_ratio_c``.
6. GMPO (``geo_mean``) divides by ``seq_count`` when given (the mini-batch's row count, so
   micro-batch losses add up to the mini-batch's); verl ignores its global batch info and
   always takes the micro-batch's row mean. Compared without ``seq_count``.

Not a difference, by choice: verl's k1 rejection thresholds (``token_k1``,
``seq_sum_k1``, ``seq_mean_k1`` with ``"lower_upper"``) bound ``exp(k1) = 1/rho`` in its code,
while its documentation calls them ratio bounds. Ours follow the code (``parse_rs_preset``) and
are compared with it, asymmetric bands such as ``"0.8_1.5"`` included.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.runtime.config.estimators import ROWS as ESTIMATOR_ROWS
from actors.runtime.config.estimators import Custom as CustomEstimator
from actors.runtime.config.losses import ROWS as LOSS_ROWS
from kernels.advantages import compute_advantages
from kernels.aggregate import AGG_MODES, aggregate
from kernels.kl import KL_KINDS, kl_estimate
from kernels.kl_control import AdaptiveKLController, FixedKLController
from kernels.policy_losses import policy_loss
from kernels.rollout_corr import rollout_correction
from kernels.value_loss import value_loss
from tests.verl_reference import (
    CONSTANT_GROUPS,
    GROUP_SIZE,
    ROWS,
    Recorder,
    load_verl,
    make_batch,
)

VERL = load_verl()
if isinstance(VERL, str):
    pytest.skip(f"verl parity not checked: {VERL}", allow_module_level=True)
CA = VERL.core_algos
RC = VERL.rollout_corr
OmegaConf = pytest.importorskip("omegaconf").OmegaConf  # a verl dependency: present with verl

SEEDS = (0, 1, 2)
DTYPES = (torch.float64, torch.float32)
RECORD = Recorder()


@pytest.fixture(scope="module", autouse=True)
def _summary():
    yield
    print("\n" + RECORD.summary())


def on_mask(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x[mask.bool()]


# Advantage estimators -----------------------------------------------------------------------

# every estimator row verl has (its registry; dr_grpo is its grpo without the std), each run
# against verl's function of it (verl_advantages); a row of a peer's estimator verl lacks has its
# reference formula checked in tests/test_kernels_advantage_estimators.py
ESTIMATORS = tuple(n for n, row in ESTIMATOR_ROWS.items() if row is not CustomEstimator
                   and (n in CA.ADV_ESTIMATOR_REGISTRY or n == "dr_grpo"))
# (estimator, option variant): gamma/lam for the discounted ones, norm for the std-normalised.
VARIANTS = {
    "grpo": ({"norm_adv_by_std": True}, {"norm_adv_by_std": False}),
    "grpo_passk": ({"norm_adv_by_std": True}, {"norm_adv_by_std": False}),
    "gdpo": ({"norm_adv_by_std": True}, {"norm_adv_by_std": False}, {"components": True}),
    "reinforce_plus_plus": ({"gamma": 1.0}, {"gamma": 0.9}),
    "gae": ({"gamma": 1.0, "lam": 1.0}, {"gamma": 0.9, "lam": 0.8}),
    "optimal_token_baseline": ({}, {"is_weights": True}, {"handle_zero_tail": False}),
    "tir_optimal_token_baseline": ({}, {"is_weights": True}, {"handle_zero_tail": False}),
}


def verl_advantages(name: str, b, group_size, opts: dict):
    # verl groups rows by ``index`` (the prompt's uid), any count per uid
    sizes = [group_size] * (ROWS // group_size) if isinstance(group_size, int) else group_size
    index = np.repeat(np.arange(len(sizes)), sizes)
    r, m = b.rewards.clone(), b.mask
    norm = opts.get("norm_adv_by_std", True)
    cfg = OmegaConf.create({"gamma": opts.get("gamma", 1.0), "norm_adv_by_std_in_grpo": norm})
    otb = dict(old_log_probs=b.old, sum_pi_squared=b.sum_pi_squared,
               rollout_is_weights=b.weights if opts.get("is_weights") else None,
               handle_zero_tail=opts.get("handle_zero_tail", True))
    match name:
        case "grpo" | "dr_grpo":
            return CA.compute_grpo_outcome_advantage(
                r, m, index, norm_adv_by_std_in_grpo=norm and name == "grpo")
        case "rloo":
            return CA.compute_rloo_outcome_advantage(r, m, index)
        case "reinforce_plus_plus":
            return CA.compute_reinforce_plus_plus_outcome_advantage(r, m, config=cfg)
        case "reinforce_plus_plus_baseline":
            return CA.compute_reinforce_plus_plus_baseline_outcome_advantage(r, m, index)
        case "remax":
            return CA.compute_remax_outcome_advantage(r, b.reward_baselines, m)
        case "gae":
            return CA.compute_gae_advantage_return(r, b.values, m, opts["gamma"], opts["lam"])
        case "opo":
            return CA.compute_opo_outcome_advantage(r, m, index)
        case "grpo_passk":
            return CA.compute_grpo_passk_outcome_advantage(r, m, index, config=cfg)
        case "gpg":
            return CA.compute_gpg_outcome_advantage(r, m, index)
        case "optimal_token_baseline":
            return CA.compute_optimal_token_baseline_advantage(r, m, index, **otb)
        case "tir_optimal_token_baseline":
            return CA.compute_multi_turn_optimal_token_baseline_advantage(r, m, index, **otb)
        case "gdpo":
            if not opts.get("components"):
                return CA.compute_gdpo_outcome_advantage(r, m, index,
                                                         norm_adv_by_std_in_grpo=norm)
            # verl reads components from non_tensor_batch and puts each on the token at
            # attention_mask's response length - 1 (the last response position).
            last = (torch.arange(m.shape[1]) * m.bool()).amax(-1)
            prompt = torch.ones(ROWS, 3, dtype=torch.long)
            attention = torch.cat([prompt, torch.arange(m.shape[1]) <= last[:, None]], dim=1)
            cfg = OmegaConf.create({"gdpo_reward_keys": ["fmt", "acc"],
                                    "gdpo_reward_weights": [0.5, 2.0]})
            non_tensor = {"fmt": b.components[0].numpy(), "acc": b.components[1].numpy()}
            return CA.compute_gdpo_outcome_advantage(
                r, m, index, config=cfg, non_tensor_batch=non_tensor,
                batch={"prompts": prompt, "attention_mask": attention.long()})
    raise AssertionError(name)


def our_advantages(name: str, b, group_size, opts: dict):
    """Estimator ``name`` through its config row, holding those of the options that are its."""
    row = ESTIMATOR_ROWS[name]
    options = {"norm_adv_by_std_in_grpo": opts.get("norm_adv_by_std", True),
               "gamma": opts.get("gamma", 1.0), "lam": opts.get("lam", 1.0),
               "gdpo_reward_keys": ["a", "b"] if opts.get("components") else ["score"],
               "gdpo_reward_weights": [0.5, 2.0] if opts.get("components") else []}
    kw = dict(group_size=group_size, values=b.values, reward_baselines=b.reward_baselines,
              old_logprobs=b.old, sum_pi_squared=b.sum_pi_squared,
              handle_zero_tail=opts.get("handle_zero_tail", True),
              is_weights=b.weights if opts.get("is_weights") else None)
    if opts.get("components"):
        kw.update(reward_components=b.components.float())
    estimator = row(**{k: v for k, v in options.items() if k in row.__struct_fields__})
    return compute_advantages(estimator, b.rewards, b.mask, **kw)


def _advantage_cases():
    for name in ESTIMATORS:
        for opts in VARIANTS.get(name, ({},)):
            for group_size in (GROUP_SIZE, 1):
                if name == "grpo_passk" and group_size == 1:
                    continue  # both raise: pass@k needs two samples per group
                yield pytest.param(name, opts, group_size, id=f"{name}-{opts}-n{group_size}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("name", "opts", "group_size"), list(_advantage_cases()))
def test_advantages(name, opts, group_size, dtype):
    # Deliberate difference 1: in float32 a group of six 0.3 rewards gets 0 here and +0.029 in
    # verl, and whitening estimators spread that over the batch; float32 uses 0.25 instead.
    constant = 0.3 if dtype == torch.float64 else 0.25
    for seed in SEEDS:
        b = make_batch(seed, dtype, constant)
        adv, ret = our_advantages(name, b, group_size, opts)
        v_adv, v_ret = verl_advantages(name, b, group_size, opts)
        keep = b.mask.bool()
        if opts.get("components"):
            dtype = torch.float32  # verl builds gdpo components in float32 whatever the input
        RECORD.check(f"{name} {opts} n={group_size} advantages", adv[keep], v_adv[keep], dtype)
        RECORD.check(f"{name} {opts} n={group_size} returns", ret[keep], v_ret[keep], dtype)


# Groups of unequal size (an endpoint episode that branched yields one more sample in its group):
# verl's estimators group by ``index`` with any count per uid (core_algos.py of verl 0.9.1:
# ``compute_grpo_outcome_advantage`` builds ``id2score[index[i]]`` and takes each uid's mean and
# std over however many rows it has; rloo, opo, grpo_passk and the optimal token baselines
# likewise). Ours take one size per group (``kernels/advantages/unequal.py``).
UNEQUAL = [3, 1, 7, 6, 2, 8, 4, 5]  # 36 rows: a group of one, groups of 2..8
UNEQUAL_2 = [3, 2, 7, 6, 2, 8, 4, 4]  # grpo_passk: two samples or more per group


def _unequal_cases():
    for name in ESTIMATORS:
        if ESTIMATOR_ROWS[name].unequal_groups:
            for opts in VARIANTS.get(name, ({},)):
                yield pytest.param(name, opts, id=f"{name}-{opts}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("name", "opts"), list(_unequal_cases()))
def test_advantages_unequal_groups(name, opts, dtype):
    sizes = UNEQUAL_2 if name == "grpo_passk" else UNEQUAL
    assert sum(sizes) == ROWS
    for seed in SEEDS:
        b = make_batch(seed, dtype, 0.3 if dtype == torch.float64 else 0.25)
        adv, ret = our_advantages(name, b, sizes, opts)
        v_adv, v_ret = verl_advantages(name, b, sizes, opts)
        keep = b.mask.bool()
        RECORD.check(f"{name} {opts} sizes={sizes} advantages", adv[keep], v_adv[keep], dtype)
        RECORD.check(f"{name} {opts} sizes={sizes} returns", ret[keep], v_ret[keep], dtype)


@pytest.mark.parametrize("name", ["reinforce_plus_plus_baseline", "gdpo", "gpg"])
def test_batch_wide_estimators_refuse_unequal_groups(name):
    b = make_batch(0, torch.float64)
    with pytest.raises(ValueError, match="needs groups of equal size"):
        our_advantages(name, b, UNEQUAL, {})
    adv, _ = our_advantages(name, b, [GROUP_SIZE] * (ROWS // GROUP_SIZE), {})  # equal: as int
    assert torch.equal(adv, our_advantages(name, b, GROUP_SIZE, {})[0])


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline",
                                  "opo", "gpg", "gdpo", "grpo_passk"])
def test_constant_groups_get_exact_zeros(name):
    """Deliberate difference 1: groups 1-4 have one reward value each (0.3, 1.0, 0 or 1, 0.0);
    six rewards of 0.3 in float32 are where verl's GRPO gives +0.029."""
    for dtype in DTYPES:
        b = make_batch(0, dtype)
        adv, _ = our_advantages(name, b, GROUP_SIZE, {})
        for group in range(1, 5):
            rows = slice(group * GROUP_SIZE, (group + 1) * GROUP_SIZE)
            if name in ("reinforce_plus_plus_baseline", "gdpo"):
                # whitened afterwards: the constant groups all get the same value
                assert torch.unique(adv[CONSTANT_GROUPS][b.mask[CONSTANT_GROUPS].bool()]).numel() == 1
            else:
                assert torch.all(adv[rows] == 0), (name, dtype, group)
    b = make_batch(0, torch.float32)
    v_adv, _ = verl_advantages("grpo", b, GROUP_SIZE, {})
    got = v_adv[GROUP_SIZE:2 * GROUP_SIZE][b.mask[GROUP_SIZE:2 * GROUP_SIZE].bool()]
    assert got.min() > 0.02, got  # verl's +0.029 on the group of 0.3


# Policy losses ------------------------------------------------------------------------------

# (name, our options, verl options, clip_low, clip_high)
LOSSES = [
    ("vanilla", {}, {}, 0.2, 0.28),
    ("gspo", {}, {}, 3e-4, 4e-4),
    ("gpg", {}, {}, 0.2, 0.2),
    ("cispo", {}, {}, 0.2, 0.28),
    ("sapo", {}, {}, 0.2, 0.2),
    ("sapo", {"tau_pos": 2.0, "tau_neg": 3.0}, {"tau_pos": 2.0, "tau_neg": 3.0}, 0.2, 0.2),
    ("geo_mean", {}, {}, 0.4, 0.4),
    ("clip_cov", {}, {}, 0.2, 0.28),
    ("clip_cov", {"clip_cov_ratio": 0.05, "clip_cov_lb": 0.2, "clip_cov_ub": 3.0},
     {"clip_cov_ratio": 0.05, "clip_cov_lb": 0.2, "clip_cov_ub": 3.0}, 0.2, 0.2),
    ("kl_cov", {}, {}, 0.2, 0.2),
    ("kl_cov", {"kl_cov_ratio": 0.05, "ppo_kl_coef": 1.0},
     {"kl_cov_ratio": 0.05, "ppo_kl_coef": 1.0}, 0.2, 0.2),
    ("dppo_tv", {}, {}, 0.2, 0.28),
    ("dppo_kl", {}, {}, 0.05, 0.1),
    ("dro", {"dro_beta": 0.1}, {"dro_beta": 0.1}, 0.2, 0.2),
]
BYPASS = [
    {"loss_type": "ppo_clip"},
    {"loss_type": "reinforce"},
    {"loss_type": "reinforce", "rollout_is": "token"},
    {"loss_type": "reinforce", "rollout_is": "sequence", "rollout_is_threshold": "0.5_5.0",
     "rollout_is_batch_normalize": True},
    {"loss_type": "ppo_clip", "rollout_is": "token", "rollout_rs": "token_k1,seq_max_k3",
     "rollout_rs_threshold": "0.5_2.0,1.0"},
    {"loss_type": "reinforce", "rollout_is": "token", "rollout_rs": "seq_mean_k2",
     "rollout_rs_threshold": 0.5},
]
CLIP_C = 3.0


def verl_actor_config(clip_low, clip_high, *, clip_c=CLIP_C, batch_info=None, tau=None,
                      **policy_loss_options):
    rollout_correction = policy_loss_options.pop("rollout_correction", None)
    if rollout_correction is not None:
        policy_loss_options["rollout_correction"] = VERL.RolloutCorrectionConfig(
            **rollout_correction)
    return VERL.ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=clip_low,
        clip_ratio_low=clip_low, clip_ratio_high=clip_high, clip_ratio_c=clip_c,
        **(tau or {}), policy_loss=VERL.PolicyLossConfig(**policy_loss_options),
        global_batch_info=batch_info or {},
    )


def _loss_cases():
    counted = {"token_count": 97, "seq_count": 21, "norm_constant": 16.0}
    for name, ours, theirs, low, high in LOSSES:
        modes = {"geo_mean": ["token-mean"]}.get(name, AGG_MODES)
        for mode in modes:
            for counts in ({}, counted) if name != "geo_mean" else ({},):  # difference 6
                for weighted in (False, True):
                    yield pytest.param(name, ours, theirs, low, high, mode, counts, weighted,
                                       id=f"{name}-{ours}-{mode}-{bool(counts)}-w{weighted}")
    for opts in BYPASS:
        for mode in ("token-mean", "seq-mean-token-sum"):
            # rollout_is: verl's yaml default is null (its dataclass says "sequence")
            theirs = {"rollout_correction": {"rollout_is": None, **opts}}
            yield pytest.param("bypass_mode", opts, theirs, 0.2, 0.28,
                               mode, {}, False, id=f"bypass-{opts}-{mode}")


def _loss_row(name: str, ours: dict):
    """Loss ``name``'s config row holding those of ``ours`` that are its fields, and the rest:
    the options the learner adds itself (bypass_mode's, the correction's)."""
    row = LOSS_ROWS[name]
    fields = {k: v for k, v in ours.items() if k in row.__struct_fields__}
    return row(**fields), {k: v for k, v in ours.items() if k not in fields}


def _verl_batch_info(counts: dict) -> dict:
    if not counts:
        return {}
    return {"dp_size": 1, "batch_num_tokens": counts["token_count"],
            "global_batch_size": counts["seq_count"], "loss_scale_factor": counts["norm_constant"]}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("name", "ours", "theirs", "low", "high", "mode", "counts", "weighted"),
                         list(_loss_cases()))
def test_policy_losses(name, ours, theirs, low, high, mode, counts, weighted, dtype):
    theirs = dict(theirs)
    tau = {k: theirs.pop(k) for k in ("tau_pos", "tau_neg") if k in theirs}
    cfg = verl_actor_config(low, high, batch_info=_verl_batch_info(counts), tau=tau, **theirs)
    verl_fn = CA.get_policy_loss_fn(name)
    for seed in SEEDS:
        b = make_batch(seed, dtype)
        adv = b.seq_advantages if name == "geo_mean" else b.advantages
        weights = b.weights if weighted else None
        lp_v = b.lp.clone().requires_grad_()
        torch.manual_seed(seed)  # clip_cov draws its tokens from the global generator
        v_loss, v_metrics = verl_fn(b.old, lp_v, adv, b.mask, mode, cfg, weights)
        v_loss.backward()
        lp_o = b.lp.clone().requires_grad_()
        torch.manual_seed(seed)
        row, own = _loss_row(name, ours)
        o_loss, o_metrics = policy_loss(row, lp_o, b.old, adv, b.mask, clip_low=low,
                                        clip_high=high, dual_clip=CLIP_C, weights=weights,
                                        loss_agg_mode=mode, **counts, **own)
        o_loss.backward()
        what = f"{name} {ours} {mode} {counts} w={weighted}"
        RECORD.check(f"{what} loss", o_loss, v_loss, dtype)
        RECORD.check(f"{what} grad", lp_o.grad, lp_v.grad, dtype)
        assert set(v_metrics) <= set(o_metrics), set(v_metrics) - set(o_metrics)
        for key, value in v_metrics.items():
            RECORD.check(f"{what} {key}", o_metrics[key], value, dtype)


def test_dppo_ratio_cap_default_is_verls_fallback():
    """dual_clip None gives verl's clip_ratio_c fallback of 20 (its actor config sets 3.0)."""
    b = make_batch(0, torch.float64)
    for name in ("dppo_tv", "dppo_kl"):
        cfg = verl_actor_config(0.2, 0.2, clip_c=20.0)
        lp_v = b.lp.clone().requires_grad_()
        v_loss, _ = CA.get_policy_loss_fn(name)(b.old, lp_v, b.advantages, b.mask,
                                                "token-mean", cfg, None)
        o_loss, _ = policy_loss(LOSS_ROWS[name](), b.lp, b.old, b.advantages, b.mask, clip_low=0.2,
                                clip_high=0.2, loss_agg_mode="token-mean")
        RECORD.check(f"{name} cap 20 loss", o_loss, v_loss, torch.float64)


# Aggregation, value loss, KL ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregation(mode, dtype):
    for seed in SEEDS:
        b = make_batch(seed, dtype)
        for counts in ({}, {"token_count": 97, "seq_count": 21, "norm_constant": 16.0}):
            x_o = b.advantages.clone().requires_grad_()
            x_v = b.advantages.clone().requires_grad_()
            ours = aggregate(x_o, b.mask, mode, **counts)
            theirs = CA.agg_loss(x_v, b.mask, mode, **_verl_batch_info(counts))
            ours.backward()
            theirs.backward()
            RECORD.check(f"agg {mode} {counts}", ours, theirs, dtype)
            RECORD.check(f"agg {mode} {counts} grad", x_o.grad, x_v.grad, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_value_loss(mode, dtype):
    for seed in SEEDS:
        b = make_batch(seed, dtype)
        for clip in (0.5, 0.1):
            v_o = b.values.clone().requires_grad_()
            v_v = b.values.clone().requires_grad_()
            ours, metrics = value_loss(v_o, b.old_values, b.returns, b.mask,
                                       cliprange_value=clip, loss_agg_mode=mode)
            theirs, clipfrac = CA.compute_value_loss(v_v, b.returns, b.old_values, b.mask,
                                                     clip, loss_agg_mode=mode)
            ours.backward()
            theirs.backward()
            RECORD.check(f"value loss {mode} {clip}", ours, theirs, dtype)
            RECORD.check(f"value loss {mode} {clip} grad", v_o.grad, v_v.grad, dtype)
            RECORD.check(f"vf_clipfrac {clip}", metrics["critic/vf_clipfrac"], clipfrac, dtype)
    # Nothing clipped, nothing counted (old + clamp(v - old) != v bitwise)
    b = make_batch(0, torch.float32)
    _, metrics = value_loss(b.values, b.values + 1e-3, b.returns, b.mask, cliprange_value=0.5)
    assert metrics["critic/vf_clipfrac"].item() == 0.0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KL_KINDS)
def test_kl_estimators(kind, dtype):
    for seed in SEEDS:
        b = make_batch(seed, dtype)
        ref = b.behav  # has the ±25 outliers against b.old
        lp_o = b.old.clone().requires_grad_()
        lp_v = b.old.clone().requires_grad_()
        ours = kl_estimate(lp_o, ref, kind)
        theirs = CA.kl_penalty(lp_v, ref, kind)
        (ours * b.mask).sum().backward()
        (theirs * b.mask).sum().backward()
        RECORD.check(f"kl {kind}", on_mask(ours, b.mask), on_mask(theirs, b.mask), dtype)
        RECORD.check(f"kl {kind} grad", lp_o.grad, lp_v.grad, dtype)


def test_kl_controllers():
    kls = [0.0, 0.05, 0.5, 3.0, 0.01, 0.2, 0.11]
    pairs = [(FixedKLController(0.05), CA.FixedKLController(0.05)),
             (AdaptiveKLController(0.05, 0.1, 1000), CA.AdaptiveKLController(0.05, 0.1, 1000)),
             (AdaptiveKLController(0.3, 0.02, 7), CA.AdaptiveKLController(0.3, 0.02, 7))]
    for ours, theirs in pairs:
        for step, kl in enumerate(kls):
            ours.update(kl, n_steps=64 + step)
            theirs.update(kl, n_steps=64 + step)
            RECORD.check("kl controller", ours.value, float(theirs.value), torch.float64)


# Rollout correction: IS weights, rejection, metrics -----------------------------------------

IS_OPTIONS = [
    {"rollout_is": level, "rollout_is_threshold": threshold, "rollout_is_batch_normalize": norm}
    for level in ("token", "sequence")
    for threshold in (2.0, 5.0, "0.5_5.0", "0.8_1.25")
    for norm in (False, True)
]
RS_OPTIONS = [
    ("token_k1", "0.5_2.0"), ("token_k1", "0.8_1.5"), ("token_k1", 1.5), ("token_k2", 0.5),
    ("token_k3", 0.3), ("seq_sum_k1", "0.5_2.0"), ("seq_sum_k1", "0.1_3.0"), ("seq_sum_k2", 2.0),
    ("seq_sum_k3", 2.0), ("seq_mean_k1", "0.9_1.1"), ("seq_mean_k2", 0.05),
    ("seq_mean_k3", 0.05), ("seq_max_k2", 1.0), ("seq_max_k3", 1.0),
    ("token_k1,seq_max_k3,seq_mean_k1", "0.5_2.0,1.0,0.8_1.25"),
]
CORRECTIONS = (
    [pytest.param(opts, id=str(opts)) for opts in IS_OPTIONS]
    + [pytest.param({"rollout_rs": rs, "rollout_rs_threshold": th}, id=f"{rs}-{th}")
       for rs, th in RS_OPTIONS]
    + [pytest.param({"rollout_is": "sequence", "rollout_rs": "seq_sum_k3",
                     "rollout_rs_threshold": 1.0}, id="is+rs"),
       pytest.param({}, id="metrics-only")]
)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("opts", CORRECTIONS)
def test_rollout_correction(opts, dtype):
    for seed in SEEDS:
        b = make_batch(seed, dtype)
        ours = rollout_correction(b.old, b.behav, b.mask, **opts)
        proto, v_keep, v_metrics = RC.compute_rollout_correction_and_rejection_mask(
            b.old, b.behav, b.mask, rollout_is=opts.get("rollout_is"),
            rollout_is_threshold=opts.get("rollout_is_threshold", 2.0),
            rollout_is_batch_normalize=opts.get("rollout_is_batch_normalize", False),
            rollout_rs=opts.get("rollout_rs"),
            rollout_rs_threshold=opts.get("rollout_rs_threshold"))
        what = f"rollout_corr {opts}"
        if proto is None:
            assert ours.weights is None
        else:
            v_weights = proto.batch["rollout_is_weights"]
            RECORD.check(f"{what} weights", on_mask(ours.weights, b.mask),
                         on_mask(v_weights, b.mask), dtype)
        assert torch.equal(ours.keep, v_keep), what
        extra = set(ours.metrics) - set(v_metrics)
        assert extra <= {"rollout_corr/is_clip_frac"}, extra
        assert set(v_metrics) <= set(ours.metrics), set(v_metrics) - set(ours.metrics)
        for key, value in v_metrics.items():
            RECORD.check(f"{what} {key}", ours.metrics[key], value, dtype)
