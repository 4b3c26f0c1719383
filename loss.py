"""
Policy-gradient losses for RL with verifiable rewards: ScaleRL's CISPO and the GRPO, DAPO and GSPO
ablations, with their advantage normalizations, loss aggregations and batch hygiene. Implements the
losses of arXiv 2510.13786, section 3.2 (loss type, aggregation, normalization, filtering) and CISPO
as ScaleRL uses it (section 4). Pure functions of tensors.

    advantages(rewards, group, norm)          A_i = r_i - mean_{j in group(i)} r_j, then normalized
                                              (norm "batch": over every trainer's rows,
                                              given all_sum)
    policy_loss(logp, gen_logp, adv, mask, group, kind, agg)
                                              scalar to MINIMIZE (kind: a LOSSES entry)
    agg_counts(group, mask)                   what each aggregation divides by, for a set of rows
    row_weights(group, tokens, agg, totals)   each row's weight in the whole batch's loss: any
                                              split into micro-batches and trainers adds up to it
    zero_variance_keep(rewards, group, valid) drop prompts whose rewards are all equal, and
                                              truncated samples
    length_penalty(lengths)                   clip((L_max - |y|) / L_cache - 1, -1, 0)
    ratio_stats(logp, gen_logp, mask)         generator/trainer mismatch, for logging
    drift_by_lag(logp, gen_logp, mask, lag)   sum and count of |log rho| per policy-version lag,
                                              for logging
    forgetting(logp, gen_logp, mask)          how much log-prob the trained policy lost on the
                                              tokens its sampler was sure of, for the alarms

Test: python -m pytest -q test_all.py -k loss   (CPU; nothing here needs a GPU or torchrun)

Readings chosen and departures from the textbook formulas:
- rho = exp(logp - gen_logp): the denominator is the log-prob the generator recorded when it
  sampled the token, not a recompute on the trainer. gen_logp and adv are treated as constants.
- Every std is the population std (divide by n, correction=0). norm="batch" divides by the std
  of all A in the batch + 1e-6 (the paper writes no eps; it guards an all-zero batch);
  norm="prompt" divides by the group's std of r + 1e-6, so an all-equal group gets A = 0.
- CISPO: sg(clamp(rho, eps_low, eps_high)) * A * logp. For cispo the eps are ABSOLUTE bounds
  on the ratio, not 1 -/+ eps: eps_high defaults to 4 (the cap eps_max), and there is no lower
  truncation unless eps_low is given. A toy departure, train.py --neg_trust (the toy
  recipe's 0.5; real-model recipes' 0 = the paper's CISPO): CISPO's token mask M (MiniMax-M1) set as PPO clips a negative advantage, so a
  token of a sample with A < 0 whose ratio rho has fallen below neg_trust gives no gradient. A
  token shared by right and wrong samples (the answer format after </think>) gets pushes that
  cancel; a policy k versions ahead of its samples can drift off it through other weights, unseen,
  and the negative samples' push down on it then no longer cancels the positive ones' push up.
  Masked, they stop pushing once it has fallen, and the positive ones pull it back
  (BENCHMARKS.md section 6: the collapse it stops). In one process rho is 1 and nothing is
  masked. GRPO, DAPO, GSPO clip to [1 - eps_low, 1 + eps_high]:
  GRPO 0.2/0.2, DAPO 0.2/0.28, GSPO 3e-3/4e-3. None for an eps means that per-kind default.
- GRPO, DAPO, GSPO: the log-ratio is clamped at MAX_LOG_RATIO = 20 before exp (float32 exp overflows
  to inf above ~88.7, which made the gradient NaN, and the loss NaN where A = 0). Only a token
  (GSPO: a sequence) with rho > e^20 = 4.9e8 changes, far past the clip bound 1 + eps_high: for
  A > 0 its term was already the constant (1 + eps_high) A; for A < 0, where the min keeps the
  unbounded rho A, it is held at e^20 A with no gradient. CISPO needs no clamp: its weight is
  clamped and detached (inf becomes the cap).
- GSPO: s_i = exp(masked mean over t of (logp - gen_logp)) (GSPO's length-normalized ratio).
  Each sequence's objective min(s A, clip(s) A) is copied onto its masked tokens and then
  aggregated like the token-level kinds, so agg="sample" is exactly the GSPO paper's mean over
  sequences; agg="token" / "prompt" weight sequences by their token counts.
- Aggregation: "token" = sum over batch tokens / batch token count; "sample" = mean over
  sequences of each sequence's token mean; "prompt" (ScaleRL, DAPO) = per prompt group, the sum
  of its token terms / its token count, then mean over groups. A sequence or group with no
  masked tokens contributes 0 but still counts in the mean (no NaN).
- Masks: a float mask is read as 0/1 (nonzero = the token counts). Tokens outside the mask are
  zeroed before exp and before summing, so padding values (even -inf) never give NaN/inf.
- Truncated samples (hit the hard budget without eos; an interrupted sample that then answers is not
  truncated) leave the batch, paper A.15: the effective batch is the batch "after excluding
  truncated samples". zero_variance_keep(..., valid=~truncated) drops them, so they get no gradient
  and are out of every statistic: a group's mean reward and its zero-variance test use its
  untruncated samples only, the batch std is over the samples that remain, and a group left with
  fewer than two samples, or whose untruncated samples all agree, is dropped whole. train.py
  --keep_truncated keeps them (the old behaviour).
- No KL term (the paper uses none). The length penalty is returned, not applied: the caller
  adds it to correct answers only.
"""
import math

import torch

NORMS = ("batch", "prompt", "none")
AGGS = ("prompt", "sample", "token")
# clipped losses: log rho clamped here before exp; far above log(1 + eps_high), below overflow
MAX_LOG_RATIO = 20.0


def group_index(group):
    """Arbitrary prompt ids (N,) -> dense ids 0..G-1 (N,) and the number of groups G."""
    uniq, idx = torch.unique(group, return_inverse=True)
    return idx, len(uniq)


def group_sum(x, idx, n_groups):
    """Sum the rows of x (N,) that share a dense group id -> (G,)."""
    return x.new_zeros(n_groups).index_add(0, idx, x)


def advantages(rewards, group, norm="batch", all_sum=None):
    """A_i = r_i - mean of r over i's group, normalized per `norm` (batch | prompt | none). all_sum:
    for "batch" when these rows are one trainer's part of the batch, a function that sums a dict of
    numbers over every trainer (so the std is the whole batch's); default: these rows are the whole
    batch."""
    if norm not in NORMS:
        raise ValueError(f"unknown norm {norm!r}; allowed: {', '.join(NORMS)}")
    idx, n_groups = group_index(group)
    count = group_sum(torch.ones_like(rewards), idx, n_groups)  # (G,)
    mean = group_sum(rewards, idx, n_groups) / count  # (G,)
    adv = rewards - mean[idx]  # (N,)
    if norm == "batch" and all_sum is None:  # ScaleRL: population std of every A in the batch
        return adv / (adv.std(correction=0) + 1e-6) if adv.numel() else adv
    if norm == "batch":  # the same std, of every trainer's A, from the sums of all of them
        s = all_sum({"n": adv.numel(), "a": adv.sum().item(), "a2": (adv**2).sum().item()})
        return (adv / (math.sqrt(max(s["a2"] / s["n"] - (s["a"] / s["n"]) ** 2, 0.0)) + 1e-6)
                if s["n"] else adv)
    if norm == "prompt":  # GRPO
        std = (group_sum(adv**2, idx, n_groups) / count).sqrt()  # (G,) population std of r
        return adv / (std[idx] + 1e-6)
    return adv  # Dr. GRPO


def clipped_objective(ratio, adv, eps_low, eps_high):
    """PPO-style min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A); ratio (N, T) or (N, 1)."""
    return torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)


def aggregate(obj, keep, group, agg):
    """Average the per-token objective obj (N, T) over the tokens in keep (N, T) per `agg`."""
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
    """CISPO (ScaleRL): sg(clamp(rho, eps_low, eps_high)) * A * logp per token; the eps are absolute
    bounds. neg_trust: CISPO's token mask M (MiniMax-M1) on the negative side, as PPO clips it: a
    token of a negative-advantage sample whose ratio has already fallen below neg_trust gives no
    gradient (it still counts in the aggregation's denominators)."""
    ratio = log_ratio.exp()
    weight = ratio.clamp(min=eps_low, max=eps_high).detach()  # (N, T) sg(min(rho, cap))
    obj = weight * adv * logp  # (N, T)
    if neg_trust is None:
        return obj
    return torch.where((adv < 0) & (ratio < neg_trust), 0.0, obj)


def token_clipped_objective(log_ratio, logp, adv, keep, eps_low, eps_high, neg_trust=None):
    """GRPO / DAPO: the PPO-clipped objective per token."""
    # (N, T)
    return clipped_objective(log_ratio.clamp(max=MAX_LOG_RATIO).exp(), adv, eps_low, eps_high)


def gspo_objective(log_ratio, logp, adv, keep, eps_low, eps_high, neg_trust=None):
    """GSPO: the clipped objective of the length-normalized sequence ratio, copied onto its
    tokens."""
    seq_log_ratio = log_ratio.sum(1) / keep.sum(1).clamp(min=1)  # (N,)
    seq_ratio = seq_log_ratio.clamp(max=MAX_LOG_RATIO).exp()[:, None]  # (N, 1)
    return clipped_objective(seq_ratio, adv, eps_low, eps_high).expand_as(logp)  # (N, T)


# The losses: name -> (per-token objective, default (eps_low, eps_high), the rho above which a
# token's weight is capped or clipped, from eps_high). A new loss is one objective function and one
# entry here; --loss offers every name.
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
    """The (eps_low, eps_high) a loss kind runs with: the flags' values, or the kind's defaults."""
    default_low, default_high = EPS_DEFAULTS[kind]
    return ((default_low if eps_low is None else eps_low),
            (default_high if eps_high is None else eps_high))


def policy_loss(logp, gen_logp, adv, mask, group, kind="cispo", agg="prompt",
                eps_low=None, eps_high=None, weights=None, neg_trust=None):
    """Scalar loss to minimize: -(aggregated per-token objective). See the module docstring.
    weights (N,): each row's weight in a larger batch's loss (row_weights); these rows are then
    a part of it (a micro-batch, a trainer's share), aggregated as the whole batch is."""
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
    """What each aggregation averages over, for a set of rows: {"prompt": groups, "sample":
    sequences, "token": masked tokens} (train.make_batch sums them over every trainer)."""
    return {"prompt": len(torch.unique(group)), "sample": len(group),
            "token": int(mask.bool().sum())}


def row_weights(group, tokens, agg, totals):
    """The weight of each row's token terms in the whole batch's loss -> (N,) float64, from the
    rows' groups (N,), their masked token counts (N,) and the whole batch's agg_counts `totals`
    (summed over every trainer): prompt 1 / (groups x its group's tokens), sample 1 / (sequences x
    its tokens), token 1 / tokens. Every aggregation is a weighted sum of token terms with one
    weight per row, so the loss of any split of the rows (micro-batches, trainers) is the sum of
    its parts' policy_loss(..., weights=): the gradient equals the unsplit batch's. A group lives on
    one trainer, so these rows hold all of it."""
    tokens = tokens.to(torch.float64)
    if agg == "token":
        return torch.full_like(tokens, 1.0 / max(totals["token"], 1))
    if agg == "sample":
        return 1.0 / (totals["sample"] * tokens.clamp(min=1))
    idx, n_groups = group_index(group)
    return 1.0 / (totals["prompt"] * group_sum(tokens, idx, n_groups)[idx].clamp(min=1))


def zero_variance_keep(rewards, group, valid=None):
    """(N,) bool: True for the valid samples (default: all) whose group's valid samples have
    non-identical rewards; invalid ones (truncated) are False and do not count in their group."""
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid
    idx, n_groups = group_index(group)
    lo = rewards.new_full((n_groups,), math.inf).scatter_reduce(
        0, idx[valid], rewards[valid], "amin")
    hi = rewards.new_full((n_groups,), -math.inf).scatter_reduce(
        0, idx[valid], rewards[valid], "amax")
    return valid & (hi > lo)[idx]


def length_penalty(lengths, l_max=14336, l_cache=2048):
    """clip((l_max - len) / l_cache - 1, -1, 0): 0 up to l_max - l_cache, then linear to -1 at
    l_max."""
    return ((l_max - lengths) / l_cache - 1).clamp(-1, 0)


@torch.no_grad()
def ratio_stats(logp, gen_logp, mask, kind="cispo", eps_high=None):
    """Generator/trainer mismatch over masked tokens: mean and max |logp - gen_logp|, and the
    fraction of tokens whose rho exceeds the loss's upper bound (LOSSES: cispo the cap eps_high, the
    clipped losses 1 + eps_high, per token also for gspo): the tokens whose weight is truncated or
    clipped."""
    diff = (logp - gen_logp)[mask.bool()]  # (K,) masked tokens only
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
    """How far the trained policy has moved from the one that sampled, by the tokens' policy-version
    lag (lag (N, T) long, aligned with mask): -> (sums, counts), (L + 1,) each, the sum of |log rho|
    and the number of masked tokens at each lag 0..L. At lag 0 |log rho| is only the
    generator/trainer numerics; at lag k it also holds k optimizer steps of change. A policy running
    away inside a frozen PPO window (or the last k steps of PipelineRL-k) shows here first: the
    oldest tokens' mean |log rho| climbs."""
    keep = mask.bool()
    lag = lag[keep]
    diff = (logp - gen_logp)[keep].abs().double()
    size = int(lag.max()) + 1 if lag.numel() else 1
    return torch.bincount(lag, weights=diff, minlength=size), torch.bincount(lag, minlength=size)


@torch.no_grad()
def forgetting(logp, gen_logp, mask, sure=0.9):
    """The early sign of a policy drifting where its stale samples give no gradient -> (sum,
    count): the sum over the masked tokens the generator sampled with p >= `sure` of the log-prob
    the trained policy has lost on them, max(0, log p_gen - log p_train), and how many such
    tokens there were. A format token (the answer after </think>) is sure and shared by right and
    wrong samples alike: their advantages cancel on it, so the loss holds it nowhere, and a
    policy k versions ahead of its samples can lose it unseen (BENCHMARKS.md section 6). In one
    process (lag 0) this is numerics only."""
    keep = mask.bool() & (gen_logp >= math.log(sure))
    return (gen_logp - logp)[keep].clamp(min=0).double().sum(), keep.sum()
