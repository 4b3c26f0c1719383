"""
train.py: the ScaleRL training loop (arXiv 2510.13786: section 2's setup, section 3.1's
generator/trainer split, section 4's recipe, section 5's scaling axes).

`main` reads as the algorithm. Each step: `source.get(step)` gives the step's groups (prompts from
the curriculum, G completions each from the KV-cache sampler with forced interruptions, verified:
verify.py, programs in sandbox.py; a reward is a float), `make_batch` drops truncated samples and
zero-variance groups and computes the advantages (loss.py), `trainer.step(batch)` takes the CISPO
loss with prompt-level aggregation over micro-batches of at most --micro_tokens tokens, sums the
gradients over the trainers and takes an AdamW step (eps 1e-15, weight decay 0.01, linear warm-up
then constant; float32 master weights under --dtype bfloat16), and `source.publish(trainer)` sends
the new weights to the sampler. Then logging, alarms, held-out evals (mean@k and the live
scaling-curve fit, fit.py) and checkpoints. What differs between one process, torchrun and FSDP2
is chosen once, at start-up: the rollout source (pipeline.LocalRollouts: the generator code run
in-process; pipeline.RemoteRollouts: a trainer rank's groups from generator ranks) and the trainer
(Trainer: replicated; ShardedTrainer: --fsdp). Generator ranks run pipeline.serve_rollouts and
never enter main.

Every ScaleRL choice is a flag whose default is ScaleRL's; the sizes come from a recipe (RECIPES:
the embedded toy's on the embedded models, the paper's appendix A.3 otherwise).

Outputs in --out: metrics.jsonl (one JSON object per step and per eval; fit.py reads it), one log
line per step, checkpoints ckpt-STEP/ (a from_pretrained-able model folder + state.pt; under
--fsdp also the sharded float32 weights and AdamW state) and --resume; what is done to the folder
itself (checks, lock, pruning, resume) is in runs.py.

Compute is counted as device-seconds of the training loop (wall-clock x devices; evaluation and
checkpointing are not counted) and as estimated FLOPs: 2 N per generated or prompt token plus
6 N per trained token, N = parameter count (attention FLOPs ignored).

    python train.py                            # the embedded toy task and model, CPU, 2 minutes
    python train.py --loss dapo --no-fp32_head # an ablation: one flag per ScaleRL choice
    python train.py --model Qwen/Qwen3-0.6B --data openai/gsm8k:main --recipe one_gpu
    torchrun $LOCAL --nproc_per_node 8 train.py --model DIR --data FILE --gen_ranks 6 --fsdp
                                               # the paper's recipe on one node (README.md)
    python fit.py runs/toy                     # fit the sigmoid to the run's held-out curve
"""

import argparse
import difflib
import glob
import itertools
import json
import math
import os
import re
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from data import (PRESETS, format_prompt, load_source_problems, prompts_ids, read_jsonl,
                  resolve_model, special_tokens, split_problems, toy_model_dir, toy_task)
import faults
import pipeline
import plan
from generate import SUPPORTED, check_supported, config_problem, packed_logprobs
from loss import (AGGS, EPS_DEFAULTS, NORMS, advantages, agg_counts, clip_eps, drift_by_lag,
                  forgetting, policy_loss, ratio_stats, row_weights, zero_variance_keep)
from runs import (checkpoint_tmp, checkpoints, metrics_log, prepare_out_dir,
                  release_lock, resume_command, resume_point, safe_load_planner, save_checkpoint,
                  shard_reader, truncate_metrics, write_file)
from sandbox import bwrap_ready, not_ready_reason

# -----------------------------------------------------------------------------
# flags: defaults are ScaleRL's choices and the tiny CPU run's sizes (paper values in the help)

# interrupt: forced interruptions (ScaleRL); penalty: a length penalty on correct answers (paper
# section 3.1); none: only the budget's truncation
LENGTH_CONTROLS = ("interrupt", "penalty", "none")

SHARDS = "shards"  # under --fsdp: a checkpoint's sharded float32 weights and AdamW state

# What a run starts from (--recipe); a flag given overrides its value. toy: the embedded task's, on
# a CPU in minutes, with two toy settings its PipelineRL-8 stability needs (--neg_trust 0.5,
# --grad_clip 1; README's recipe table). paper: the paper's runs (appendix A.3: 48 prompts x 16,
# 12k thinking + 2k answer tokens with the interruption in the thinking budget's last sixth, lr 5e-7
# constant after 100 warm-up steps, eval every 100 steps on 1000 held-out prompts x 16; CISPO with
# no mask and no gradient clipping: AdamW eps 1e-15 instead), for any other model. one_gpu: the same
# recipe scaled to one GPU and a day.
RECIPES = {
    "toy": dict(prompts=16, samples=8, think_budget=48, answer_budget=64, lr=2e-4, warmup=10,
                steps=150, eval_every=10, eval_samples=4, val_size=None, save_every=50,
                dtype="float32", neg_trust=0.5, grad_clip=1.0),
    "paper": dict(prompts=48, samples=16, think_budget=12288, answer_budget=2048, lr=5e-7,
                  warmup=100, steps=2000, eval_every=100, eval_samples=16, val_size=1000,
                  save_every=100, dtype="bfloat16", neg_trust=0.0, grad_clip=0.0),
    "one_gpu": dict(prompts=16, samples=8, think_budget=4096, answer_budget=1024, lr=1e-6,
                    warmup=20, steps=500, eval_every=50, eval_samples=4, val_size=500,
                    save_every=100, dtype="bfloat16", neg_trust=0.0, grad_clip=0.0),
}


class FlagParser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block; "did you mean" for a mistyped flag), said
    once under torchrun (faults.say_error), and no abbreviations (--prompt is not taken for
    --prompts)."""

    def __init__(self, **kw):
        super().__init__(allow_abbrev=False, formatter_class=RecipeHelpFormatter, **kw)

    def error(self, message):
        flags = [o for a in self._actions for o in a.option_strings]
        typed = (re.findall(r"(--[\w-]+)", message)
                 if message.startswith("unrecognized arguments") else [])
        hints = [f"{t}: did you mean {close}?" for t in typed
                 if (close := closest_flag(t, flags))]
        line = (f"{self.prog}: error: {message}{''.join(' (' + h + ')' for h in hints)} "
                "(--help lists the flags)")
        faults.say_error(line)  # under torchrun: once, in its report
        self.exit(2)


class RecipeHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help: a recipe flag shows each recipe's value (toy / paper / one_gpu); a None default is
    said by the help's own words, not "default: None"."""

    def _get_help_string(self, action):
        if action.dest not in RECIPES["toy"]:
            return action.help if action.default is None else super()._get_help_string(action)
        show = lambda v: "auto" if v is None else f"{v:g}" if isinstance(v, float) else v
        values = ", ".join(f"{name} {show(r[action.dest])}" for name, r in RECIPES.items())
        return f"{action.help} (recipe: {values})"


def closest_flag(typed, flags):
    """The flag a mistyped one most likely meant, or None. Words first (split at - and _): the flags
    that share the most leading words with it, then whose next word begins the other's in 3 letters
    or more (--temp, --temperature), the closest of them by difflib; with nothing shared, difflib's
    closest above its usual 0.6 cutoff. Spelling alone picks a flag that looks alike over the one
    meant: --lr_rate is nearer --l_cache than --lr letter by letter."""
    def words(flag):
        return re.split(r"[-_]+", flag.lstrip("-"))

    def kinship(flag):  # (equal leading words, whether the next two begin one another)
        pairs = list(zip(words(typed), words(flag)))
        n = len(list(itertools.takewhile(lambda ab: ab[0] == ab[1], pairs)))
        a, b = sorted(pairs[n], key=len) if n < len(pairs) else ("", "")
        return n, len(a) >= 3 and b.startswith(a)  # 3 letters at least: "l" begins too much

    best = max(map(kinship, flags), default=(0, False))
    pool = [f for f in flags if kinship(f) == best] if any(best) else flags
    close = difflib.get_close_matches(typed, pool, 1, cutoff=0.0 if any(best) else 0.6)
    return close[0] if close else None


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
                   help="held-out problems (toy: 200, or a tenth of a --data of fewer than 2,000 "
                        "problems)")
    g.add_argument("--out", default=None,
                   help="output folder: metrics.jsonl and checkpoints; None = runs/ and the run's "
                        "shape: its data, and under torchrun its ranks, mode and --fsdp "
                        "(runs/toy, runs/toy-2ranks, runs/gsm8k-8ranks-fsdp, ...)")
    g.add_argument("--device", default="auto", help="auto = cuda when available, else cpu")
    g.add_argument("--recipe", default="auto", choices=["auto", *RECIPES],
                   help="the sizes and rates to start from (RECIPES; a flag given overrides its "
                        "value, and the start-up line names each one that differs): auto = toy "
                        "for the embedded tasks, paper for any --model")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="the weights' dtype for sampling and the loss's forward and backward; "
                        "AdamW always steps a float32 master copy (no float16: its gradients "
                        "underflow without loss scaling, which train.py does not do)")
    g.add_argument("--seed", type=int, default=0,
                   help="seeds the split, the curriculum and the sampling noise")


def rollout_flags(g):
    """The flags of --help's group "rollouts"."""
    g.add_argument("--prompts", type=int, default=None,
                   help="prompts per optimizer step")
    g.add_argument("--samples", type=int, default=None,
                   help="completions per prompt, G")
    g.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature (paper: 1.0)")
    g.add_argument("--slots", type=int, default=None,
                   help="rows the sampler decodes at once (continuous batching); None = 128 on "
                        "CPU, as many as --gen_memory fits on CUDA, at most what a generator can "
                        "have in flight (--slots caps them too)")
    g.add_argument("--gen_memory", type=float, default=0.85,
                   help="CUDA: the fraction of the device memory left after the weights that the "
                        "sampler's KV cache may take (vLLM's gpu_memory_utilization); the "
                        "sequences that fit at their mean length are printed. Ranks sharing one "
                        "GPU: lower it (two ranks of the toy on one H100 ran at 0.3)")
    g.add_argument("--think_budget", type=int, default=None,
                   help="thinking tokens")
    g.add_argument("--answer_budget", type=int, default=None,
                   help="answer tokens after </think>. The toy's answer is "
                        "11 tokens; 64 leaves room for a whole rethought chain plus the answer, so "
                        "a policy that changes format is scored (-1) rather than truncated (out of "
                        "the loss, no gradient)")
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
    g.add_argument("--neg_trust", type=float, default=None,
                   help="cispo: a token of a negative-advantage sample whose IS ratio has fallen "
                        "below this gives no gradient (CISPO's token mask M, as PPO clips A < 0); "
                        "0 = off, the paper's CISPO. A toy setting: under PipelineRL-8 it keeps "
                        "the toy from drifting off tokens its stale samples share (BENCHMARKS.md "
                        "section 6)")
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
    g.add_argument("--steps", type=int, default=None, help="optimizer steps")
    g.add_argument("--lr", type=float, default=None,
                   help="learning rate. The toy's 2e-4 holds under "
                        "PipelineRL-8 with every token 8 versions old; 3e-4 collapsed there "
                        "(BENCHMARKS.md section 6)")
    g.add_argument("--warmup", type=int, default=None,
                   help="linear warm-up steps")
    g.add_argument("--weight_decay", type=float, default=0.01,
                   help="AdamW weight decay (paper: 0.01)")
    g.add_argument("--adam_eps", type=float, default=1e-15,
                   help="a larger eps silently damps tiny gradients")
    g.add_argument("--grad_clip", type=float, default=None,
                   help="max gradient norm; 0 = off, the paper's (AdamW eps 1e-15 instead); the "
                        "toy's 1 is a toy setting (README, \"Recipes\")")
    g.add_argument("--micro_tokens", type=int, default=8192,
                   help="tokens per forward/backward, rows packed into one (a row longer than "
                        "that alone): the trainer's activations are sized by it, not by the group "
                        "or the sample length; 0 = the whole batch at once")
    g.add_argument("--ckpt_layers", default="auto", choices=["auto", "on", "off"],
                   help="recompute each decoder layer in the backward (activation checkpointing: "
                        "a layer keeps its input alone); auto = on above 4 layers")
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
                        "(FSDP2); no trainer keeps a whole copy, and checkpoints keep the float32 "
                        "shards and AdamW state sharded")


def logging_flags(g):
    """The flags of --help's group "evaluation, logging, checkpoints"."""
    g.add_argument("--eval_every", type=int, default=None,
                   help="steps between held-out evals")
    g.add_argument("--log_every", type=int, default=1,
                   help="print the step line every N steps (and the last one); metrics.jsonl "
                        "keeps every step")
    g.add_argument("--eval_samples", type=int, default=None,
                   help="samples per held-out prompt, mean@k")
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
    g.add_argument("--save_every", type=int, default=None,
                   help="steps between checkpoints; 0 = only at the end")
    g.add_argument("--keep", type=int, default=2, help="checkpoints kept")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest intact checkpoint in --out")
    g.add_argument("--overwrite", action="store_true",
                   help="start over in an --out that holds a run: its metrics, checkpoints and "
                        "curriculum files are deleted first (without it or --resume such an --out "
                        "is refused)")


def make_parser():
    ap = FlagParser(prog="train.py", description="ScaleRL training loop")
    model_flags(ap.add_argument_group("model and data"))
    rollout_flags(ap.add_argument_group("rollouts"))
    loss_flags(ap.add_argument_group("loss (loss.py)"))
    optimization_flags(ap.add_argument_group("optimization"))
    rank_flags(ap.add_argument_group("ranks (pipeline.py; under torchrun only)"))
    logging_flags(ap.add_argument_group("evaluation, logging, checkpoints"))
    return ap


def get_args(argv=None):
    ap = make_parser()
    args = ap.parse_args(argv)
    # what loads; args.model stays as typed (--resume compares it)
    args.model_dir = check_model_dir(args.model, ap.error)
    apply_recipe(args)
    args.out = args.out or default_out(args)
    check_args(args, ap.error)
    return args


def default_out(args):
    """runs/ and the run's shape: its data (a preset's name, a file's or dataset's stem, several
    joined by +), and under torchrun its ranks, mode and --fsdp: the README's commands, run one
    after another, write different folders."""
    name = "+".join(os.path.splitext(os.path.basename(p.split(":")[0].rstrip("/")))[0] or p
                    for p in (args.data or "toy").split(","))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        name += f"-{world}ranks" + ("" if args.mode == "pipeline" else f"-{args.mode}") + \
            ("-fsdp" if args.fsdp else "")
    return os.path.join("runs", name)


def apply_recipe(args):
    """--recipe auto: toy for the embedded models (and a model built or trained from one: its
    config.json names the task, data.py's scalerl_task), paper for any other --model. Every
    recipe flag not given takes the recipe's value."""
    if args.recipe == "auto":
        task = ""
        if args.model_dir and os.path.isfile(os.path.join(args.model_dir, "config.json")):
            with open(os.path.join(args.model_dir, "config.json")) as f:
                task = json.load(f).get("scalerl_task", "")
        args.recipe = "toy" if not args.model_dir or task in PRESETS else "paper"
    for name, value in RECIPES[args.recipe].items():
        if getattr(args, name) is None:
            setattr(args, name, value)


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
    **dict.fromkeys(("neg_trust", "micro_tokens", "grad_clip", "save_every", "l_max",
                     "l_cache", "gen_ranks", "weight_decay", "eps_low"), AT_LEAST_0),  # 0: --help
    "timeout": SECONDS, "heartbeat_timeout": SECONDS,
    "seed": (lambda v: 0 <= v < 2 ** 63, "in [0, 2^63)"),
    # the fraction of the device memory the sampler's KV cache takes
    "gen_memory": (lambda v: 0 < v <= 1, "a fraction of the device memory, in (0, 1]"),
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
    if args.model_dir and os.path.isfile(os.path.join(args.model_dir, "config.json")):
        with open(os.path.join(args.model_dir, "config.json")) as f:
            context = json.load(f).get("max_position_embeddings")
        if (why := context_error(args, context)):
            error(why)


def context_error(args, context, prompt_len=0, phrase_len=0):
    """The budgets against the model's context (max_position_embeddings; Qwen2.5-Math has 4096):
    the longest prompt, the thinking budget, the interruption phrase and the answer budget must
    fit in it -> a one-line error naming the flags, or None. At argument parsing the prompts are
    not tokenized yet (0); start() checks again once they are."""
    need = prompt_len + args.think_budget + args.answer_budget + phrase_len
    if context is None or need <= context:
        return None
    prompt = f"the longest prompt ({prompt_len} tokens) + " if prompt_len else ""
    phrase = f" + the interruption phrase ({phrase_len})" if phrase_len else ""
    return (f"{prompt}--think_budget {args.think_budget} + --answer_budget {args.answer_budget}"
            f"{phrase} = {need} tokens: more than the model's context (max_position_embeddings "
            f"{context}); lower the budgets")


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
    try:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        config = {"model_type": f"unreadable ({type(err).__name__}: {err})"}
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in SUPPORTED:
        error(f"--model {name}: model_type {model_type!r} is not supported by the sampler "
              f"({', '.join(SUPPORTED)})")
    elif problem := config_problem(config):
        error(f"--model {name}: config.json: {problem}")
    return folder


# -----------------------------------------------------------------------------
# data, the model, held-out evals


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
        return [dict(p) for p in toy_task(seed, path)]
    try:
        return load_source_problems(path, "test" if flag == "--val_data" else "train")
    except OSError as err:
        sys.exit(f"error: {flag} {path}: {err.strerror or err}")
    except ValueError as err:
        sys.exit(f"error: {flag}: {err}")


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
    """A real dataset without --model: say at start that the toy model only knows the toy task, and
    which sources of a mix (toy,fixtures/code_toy.jsonl) it does not know."""
    sources = (paths or "toy").split(",")
    others = [p for p in sources if p not in PRESETS]
    if not others or args.model:
        return
    known = [p for p in sources if p in PRESETS]
    knows = (f"knows the {' and '.join(known)} task but not {', '.join(others)}: expect a pass "
             "rate near 0 on that part" if known else
             "only knows the toy arithmetic task: expect a pass rate near 0")
    print(f"note: {flag} without --model {verb} the embedded toy model, which {knows}; give "
          "--model a real checkpoint", flush=True)


def base_model_dir(args):
    """Without --model: the embedded base model of the preset task in --data (toy or toy-hard)."""
    return toy_model_dir(preset=args.data if args.data in PRESETS else "toy")


def pick_threads():
    """One process on the CPU: half the cores as torch threads (at least 1, at most torch's
    default), unless OMP_NUM_THREADS says. Threads beyond the cores a process gets spin and wait
    for each other at every parallel op: on a busy 2-core machine the toy's steps took 5-22 s
    with 2 threads and 1-2 s with 1 (BENCHMARKS.md section 9); half leaves the other
    half to the verifier workers and to others. A function of the machine, not of its load: the
    same run on the same machine computes the same numbers (an exact --resume). -> the threads
    set."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // 2)))
    return torch.get_num_threads()


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
    weights = sum(os.path.getsize(f) for f in glob.glob(os.path.join(model_dir, "*.safetensors")) +
                  glob.glob(os.path.join(model_dir, "*.bin")))
    if weights > 1e8:  # seconds to minutes: say so (the toy's 1.4 MB loads at once)
        print0(f"loading {model_dir} ({weights / 1e9:.1f} GB of weights) onto {device} ...",
               flush=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
        for domain in ("math", "code"):
            format_prompt(tokenizer, "", domain)
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, args.dtype), trust_remote_code=False).to(device)
        check_supported(model)
    except ValueError as err:
        sys.exit(f"error: --model {model_dir}: {' '.join(str(err).split())[:400]}")
    except BaseException as err:  # the tokenizers library's PanicException (a Rust panic) is none
        if type(err).__name__ != "PanicException":
            raise
        sys.exit(f"error: --model {model_dir}: its tokenizer fails: "
                 f"{' '.join(str(err).split())[:400]}")
    return tokenizer, model


def tokenize_prompts(tokenizer, problems):
    """Each problem's prompt, formatted as in training, as token ids (data.prompt_ids, batched)."""
    return prompts_ids(tokenizer, [p["prompt"] for p in problems],
                       [p.get("domain") for p in problems])


def domain_rates(problems, correct):
    """{"pass_rate/math": .., "pass_rate/code": ..} when problems mix domains (the paper fits one
    curve per domain), else {}."""
    domains = sorted({p.get("domain", "math") for p in problems})
    if len(domains) < 2:
        return {}
    return {f"pass_rate/{d}": float(np.mean([c for p, c in zip(problems, correct)
                                             if p.get("domain", "math") == d]))
            for d in domains}


class Progress:
    """A sampler's steps (make_sampler) that say how far a long phase is: every PROGRESS_S seconds,
    the samples finished of `total` and an ETA at the pace so far."""
    PROGRESS_S = 10

    def __init__(self, steps, total, what):
        self.steps, self.total, self.what, self.done = steps, total, what, 0
        self.t0 = self.shown = time.time()

    def __next__(self):
        return next(self.steps)

    def send(self, value):
        finished, *rest = self.steps.send(value)
        self.done += len(finished)
        if time.time() - self.shown >= self.PROGRESS_S:
            self.shown, spent = time.time(), time.time() - self.t0
            eta = (f"ETA {(self.total - self.done) * spent / self.done:.0f} s" if self.done else
                   "no sample finished yet")
            print0(f"{self.what}: {self.done}/{self.total} samples in {spent:.0f} s, {eta}",
                   flush=True)
        return (finished, *rest)

    def close(self):
        self.steps.close()


def evaluate(model, tokenizer, val_ids, val, args, most=None):
    """Held-out mean@k of `model` here (pipeline.held_out_items: the same samples at every eval;
    generator ranks sample the same ones) -> summarize_eval's dict; None when a signal stopped
    it. Its sampler's slots are the memory plan's (most: the plan's bound of a training run)."""
    items = pipeline.held_out_items(val_ids, args.eval_samples)
    steps = pipeline.make_sampler(model, tokenizer, args, max(map(len, val_ids)),
                                  most=min(len(items), most or len(items)))
    done = pipeline.sample_all(Progress(steps, len(items), "held-out eval"), items,
                               stop=lambda: bool(faults.STOP))
    if done is None:
        return None
    records = pipeline.score_held_out(tokenizer, {i: s for (_, i), s in done.items()}, val,
                                      args.unsafe_code_exec)
    return summarize_eval(records, val, args.eval_samples)


def summarize_eval(records, val, k):
    """A held-out eval's samples, [[i, correct, truncated, interrupted, length]] (sample i: prompt
    i % n, pipeline.score_held_out) -> its mean@k pass rate (and per domain) and standard error over
    the prompts (the spread of the per-prompt means / sqrt(prompts): the noise of the eval
    itself), truncation and interruption rates, mean length."""
    n = len(val)
    _, correct, truncated, interrupted, lengths = zip(*sorted(records))
    per_prompt = np.reshape(np.asarray(correct, dtype=float), (k, n)).mean(0)
    se = float(per_prompt.std(ddof=1) / np.sqrt(n)) if n > 1 else float("nan")
    return {"pass_rate": float(np.mean(correct)), "pass_rate_se": se,
            "trunc": float(np.mean(truncated)), "intr": float(np.mean(interrupted)),
            "len": float(np.mean(lengths)), "n": len(correct),
            **domain_rates(val * k, list(correct))}


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
    val_ids = tokenize_prompts(tokenizer, val)
    plan.print_memory_plan(model.config, args, None, next(model.parameters()).device,
                               max(map(len, val_ids)),
                               len(special_tokens(tokenizer)["interrupt_ids"]),
                               evaluate=len(val) * args.eval_samples)
    t0 = time.time()
    r = evaluate(model.eval(), tokenizer, val_ids, val, args)
    per_domain = "".join(f" | {k.split('/')[1]} {v:.3f}" for k, v in r.items()
                         if k.startswith("pass_rate/"))
    held = args.val_data or f"{len(val)} held-out problems of " + \
        (f"--data {args.data}" if args.data else "the toy task")
    print(f"eval {args.model or model_dir} on {held}: pass rate "
          f"{r['pass_rate']:.3f} (mean@{args.eval_samples} over {len(val)} problems, "
          f"{r['n']} samples){per_domain} | trunc {r['trunc']:.3f} | intr {r['intr']:.3f} | "
          f"len {r['len']:.1f} tokens | {time.time() - t0:.1f} s", flush=True)
    return r

# -----------------------------------------------------------------------------
# a batch: rewards, the samples that enter the loss, advantages; the loss over micro-batches


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


def make_batch(groups, args, all_sum=None):
    """Rewards (the verifier's, plus the length penalty of a correct answer under --length_control
    penalty), truncated samples out (paper A.15), zero-variance filtering, advantages (the batch
    std over every trainer's part of the batch; all_sum: sums a dict over the trainer ranks, None
    when these groups are the whole batch)."""
    samples = [s for g in groups for s in g["samples"]]
    correct = [c for g in groups for c in g["correct"]]
    rewards = torch.tensor([r for g in groups for r in g["rewards"]])
    _, penalty = pipeline.length_control(args)
    if penalty:
        lengths = torch.tensor([len(s.tokens) for s in samples])
        rewards = rewards + torch.tensor(correct, dtype=torch.float) * penalty(lengths)
    group = torch.tensor([j for j, g in enumerate(groups) for _ in g["samples"]], dtype=torch.long)
    truncated = torch.tensor([s.finish == "truncated" for s in samples], dtype=torch.bool)
    valid = torch.ones(len(samples), dtype=torch.bool) if args.keep_truncated else ~truncated
    keep = zero_variance_keep(rewards, group, valid) if args.zero_var_filter else valid
    rows = keep.nonzero().squeeze(1).tolist()
    adv = advantages(rewards[rows], group[rows], args.adv_norm, all_sum=all_sum)
    masks = [torch.tensor(samples[r].mask) for r in rows]
    sums = (all_sum or dict)(agg_counts(group[rows], torch.cat(masks) if masks else torch.zeros(0)))
    return Batch([g["prompt"] for g in groups for _ in g["samples"]], samples, correct, rewards,
                 group, truncated, valid, rows, adv, sums)


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


def pack(prompt_ids, samples, device):
    """Prompt+completion rows concatenated into one row -> ids (sum of lengths,), the lengths."""
    rows = [p + s.tokens for p, s in zip(prompt_ids, samples)]
    return torch.tensor([t for r in rows for t in r], device=device), [len(r) for r in rows]


def micro_batches(lengths, budget):
    """Rows (their prompt+completion lengths) packed into micro-batches of at most `budget` tokens
    (first fit, longest rows first; no padding); a row longer than the budget goes alone; 0: one
    micro-batch -> lists of row positions."""
    parts, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        j = next((j for j, r in enumerate(room) if not budget or lengths[i] <= r), None)
        if j is None:
            parts.append([i])
            room.append(budget - lengths[i])
        else:
            parts[j].append(i)
            room[j] -= lengths[i]
    return parts


def train_batch(logprobs, batch, parts, args, version, device, after=lambda: None):
    """Forward/backward of this trainer's rows (batch.rows), micro-batch by micro-batch (`parts`:
    micro_batches, positions in batch.rows), each packed into one row; every row's loss terms carry
    its weight in the whole batch's loss (loss.row_weights, from the counts over every trainer), so
    the gradients add up to the full-batch gradient whatever the split.
    logprobs(ids, lens) -> (N, T-1): the trainer's forward of a packed row, per sample right-padded
    (generate.packed_logprobs); after(): called after each backward. -> (loss, stats:
    generator/trainer mismatch, drift by lag, forgetting)."""
    rows = batch.rows
    adv = batch.adv.to(device)
    tokens = torch.tensor([sum(batch.samples[r].mask) for r in rows])
    weights = row_weights(batch.group[rows], tokens, args.agg, batch.sums).to(device)
    loss_sum, stats, drift, lost = 0.0, [], [], []
    for part in parts:
        prompts = [batch.prompt_ids[rows[i]] for i in part]
        samples = [batch.samples[rows[i]] for i in part]
        _, _, mask, gen_logp, lag = collate(prompts, samples, 0, device, version)
        logp = logprobs(*pack(prompts, samples, device))
        at = torch.tensor(part, device=device)
        loss = policy_loss(logp, gen_logp, adv[at], mask, batch.group[rows].to(device)[at],
                           kind=args.loss, agg=args.agg, eps_low=args.eps_low,
                           eps_high=args.eps_high, weights=weights[at].to(logp.dtype),
                           neg_trust=args.neg_trust or None)
        loss.backward()
        after()
        loss_sum += loss.item()
        stats.append(ratio_stats(logp.detach(), gen_logp, mask, args.loss, args.eps_high))
        drift.append(drift_by_lag(logp.detach(), gen_logp, mask, lag))
        lost.append(forgetting(logp.detach(), gen_logp, mask))
    mismatch = {f"mismatch_{k}": float(np.mean([s[k] for s in stats])) for k in stats[0]}
    lost_sum, sure = (sum(x) for x in zip(*lost))
    return loss_sum, {**mismatch, **lag_drift(drift),
                      "forget": float(lost_sum / max(int(sure), 1))}


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
# the trainer: its weights, the optimizer, one step


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


class Trainer:
    """A trainer's weights and optimizer, replicated on every trainer rank (one process: the only
    one): AdamW (eps 1e-15, weight decay 0.01) with a linear warm-up, on float32 weights: the
    model's own, or under a half --dtype float32 master copies that the model's weights are rounded
    from after every step. `version` counts the optimizer steps taken: the policy version of the
    weights. Each trainer computes the gradient of its share of the batch; they are summed
    (all_reduce_grads), so a step equals the single-trainer full-batch step."""
    sharded = False  # every trainer takes part in each broadcast, eval and checkpoint
    def __init__(self, args, model, ctx, state, ckpt=None):
        self.args, self.model, self.ctx, self.ckpt = args, model, ctx, ckpt
        # sums over the trainer ranks, for the batch's statistics (None: one process holds it all)
        self.ranks_sum = None if ctx is None else self.all_sum
        self.n_params = sum(p.numel() for p in model.parameters())
        self.master = self.optimized_weights(state)
        self.opt = torch.optim.AdamW(self.master or model.parameters(), lr=args.lr,
                                     eps=args.adam_eps, weight_decay=args.weight_decay,
                                     betas=(0.9, 0.999))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: self.warmup(s))
        self.version, self.bad_steps = state.get("step", 0), 0
        if state:
            self.load_state_dict(state)

    def warmup(self, s):
        return min(1.0, (s + 1) / self.args.warmup)

    def optimized_weights(self, state):
        """The float32 copies AdamW steps under a half dtype (None: the model's own)."""
        return master_weights(self.model, state.get("master"))

    def logprobs(self, ids, lens):
        """The loss's forward: the trained policy's log-probs of a packed row
        (generate.packed_logprobs)."""
        return packed_logprobs(self.model, ids, lens, self.args.fp32_head, self.args.temperature,
                               checkpoint_layers=self.args.ckpt_layers)

    def all_sum(self, sums):
        """Sum a dict of numbers over the trainer ranks."""
        return pipeline.all_reduce_stats(self.ctx, sums)[0]

    def any(self, flag):
        """Is `flag` true on any trainer?"""
        return self.all_sum({"flag": bool(flag)})["flag"] > 0

    def step(self, batch, pad_id):
        """Loss, backward over micro-batches, the gradients summed over the trainers, clip, AdamW
        step; a non-finite loss or gradient skips the step (--max_bad_steps in a row stop the
        run). -> (loss, stats: mismatch, drift, the gradient norm, the learning rate used)."""
        lr = self.opt.param_groups[0]["lr"]  # the rate this step trains with
        if not batch.sums["sample"]:  # no trainer kept a sample: nothing to step on
            self.version += 1
            return 0.0, {"grad_norm": 0.0, "skipped_bad": self.bad_steps > 0, "lr": lr}
        self.model.train()
        plan.peak_gb(self.model)  # the peak from here is this step's
        loss, stats = self.backward(batch, pad_id)
        self.reduce_grads()
        stepped = self.master or list(self.model.parameters())
        norm = torch.nn.utils.clip_grad_norm_(stepped, self.args.grad_clip or float("inf"))
        norm = pipeline.whole(norm).item()
        if math.isfinite(norm) and math.isfinite(loss):  # every trainer sees the same sums
            self.opt.step()
            self.sched.step()
            self.bad_steps = 0
            self.copy_master()
        else:
            self.skip_step(loss, norm)
        self.opt.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        self.version += 1
        peak = plan.peak_gb(self.model)
        return loss, {**stats, "grad_norm": norm, "skipped_bad": self.bad_steps > 0, "lr": lr,
                      **({"train_peak_gb": peak} if peak else {})}

    def backward(self, batch, pad_id):
        """This trainer's rows in micro-batches of --micro_tokens, forward and backward -> (loss,
        stats)."""
        parts = self.micro_batches(batch)
        if not parts:
            return 0.0, {}
        device = next(self.model.parameters()).device
        return train_batch(self.logprobs, batch, parts, self.args, self.version, device,
                           after=self.accumulate)

    def micro_batches(self, batch):
        """The kept rows' micro-batches (positions in batch.rows)."""
        return micro_batches([len(batch.prompt_ids[r]) + len(batch.samples[r].tokens)
                              for r in batch.rows], self.args.micro_tokens)

    def accumulate(self):
        """After each micro-batch's backward: under a half dtype its gradients are added to the
        float32 copies' and dropped, so they accumulate in float32, not in bf16."""
        for p, m in zip(self.model.parameters(), self.master or []):
            if p.grad is not None:
                m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad)
                p.grad = None

    def reduce_grads(self):
        """Sum the trainers' gradients (the float32 ones AdamW steps)."""
        if self.ctx is not None:
            pipeline.all_reduce_grads(self.ctx, self.master or list(self.model.parameters()))

    def copy_master(self):
        """The weights sampled and trained with: the float32 copies, rounded."""
        if self.master:
            with torch.no_grad():
                for p, m in zip(self.model.parameters(), self.master):
                    p.copy_(m)

    def skip_step(self, loss, norm):
        """A NaN/inf loss or gradient: no update (the weights sent next are the last good ones)."""
        self.bad_steps += 1
        print0(f"step {self.version + 1}: loss {loss} / gradient norm {norm}: not finite, "
               f"optimizer step skipped ({self.bad_steps} in a row, --max_bad_steps "
               f"{self.args.max_bad_steps})", flush=True)
        if self.bad_steps >= self.args.max_bad_steps:
            raise SystemExit(f"error: {self.bad_steps} consecutive steps with a non-finite loss "
                             f"or gradient (up to step {self.version + 1}); stopping. The last "
                             "checkpoint holds the last good weights.")

    def eval_model(self, device=None):
        """The whole model, on trainer 0, to evaluate and save."""
        return self.model

    def save_shards(self, folder):
        """Write what each trainer holds of the state into a checkpoint folder (FSDP2 only)."""

    def optimizer_state(self):
        """The optimizer's part of state.pt: AdamW's state and, under a half --dtype, the float32
        weights it steps (the model holds them rounded)."""
        return {"optimizer": self.opt.state_dict(),
                "master": [m.detach().cpu() for m in self.master] if self.master else None}

    def state_dict(self):
        """What --resume needs of the trainer."""
        return {**self.optimizer_state(), "scheduler": self.sched.state_dict(),
                "step": self.version, "torch_rng": torch.get_rng_state()}

    def load_state_dict(self, state):
        self.load_optimizer(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        # the flags given now apply from here (check_resume printed the changes)
        for group in self.opt.param_groups:
            group.update(lr=self.args.lr * self.warmup(self.sched.last_epoch),
                         initial_lr=self.args.lr, eps=self.args.adam_eps,
                         weight_decay=self.args.weight_decay, betas=(0.9, 0.999))
        self.sched.base_lrs = [self.args.lr] * len(self.opt.param_groups)

    def load_optimizer(self, saved):
        self.opt.load_state_dict(saved)


class ShardedTrainer(Trainer):
    """--fsdp: the model and its AdamW state sharded over the trainer ranks with FSDP2 (each holds
    1/T of them; pipeline.shard_trainer). A half --dtype keeps float32 shards (they are AdamW's
    master weights) and computes in the half dtype. Every trainer takes part in making the weights
    whole for each broadcast, eval and checkpoint, one parameter or bucket at a time; no trainer
    keeps a whole copy. A checkpoint's model folder holds the whole weights in --dtype (trainer 0
    writes them, one parameter at a time through its host); the float32 shards and their AdamW
    state are saved sharded, each trainer its own (torch.distributed.checkpoint, SHARDS), and each
    trainer reads its own back on --resume."""
    sharded = True

    def optimized_weights(self, state):
        """Shard the model in place (float32 shards; on --resume, the saved ones: load_state_dict);
        AdamW steps the shards themselves."""
        model, ctx = self.model, self.ctx
        self.dtype = dtype = next(model.parameters()).dtype
        if dtype != torch.float32:
            model.float()
        self.forward = pipeline.shard_trainer(model, ctx.trainers, ctx.device, dtype)
        self.sync_once = plan.fsdp_sync_once(self.n_params, plan.device_bytes(ctx.device))
        local = sum(p.to_local().numel() for p in model.parameters())
        print0(f"FSDP2: trainer 0 holds {local} of {self.n_params} parameters (and their AdamW "
               "state)", flush=True)
        return None

    def logprobs(self, ids, lens):
        return self.forward(ids, lens, self.args.fp32_head, self.args.temperature,
                            self.args.ckpt_layers)

    def backward(self, batch, pad_id):
        """Every micro-batch is a chain of collectives: a trainer with fewer micro-batches than
        another first runs passes that add nothing, until their counts match."""
        n_micro = len(self.micro_batches(batch))
        self.n_all = int(pipeline.all_reduce_stats(self.ctx, {}, {"n": n_micro})[1]["n"])
        self.done = 0
        self.forward.set_requires_gradient_sync(not self.sync_once or self.n_all == 1)
        for _ in range(n_micro, self.n_all):
            ids = torch.full((2,), pad_id, device=self.ctx.device)
            (self.logprobs(ids, [2]).sum() * 0).backward()
            self.accumulate()
        return super().backward(batch, pad_id)

    def accumulate(self):
        """After each micro-batch's backward: the last of the step reduce-scatters (sync_once), or
        every one does (a model whose unsharded gradients would not fit: plan.fsdp_sync_once)."""
        self.done += 1
        self.forward.set_requires_gradient_sync(not self.sync_once or self.done >= self.n_all - 1)

    def reduce_grads(self):
        pass  # FSDP2 reduce-scatters the gradients in the backward

    def eval_model(self, device=None):
        """The whole model in --dtype, built on trainer 0's host from the shards one parameter at a
        time (a collective: None on the other trainers), then on `device` when given (an eval on
        trainer 0, in the frozen modes)."""
        whole = None
        if self.ctx.rank == 0:
            with torch.device("meta"):
                whole = AutoModelForCausalLM.from_config(self.model.config, dtype=self.dtype)
            whole.to_empty(device="cpu")
            whole.tie_weights()  # to_empty leaves a tied head its own tensor
            for b, ours in zip(whole.buffers(), self.model.buffers()):  # the rotary tables
                b.copy_(ours)
        params = dict(whole.named_parameters()) if whole else {}
        names = (name for name, _ in self.model.named_parameters())
        with torch.no_grad():
            for name, full in zip(names, pipeline.whole_weights(self.model, self.dtype)):
                if whole is not None:
                    params[name].copy_(full)  # a half --dtype: rounded from the float32 shards
        return whole.to(device) if whole is not None and device else whole

    def save_shards(self, folder):
        """Every trainer writes its float32 shards and their AdamW state into folder/SHARDS (a
        collective), once trainer 0 has emptied the folder."""
        import torch.distributed.checkpoint as dcp  # here: only --fsdp needs it
        self.any(False)  # a barrier
        dcp.save(pipeline.sharded_state(self.model, self.opt),
                 checkpoint_id=os.path.join(folder, SHARDS), process_group=self.ctx.trainers)

    def optimizer_state(self):
        """In the shards (save_shards), not in state.pt."""
        return {"optimizer": None, "master": None, "shards": SHARDS}

    def load_optimizer(self, saved):
        """The shards this trainer saved: its float32 weights and their AdamW state."""
        import torch.distributed.checkpoint as dcp
        folder = os.path.join(self.ckpt, SHARDS)
        state = pipeline.sharded_state(self.model, self.opt)
        dcp.load(state, storage_reader=shard_reader(folder),  # nothing in the folder runs code
                 process_group=self.ctx.trainers, planner=safe_load_planner())
        pipeline.set_sharded_state(self.model, self.opt, state)

# -----------------------------------------------------------------------------
# the run's record: compute, the metrics of a step, alarms, evals, checkpoints


@dataclass
class Record:
    """What the loop counts and logs from step to step: compute in device-seconds and FLOPs, the
    evals (for the live fit), the alarms raised; `log` writes metrics.jsonl (rank 0; elsewhere it
    does nothing)."""
    args: object
    log: object
    world: int  # processes: every one counts in compute_s
    n_params: int
    domains: list  # the training problems' domains: one pass-rate curve each when they mix
    compute_s: float = 0.0  # device-seconds: training wall-clock x processes
    flops: float = 0.0
    evals: list = field(default_factory=list)  # (compute_s, held-out pass rate) of every eval
    eval_intr: list = field(default_factory=list)  # held-out interruption rate of every eval
    warned: set = field(default_factory=set)  # the alarms already raised (each is said once)
    empty_steps: int = 0  # consecutive steps that kept no prompt (nothing to train on)
    forgets: list = field(default_factory=list)  # forget of the last FORGET_WINDOW trained steps
    saved: int = -1  # the step of the last checkpoint written
    evaluated: int = -1  # the step of the last held-out eval
    loop_start: tuple = (0.0, 0)  # (time, step) when this process's loop began: the ETA


def new_record(env, trainer):
    """The record of a new run (metrics.jsonl's config line), or of a resumed one: the metrics
    logged after its checkpoint dropped, the evals before it taken back for the live fit, the
    steps' forget for its alarm's window and the count of steps in a row that kept nothing."""
    args, state = env.args, env.state
    rec = Record(args, env.log, env.ctx.world if env.ctx else 1, trainer.n_params,
                 sorted({p.get("domain", "math") for p in env.train}),
                 state.get("compute_s", 0.0), state.get("flops", 0.0),
                 loop_start=(time.time(), trainer.version))
    rec.empty_steps = state.get("empty_steps", 0)  # every trainer: each decides the stop from it
    path = os.path.join(args.out, "metrics.jsonl")
    if env.rank0 and env.ckpt:
        kept = truncate_metrics(path, trainer.version)
        rec.evals = [(r["compute_s"], r["pass_rate"]) for r in kept if r["kind"] == "eval"]
        rec.eval_intr = [r.get("intr", 0.0) for r in kept if r["kind"] == "eval"]
        rec.forgets = [r["forget"] for r in kept if r["kind"] == "train" and r["kept_prompts"]
                       and r.get("forget") is not None][-FORGET_WINDOW:]  # the alarm's window
        print(f"resumed from {env.ckpt} at step {trainer.version}")
    elif env.rank0:
        ran = "one process, synchronous" if rec.world == 1 else args.mode  # what actually ran
        write_file(path, json.dumps({"kind": "config", **vars(args), "ran": ran,
                                     "n_params": rec.n_params, "world": rec.world}) + "\n")
    return rec


def step_metrics(rec, trainer, batch, groups, rstats, train, loss_value, stats, dt):
    """The step just taken, summed over every trainer's part of its batch (a collective; every
    trainer calls it) -> the metrics dict that rank 0 logs. Adds the step's FLOPs to rec.flops."""
    step, samples, rows = trainer.version - 1, batch.samples, batch.rows  # the version trained
    lags = [step - v for r in rows for v, m in zip(samples[r].versions, samples[r].mask) if m]
    sums, maxes = pipeline.all_reduce_stats(trainer.ctx, {
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
           for d in rec.domains for key in ("correct", "n")}},
        {"lag_max": max(lags, default=0)})
    rec.flops += 2 * rec.n_params * sums["gen_tokens"] + 6 * rec.n_params * sums["train_tokens"]
    n = sums["n"]
    m = {"kind": "train", "step": trainer.version, "compute_s": rec.compute_s, "flops": rec.flops,
         "reward": sums["reward"] / n, "pass_rate": sums["correct"] / n, "len": sums["len"] / n,
         "trunc": sums["trunc"] / n, "intr": sums["intr"] / n,
         "excluded_truncated": int(sums["excluded"]),
         # mean -log p of the sampled tokens: estimates it
         "entropy": sums["nll"] / max(sums["sampled"], 1),
         "lag": sums["lag"] / max(sums["lag_n"], 1), "lag_max": maxes.get("lag_max", 0),
         "prompts": int(sums["groups"]),
         "kept_prompts": int(sums["kept"]), "dropped_zero_var": int(sums["groups"] - sums["kept"]),
         "too_old": int(sums["too_old"]), "skipped_bad": stats["skipped_bad"],
         "loss": sums["loss"], "grad_norm": stats["grad_norm"], "lr": stats["lr"],
         "dt_ms": dt * 1000,
         "tok_s": tokens_per_s(sums, rstats, dt),
         **{k: v for k, v in stats.items() if k not in ("grad_norm", "skipped_bad", "lr")}}
    if len(rec.domains) > 1:  # one pass-rate curve per domain, as the paper fits them
        m.update({f"pass_rate/{d}": sums[f"correct/{d}"] / max(sums[f"n/{d}"], 1)
                  for d in rec.domains})
    return m


def tokens_per_s(sums, rstats, dt):
    """A step's tok/s: in one process the sampler's (generated tokens per second of generating);
    under torchrun the trainers' (trained tokens per second of step), None for a step that trained
    nothing (no prompt kept): there is no rate to show, and 0 would read as a stall."""
    if "gen_s" in rstats:
        return sums["len"] / rstats["gen_s"]
    return sums["train_tokens"] / dt if sums["train_tokens"] else None


def log_line(m, steps):
    line = (f"step {m['step']}/{steps} | reward {m['reward']:+.3f} | pass@1 {m['pass_rate']:.3f} | "
            f"len {m['len']:.1f} | ent {m['entropy']:.3f} | trunc {m['trunc']:.3f} | "
            f"intr {m['intr']:.3f} | "
            f"lag {m['lag']:.1f}/{m['lag_max']:.0f} | drift {m.get('drift', 0.0):.3f} | "
            f"forget {m.get('forget', 0.0):.3f} | "
            f"kept {m['kept_prompts']}/{m['prompts']} | loss {m['loss']:+.4f} | "
            f"dt {m['dt_ms']:.0f} ms | tok/s "
            f"{'n/a' if m['tok_s'] is None else format(m['tok_s'], '.0f')}")
    if "generate_ms" in m:  # one process: where the step's time went
        line += (f" | gen {m['generate_ms']:.0f} verify {m['verify_ms']:.0f} "
                 f"train {m['train_ms']:.0f} ms")
    if "train_peak_gb" in m:  # CUDA: each role's peak allocated memory this step
        line += (" | peak" + (f" gen {m['gen_peak_gb']:.1f}" if "gen_peak_gb" in m else "") +
                 f" train {m['train_peak_gb']:.1f} GB")
    if "gen_busy" in m:
        line += (f" | busy gen {m['gen_busy']:.2f} train {m['train_busy']:.2f} "
                 f"| sync {m['sync_ms']:.0f} ms")
    return line


def progress(rec, step):
    """The end of a step line: the last held-out pass rate and the time left at this run's pace so
    far (evals and checkpoints included)."""
    t0, step0 = rec.loop_start
    left = (time.time() - t0) / max(step - step0, 1) * (rec.args.steps - step)
    held_out = f" | held-out {rec.evals[-1][1]:.3f}" if rec.evals else ""
    return f"{held_out} | ETA {int(left // 60)}m{int(left % 60):02d}s"


def log_step(rec, m):
    """metrics.jsonl gets every step; the console every --log_every-th (and the last)."""
    rec.log(m)
    if m["step"] % rec.args.log_every == 0 or m["step"] == rec.args.steps:
        print0(log_line(m, rec.args.steps) + progress(rec, m["step"]), flush=True)


# the alarms' thresholds, set from healthy and collapsing runs (BENCHMARKS.md section 6)
# forget (the mean log-prob lost on the tokens the sampler was >= 90% sure of), averaged over the
# last FORGET_WINDOW steps that trained: one step's forget spikes past 0.01 in healthy runs
FORGET_ALARM, FORGET_WINDOW = 0.01, 5
HELD_OUT_TRUNC_ALARM = 0.05  # held-out hard truncation
HELD_OUT_DROP_ALARM = 0.1  # held-out pass rate fallen since the eval before
HELD_OUT_INTR_RISE = 0.05  # held-out forced-interruption rate risen since the eval before


def warn_once(rec, key, step, text):
    """One warning line per kind of alarm in a run (rank 0 says it)."""
    if key not in rec.warned:
        print0(f"warning: step {step}: {text}", flush=True)
    rec.warned.add(key)


def alarms(rec, m):
    """Paper A.15: watch the truncations; and, before them, a policy that forgets what its stale
    samples hold. Rank 0 warns once per kind, in one line naming the likely cause and the flags:
    when a batch's hard-truncation rate passes 10% (where the paper's instability band starts),
    when the trained policy has lost the tokens its sampler was sure of (`forget`: the early sign
    of a collapse under PipelineRL-k, BENCHMARKS.md section 6), and when a step keeps no prompt
    (unless every sample of it was right: a solved batch is no alarm).
    After --max_empty_steps steps in a row that kept nothing -> why the run should stop (every
    trainer computes the same from the summed metrics), else None: with nothing kept the optimizer
    never steps again, and the run would spin."""
    args, step = rec.args, m["step"]
    if m["trunc"] > 0.10:
        warn_once(rec, "trunc", step, f"{m['trunc']:.0%} of the batch was truncated (no eos "
                  "within the budgets); the paper's runs became unstable above 10-15%. " +
                  ("--keep_truncated keeps them in the loss, as wrong answers"
                   if args.keep_truncated else "Truncated samples leave the loss, so a format "
                   "that runs out of budget gets no gradient") + ": watch trunc and forget")
    if m["kept_prompts"] and m.get("forget") is not None:
        rec.forgets = (rec.forgets + [m["forget"]])[-FORGET_WINDOW:]
    forget = sum(rec.forgets) / FORGET_WINDOW  # a window not yet full counts its gaps as 0
    if forget > FORGET_ALARM:
        warn_once(rec, "forget", step, f"forget {forget:.3f} (mean of the last {FORGET_WINDOW} "
                  "steps): the trained policy has lost "
                  f"log-prob on tokens its sampler was sure of, {m['lag_max']:.0f} versions ago. "
                  "Such tokens (the answer format after </think>) are shared by right and wrong "
                  "samples, so the loss holds them nowhere; the policy drifts there unseen until "
                  "its own samples, k steps later, show it: a collapse may follow within ~k steps. "
                  f"Train nearer on-policy: a lower --max_lag, or --mode sync; or mask more stale "
                  f"negatives: --neg_trust above {rec.args.neg_trust:g} (the toy's 0.5: "
                  "BENCHMARKS.md section 6)")
    rec.empty_steps = rec.empty_steps + 1 if m["kept_prompts"] == 0 else 0
    if rec.empty_steps and m["pass_rate"] < 1.0:  # every sample right: solved, not an alarm
        warn_once(rec, "empty", step, f"no prompt kept (trunc {m['trunc']:.2f}, pass@1 "
                  f"{m['pass_rate']:.2f}): nothing to train on, the optimizer step is skipped; the "
                  f"run stops after {args.max_empty_steps} such steps in a row")
    if rec.empty_steps < args.max_empty_steps:
        return None
    if m["trunc"] >= 0.5:
        cause = ("the samples run out of budget (the policy writes past --answer_budget / "
                 "--think_budget), and truncated samples carry no gradient that could pull it "
                 "back. Raise --answer_budget, " + ("" if args.keep_truncated else
                                                  "or train on them with --keep_truncated, ") +
                 "or lower --lr / --max_lag")
    elif m["pass_rate"] >= 0.5:
        cause = ("every group was all correct: the policy has solved these prompts "
                 "(harder data, or stop here)")
    else:
        cause = ("every group was all wrong: the prompts are too hard for this policy "
                 "(easier data, more --samples)")
    return (f"stopping at step {step}: {rec.empty_steps} steps in a row kept no prompt "
            f"(--max_empty_steps {args.max_empty_steps}): {cause}")


def eval_alarms(rec, step, result):
    """Trainer 0, after a held-out eval: warn once when the held-out samples truncate (the trained
    policy's own samples, k versions ahead of the batches: truncation shows here before it reaches
    the training batches), when the held-out pass rate fell since the eval before, and when more
    of the held-out samples got the forced interruption than at the eval before."""
    older = rec.world > 1 and rec.args.mode != "sync"  # off-policy: batches behind the policy
    if result["trunc"] > HELD_OUT_TRUNC_ALARM:
        who = ("the base model writes past its budgets. Raise --answer_budget or --think_budget"
               if step == 0 else "the policy being trained writes past its budgets" + (
                   " (its training batches are older). Raise --answer_budget, or train nearer "
                   "on-policy: a lower --max_lag, or --mode sync" if older else
                   ". Raise --answer_budget or lower --lr"))
        keep = ("" if rec.args.keep_truncated else
                ", or train on truncated samples with --keep_truncated")
        warn_once(rec, "held-out trunc", step, f"{result['trunc']:.1%} of the held-out samples ran "
                  f"out of budget: {who}{keep}")
    if len(rec.evals) > 1 and rec.evals[-2][1] - rec.evals[-1][1] > HELD_OUT_DROP_ALARM:
        warn_once(rec, "held-out drop", step, f"the held-out pass rate fell from "
                  f"{rec.evals[-2][1]:.3f} to {rec.evals[-1][1]:.3f} since the last eval. Look at "
                  "forget, trunc and the held-out truncation and interruption. " + (
                      "Under PipelineRL-k such dips are the stale samples' (one process did not "
                      "dip so, BENCHMARKS.md section 6): a lower --max_lag, or --mode sync"
                      if older else "On-policy: a lower --lr"))
    if len(rec.eval_intr) > 1 and rec.eval_intr[-1] - rec.eval_intr[-2] > HELD_OUT_INTR_RISE:
        warn_once(rec, "held-out intr", step, f"{rec.eval_intr[-1]:.1%} of the held-out samples "
                  f"were interrupted ({rec.eval_intr[-2]:.1%} at the eval before): the policy now "
                  "thinks past --think_budget. A prompt whose samples are all interrupted and "
                  "wrong is dropped as zero-variance, so nothing trains it back; under "
                  "PipelineRL-k its batches show it up to k steps later. On-policy runs did not "
                  "fall so on toy-hard (BENCHMARKS.md section 6): --mode sync")


def run_eval(rec, model, env, step, stamp):
    """Trainer 0 (one process: the trainer): the held-out pass rate of `model` at `step`, logged
    (log_eval)."""
    model.eval()
    result = evaluate(model, env.tokenizer, env.val_ids, env.val, env.args,
                      pipeline.sampler_most(env.args, env.ctx))
    if result is not None:  # None: a signal stopped it: no eval line
        log_eval(rec, env, step, result, stamp)


def log_evals(rec, env, source, wait=False):
    """Trainer 0: log the generators' evals whose results are in (wait: all of them)."""
    for step, records, stamp in source.evals_done(wait):
        log_eval(rec, env, step, summarize_eval(records, env.val, env.args.eval_samples), stamp)


def log_eval(rec, env, step, result, stamp):
    """A held-out eval's result at `step` (stamp: the compute_s and FLOPs of that step), the live
    fit of the curve so far, one log line and the alarms."""
    from fit import predict_final  # here: scipy's import (~0.5 CPU-s) is rank 0's alone
    args, (compute_s, flops) = env.args, stamp
    m = {"kind": "eval", "step": step, "compute_s": compute_s, "flops": flops, **result}
    rec.evals.append((compute_s, result["pass_rate"]))
    rec.eval_intr.append(result["intr"])
    C, R = np.array(rec.evals).T
    try:  # a diagnostic: a curve that cannot be fitted yet must not stop the run
        pred = predict_final(C, R, C_end=compute_s / max(step, 1) * args.steps)
    except ValueError as err:
        pred = None
        print(f"eval step {step}: no live fit ({err})")
    if pred:
        m.update(fit_A=pred["A"], fit_B=pred["B"], fit_C_mid=pred["C_mid"],
                 predicted_final=pred["R_end"])
    rec.log(m)
    fit_txt = (f" | fit A {pred['A']:.3f} B {pred['B']:.2f} C_mid {pred['C_mid']:.0f} device-s "
               f"-> predicted {pred['R_end']:.3f} at step {args.steps}") if pred else ""
    per_domain = "".join(f" | {k.split('/')[1]} {v:.3f}" for k, v in result.items()
                         if k.startswith("pass_rate/"))
    print(f"eval step {step} | held-out pass rate {result['pass_rate']:.3f} "
          f"+- {result['pass_rate_se']:.3f} (mean@{args.eval_samples}, n={result['n']})"
          f"{per_domain} | trunc {result['trunc']:.3f} | intr {result['intr']:.3f}{fit_txt}",
          flush=True)
    eval_alarms(rec, step, result)


def held_out_eval(rec, env, trainer, source):
    """A held-out eval of the trainer's version (not counted as compute): under PipelineRL with
    generator ranks, they run it while training goes on (logged when its results are in:
    log_evals); else here (the whole model: gathered under --fsdp, on trainer 0)."""
    step, stamp = trainer.version, (rec.compute_s, rec.flops)
    source.held_out(step, trainer, lambda model: run_eval(rec, model, env, step, stamp), stamp)
    rec.evaluated = step


def save(rec, env, trainer, source):
    """A checkpoint of the weights and everything --resume needs (trainer 0 writes it; under
    --fsdp every trainer takes part in gathering the weights and writes its own shards)."""
    model, state = trainer.eval_model(), trainer.state_dict()
    state.update(source.state_dict(trainer.version), compute_s=rec.compute_s, flops=rec.flops,
                 empty_steps=rec.empty_steps, args=vars(env.args))
    trainer.save_shards(checkpoint_tmp(env.args.out, trainer.version, fresh=env.rank0))
    if env.rank0:
        path = save_checkpoint(env.args.out, trainer.version, model, env.tokenizer, state,
                               env.args.keep, fresh=False)
        print(f"saved {path}", flush=True)
    rec.saved = trainer.version

# -----------------------------------------------------------------------------
# start-up: every rank's set-up, then the two things the loop depends on


def print0(*args, **kw):
    """print on rank 0 only (one process: always)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, **kw)


@dataclass
class Setup:
    """What start() gives every rank."""
    args: object
    ctx: object  # this rank's place under torchrun (pipeline.Context), None for one process
    rank0: bool
    log: object  # metrics.jsonl (and the trackers) on rank 0; a no-op elsewhere
    train: list
    val: list
    train_ids: list
    val_ids: list
    tokenizer: object
    model: object
    model_dir: str
    ckpt: str  # the checkpoint resumed from (None for a new run)
    state: dict  # its state.pt ({} for a new run)


def start(args):
    """Every rank, before any training: user errors first (nothing is made in --out before they
    are all checked), the output folder, the data, the resume point, the ranks, the model."""
    hf_logging.disable_progress_bar()  # the log holds our own lines (no "Loading weights" bars)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    train, val = load_data(args)
    check_code_rewards(args, train + val)
    prepare_out_dir(args)
    log = metrics_log(args, rank0)  # checks --wandb/--tensorboard before ranks wait
    note_toy_model(args, args.data, "--data", "trains")
    ckpt, state = resume_point(args, quiet=not rank0)
    ctx = pipeline.setup(args)  # None for one process; else this rank's role and process groups
    if ctx is None and pick_device(args).type == "cpu":
        print(f"torch threads: {pick_threads()} of {os.cpu_count()} cores", flush=True)
    torch.manual_seed(args.seed)
    model_dir = ckpt or args.model_dir or base_model_dir(args)
    tokenizer, model = load_model(model_dir, args, pick_device(args, ctx))
    train_ids, val_ids = tokenize_prompts(tokenizer, train), tokenize_prompts(tokenizer, val)
    phrase_len = len(special_tokens(tokenizer)["interrupt_ids"])
    if (why := context_error(args, getattr(model.config, "max_position_embeddings", None),
                             max(map(len, train_ids + val_ids)), phrase_len)):
        sys.exit(f"error: {why}")
    if ctx:  # rollouts travel as packed rows of this many tokens per sample
        pipeline.start(ctx, state.get("step", 0),
                       max(map(len, train_ids)) + args.think_budget + args.answer_budget +
                       phrase_len)
    return Setup(args, ctx, rank0, log, train, val, train_ids, val_ids, tokenizer, model,
                 model_dir, ckpt, state)


def rollout_source(env):
    """Where the loop's groups come from: sampled in this process (LocalRollouts), or by the
    generator ranks (RemoteRollouts)."""
    if env.ctx is None:
        return pipeline.LocalRollouts(env.args, env.model, env.tokenizer, env.train, env.train_ids,
                                      env.state.get("step", 0), env.state.get("curriculum"))
    return pipeline.RemoteRollouts(env.ctx, env.args)


def make_trainer(env):
    """Replicated (one process, or data-parallel trainer ranks), or sharded with --fsdp."""
    sharded = env.args.fsdp and env.ctx is not None
    return (ShardedTrainer if sharded else Trainer)(env.args, env.model, env.ctx, env.state,
                                                    env.ckpt)


def recipe_values(args, n_val):
    """The recipe's values in force, one line: batch, budgets, steps, lr, evals, clipping."""
    clip = f"grad clip {args.grad_clip:g}" if args.grad_clip else "no grad clip"
    mask = f"--neg_trust {args.neg_trust:g}" if args.neg_trust else "no CISPO mask"
    return (f"{args.prompts} prompts x {args.samples} samples | think {args.think_budget} + answer "
            f"{args.answer_budget} tokens | {args.steps} steps, lr {args.lr:g}, warm-up "
            f"{args.warmup}, {clip}, {mask} | eval every {args.eval_every} on {n_val} held-out x "
            f"{args.eval_samples} | save every "
            f"{args.save_every} | {args.dtype}")


def describe(env, trainer):
    """Rank 0's start-up lines: the recipe's values in force and each flag that differs from it or
    its default; the model, the device, the roles, the data; the memory plan."""
    args, ctx = env.args, env.ctx
    print0(f"recipe {args.recipe}: " + recipe_values(args, len(env.val)))
    defaults = vars(make_parser().parse_args([])) | RECIPES[args.recipe]
    flag = lambda k, v: f"--{k}" if v is True else f"--no-{k}" if v is False else f"--{k} {v}"
    given = [flag(k, getattr(args, k)) for k, v in defaults.items()
             if k not in ("recipe", "out") and getattr(args, k) != v]
    print0(f"flags that differ from it and the defaults: {' '.join(given) or 'none'}")
    roles = (f"{ctx.n_trainers} trainer + {ctx.n_gens} generator ranks, {args.mode}, "
             f"max lag {ctx.k}" if ctx else "one process, synchronous and on-policy")
    device = next(env.model.parameters()).device
    print0(f"model {env.model_dir} ({trainer.n_params / 1e6:.2f}M params, "
           f"{env.model.config.model_type}) on {device} | {roles} | {len(env.train)} train / "
           f"{len(env.val)} held-out problems")
    if env.rank0:
        plan.print_memory_plan(env.model.config, args, env.ctx, device,
                                   max(map(len, env.train_ids + env.val_ids)),
                                   len(special_tokens(env.tokenizer)["interrupt_ids"]))

# -----------------------------------------------------------------------------
# the training loop


def main(args):
    """The training loop: one process (the rollouts are sampled here, between steps), or a trainer
    rank under torchrun (from the generator ranks: serve_rollouts). -> None; --eval_only: its
    dict."""
    if args.eval_only:
        return eval_only(args)
    t_start = time.time()
    env = start(args)
    trainer, source = make_trainer(env), rollout_source(env)
    rec = new_record(env, trainer)
    describe(env, trainer)
    if trainer.version == 0:
        held_out_eval(rec, env, trainer, source)
    rec.saved = rec.evaluated = trainer.version  # step 0 is evaluated; a resumed step was saved
    stopped, signaled = None, False
    while trainer.version < args.steps:
        if trainer.any(source.stop_requested()):  # SIGINT / SIGTERM to any rank: save, then stop
            signaled = True
            break
        # ---- rollouts: G samples per prompt, verified (one process: sampled here, lag 0)
        t0 = time.time()
        groups, rstats = source.get(trainer.version)
        if groups is None:  # a signal stopped the sampling under way
            signaled = True
            break
        if trainer.any(len(groups) < source.share):
            stopped = (f"stopping at step {trainer.version}: out of prompts "
                       "(No-Positive-Resampling retired every one)")
            print0(stopped, flush=True)
            break
        # ---- the batch, then one optimizer step, then the new weights to the generators
        batch = make_batch(groups, args, trainer.ranks_sum)
        t_train = time.time()
        loss, stats = trainer.step(batch, env.tokenizer.pad_token_id or 0)
        t_train = time.time() - t_train
        eval_now = trainer.version % args.eval_every == 0 or trainer.version == args.steps
        sync_s, sync_bytes = source.publish(trainer, trainer.version == args.steps, eval_now)
        # ---- accounting, logging, alarms (sums over every trainer's part of the batch)
        dt = time.time() - t0
        # every device, busy or not; not the waits on the generators' evals (source.uncounted)
        rec.compute_s += (dt - source.uncounted()) * rec.world
        m = step_metrics(rec, trainer, batch, groups, rstats, env.train, loss, stats, dt)
        log_step(rec, m | source.busy(dt, rstats, t_train, sync_s, sync_bytes))
        log_evals(rec, env, source)
        stop = alarms(rec, m)
        # ---- checkpoint, then eval (not counted as compute): an eval that fails loses no step
        if (args.save_every and trainer.version % args.save_every == 0) or \
                trainer.version == args.steps:
            save(rec, env, trainer, source)
        if eval_now:
            held_out_eval(rec, env, trainer, source)
        if stop:
            print0(stop, flush=True)
            stopped = stop
            break
    finish(rec, env, trainer, source, stopped, signaled, t_start)


def finish(rec, env, trainer, source, stopped, signaled, t_start):
    """The end: a run stopped early (every prompt retired, a signal) is saved, and evaluated unless
    a signal asked it to stop; ranks leave together. A run that stopped itself says so in its
    metrics (kind "stopped"): it is over, not interrupted (study.py counts it as finished)."""
    if stopped:
        rec.log({"kind": "stopped", "step": trainer.version, "reason": stopped})
    if trainer.version != rec.saved:
        save(rec, env, trainer, source)
    if trainer.version != rec.evaluated and not signaled:
        held_out_eval(rec, env, trainer, source)
    log_evals(rec, env, source, wait=not signaled)
    source.close(trainer.version)
    if signaled:
        saved = checkpoints(env.args.out)[-1:] or ["nothing (no step finished yet)"]
        print0(f"stopped by a signal after step {trainer.version}/{env.args.steps}; saved "
               f"{saved[0]}; continue with: {resume_command()}", flush=True)
    else:
        summary(env.args, time.time() - t_start)
    release_lock()  # the run is over: --out is free again


def serve_rollouts(args):
    """A generator rank's life (pipeline.run_generator): sample, verify and send groups to the
    trainers, take every new version of the weights, until the trainers say stop."""
    env = start(args)
    path = os.path.join(args.out, f"curriculum-rank{env.ctx.rank}.json")
    pipeline.run_generator(env.ctx, args, env.model, env.tokenizer, env.train, env.train_ids,
                           env.state.get("step", 0), path, env.val, env.val_ids)
    pipeline.finish(env.ctx)


def summary(args, seconds):
    """Rank 0: the end of a run in a few lines: time, held-out first -> last, the fit's prediction,
    where things are."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
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
        faults.stop_on_signals()
    # under torchrun the last --gen_ranks ranks serve rollouts, the others train
    entry = serve_rollouts if pipeline.generator_rank(args) else main
    one = int(os.environ.get("WORLD_SIZE", "1")) == 1
    try:
        entry(args)
    except SystemExit as err:
        if isinstance(err.code, str):  # a user error: one line, as argparse's, exit 2
            message = err.code.removeprefix("error: ")
            faults.say_error(f"train.py: error: {message}")
            err.code = 2
        if one:
            raise
        sys.stdout.flush()
        os._exit(err.code or 0)
    except BaseException as err:
        if one:
            raise
        # one rank failing: print why, and exit without waiting on the others
        traceback.print_exc()
        faults.report_failure(err)
        sys.stderr.flush()
        os._exit(1)
    if faults.STOP:  # stopped by a signal, its step saved: the status a signal gives
        sys.exit(128 + signal.Signals[faults.STOP["name"]].value)
