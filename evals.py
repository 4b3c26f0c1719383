"""
evals.py: the held-out evaluation, mean@k (arXiv 2510.13786: the pass rate over k samples of every
held-out problem, the y-axis of its compute curves; its recipe, appendix A.3: 1,000 problems x 16).
Start at `evaluate`: the sampler driven over `held_out_items`, each sample scored as in training (a
truncated sample is wrong), the records summed up by `summarize_eval`. Under PipelineRL the
generator ranks sample the same items, each its share (EvalShare, from pipeline.poll), and
trainer 0 sums their records up (train.log_evals); the eval line is metrics.log_eval.

    python train.py --eval_only --model runs/toy/ckpt-000150 --eval_samples 16
    python train.py --eval_only --model Qwen/Qwen3-0.6B --val_data HuggingFaceH4/MATH-500
"""

import time
from dataclasses import dataclass, field

import numpy as np

import faults
from data import score_samples
from generate import drive

EVAL_KEY = 10 ** 12  # held-out noise keys start here, clear of the training samples'


def due(step, args):
    """Is a held-out eval of `step` in the run's schedule (--eval_every, and the last step)?"""
    return step % args.eval_every == 0 or step == args.steps


def held_out_items(val_ids, k, g=0, n_gens=1):
    """Generator g's share of a held-out eval, the same noise at every eval."""
    n = len(val_ids)
    return [(val_ids[i % n], EVAL_KEY + i, ("eval", i)) for i in range(n * k)
            if (i % n) % n_gens == g]


def score_held_out(tokenizer, done, val, unsafe_code=False):
    """{sample index: Sample} -> [[index, correct, truncated, interrupted, length]]."""
    idx, n = sorted(done), len(val)
    _, correct, _ = score_samples(tokenizer, [done[i] for i in idx], [val[i % n] for i in idx],
                                  unsafe_code=unsafe_code)
    return [[i, c, done[i].finish == "truncated", 0 in done[i].mask, len(done[i].tokens)]
            for i, c in zip(idx, correct)]


def domain_rates(problems, correct):
    domains = sorted({p.get("domain", "math") for p in problems})
    if len(domains) < 2:
        return {}
    return {f"pass_rate/{d}": float(np.mean([c for p, c in zip(problems, correct)
                                             if p.get("domain", "math") == d]))
            for d in domains}


def summarize_eval(records, val, k):
    """Held-out records -> mean@k pass rate, its standard error, rates."""
    n = len(val)
    _, correct, truncated, interrupted, lengths = zip(*sorted(records))
    per_prompt = np.reshape(np.asarray(correct, dtype=float), (k, n)).mean(0)
    se = float(per_prompt.std(ddof=1) / np.sqrt(n)) if n > 1 else float("nan")
    return {"pass_rate": float(np.mean(correct)), "pass_rate_se": se,
            "trunc": float(np.mean(truncated)), "intr": float(np.mean(interrupted)),
            "len": float(np.mean(lengths)), "n": len(correct),
            **domain_rates(val * k, list(correct))}


class Progress:
    """A long eval's progress line: done/total, the seconds so far and the ETA at that pace,
    at most one line every `every` seconds."""

    def __init__(self, total, what, every=10.0):
        self.total, self.what, self.every = total, what, every
        self.t0 = self.shown = time.time()

    def update(self, done):
        now = time.time()
        if now - self.shown >= self.every:
            self.shown, spent = now, now - self.t0
            eta = (f"ETA {(self.total - done) * spent / done:.0f} s" if done else
                   "no sample finished yet")
            print(f"{self.what}: {done}/{self.total} samples in {spent:.0f} s, {eta}", flush=True)


EVAL_SHARE = 0.5  # at most this share of the slots: training groups keep flowing during an eval


@dataclass
class EvalShare:
    """A generator rank's share of the held-out eval of one weights version (pipeline.py)."""
    val: list = None
    val_ids: list = None
    version: int = None  # the version under eval; None between evals
    items: list = field(default_factory=list)  # not yet given to the sampler
    want: int = 0
    progress: object = None  # Progress on generator 0: the count and ETA of its share
    done: dict = field(default_factory=dict)
    evaluated: set = field(default_factory=set)
    report: object = None  # (version, records) -> the store, for trainer 0

    def start(self, version, k, g, n_gens):
        """The eval of `version`: generator g's share of the items, mean@k."""
        self.version, self.done = version, {}
        self.items = held_out_items(self.val_ids, k, g, n_gens)
        self.want = len(self.items)
        # the first generator speaks for all: their shares are the same size
        self.progress = (Progress(self.want, f"generator 0: held-out eval of step {version}")
                         if g == 0 else None)

    def take(self, slots, free):
        """The items to start now: at most EVAL_SHARE of the slots in use, within the free ones."""
        running = self.want - len(self.items) - len(self.done)
        n = max(0, min(max(1, int(slots * EVAL_SHARE)) - running, free))
        items, self.items = self.items[:n], self.items[n:]
        return items


def evaluate(steps, tokenizer, val_ids, val, k, unsafe_code=False):
    """Held-out mean@k with `steps`, a generate.sampler not yet started -> summarize_eval's dict;
    None if a signal stopped it."""
    items = held_out_items(val_ids, k)
    progress = Progress(len(items), "held-out eval")
    done = drive(steps, items, stop=lambda: bool(faults.STOP), progress=progress.update)
    if done is None:
        return None
    records = score_held_out(tokenizer, {i: s for (_, i), s in done.items()}, val, unsafe_code)
    return summarize_eval(records, val, k)


def per_domain(result):
    """' | math 0.500 | code 0.250': the pass rate of each domain, when domains mix."""
    return "".join(f" | {k.split('/')[1]} {v:.3f}" for k, v in result.items()
                   if k.startswith("pass_rate/"))


def eval_only_line(r, what, k, n, seconds):
    """--eval_only's one line: `what` (the model and the problems), then the eval."""
    return (f"{what}: pass rate {r['pass_rate']:.3f} (mean@{k} over {n} problems, "
            f"{r['n']} samples){per_domain(r)} | trunc {r['trunc']:.3f} | intr {r['intr']:.3f} | "
            f"len {r['len']:.1f} tokens | {seconds:.1f} s")
