"""
ScaleRL's loss (arXiv 2510.13786): the recipe after the rewards, in its order. Start at
`make_batch` (the length penalty, truncated samples out per A.15, the zero-variance filter, the
advantages: section 3.2), then `policy_loss` (the objective from LOSSES: CISPO, section 4, or the
GRPO, DAPO and GSPO ablations; each row weighed by `row_weights`, the aggregation of section 3.2).
train.train_step calls policy_loss once per micro-batch. rho = exp(logp - gen_logp), gen_logp as
the generator recorded it.
"""
import math
from dataclasses import dataclass

import torch

NORMS = ("batch", "prompt", "none")
AGGS = ("prompt", "sample", "token")
# clipped losses clamp log rho here: far above log(1 + eps_high), below exp overflow
MAX_LOG_RATIO = 20.0

# -----------------------------------------------------------------------------
# the batch: rewards, truncation, the zero-variance filter, advantages


@dataclass(frozen=True)
class LengthControl:
    """--length_control: forced interruptions (ScaleRL, section 4), a length penalty, or none."""
    kind: str
    think_budget: int
    answer_budget: int
    l_max: int = 0  # 0: think_budget + answer_budget
    l_cache: int = 0  # 0: l_max // 7, the paper's 2k of 14k

    @classmethod
    def from_args(cls, args):
        return cls(args.length_control, args.think_budget, args.answer_budget, args.l_max,
                   args.l_cache)

    @property
    def interrupt(self):
        """Does the sampler force an interruption into long thinking (generate.cut_point)?"""
        return self.kind == "interrupt"

    def penalty(self, lengths):
        """Each completion length's reward penalty, or None when off."""
        if self.kind != "penalty":
            return None
        l_max = self.l_max or self.think_budget + self.answer_budget
        return length_penalty(lengths, l_max, self.l_cache or l_max // 7)


def length_penalty(lengths, l_max=14336, l_cache=2048):
    """clip((l_max - len) / l_cache - 1, -1, 0)."""
    return ((l_max - lengths) / l_cache - 1).clamp(-1, 0)


@dataclass
class Batch:
    """One trainer's part of a step's batch."""
    prompt_ids: list
    samples: list
    correct: list
    rewards: torch.Tensor
    group: torch.Tensor
    truncated: torch.Tensor
    valid: torch.Tensor  # (N,) untruncated, unless --keep_truncated
    rows: list  # the samples that enter the loss
    adv: torch.Tensor  # (len(rows),)
    # every trainer's counts (agg_counts): the loss's denominators
    sums: dict


def make_batch(groups, *, length, keep_truncated, zero_var_filter, adv_norm, all_sum=None):
    """Rewards, truncated samples out, the zero-variance filter, advantages (all_sum: sums a dict
    over the trainers)."""
    samples = [s for g in groups for s in g["samples"]]
    correct = [c for g in groups for c in g["correct"]]
    rewards = torch.tensor([r for g in groups for r in g["rewards"]])
    penalty = length.penalty(torch.tensor([len(s.tokens) for s in samples]))
    if penalty is not None:  # correct samples only: a long right answer (>= 0) still beats -1
        rewards = rewards + torch.tensor(correct, dtype=torch.float) * penalty
    group = torch.tensor([j for j, g in enumerate(groups) for _ in g["samples"]], dtype=torch.long)
    truncated = torch.tensor([s.finish == "truncated" for s in samples], dtype=torch.bool)
    # A.15: truncated samples leave the loss and their group's statistics
    valid = torch.ones(len(samples), dtype=torch.bool) if keep_truncated else ~truncated
    keep = zero_variance_keep(rewards, group, valid) if zero_var_filter else valid
    rows = keep.nonzero().squeeze(1).tolist()
    adv = advantages(rewards[rows], group[rows], adv_norm, all_sum=all_sum)
    masks = [torch.tensor(samples[r].mask) for r in rows]
    sums = (all_sum or dict)(agg_counts(group[rows], torch.cat(masks) if masks else torch.zeros(0)))
    return Batch([g["prompt"] for g in groups for _ in g["samples"]], samples, correct, rewards,
                 group, truncated, valid, rows, adv, sums)


def zero_variance_keep(rewards, group, valid=None):
    """Valid (untruncated, A.15) samples whose group's rewards differ (section 3.2)."""
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid
    idx, n_groups = group_index(group)
    lo = rewards.new_full((n_groups,), math.inf).scatter_reduce(
        0, idx[valid], rewards[valid], "amin")
    hi = rewards.new_full((n_groups,), -math.inf).scatter_reduce(
        0, idx[valid], rewards[valid], "amax")
    return valid & (hi > lo)[idx]


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
    if norm == "none":  # Dr. GRPO
        return adv
    if norm == "prompt":  # GRPO; population std, + 1e-6: a group whose rewards agree has std 0
        std = (group_sum(adv**2, idx, n_groups) / count).sqrt()  # (G,)
        return adv / (std[idx] + 1e-6)
    # ScaleRL (section 3.2): the std of every A in the batch, every trainer's rows summed in
    sums = {"n": adv.numel(), "a": adv.sum().item(), "a2": (adv**2).sum().item()}
    sums = all_sum(sums) if all_sum else sums
    if not sums["n"]:
        return adv
    var = max(sums["a2"] / sums["n"] - (sums["a"] / sums["n"]) ** 2, 0.0)  # population variance
    return adv / (math.sqrt(var) + 1e-6)  # + 1e-6: a batch whose rewards all agree has std 0

# -----------------------------------------------------------------------------
# the objectives and the loss


def clipped_objective(ratio, adv, eps_low, eps_high):
    """PPO: min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A)."""
    return torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)


def cispo_objective(log_ratio, logp, adv, keep, eps_low, eps_high, neg_trust=None):
    """CISPO: sg(clamp(rho, eps_low, eps_high)) A logp; neg_trust masks rho < neg_trust, A < 0."""
    ratio = log_ratio.exp()
    # section 4: the cap bounds rho itself (eps_max = 4), not 1 + eps; no floor unless eps_low
    weight = ratio.clamp(min=eps_low, max=eps_high).detach()  # (N, T) sg(min(rho, cap))
    obj = weight * adv * logp  # (N, T)
    if neg_trust is None:
        return obj
    # a departure from the paper's CISPO (--neg_trust, docs/reference.md): PPO's clip for A < 0
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
# objectives per sequence, spread over its tokens: a sequence, not a token, is what they average
PER_SEQUENCE = ("gspo",)


def clip_eps(kind, eps_low=None, eps_high=None):
    """(eps_low, eps_high): the flags', else the kind's defaults."""
    default_low, default_high = EPS_DEFAULTS[kind]
    return ((default_low if eps_low is None else eps_low),
            (default_high if eps_high is None else eps_high))


def policy_loss(logp, gen_logp, adv, mask, group, kind="cispo", agg="prompt",
                eps_low=None, eps_high=None, weights=None, neg_trust=None):
    """Scalar loss to minimize. weights: row_weights, these rows being part of a larger batch (a
    micro-batch); None: these rows are the batch."""
    if kind not in LOSSES:
        raise ValueError(f"unknown kind {kind!r}; allowed: {', '.join(LOSSES)}")
    if agg not in AGGS:
        raise ValueError(f"unknown agg {agg!r}; allowed: {', '.join(AGGS)}")
    eps_low, eps_high = clip_eps(kind, eps_low, eps_high)
    keep = mask.bool()  # (N, T)
    log_ratio = torch.where(keep, logp - gen_logp.detach(), 0.0)  # (N, T)
    obj = LOSSES[kind][0](log_ratio, logp, adv.detach()[:, None], keep, eps_low, eps_high,
                          neg_trust)
    if weights is None:
        weights = row_weights(group, keep.sum(1), agg, agg_counts(group, keep), kind)
    return -(torch.where(keep, obj, 0.0).sum(1) * weights.to(logp.dtype)).sum()


def agg_counts(group, mask):
    """What each aggregation divides by."""
    return {"prompt": len(torch.unique(group)), "sample": len(group),
            "token": int(mask.bool().sum())}


def row_weights(group, tokens, agg, totals, kind="cispo"):
    """Each row's weight in the batch's loss (totals: agg_counts): prompt 1 / (groups x group
    tokens), sample 1 / (sequences x tokens), token 1 / tokens; a PER_SEQUENCE kind's prompt
    average 1 / (groups x group size x tokens). Splits then sum to the batch."""
    tokens = tokens.to(torch.float64)
    # max(.., 1): a row, group or batch without tokens weighs nothing instead of dividing by 0
    if agg == "token":
        return torch.full_like(tokens, 1.0 / max(totals["token"], 1))
    if agg == "sample":
        return 1.0 / (totals["sample"] * tokens.clamp(min=1))
    idx, n_groups = group_index(group)
    if kind in PER_SEQUENCE:  # GSPO: each of a prompt's G sequences weighs 1/G, not |y_i|/sum|y|
        size = group_sum(torch.ones_like(tokens), idx, n_groups)[idx]
        return 1.0 / (totals["prompt"] * size * tokens.clamp(min=1))
    return 1.0 / (totals["prompt"] * group_sum(tokens, idx, n_groups)[idx].clamp(min=1))
