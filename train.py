"""
train.py: the ScaleRL training loop (arXiv 2510.13786: section 2's setup,
section 4's recipe, section 5's scaling axes), one process, synchronous.

Each step: take a batch of prompts from the curriculum, sample G completions per prompt with the
KV-cache sampler (generate.py, forced interruptions), verify the final answers (verify.py; programs
run in sandbox.py; reward +1 / -1), drop prompts whose G rewards are all equal (zero-variance
filtering), compute advantages and the CISPO loss with prompt-level aggregation (loss.py) from the
generator's recorded log-probs, take an AdamW step (eps 1e-15, weight decay 0.01, linear warm-up
then constant; on float32 master weights under --dtype bfloat16), update the pass-rate history
(No-Positive-Resampling). Every N steps: held-out pass rate (mean@k) and the live scaling-curve fit
(fit.py). Every ScaleRL choice is a flag whose default
is ScaleRL's; the sizes default to the tiny CPU run.

Outputs in --out: metrics.jsonl (one JSON object per step and per eval; fit.py reads it), one log
line per step, checkpoints ckpt-STEP/ (a from_pretrained-able model folder + state.pt) and --resume;
what is done to the folder itself (checks, lock, pruning, resume) is in runs.py.

Compute is counted as device-seconds of the training loop (wall-clock x devices; evaluation and
checkpointing are not counted) and as estimated FLOPs: 2 N per generated or prompt token plus
6 N per trained token, N = parameter count (attention FLOPs ignored).

    python train.py                            # the embedded toy task and model, CPU, a few minutes
    python train.py --loss dapo --no-fp32_head # an ablation: one flag per ScaleRL choice
    python train.py --model DIR --data gsm8k_train.jsonl --val_data gsm8k_test.jsonl \\
        --device cuda --dtype bfloat16 --prompts 48 --samples 16 \\
        --think_budget 12288 --answer_budget 2048 \\
        --lr 5e-7 --warmup 100 --eval_every 100 --eval_samples 16 --val_size 1000
                                               # the paper's settings, one GPU
    python fit.py runs/toy                     # fit the sigmoid to the run's held-out curve
"""

import argparse
import difflib
import glob
import json
import math
import os
import re
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from data import (PRESETS, Curriculum, format_prompt, load_source_problems, read_jsonl,
                  resolve_model, score_samples, special_tokens, split_problems, toy_model_dir,
                  toy_problems)
import pipeline
from fit import predict_final
from generate import SUPPORTED, check_supported, generate, sequence_logprobs
from loss import (AGGS, EPS_DEFAULTS, NORMS, advantages, agg_counts, clip_eps, drift_by_lag,
                  length_penalty, policy_loss, ratio_stats, zero_variance_keep)
from runs import (checkpoints, metrics_log, prepare_out_dir, release_lock, resume_command,
                  resume_point, save_checkpoint, truncate_metrics, write_file)
from sandbox import bwrap_ready, not_ready_reason

# -----------------------------------------------------------------------------
# flags: defaults are ScaleRL's choices and the tiny CPU run's sizes (paper values in the help)

# interrupt: forced interruptions (ScaleRL); penalty: a length penalty on correct answers (paper
# section 3.1); none: only the budget's truncation
LENGTH_CONTROLS = ("interrupt", "penalty", "none")


class FlagParser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block; "did you mean" for a mistyped flag), no
    abbreviations (--prompt is not taken for --prompts), and under torchrun only rank 0 says it
    (the others exit quietly)."""

    def __init__(self, **kw):
        super().__init__(allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                         **kw)

    def error(self, message):
        if int(os.environ.get("RANK", "0")) != 0:
            self.exit(2)
        flags = [o for a in self._actions for o in a.option_strings]
        typed = (re.findall(r"(--[\w-]+)", message)
                 if message.startswith("unrecognized arguments") else [])
        hints = [f"{t}: did you mean {close[0]}?" for t in typed
                 if (close := difflib.get_close_matches(t, flags, 1))]
        self.exit(2, f"{self.prog}: error: {message}{''.join(' (' + h + ')' for h in hints)} "
                     "(--help lists the flags)\n")


def model_flags(g):
    """The flags of --help's group "model and data"."""
    g.add_argument("--model", default="",
                   help="HF model folder or Hugging Face Hub id, e.g. Qwen/Qwen3-0.6B "
                        "(Llama/Qwen2/Qwen3; a Hub id is downloaded once into the Hugging Face "
                        "cache, HF_HOME / HF_HUB_CACHE / HF_HUB_OFFLINE apply); empty = the "
                        "embedded base model of the --data preset")
    g.add_argument("--data", default="",
                   help="training jsonl or Hugging Face dataset owner/name[:config[:split]] "
                        "(split default train; e.g. openai/gsm8k:main; pip install datasets), or "
                        "several comma-separated (math and code mix); 'toy' or empty = the "
                        "embedded toy task; 'toy-hard' = the study's harder one (data.PRESETS)")
    g.add_argument("--unsafe_code_exec", action="store_true",
                   help="code problems: run programs with resource limits only when bubblewrap "
                        "(bwrap) is missing; a program can then forge its reward (sandbox.py)")
    g.add_argument("--val_data", default="",
                   help="held-out jsonl or Hugging Face dataset owner/name[:config[:split]] "
                        "(split default test; e.g. openai/gsm8k:main, HuggingFaceH4/MATH-500); "
                        "empty = hold out --val_size problems of --data")
    g.add_argument("--val_size", type=int, default=None,
                   help="held-out problems (paper: 1000); None = 200, or a tenth of a --data of "
                        "fewer than 2,000 problems")
    g.add_argument("--out", default="runs/toy", help="output folder: metrics.jsonl and checkpoints")
    g.add_argument("--device", default="auto", help="auto = cuda when available, else cpu")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the weights' dtype for sampling and the loss's forward and backward; "
                        "AdamW always steps a float32 master copy (no float16: its gradients "
                        "underflow without loss scaling, which train.py does not do)")
    g.add_argument("--seed", type=int, default=0,
                   help="seeds the split, the curriculum and the sampling noise")


def rollout_flags(g):
    """The flags of --help's group "rollouts"."""
    g.add_argument("--prompts", type=int, default=16, help="prompts per optimizer step (paper: 48)")
    g.add_argument("--samples", type=int, default=8, help="completions per prompt, G (paper: 16)")
    g.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature (paper: 1.0)")
    g.add_argument("--slots", type=int, default=128,
                   help="rows the sampler decodes at once (continuous batching)")
    g.add_argument("--think_budget", type=int, default=48, help="thinking tokens (paper: 12288)")
    g.add_argument("--answer_budget", type=int, default=64,
                   help="answer tokens after </think> (paper: 2048). The toy's answer is 11 "
                        "tokens; 64 leaves room for a whole rethought chain plus the answer, so a "
                        "policy that changes format is scored (-1) rather than truncated (out of "
                        "the loss, no gradient: README)")
    g.add_argument("--length_control", default="interrupt", choices=LENGTH_CONTROLS,
                   help="interrupt = forced interruption (ScaleRL); penalty = a length penalty")
    g.add_argument("--l_max", type=int, default=0,
                   help="length penalty L_max; 0 = think_budget + answer_budget")
    g.add_argument("--l_cache", type=int, default=0,
                   help="length penalty L_cache; 0 = l_max // 7 (paper: 2k of 14k)")


def loss_flags(g):
    """The flags of --help's group "loss (loss.py)"."""
    g.add_argument("--loss", default="cispo", choices=list(EPS_DEFAULTS),
                   help="policy loss: CISPO is ScaleRL's; the others are ablations (loss.py)")
    g.add_argument("--agg", default="prompt", choices=AGGS, help="loss aggregation")
    g.add_argument("--adv_norm", default="batch", choices=NORMS, help="advantage normalization")
    g.add_argument("--eps_low", type=float, default=None,
                   help="None = the loss kind's default: cispo none, grpo/dapo 0.2, gspo 3e-3 "
                        "(the paper, section 3.2)")
    g.add_argument("--eps_high", type=float, default=None,
                   help="None = the loss kind's default: cispo 4 (the cap on the IS weight), grpo "
                        "0.2, dapo 0.28, gspo 4e-3")
    g.add_argument("--fp32_head", action=argparse.BooleanOptionalAction, default=True,
                   help="float32 LM head")
    g.add_argument("--zero_var_filter", action=argparse.BooleanOptionalAction, default=True,
                   help="drop prompts whose rewards are all equal")
    g.add_argument("--keep_truncated", action="store_true",
                   help="an ablation: keep truncated samples (no eos within the budget) in the "
                        "loss, with reward -1 (a truncated sample is never correct); default: "
                        "excluded from the loss and the group statistics (paper A.15's effective "
                        "batch)")
    g.add_argument("--no_positive_resampling", action=argparse.BooleanOptionalAction, default=True,
                   help="never resample a prompt once its pass rate reaches 0.9")


def optimization_flags(g):
    """The flags of --help's group "optimization"."""
    g.add_argument("--steps", type=int, default=150, help="optimizer steps")
    g.add_argument("--lr", type=float, default=3e-4, help="paper: 5e-7 for an 8B model")
    g.add_argument("--warmup", type=int, default=10, help="linear warm-up steps (paper: 100)")
    g.add_argument("--weight_decay", type=float, default=0.01,
                   help="AdamW weight decay (paper: 0.01)")
    g.add_argument("--adam_eps", type=float, default=1e-15,
                   help="a larger eps silently damps tiny gradients")
    g.add_argument("--grad_clip", type=float, default=1.0,
                   help="max gradient norm; 0 = off (not part of the recipe as the paper states "
                        "it; README: what the toy does without it)")
    g.add_argument("--micro_prompts", type=int, default=0,
                   help="prompts per forward/backward; 0 = the whole batch")
    g.add_argument("--max_bad_steps", type=int, default=3,
                   help="consecutive steps with a NaN/inf loss or gradient (each skipped) before "
                        "the run stops")
    g.add_argument("--max_empty_steps", type=int, default=10,
                   help="consecutive steps that keep no prompt (every group all truncated or with "
                        "equal rewards: nothing to train on) before the run stops and says why")


def rank_flags(g):
    """The flags of --help's group "ranks (pipeline.py; under torchrun only)"."""
    g.add_argument("--mode", default="pipeline", choices=["pipeline", "ppo_offpolicy", "sync"],
                   help="pipeline = PipelineRL-k (ScaleRL); ppo_offpolicy = PPO-off-policy-k; "
                        "sync = k of 1")
    g.add_argument("--max_lag", type=int, default=8,
                   help="k: no token trained on is more than k versions old")
    g.add_argument("--gen_ranks", type=int, default=0,
                   help="generator ranks; 0 = world - max(1, world // 4)")
    g.add_argument("--timeout", type=float, default=1800,
                   help="seconds any cross-rank wait may last")
    g.add_argument("--heartbeat_timeout", type=float, default=60,
                   help="seconds of silence before a rank is declared dead")
    g.add_argument("--bucket_mb", type=int, default=256, help="weight broadcast bucket size")
    g.add_argument("--fsdp", action="store_true",
                   help="shard the trainers' model and optimizer state over the trainer ranks "
                        "(FSDP2); rank 0 keeps one unsharded copy to evaluate and save")


def logging_flags(g):
    """The flags of --help's group "evaluation, logging, checkpoints"."""
    g.add_argument("--eval_every", type=int, default=10,
                   help="steps between held-out evals (paper: 100)")
    g.add_argument("--log_every", type=int, default=1,
                   help="print the step line every N steps (and the last one); metrics.jsonl "
                        "keeps every step")
    g.add_argument("--eval_samples", type=int, default=4,
                   help="samples per held-out prompt, mean@k (paper: 16)")
    g.add_argument("--eval_only", action="store_true",
                   help="only evaluate --model (default: the --data preset's base model) on "
                        "--val_data (default: the held-out split of --data), print the pass rate "
                        "and exit")
    g.add_argument("--wandb", default="", metavar="PROJECT",
                   help="also log metrics to Weights & Biases (pip install wandb; "
                        "WANDB_MODE=offline works without a network)")
    g.add_argument("--tensorboard", action="store_true",
                   help="also log metrics as TensorBoard events in --out/tb (pip install "
                        "tensorboard)")
    g.add_argument("--save_every", type=int, default=50,
                   help="steps between checkpoints; 0 = only at the end")
    g.add_argument("--keep", type=int, default=2, help="checkpoints kept")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest intact checkpoint in --out")
    g.add_argument("--overwrite", action="store_true",
                   help="start over in an --out that holds a run: its metrics, checkpoints and "
                        "curriculum files are deleted first (without it or --resume such an --out "
                        "is refused)")


def get_args(argv=None):
    ap = FlagParser(prog="train.py", description="ScaleRL training loop")
    model_flags(ap.add_argument_group("model and data"))
    rollout_flags(ap.add_argument_group("rollouts"))
    loss_flags(ap.add_argument_group("loss (loss.py)"))
    optimization_flags(ap.add_argument_group("optimization"))
    rank_flags(ap.add_argument_group("ranks (pipeline.py; under torchrun only)"))
    logging_flags(ap.add_argument_group("evaluation, logging, checkpoints"))
    args = ap.parse_args(argv)
    check_args(args, ap.error)
    return args


# what each numeric flag may be, besides finite: nan, inf or a negative value would fail late or
# train silently wrong (a negative --temperature sampled the argmax and trained to 0.000)
MAX_SECONDS = 1e7  # --timeout, --heartbeat_timeout: past this, waits overflow their clocks
POSITIVE, AT_LEAST_0 = (lambda v: v > 0, "positive"), (lambda v: v >= 0, ">= 0")
SECONDS = (lambda v: 0 < v <= MAX_SECONDS, f"in (0, {MAX_SECONDS:g}] seconds")
FLAG_RANGES = {
    **dict.fromkeys(("prompts", "samples", "think_budget", "answer_budget", "steps", "eval_every",
                     "eval_samples", "slots", "max_lag", "bucket_mb", "warmup", "max_empty_steps",
                     "max_bad_steps", "log_every", "keep", "val_size", "temperature", "lr",
                     "adam_eps", "eps_high"), POSITIVE),
    **dict.fromkeys(("micro_prompts", "grad_clip", "save_every", "l_max", "l_cache", "gen_ranks",
                     "weight_decay", "eps_low"), AT_LEAST_0),  # 0 has a meaning (see --help)
    "timeout": SECONDS, "heartbeat_timeout": SECONDS,
    "seed": (lambda v: 0 <= v < 2 ** 63, "in [0, 2^63)"),
}


def check_args(args, error):
    """Flag values that would fail late (after the model loads) or silently train wrong:
    error(message), one line, before anything is made in --out."""
    for name, (ok, what) in FLAG_RANGES.items():
        value = getattr(args, name)
        if value is not None and (not ok(value) or abs(value) == math.inf):
            error(f"--{name} must be {what} and finite, got {value}")
    check_clip_bounds(args, error)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        error(f"--device {args.device}: " +
              ("this PyTorch build has no CUDA (a CPU wheel); install the CUDA build"
               if torch.version.cuda is None else "no CUDA device is visible"))
    if args.resume and args.overwrite:
        error("--resume continues the run in --out and --overwrite deletes it: give one of them")
    # what loads; args.model stays as typed (--resume compares it)
    args.model_dir = check_model_dir(args.model, error)


def check_clip_bounds(args, error):
    """--eps_low / --eps_high as the loss reads them (loss.py): CISPO's are absolute bounds on the
    ratio (low below high), the clipped losses' 1 - eps_low may not be negative."""
    low, high = clip_eps(args.loss, args.eps_low, args.eps_high)
    if args.loss == "cispo" and low is not None and low >= high:
        error(f"--eps_low {low} must be below --eps_high {high} (CISPO: bounds on the ratio)")
    if args.loss != "cispo" and low > 1:
        error(f"--eps_low {low}: {args.loss} clips the ratio at 1 - eps_low, which must be >= 0")


def check_model_dir(path, error):
    """--model: a local folder, or a Hugging Face Hub id resolved to its folder in the Hugging Face
    cache (downloaded there once: data.resolve_model) -> the folder to load ("" without --model),
    checked to be one the sampler can run. At argument parsing: before any process group waits on
    another."""
    if not path:
        return ""
    try:
        folder = resolve_model(path)
    except ValueError as err:
        error(f"--model {err}")
        return ""
    name = path if folder == path else f"{path} ({folder})"
    if not os.path.isfile(os.path.join(folder, "config.json")):
        error(f"--model {name}: no config.json there (a Hugging Face model folder is expected)")
        return folder
    if not (glob.glob(os.path.join(folder, "*.safetensors")) +
            glob.glob(os.path.join(folder, "*.bin"))):
        error(f"--model {name}: no weights (*.safetensors or *.bin) in the folder")
    with open(os.path.join(folder, "config.json")) as f:
        model_type = json.load(f).get("model_type")
    if model_type not in SUPPORTED:
        error(f"--model {name}: model_type {model_type!r} is not supported by the sampler "
              f"({', '.join(SUPPORTED)})")
    return folder


# -----------------------------------------------------------------------------
# rollouts: sample, decode, verify


def rollout(model, tokenizer, prompt_ids, problems, args, keys, version=0, max_prompt_len=None):
    """Sample one completion per prompt (keys: noise keys) and score it against its problem's answer
    or tests -> (samples, texts, correct, seconds spent generating, seconds spent verifying); None
    when a signal asked the run to stop meanwhile (the sampling is abandoned: nothing of it is
    used)."""
    t0 = time.time()
    samples = generate(model, prompt_ids, **special_tokens(tokenizer),
                       think_budget=args.think_budget, answer_budget=args.answer_budget,
                       interrupt=args.length_control == "interrupt", slots=args.slots,
                       temperature=args.temperature, fp32_head=args.fp32_head, seed=args.seed,
                       keys=keys, version=version, stop=lambda: bool(pipeline.STOP),
                       max_prompt_len=max_prompt_len)
    if samples is None:
        return None
    t1 = time.time()
    texts, correct = score_samples(tokenizer, samples, problems, unsafe_code=args.unsafe_code_exec)
    return samples, texts, correct, t1 - t0, time.time() - t1


def domain_rates(problems, correct):
    """{"pass_rate/math": .., "pass_rate/code": ..} when problems mix domains (the paper fits one
    curve per domain), else {}."""
    domains = sorted({p.get("domain", "math") for p in problems})
    if len(domains) < 2:
        return {}
    return {f"pass_rate/{d}": float(np.mean([c for p, c in zip(problems, correct)
                                             if p.get("domain", "math") == d]))
            for d in domains}


def evaluate(model, tokenizer, val_ids, val, args):
    """Held-out mean@k pass rate (and per domain) and its standard error over the prompts (the
    spread of the per-prompt means / sqrt(prompts): the noise of the eval itself); the same noise
    keys at every eval."""
    k = args.eval_samples
    keys = [10**12 + i for i in range(len(val_ids) * k)]
    result = rollout(model, tokenizer, val_ids * k, val * k, args, keys)
    if result is None:  # stopped by a signal
        return None
    samples, _, correct, _, _ = result
    # sample i: prompt i % n
    per_prompt = np.reshape(np.asarray(correct, dtype=float), (k, len(val_ids))).mean(0)
    se = (float(per_prompt.std(ddof=1) / np.sqrt(len(per_prompt))) if len(per_prompt) > 1
          else float("nan"))
    return {"pass_rate": float(np.mean(correct)), "pass_rate_se": se,
            "trunc": float(np.mean([s.finish == "truncated" for s in samples])),
            "intr": float(np.mean([0 in s.mask for s in samples])),
            "len": float(np.mean([len(s.tokens) for s in samples])),
            "n": len(correct), **domain_rates(val * k, correct)}


def check_code_rewards(args, problems):
    """Code problems need the bwrap sandbox (or --unsafe_code_exec): checked before any rank waits
    on another."""
    if not any(p.get("domain") == "code" for p in problems):
        return
    if not args.unsafe_code_exec and not bwrap_ready():
        sys.exit(f"error: {not_ready_reason()}")
    print("code rewards: " +
          ("--unsafe_code_exec: resource limits only, no isolation; a program can forge its reward"
           if args.unsafe_code_exec else "each program in its own bwrap sandbox"))


def note_toy_model(args, paths, flag, verb):
    """A real dataset without --model: say at start that the toy model only knows the toy task."""
    if any(p not in PRESETS for p in (paths or "toy").split(",")) and not args.model:
        print(f"note: {flag} without --model {verb} the embedded toy model, which only knows the "
              "toy arithmetic task: expect a pass rate near 0; give --model a real checkpoint",
              flush=True)


def eval_only(args):
    """--eval_only: the held-out mean@k of --model (default: the embedded toy model) on --val_data
    (default: the held-out split of --data), printed; nothing is trained or written.
    -> evaluate's dict."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.exit("error: --eval_only runs as one process: python train.py --eval_only ..., "
                 "not under torchrun")
    _, val = load_data(args)
    note_toy_model(args, args.val_data, "--val_data", "evaluates")
    model_dir = args.model_dir or base_model_dir(args)
    tokenizer, model = load_model(model_dir, args, pick_device(args))
    t0 = time.time()
    r = evaluate(model.eval(), tokenizer, tokenize_prompts(tokenizer, val), val, args)
    per_domain = "".join(f" | {k.split('/')[1]} {v:.3f}" for k, v in r.items()
                         if k.startswith("pass_rate/"))
    print(f"eval {args.model or model_dir} on "
          f"{args.val_data or f'{len(val)} held-out problems of --data'}: pass rate "
          f"{r['pass_rate']:.3f} (mean@{args.eval_samples} over {len(val)} problems, "
          f"{r['n']} samples){per_domain} | trunc {r['trunc']:.3f} | intr {r['intr']:.3f} | "
          f"len {r['len']:.1f} tokens | {time.time() - t0:.1f} s", flush=True)
    return r


def base_model_dir(args):
    """Without --model: the embedded base model of the preset task in --data (toy or toy-hard)."""
    return toy_model_dir(preset=args.data if args.data in PRESETS else "toy")


def pick_device(args, ctx=None):
    """The rank's device under torchrun, else --device (auto = cuda when available)."""
    if ctx:
        return torch.device(ctx.device)
    if args.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(args.device)


def load_model(model_dir, args, device):
    """-> (tokenizer, model in --dtype on device), checked to be one the sampler runs. Nothing in
    the folder runs as code (no trust_remote_code; its chat template, rendered once here under a
    time limit, is data.format_prompt's): a folder that needs it stops the run with one line."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
        for domain in ("math", "code"):
            format_prompt(tokenizer, "", domain)
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, args.dtype), trust_remote_code=False).to(device)
    except ValueError as err:
        sys.exit(f"error: --model {model_dir}: {' '.join(str(err).split())[:400]}")
    check_supported(model)
    return tokenizer, model


def tokenize_prompts(tokenizer, problems):
    """Each problem's prompt, formatted as in training, as token ids."""
    return [tokenizer(format_prompt(tokenizer, p["prompt"], p.get("domain")))["input_ids"]
            for p in problems]


def rewards_of(samples, correct, args):
    """+1 correct, -1 otherwise; with --length_control penalty, correct answers also get the
    length penalty."""
    r = torch.tensor([1.0 if c else -1.0 for c in correct])
    if args.length_control == "penalty":
        l_max = args.l_max or args.think_budget + args.answer_budget
        lengths = torch.tensor([len(s.tokens) for s in samples])
        r = r + (torch.tensor(correct, dtype=torch.float)
                 * length_penalty(lengths, l_max, args.l_cache or l_max // 7))
    return r


def collate(prompt_ids, samples, pad_id, device, step=0):
    """Right-padded prompt+completion batch -> ids (N, T), attention (N, T), and, aligned with the
    next-token targets ids[:, 1:], the loss mask (N, T-1), the generator's log-probs (N, T-1) and
    each token's lag (N, T-1): how many versions older than `step` (the version trained) the weights
    that sampled it were."""
    T = max(len(p) + len(s.tokens) for p, s in zip(prompt_ids, samples))
    N = len(samples)
    ids = torch.full((N, T), pad_id, dtype=torch.long)
    attn, lag = torch.zeros(N, T, dtype=torch.long), torch.zeros(N, T - 1, dtype=torch.long)
    mask, gen_logp = torch.zeros(N, T - 1), torch.zeros(N, T - 1)
    for i, (p, s) in enumerate(zip(prompt_ids, samples)):
        P, C = len(p), len(s.tokens)
        ids[i, :P + C] = torch.tensor(p + s.tokens)
        attn[i, :P + C] = 1
        mask[i, P - 1:P - 1 + C] = torch.tensor(s.mask, dtype=torch.float)
        gen_logp[i, P - 1:P - 1 + C] = torch.tensor(s.logps)
        lag[i, P - 1:P - 1 + C] = step - torch.tensor(s.versions, dtype=torch.long)
    return ids.to(device), attn.to(device), mask.to(device), gen_logp.to(device), lag.to(device)


def train_batch(model, batch, args, n_groups, total=None, forward=None):
    """Forward/backward over micro-batches of whole prompt groups; gradients add up to the
    full-batch loss's (each micro-batch's loss is weighted by its share of groups, sequences or
    tokens; `total`: the whole batch's count when this is one trainer's part of it)."""
    ids, attn, mask, gen_logp, adv, group, lag = batch
    per = args.micro_prompts or n_groups
    uniq = group.unique()
    total = total or agg_counts(group, mask)[args.agg]
    loss_sum, stats, drift = 0.0, [], []
    for a in range(0, len(uniq), per):
        rows = torch.isin(group, uniq[a:a + per]).nonzero().squeeze(1)
        logp = (forward or partial(sequence_logprobs, model))(ids[rows], attn[rows],
                                                              args.fp32_head, args.temperature)
        loss = policy_loss(logp, gen_logp[rows], adv[rows], mask[rows], group[rows], kind=args.loss,
                           agg=args.agg, eps_low=args.eps_low, eps_high=args.eps_high)
        share = agg_counts(group[rows], mask[rows])[args.agg]
        (loss * share / total).backward()
        loss_sum += loss.item() * share / total
        stats.append(ratio_stats(logp.detach(), gen_logp[rows], mask[rows], args.loss,
                                 args.eps_high))
        drift.append(drift_by_lag(logp.detach(), gen_logp[rows], mask[rows], lag[rows]))
    mismatch = {f"mismatch_{k}": float(np.mean([s[k] for s in stats])) for k in stats[0]}
    return loss_sum, {**mismatch, **lag_drift(drift)}


def lag_drift(parts):
    """loss.drift_by_lag of each micro-batch -> {"log_rho_by_lag": mean |log rho| at lag 0, 1, ..
    (None where no token had that lag), "drift": the mean at the oldest lag present}."""
    size = max(len(sums) for sums, _ in parts)
    sums = sum(torch.nn.functional.pad(s, (0, size - len(s))) for s, _ in parts)
    counts = sum(torch.nn.functional.pad(n, (0, size - len(n))) for _, n in parts)
    by_lag = [float(s / n) if n else None for s, n in zip(sums.tolist(), counts.tolist())]
    return {"log_rho_by_lag": by_lag,
            "drift": next((v for v in reversed(by_lag) if v is not None), 0.0)}

# -----------------------------------------------------------------------------
# the run's metrics file (the folder itself: runs.py)


def start_metrics(args, run, ckpt, world):
    """Rank 0: a new run writes metrics.jsonl's config line; a resumed one drops what was logged
    after its checkpoint and takes back the evals before it (for the live fit)."""
    path = os.path.join(args.out, "metrics.jsonl")
    if ckpt:
        run.evals = [(r["compute_s"], r["pass_rate"]) for r in truncate_metrics(path, run.step)
                     if r["kind"] == "eval"]
        print(f"resumed from {ckpt} at step {run.step}")
        return
    ran = "one process, synchronous" if world == 1 else args.mode  # what actually ran
    write_file(path, json.dumps({"kind": "config", **vars(args), "ran": ran,
                                 "n_params": run.n_params, "world": world}) + "\n")


# -----------------------------------------------------------------------------
# data


def load_data(args):
    """-> (train problems, held-out problems). --data: jsonl files or Hugging Face datasets,
    comma-separated; "toy" (or an empty --data) is the embedded task: the distinct problems among
    4000 generated ones (about 2200)."""
    problems = [p for path in (args.data or "toy").split(",")
                for p in load_source("--data", path, args.seed)]
    if args.val_data:
        return problems, load_source("--val_data", args.val_data, args.seed)
    if args.val_size is None:
        return split_problems(problems, min(200, max(1, len(problems) // 10)), args.seed)
    if args.val_size >= len(problems):
        sys.exit(f"error: --val_size {args.val_size}: --data has {len(problems)} problems, and "
                 "some must be left to train on: give a smaller --val_size "
                 f"(e.g. {max(1, len(problems) // 10)}), or a --val_data file")
    return split_problems(problems, args.val_size, args.seed)


def load_source(flag, path, seed):
    """The problems of one --data / --val_data source: a preset task ("toy": the distinct problems
    among 4000 generated ones, about 2200), a jsonl file or a Hugging Face dataset
    owner/name[:config[:split]] (data.py; the split defaults to train for --data, test for
    --val_data). A missing file, a dataset that does not load or a bad record: one line naming the
    flag, or file:line (dataset row) and the field, not a traceback."""
    if path in PRESETS:
        seen = {}
        for p in toy_problems(4000, seed + 12345, path):
            seen.setdefault(p["prompt"], dict(p, domain="math"))
        return list(seen.values())
    try:
        return load_source_problems(path, "test" if flag == "--val_data" else "train")
    except OSError as err:
        sys.exit(f"error: {flag} {path}: {err.strerror or err}")
    except ValueError as err:
        sys.exit(f"error: {flag}: {err}")


def log_line(m, steps):
    line = (f"step {m['step']}/{steps} | reward {m['reward']:+.3f} | pass@1 {m['pass_rate']:.3f} | "
            f"len {m['len']:.1f} | ent {m['entropy']:.3f} | trunc {m['trunc']:.3f} | "
            f"intr {m['intr']:.3f} | "
            f"lag {m['lag']:.1f}/{m['lag_max']:.0f} | drift {m.get('drift', 0.0):.3f} | "
            f"kept {m['kept_prompts']}/{m['prompts']} | loss {m['loss']:+.4f} | "
            f"dt {m['dt_ms']:.0f} ms | tok/s {m['tok_s']:.0f}")
    if "generate_ms" in m:  # one process: where the step's time went
        line += (f" | gen {m['generate_ms']:.0f} verify {m['verify_ms']:.0f} "
                 f"train {m['train_ms']:.0f} ms")
    if "gen_busy" in m:
        line += (f" | busy gen {m['gen_busy']:.2f} train {m['train_busy']:.2f} "
                 f"| sync {m['sync_ms']:.0f} ms")
    return line


def progress(run, args, loop_start):
    """The end of a step line: the last held-out pass rate and the time left at this run's pace so
    far (evals and checkpoints included)."""
    t0, step0 = loop_start
    left = (time.time() - t0) / max(run.step - step0, 1) * (args.steps - run.step)
    held_out = f" | held-out {run.evals[-1][1]:.3f}" if run.evals else ""
    return f"{held_out} | ETA {int(left // 60)}m{int(left % 60):02d}s"


def local_rollouts(model, tokenizer, train, train_ids, curriculum, args, step):
    """One process, as generator 0 of 1 under --mode sync: the step's groups (step * prompts + p),
    one prompt each from the curriculum, their G samples drawn with pipeline.group_items' noise
    keys, verified, their pass rates recorded. -> (groups, each dict(index, prompt, samples,
    correct) as pipeline.receive_groups returns them; stats like receive_groups's: too_old, wait_s,
    gen_tokens, and seconds generating and verifying, the curriculum's retired prompts and epoch).
    No groups when the curriculum has retired every prompt; None when a signal stopped the
    sampling."""
    before = curriculum.state_dict()
    try:
        # as pipeline.admit picks them
        idx = [i for _ in range(args.prompts) for i in curriculum.next_batch(1)]
    except StopIteration as err:
        print(err, flush=True)
        return [], None
    items = [it for p, i in enumerate(idx)
             for it in pipeline.group_items(train_ids[i], step * args.prompts + p, args.samples)]
    prompt_ids = [prompt for prompt, _, _ in items]
    problems = [train[i] for i in idx for _ in range(args.samples)]
    model.eval()
    result = rollout(model, tokenizer, prompt_ids, problems, args, [key for _, key, _ in items],
                     version=step, max_prompt_len=max(map(len, train_ids)))
    # stopped by a signal: this step is not taken, and its prompts are not served
    if result is None:
        curriculum.load_state_dict(before)
        return None, None
    samples, _, correct, gen_s, verify_s = result
    groups = []
    for j, i in enumerate(idx):  # samples come in blocks of G per prompt
        block = slice(j * args.samples, (j + 1) * args.samples)
        curriculum.record(i, float(np.mean(correct[block])))
        groups.append({"index": i, "prompt": train_ids[i], "samples": samples[block],
                       "correct": correct[block]})
    stats = {"too_old": 0, "wait_s": 0.0, "gen_s": gen_s, "verify_s": verify_s,
             "retired": len(curriculum.retired), "epoch": curriculum.epoch,
             "gen_tokens": sum(len(p) + len(s.tokens) for p, s in zip(prompt_ids, samples))}
    return groups, stats

# -----------------------------------------------------------------------------
# the trainer: its state, one batch, one optimizer step, the metrics of a step


@dataclass
class Run:
    """What the training loop carries from step to step (and a checkpoint saves)."""
    model: object  # the model trained (under --fsdp: sharded)
    # the model evaluated and saved (under --fsdp: rank 0's unsharded copy; else `model`)
    full_model: object
    # the loss's forward: None = generate.sequence_logprobs; --fsdp: pipeline.LogProbs, sharded
    forward: object
    opt: object
    sched: object
    curriculum: Curriculum  # one process only (generators keep their own)
    n_params: int
    domains: list  # the training problems' domains: one pass-rate curve each when they mix
    step: int = 0
    compute_s: float = 0.0  # device-seconds: training wall-clock x processes
    flops: float = 0.0
    bad_steps: int = 0  # consecutive skipped optimizer steps (non-finite loss or gradient)
    empty_steps: int = 0  # consecutive steps that kept no prompt (nothing to train on)
    warned: set = field(default_factory=set)  # the alarms already raised (each is said once)
    # the learning rate of the step just taken (the scheduler already holds the next one)
    lr: float = 0.0
    # (compute_s, held-out pass rate) of every eval, for the live fit
    evals: list = field(default_factory=list)
    full_opt: dict = None  # --fsdp: the optimizer state gathered on rank 0 for the next save
    # --dtype bfloat16, replicated trainer: the float32 copies AdamW steps (None: AdamW
    # steps the weights themselves: float32, or FSDP2's float32 shards)
    master: list = None
    full_master: list = None  # --fsdp and a half dtype: the float32 weights gathered for the save


def new_run(args, ctx, model, train, state, rank0):
    """The trainer's state: AdamW, the warm-up schedule, the curriculum, FSDP2 shards (--fsdp), and
    on --resume everything the checkpoint saved."""
    n_params = sum(p.numel() for p in model.parameters())
    model, full_model, forward = pipeline.trainer_model(ctx, model, args.fsdp, rank0,
                                                        state.get("master"))
    master = master_weights(model, state.get("master")) if forward is None else None
    opt = torch.optim.AdamW(master or model.parameters(), lr=args.lr, eps=args.adam_eps,
                            weight_decay=args.weight_decay)
    warmup = lambda s: min(1.0, (s + 1) / args.warmup)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    # generator 0 of 1
    _, curriculum = pipeline.problems_of(len(train), 0, 1, args.seed, args.no_positive_resampling)
    run = Run(model, full_model, forward, opt, sched, curriculum,
              n_params, sorted({p.get("domain", "math") for p in train}), state.get("step", 0),
              state.get("compute_s", 0.0), state.get("flops", 0.0), master=master)
    if state:
        # --fsdp: every trainer keeps its shard of the saved full optimizer state
        if forward is not None:
            pipeline.load_sharded_optimizer(model, opt, state["optimizer"])
        else:
            opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        run.curriculum.load_state_dict(state["curriculum"])
        torch.set_rng_state(state["torch_rng"])
        # the flags given now apply from here (check_resume printed the changes)
        for group in opt.param_groups:
            group.update(lr=args.lr * warmup(sched.last_epoch), initial_lr=args.lr,
                         eps=args.adam_eps, weight_decay=args.weight_decay)
        sched.base_lrs = [args.lr] * len(opt.param_groups)
        run.curriculum.npr = args.no_positive_resampling
    return run


@dataclass
class Batch:
    """One trainer's part of a step's batch: every sample received, and the rows that enter the
    loss."""
    prompt_ids: list  # per sample, its prompt's token ids
    samples: list  # generate.Sample
    correct: list  # bool per sample
    rewards: torch.Tensor  # (N,)
    group: torch.Tensor  # (N,) the sample's prompt group
    truncated: torch.Tensor  # (N,) bool: no eos within the budget
    valid: torch.Tensor  # (N,) bool: may enter the loss (untruncated, unless --keep_truncated)
    rows: list  # the samples that enter the loss: valid, in a group with unequal rewards
    adv: torch.Tensor  # (len(rows),)
    # over every trainer: prompt, sample and token counts of the rows (the loss's denominators)
    sums: dict


def make_batch(groups, args, ctx):
    """Rewards, truncated samples out (paper A.15), zero-variance filtering, advantages (the batch
    std over every trainer's part of the batch)."""
    samples = [s for g in groups for s in g["samples"]]
    correct = [c for g in groups for c in g["correct"]]
    rewards = rewards_of(samples, correct, args)
    group = torch.tensor([j for j, g in enumerate(groups) for _ in g["samples"]], dtype=torch.long)
    truncated = torch.tensor([s.finish == "truncated" for s in samples], dtype=torch.bool)
    valid = torch.ones(len(samples), dtype=torch.bool) if args.keep_truncated else ~truncated
    keep = zero_variance_keep(rewards, group, valid) if args.zero_var_filter else valid
    rows = keep.nonzero().squeeze(1).tolist()
    adv = advantages(rewards[rows], group[rows], args.adv_norm,
                     all_sum=(lambda d: pipeline.all_reduce_stats(ctx, d)[0]) if ctx else None)
    masks = [torch.tensor(samples[r].mask) for r in rows]
    sums, _ = pipeline.all_reduce_stats(
        ctx, agg_counts(group[rows], torch.cat(masks) if masks else torch.zeros(0)))
    return Batch([g["prompt"] for g in groups for _ in g["samples"]], samples, correct, rewards,
                 group, truncated, valid, rows, adv, sums)


def master_weights(model, saved=None):
    """Mixed precision as the paper trains (bf16 weights, float32 optimizer): for weights in a half
    dtype, float32 copies for AdamW to step (the saved ones on --resume), else None. Stepping bf16
    weights directly rounds away every update under half a unit in their last place: at lr 5e-7 a
    weight of 0.02 (bf16 spacing 1.2e-4) would never move."""
    params = list(model.parameters())
    if params[0].dtype == torch.float32:
        return None
    return [torch.nn.Parameter(s.to(p.device) if s is not None else p.detach().float())
            for p, s in zip(params, saved or [None] * len(params))]


def optimize(run, batch, args, ctx, device, pad_id):
    """Loss, backward over micro-batches, (all-reduce), clip, AdamW step; a non-finite loss or
    gradient skips the step (--max_bad_steps in a row stop the run).
    -> (loss, mismatch stats, gradient norm)."""
    model, forward, rows = run.model, run.forward, batch.rows
    model.train()
    n_local = len(set(batch.group[rows].tolist()))

    # the loss and backward over this trainer's micro-batches -> (loss, mismatch stats)
    def passes():
        if not rows:
            return 0.0, {}
        ids, attn, mask, gen_logp, lag = collate([batch.prompt_ids[r] for r in rows],
                                                 [batch.samples[r] for r in rows], pad_id, device,
                                                 run.step)
        return train_batch(model, (ids, attn, mask, gen_logp, batch.adv.to(device),
                                   batch.group[rows].to(device), lag),
                           args, n_local, total=batch.sums[args.agg], forward=forward)
    n_micro = math.ceil(n_local / (args.micro_prompts or max(n_local, 1)))
    loss_value, mismatch = pipeline.batch_grads(ctx, model, forward, n_micro, passes, pad_id,
                                                args.fp32_head, args.temperature)
    if run.master:  # the (all-reduced) half-precision gradients onto the float32 copies
        for p, m in zip(model.parameters(), run.master):
            m.grad = None if p.grad is None else p.grad.float()
    stepped = run.master or list(model.parameters())
    grad_norm = torch.nn.utils.clip_grad_norm_(stepped, args.grad_clip or float("inf"))
    grad_norm = (grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm).item()
    # grads are all-reduced: all trainers agree
    if math.isfinite(grad_norm) and math.isfinite(loss_value):
        run.opt.step()
        run.sched.step()
        run.bad_steps = 0
        if run.master:  # the weights sampled and trained with: the float32 copies, rounded
            with torch.no_grad():
                for p, m in zip(model.parameters(), run.master):
                    p.copy_(m)
    else:
        # a NaN/inf loss or gradient: skip the update (the weights sent next are the last good
        # ones)
        run.bad_steps += 1
        if ctx is None or ctx.rank == 0:
            print(f"step {run.step + 1}: loss {loss_value} / gradient norm {grad_norm}: "
                  f"not finite, optimizer step skipped ({run.bad_steps} in a row, "
                  f"--max_bad_steps {args.max_bad_steps})", flush=True)
        if run.bad_steps >= args.max_bad_steps:
            raise SystemExit(f"error: {run.bad_steps} consecutive steps with a non-finite loss or "
                             f"gradient (up to step {run.step + 1}); stopping. The last checkpoint "
                             "holds the last good weights.")
    run.opt.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    return loss_value, mismatch, grad_norm


def step_metrics(run, batch, groups, rstats, train, ctx, loss_value, grad_norm, mismatch, dt):
    """The step just taken, summed over every trainer's part of its batch (a collective; every
    trainer calls it) -> the metrics dict that rank 0 logs. Adds the step's FLOPs to run.flops."""
    step, samples, rows = run.step - 1, batch.samples, batch.rows  # the version the step trained
    lags = [step - v for r in rows for v, m in zip(samples[r].versions, samples[r].mask) if m]
    domains = run.domains
    sums, maxes = pipeline.all_reduce_stats(ctx, {
        "groups": len(groups), "kept": len(set(batch.group[rows].tolist())), "n": len(samples),
        "reward": batch.rewards.sum().item(), "correct": sum(batch.correct),
        "len": sum(len(s.tokens) for s in samples),
        "trunc": sum(batch.truncated.tolist()), "intr": sum(0 in s.mask for s in samples),
        "excluded": int((batch.truncated & ~batch.valid).sum()),
        "nll": -sum(lp for s in samples for lp, m in zip(s.logps, s.mask) if m),
        "sampled": sum(sum(s.mask) for s in samples),
        "lag": sum(lags), "lag_n": len(lags), "too_old": rstats["too_old"],
        "gen_tokens": rstats["gen_tokens"],
        "train_tokens": sum(len(batch.prompt_ids[r]) + len(samples[r].tokens) for r in rows),
        "loss": loss_value,
        **{f"{key}/{d}": sum(c if key == "correct" else 1 for g in groups
                             if train[g["index"]].get("domain", "math") == d
                             for c in g["correct"])
           for d in domains for key in ("correct", "n")}},
        {"lag_max": max(lags, default=0)})
    run.flops += 2 * run.n_params * sums["gen_tokens"] + 6 * run.n_params * sums["train_tokens"]
    n = sums["n"]
    m = {"kind": "train", "step": run.step, "compute_s": run.compute_s, "flops": run.flops,
         "reward": sums["reward"] / n, "pass_rate": sums["correct"] / n, "len": sums["len"] / n,
         "trunc": sums["trunc"] / n, "intr": sums["intr"] / n,
         "excluded_truncated": int(sums["excluded"]),
         # mean -log p of the sampled tokens: estimates it
         "entropy": sums["nll"] / max(sums["sampled"], 1),
         "lag": sums["lag"] / max(sums["lag_n"], 1), "lag_max": maxes.get("lag_max", 0),
         "prompts": int(sums["groups"]),
         "kept_prompts": int(sums["kept"]), "dropped_zero_var": int(sums["groups"] - sums["kept"]),
         "too_old": int(sums["too_old"]), "skipped_bad": run.bad_steps > 0, "loss": sums["loss"],
         "grad_norm": grad_norm, "lr": run.lr, "dt_ms": dt * 1000,
         "tok_s": sums["len"] / rstats["gen_s"] if ctx is None else sums["train_tokens"] / dt,
         **mismatch}
    if len(domains) > 1:  # one pass-rate curve per domain, as the paper fits them
        m.update({f"pass_rate/{d}": sums[f"correct/{d}"] / max(sums[f"n/{d}"], 1) for d in domains})
    return m


def alarms(run, m, args, rank0):
    """Paper A.15: watch the truncations. Rank 0 warns once, in one line, when a batch's
    hard-truncation rate passes 10% (where the paper's instability band starts) and when a step
    keeps no prompt. After --max_empty_steps steps in a row that kept nothing -> why the run should
    stop (every trainer computes the same from the summed metrics), else None: with nothing kept the
    optimizer never steps again, and the run would spin."""
    def warn(key, text):
        if rank0 and key not in run.warned:
            print(f"warning: step {m['step']}: {text}", flush=True)
        run.warned.add(key)
    if m["trunc"] > 0.10:
        warn("trunc", f"{m['trunc']:.0%} of the batch was truncated (no eos within the budgets); "
             "the paper's runs became unstable above 10-15%. Truncated samples leave the loss, so "
             "a format that runs out of budget gets no gradient: watch trunc and drift")
    run.empty_steps = run.empty_steps + 1 if m["kept_prompts"] == 0 else 0
    if run.empty_steps:
        warn("empty", f"no prompt kept (trunc {m['trunc']:.2f}, pass@1 {m['pass_rate']:.2f}): "
             "nothing to train on, the optimizer step is skipped; the run stops after "
             f"{args.max_empty_steps} such steps in a row")
    if run.empty_steps < args.max_empty_steps:
        return None
    if m["trunc"] >= 0.5:
        cause = ("the samples run out of budget (the policy writes past --answer_budget / "
                 "--think_budget), and truncated samples carry no gradient that could pull it "
                 "back. Raise --answer_budget, or train on them with --keep_truncated, or lower "
                 "--lr / --max_lag")
    elif m["pass_rate"] >= 0.5:
        cause = ("every group was all correct: the policy has solved these prompts "
                 "(harder data, or stop here)")
    else:
        cause = ("every group was all wrong: the prompts are too hard for this policy "
                 "(easier data, more --samples)")
    return (f"stopping at step {m['step']}: {run.empty_steps} steps in a row kept no prompt "
            f"(--max_empty_steps {args.max_empty_steps}): {cause}")


def gather_shards(run, rank0, with_optimizer):
    """--fsdp, every trainer: the shards into rank 0's unsharded copy (and the full optimizer
    state)."""
    with torch.no_grad():
        gathered = pipeline.full_weights(run.model)
        if rank0:
            for p, full in zip(run.full_model.parameters(), gathered):
                p.copy_(full)  # a half --dtype: rounded from FSDP2's float32 shards
    if with_optimizer:
        run.full_opt = pipeline.full_optimizer_state(run.model, run.opt)
        half = next(run.full_model.parameters()).dtype != torch.float32 if rank0 else False
        run.full_master = [g.detach().cpu() for g in gathered] if half else None


def run_eval(run, args, tokenizer, val_ids, val, log):
    """Trainer 0 (pipeline.on_trainer0): the held-out pass rate now, the live fit of the curve so
    far, one log line."""
    run.full_model.eval()
    result = evaluate(run.full_model, tokenizer, val_ids, val, args)
    if result is None:  # a signal stopped it: no eval line
        return
    m = {"kind": "eval", "step": run.step, "compute_s": run.compute_s, "flops": run.flops, **result}
    run.evals.append((run.compute_s, result["pass_rate"]))
    C, R = np.array(run.evals).T
    try:  # a diagnostic: a curve that cannot be fitted yet must not stop the run
        pred = predict_final(C, R, C_end=run.compute_s / max(run.step, 1) * args.steps)
    except ValueError as err:
        pred = None
        print(f"eval step {run.step}: no live fit ({err})")
    if pred:
        m.update(fit_A=pred["A"], fit_B=pred["B"], fit_C_mid=pred["C_mid"],
                 predicted_final=pred["R_end"])
    log(m)
    fit_txt = (f" | fit A {pred['A']:.3f} B {pred['B']:.2f} C_mid {pred['C_mid']:.0f} device-s "
               f"-> predicted {pred['R_end']:.3f} at step {args.steps}") if pred else ""
    per_domain = "".join(f" | {k.split('/')[1]} {v:.3f}" for k, v in result.items()
                         if k.startswith("pass_rate/"))
    print(f"eval step {run.step} | held-out pass rate {result['pass_rate']:.3f} "
          f"+- {result['pass_rate_se']:.3f} (mean@{args.eval_samples}, n={result['n']})"
          f"{per_domain} | trunc {result['trunc']:.3f} | intr {result['intr']:.3f}{fit_txt}",
          flush=True)


def save(run, args, tokenizer):
    """Rank 0: a checkpoint of the weights and everything --resume needs."""
    state = {"optimizer": run.full_opt if run.forward is not None else run.opt.state_dict(),
             "scheduler": run.sched.state_dict(), "curriculum": run.curriculum.state_dict(),
             "step": run.step, "compute_s": run.compute_s, "flops": run.flops,
             "torch_rng": torch.get_rng_state(), "args": vars(args),
             # a half --dtype: the float32 weights AdamW steps (the saved model holds them rounded)
             "master": ([m.detach().cpu() for m in run.master] if run.master else run.full_master)}
    print(
        f"saved {save_checkpoint(args.out, run.step, run.full_model, tokenizer, state, args.keep)}",
        flush=True)


# -----------------------------------------------------------------------------
# the training loop


def main(args):
    # the log holds our own lines (no "Loading weights" / "Writing shards" bars)
    hf_logging.disable_progress_bar()
    if args.eval_only:
        return eval_only(args)
    # ---- setup: output folder, data, ranks, device, model
    t_start = time.time()
    rank0 = int(os.environ.get("RANK", "0")) == 0
    # user errors first: nothing is made in --out before they are all checked
    train, val = load_data(args)
    check_code_rewards(args, train + val)
    prepare_out_dir(args)
    log = metrics_log(args, rank0)  # checks --wandb/--tensorboard before ranks wait
    note_toy_model(args, args.data, "--data", "trains")
    ckpt, state = resume_point(args, quiet=not rank0)
    ctx = pipeline.setup(args)  # None for one process; else this rank's role and process groups
    torch.manual_seed(args.seed)
    model_dir = ckpt or args.model_dir or base_model_dir(args)
    device = pick_device(args, ctx)
    tokenizer, model = load_model(model_dir, args, device)
    train_ids, val_ids = tokenize_prompts(tokenizer, train), tokenize_prompts(tokenizer, val)
    if ctx:  # rollouts travel as packed rows of this many tokens per sample
        pipeline.start(ctx, state.get("step", 0),
                       max(map(len, train_ids)) + args.think_budget + args.answer_budget +
                       len(special_tokens(tokenizer)["interrupt_ids"]))
        if ctx.role == "generator":
            path = os.path.join(args.out, f"curriculum-rank{ctx.rank}.json")
            pipeline.run_generator(ctx, args, model, tokenizer, train, train_ids,
                                   state.get("step", 0), path)
            return pipeline.finish(ctx)

    # ---- the trainer's state: optimizer, schedule, curriculum (one process), FSDP2 shards, the
    # resumed step
    run = new_run(args, ctx, model, train, state, rank0)
    # need: groups per step here
    world, need = (ctx.world, args.prompts // ctx.n_trainers) if ctx else (1, args.prompts)
    if rank0:
        start_metrics(args, run, ckpt, world)
        roles = (f"{ctx.n_trainers} trainer + {ctx.n_gens} generator ranks, {args.mode}, "
                 f"max lag {ctx.k}" if ctx else "one process, synchronous")
        print(f"model {model_dir} ({run.n_params / 1e6:.2f}M params, {model.config.model_type}) "
              f"on {device} | {roles} | {len(train)} train / {len(val)} held-out problems | "
              f"{args.prompts} prompts x {args.samples} samples")
    held_out_eval = lambda: pipeline.on_trainer0(
        ctx, run.step, partial(run_eval, run, args, tokenizer, val_ids, val, log))
    # step -> (groups, stats): sampled here or by generators
    rollouts = (partial(local_rollouts, model, tokenizer, train, train_ids, run.curriculum, args)
                if ctx is None else partial(pipeline.receive_groups, ctx))
    if run.step == 0:
        held_out_eval()
    evaluated_at = saved_at = run.step  # step 0 is evaluated above; a resumed step was saved
    signaled, stopped, loop_start = False, None, (time.time(), run.step)
    while run.step < args.steps:
        signaled = pipeline.all_reduce_stats(
            ctx, {"stop": pipeline.stop_requested(ctx)})[0]["stop"] > 0
        if signaled:
            # SIGINT / SIGTERM (any rank): save the last finished step below and say how to resume
            break
        # ---- rollouts: G samples per prompt; one process: sampled here (lag 0), else from the
        # generators
        t0 = time.time()
        groups, rstats = rollouts(run.step)
        if groups is None:  # one process: a signal stopped the sampling under way
            signaled = True
            break
        if pipeline.all_reduce_stats(ctx, {"short": len(groups) < need})[0]["short"]:
            stopped = (f"stopping at step {run.step}: out of prompts "
                       "(No-Positive-Resampling retired every one)")
            print(stopped, flush=True)
            break

        # ---- batch, then train: loss, backward, (all-reduce), clip, AdamW step
        batch = make_batch(groups, args, ctx)
        # the rate this step trains with
        t_train, run.lr = time.time(), run.opt.param_groups[0]["lr"]
        loss_value, mismatch, grad_norm = (
            optimize(run, batch, args, ctx, device, tokenizer.pad_token_id or 0)
            if batch.sums["sample"] else (0.0, {}, 0.0))
        t_train = time.time() - t_train
        run.step += 1
        sync_s, sync_bytes = pipeline.publish_weights(ctx, model, run.step, run.step == args.steps,
                                                      args.bucket_mb, getattr(torch, args.dtype))

        # ---- accounting and logging (sums over every trainer's part of the batch)
        dt = time.time() - t0
        run.compute_s += dt * world  # every device, busy or not
        m = step_metrics(run, batch, groups, rstats, train, ctx, loss_value, grad_norm,
                         mismatch, dt)
        eval_now = run.step % args.eval_every == 0 or run.step == args.steps
        save_now = (args.save_every and run.step % args.save_every == 0) or run.step == args.steps
        evaluated_at = run.step if eval_now else evaluated_at
        saved_at = run.step if save_now else saved_at
        if run.forward is not None and (eval_now or save_now):
            gather_shards(run, rank0, save_now)
        if rank0:
            log(m | pipeline.busy_metrics(ctx, dt, rstats, t_train, sync_s, sync_bytes))
            if run.step % args.log_every == 0 or run.step == args.steps:
                print(log_line(m, args.steps) + progress(run, args, loop_start), flush=True)
        stop = alarms(run, m, args, rank0)

        # ---- checkpoint, then eval (trainer 0; not counted as compute): an eval that fails loses
        # no step
        if rank0 and save_now:
            save(run, args, tokenizer)
        if eval_now:
            held_out_eval()
        if stop:
            if rank0:
                print(stop, flush=True)
            stopped = stop
            break

    # ---- the end: a run stopped early (every prompt retired, a signal) is saved, and evaluated
    # unless a signal asked it to stop; ranks leave together. A run that stopped itself says so in
    # its metrics (kind "stopped"): it is over, not interrupted (study.py counts it as finished)
    if stopped:
        log({"kind": "stopped", "step": run.step, "reason": stopped})
    evaluated_at = run.step if signaled else evaluated_at
    if run.forward is not None and (run.step != saved_at or run.step != evaluated_at):
        gather_shards(run, rank0, run.step != saved_at)
    if rank0 and run.step != saved_at:
        save(run, args, tokenizer)
    if run.step != evaluated_at:
        held_out_eval()
    pipeline.end_trainer(ctx, run.step)
    if rank0 and signaled:
        saved = checkpoints(args.out)[-1:] or ["nothing (no step finished yet)"]
        print(f"stopped by a signal after step {run.step}/{args.steps}; saved {saved[0]}; "
              f"continue with: {resume_command()}", flush=True)
    elif rank0:
        summary(args, time.time() - t_start)
    release_lock()  # the run is over: --out is free again


def summary(args, seconds):
    """The end of a run in a few lines: time, held-out first -> last, the fit's prediction, where
    things are."""
    metrics_path = os.path.join(args.out, "metrics.jsonl")
    evals = [r for _, r in read_jsonl(metrics_path) if r.get("kind") == "eval"]
    print(f"done in {seconds / 60:.1f} min | held-out pass rate {evals[0]['pass_rate']:.3f} -> "
          f"{evals[-1]['pass_rate']:.3f} (step {evals[0]['step']} -> {evals[-1]['step']})"
          if evals else f"done in {seconds / 60:.1f} min (no eval)")
    if evals and "fit_A" in evals[-1]:
        last = evals[-1]
        print(f"fit A {last['fit_A']:.3f} B {last['fit_B']:.2f} C_mid {last['fit_C_mid']:.3g} "
              f"device-s -> predicted {last['predicted_final']:.3f} at the end "
              f"(measured {last['pass_rate']:.3f})")
    print(f"metrics: {metrics_path} | checkpoints: {args.out}/ckpt-* | "
          f"next: python fit.py {args.out}", flush=True)


if __name__ == "__main__":
    args = get_args()
    if not args.eval_only:  # an eval has nothing to save: a signal stops it at once
        pipeline.stop_on_signals()
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        main(args)
    else:
        try:
            main(args)
        except SystemExit as err:
            # a user error: one line, said by rank 0 alone (every rank meets it)
            if (err.code not in (None, 0) and not isinstance(err.code, int)
                    and int(os.environ["RANK"]) == 0):
                print(err.code, file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(err.code if isinstance(err.code, int) else 1)
        except BaseException as err:
            # one rank failing: print why, and exit without waiting on the others
            traceback.print_exc()
            pipeline.report_failure(err)
            sys.stderr.flush()
            os._exit(1)
    if pipeline.STOP:  # stopped by a signal, its step saved: the status a signal gives
        sys.exit(128 + signal.Signals[pipeline.STOP["name"]].value)
