"""
ScaleRL's losses (arXiv 2510.13786): CISPO (section 4), the GRPO, DAPO and GSPO ablations, advantage
normalization, aggregation and filtering (section 3.2). Start at LOSSES and policy_loss.
rho = exp(logp - gen_logp), gen_logp as the generator recorded it; stds are population stds.
"""
import math

import torch

NORMS = ("batch", "prompt", "none")
AGGS = ("prompt", "sample", "token")
# clipped losses clamp log rho here: far above log(1 + eps_high), below exp overflow
MAX_LOG_RATIO = 20.0


def group_index(group):
    """Prompt ids (N,) -> dense ids 0..G-1 (N,), G."""
    uniq, idx = torch.unique(group, return_inverse=True)
    return idx, len(uniq)


def group_sum(x, idx, n_groups):
    """Per-group sums of x (N,) -> (G,)."""
    return x.new_zeros(n_groups).index_add(0, idx, x)


def advantages(rewards, group, norm="batch", all_sum=None):
    """A_i = r_i - mean of i's group, normalized per `norm`; all_sum sums over every trainer."""
    if norm not in NORMS:
        raise ValueError(f"unknown norm {norm!r}; allowed: {', '.join(NORMS)}")
    idx, n_groups = group_index(group)
    count = group_sum(torch.ones_like(rewards), idx, n_groups)  # (G,)
    mean = group_sum(rewards, idx, n_groups) / count  # (G,)
    adv = rewards - mean[idx]  # (N,)
    if norm == "batch" and all_sum is None:  # ScaleRL: std of every A in the batch
        return adv / (adv.std(correction=0) + 1e-6) if adv.numel() else adv
    if norm == "batch":
        s = all_sum({"n": adv.numel(), "a": adv.sum().item(), "a2": (adv**2).sum().item()})
        return (adv / (math.sqrt(max(s["a2"] / s["n"] - (s["a"] / s["n"]) ** 2, 0.0)) + 1e-6)
                if s["n"] else adv)
    if norm == "prompt":  # GRPO
        std = (group_sum(adv**2, idx, n_groups) / count).sqrt()  # (G,)
        return adv / (std[idx] + 1e-6)
    return adv  # Dr. GRPO


def clipped_objective(ratio, adv, eps_low, eps_high):
    """PPO: min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A)."""
    return torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)


def aggregate(obj, keep, group, agg):
    """Average obj (N, T) over the kept tokens per `agg`."""
    token_sum = torch.where(keep, obj, 0.0).sum(1)  # (N,)
    token_count = keep.sum(1).to(obj.dtype)  # (N,)
    if agg == "token":
        return token_sum.sum() / token_count.sum().clamp(min=1)
    if agg == "sample":
        return (token_sum / token_count.clamp(min=1)).mean()
    idx, n_groups = group_index(group)
    group_token_sum = group_sum(token_sum, idx, n_groups)  # (G,)
    group_token_count = group_sum(token_count, idx, n_groups)  # (G,)
    return (group_token_sum / group_token_count.clamp(min=1)).mean()


def cispo_objective(log_ratio, logp, adv, keep, eps_low, eps_high, neg_trust=None):
    """CISPO: sg(clamp(rho, eps_low, eps_high)) A logp; neg_trust masks rho < neg_trust, A < 0."""
    ratio = log_ratio.exp()
    weight = ratio.clamp(min=eps_low, max=eps_high).detach()  # (N, T) sg(min(rho, cap))
    obj = weight * adv * logp  # (N, T)
    if neg_trust is None:
        return obj
    return torch.where((adv < 0) & (ratio < neg_trust), 0.0, obj)


def token_clipped_objective(log_ratio, logp, adv, keep, eps_low, eps_high, neg_trust=None):
    """GRPO / DAPO: clipped per token."""
    # (N, T)
    return clipped_objective(log_ratio.clamp(max=MAX_LOG_RATIO).exp(), adv, eps_low, eps_high)


def gspo_objective(log_ratio, logp, adv, keep, eps_low, eps_high, neg_trust=None):
    """GSPO: clipped length-normalized sequence ratio, on each token."""
    seq_log_ratio = log_ratio.sum(1) / keep.sum(1).clamp(min=1)  # (N,)
    seq_ratio = seq_log_ratio.clamp(max=MAX_LOG_RATIO).exp()[:, None]  # (N, 1)
    return clipped_objective(seq_ratio, adv, eps_low, eps_high).expand_as(logp)  # (N, T)


# name -> (per-token objective, default (eps_low, eps_high), rho cap). A new loss is one entry.
LOSSES = {
    "cispo": (cispo_objective, (None, 4.0), lambda eps_high: eps_high),  # absolute ratio bounds
    "grpo": (token_clipped_objective, (0.2, 0.2), lambda eps_high: 1 + eps_high),
    "dapo": (token_clipped_objective, (0.2, 0.28), lambda eps_high: 1 + eps_high),
    # per sequence, logged per token
    "gspo": (gspo_objective, (3e-3, 4e-3), lambda eps_high: 1 + eps_high),
}
EPS_DEFAULTS = {kind: eps for kind, (_, eps, _) in LOSSES.items()}
OBJECTIVES = {kind: objective for kind, (objective, _, _) in LOSSES.items()}  # train.train_step


def clip_eps(kind, eps_low=None, eps_high=None):
    """(eps_low, eps_high): the flags', else the kind's defaults."""
    default_low, default_high = EPS_DEFAULTS[kind]
    return ((default_low if eps_low is None else eps_low),
            (default_high if eps_high is None else eps_high))


def policy_loss(logp, gen_logp, adv, mask, group, kind="cispo", agg="prompt",
                eps_low=None, eps_high=None, weights=None, neg_trust=None):
    """Scalar loss to minimize; weights: row_weights, these rows being part of a batch."""
    if kind not in LOSSES:
        raise ValueError(f"unknown kind {kind!r}; allowed: {', '.join(LOSSES)}")
    if agg not in AGGS:
        raise ValueError(f"unknown agg {agg!r}; allowed: {', '.join(AGGS)}")
    eps_low, eps_high = clip_eps(kind, eps_low, eps_high)
    keep = mask.bool()  # (N, T)
    log_ratio = torch.where(keep, logp - gen_logp.detach(), 0.0)  # (N, T)
    obj = LOSSES[kind][0](log_ratio, logp, adv.detach()[:, None], keep, eps_low, eps_high,
                          neg_trust)
    if weights is not None:
        return -(torch.where(keep, obj, 0.0).sum(1) * weights).sum()
    return -aggregate(obj, keep, group, agg)


def agg_counts(group, mask):
    """What each aggregation divides by."""
    return {"prompt": len(torch.unique(group)), "sample": len(group),
            "token": int(mask.bool().sum())}


def row_weights(group, tokens, agg, totals):
    """Each row's weight in the batch's loss (totals: agg_counts): prompt 1 / (groups x group
    tokens), sample 1 / (sequences x tokens), token 1 / tokens. Splits then sum to the batch."""
    tokens = tokens.to(torch.float64)
    if agg == "token":
        return torch.full_like(tokens, 1.0 / max(totals["token"], 1))
    if agg == "sample":
        return 1.0 / (totals["sample"] * tokens.clamp(min=1))
    idx, n_groups = group_index(group)
    return 1.0 / (totals["prompt"] * group_sum(tokens, idx, n_groups)[idx].clamp(min=1))


def zero_variance_keep(rewards, group, valid=None):
    """Valid (untruncated, A.15) samples whose group's rewards differ (section 3.2)."""
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid
    idx, n_groups = group_index(group)
    lo = rewards.new_full((n_groups,), math.inf).scatter_reduce(
        0, idx[valid], rewards[valid], "amin")
    hi = rewards.new_full((n_groups,), -math.inf).scatter_reduce(
        0, idx[valid], rewards[valid], "amax")
    return valid & (hi > lo)[idx]


def length_penalty(lengths, l_max=14336, l_cache=2048):
    """clip((l_max - len) / l_cache - 1, -1, 0)."""
    return ((l_max - lengths) / l_cache - 1).clamp(-1, 0)


@torch.no_grad()
def ratio_stats(logp, gen_logp, mask, kind="cispo", eps_high=None):
    """Mean and max |log rho|, and the share of tokens capped or clipped."""
    diff = (logp - gen_logp)[mask.bool()]  # (K,)
    if diff.numel() == 0:
        return {"abs_diff_mean": 0.0, "abs_diff_max": 0.0, "frac_above_cap": 0.0}
    cap = LOSSES[kind][2](clip_eps(kind, None, eps_high)[1])
    return {
        "abs_diff_mean": diff.abs().mean().item(),
        "abs_diff_max": diff.abs().max().item(),
        "frac_above_cap": (diff > math.log(cap)).float().mean().item(),
    }


@torch.no_grad()
def drift_by_lag(logp, gen_logp, mask, lag):
    """Sum and count of |log rho| per policy-version lag."""
    keep = mask.bool()
    lag = lag[keep]
    diff = (logp - gen_logp)[keep].abs().double()
    size = int(lag.max()) + 1 if lag.numel() else 1
    return torch.bincount(lag, weights=diff, minlength=size), torch.bincount(lag, minlength=size)


@torch.no_grad()
def forgetting(logp, gen_logp, mask, sure=0.9):
    """Sum and count of max(0, log p_gen - log p_train) over tokens sampled with p >= sure."""
    keep = mask.bool() & (gen_logp >= math.log(sure))
    return (gen_logp - logp)[keep].clamp(min=0).double().sum(), keep.sum()
