"""
checks.py: what guards train.py's flags before anything is loaded or written: each numeric flag's
range, the clipping bounds, the model folder, the budgets against the model's context, the code
sandbox, the "did you mean" of a mistyped flag, and what the sampler can run (config_problem on a
config.json, check_supported on a loaded model). config.get_args calls check_model_dir and
check_args; each failure is one line.
"""
import difflib
import glob
import itertools
import json
import math
import os
import re
import sys

import torch

from hub import resolve_model
from loss import clip_eps
from sandbox import bwrap_ready, not_ready_reason

# what each numeric flag may be, besides finite (a negative --temperature once trained to 0.000)
MAX_SECONDS = 1e7  # past this, waits overflow their clocks
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
    "gen_memory": (lambda v: 0 < v <= 1, "a fraction of the device memory, in (0, 1]"),
}


def check_args(args, error):
    """Flag values that would fail late or train silently wrong -> error(one line)."""
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
    """The longest prompt, the budgets and the interruption phrase against the model's context
    -> a one-line error, or None (prompt_len 0: not tokenized yet)."""
    need = prompt_len + args.think_budget + args.answer_budget + phrase_len
    if context is None or need <= context:
        return None
    prompt = f"the longest prompt ({prompt_len} tokens) + " if prompt_len else ""
    phrase = f" + the interruption phrase ({phrase_len})" if phrase_len else ""
    return (f"{prompt}--think_budget {args.think_budget} + --answer_budget {args.answer_budget}"
            f"{phrase} = {need} tokens: more than the model's context (max_position_embeddings "
            f"{context}); lower the budgets")


def check_clip_bounds(args, error):
    """--eps_low / --eps_high as loss.py reads them: CISPO's are bounds on the ratio."""
    low, high = clip_eps(args.loss, args.eps_low, args.eps_high)
    if args.loss == "cispo" and low is not None and low >= high:
        error(f"--eps_low {low} must be below --eps_high {high} (CISPO: bounds on the ratio)")
    if args.loss != "cispo" and low > 1:
        error(f"--eps_low {low}: {args.loss} clips the ratio at 1 - eps_low, which must be >= 0")


SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")
SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings")
ROPE = ("rope_theta", "factor", "original_max_position_embeddings", "low_freq_factor",
        "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "partial_rotary_factor")


def config_problem(cfg):
    """What in a config.json dict the sampler cannot run -> 'FIELD is ...', or None."""
    whole = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    for k in SIZES:
        if cfg.get(k) is not None and not (whole(cfg[k]) and cfg[k] >= 1):
            return f"{k} is {cfg[k]!r}, not a whole number >= 1"
    heads = cfg.get("num_attention_heads") or 1
    kv = cfg.get("num_key_value_heads") or heads
    if heads % kv:
        return f"num_key_value_heads {kv} does not divide num_attention_heads {heads}"
    nested = [(f"{d}.", cfg[d]) for d in ("rope_parameters", "rope_scaling")
              if isinstance(cfg.get(d), dict)]
    for prefix, d in [("", cfg)] + nested:
        for k in ROPE:
            v = d.get(k)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool)
                                      and 0 < v < float("inf")):
                return f"{prefix}{k} is {v!r}, not a finite number > 0"
    for k in ("bos_token_id", "eos_token_id"):
        ids = cfg.get(k) if isinstance(cfg.get(k), list) else [cfg.get(k)]
        vocab = cfg.get("vocab_size") or float("inf")
        if any(i is not None and not (whole(i) and 0 <= i < vocab) for i in ids):
            return f"{k} is {cfg.get(k)!r}, not an id below vocab_size {vocab}"
    return None


def check_supported(model):
    """A loaded model the sampler cannot run (generate.Decoder) -> ValueError, one line."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED:
        raise ValueError(f"model_type '{cfg.model_type}' is not supported by the sampler; "
                         f"supported: {', '.join(SUPPORTED)}")
    problem = config_problem(cfg.to_dict())
    if problem:
        raise ValueError(f"config.json: {problem}")
    if (getattr(cfg, "use_sliding_window", False)
            or "sliding_attention" in (getattr(cfg, "layer_types", None) or [])):
        raise ValueError("sliding-window attention is not supported by the sampler "
                         "(full attention only)")
    rope = model.model.rotary_emb.rope_type
    if "dynamic" in rope or rope == "longrope":  # length-dependent frequencies
        raise ValueError(f"rope_type '{rope}' is not supported by the sampler "
                         "(its rotary tables are fixed)")


def check_model_dir(path, error):
    """--model (a folder, or a Hub id resolved into the cache) -> the folder to load, checked to
    be one the sampler runs; "" without --model."""
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


def check_code_rewards(args, problems):
    """Code problems need the bwrap sandbox, or --unsafe_code_exec."""
    if not any(p.get("domain") == "code" for p in problems):
        return
    if not args.unsafe_code_exec and not bwrap_ready():
        sys.exit(f"error: {not_ready_reason()}")
    print("code rewards: " +
          ("--unsafe_code_exec: resource limits only, no isolation; a program can forge its reward"
           if args.unsafe_code_exec else "each program in its own bwrap sandbox"))


def did_you_mean(message, flags):
    """argparse's message -> " (--x: did you mean --y?)" for each mistyped flag in it, or ""."""
    typed = (re.findall(r"(--[\w-]+)", message)
             if message.startswith("unrecognized arguments") else [])
    return "".join(f" ({t}: did you mean {close}?)" for t in typed
                   if (close := closest_flag(t, flags)))


def closest_flag(typed, flags):
    """The flag a mistyped one most likely meant, or None: the flags sharing the most leading
    words (--temp, --temperature), then difflib. Spelling alone would take --lr_rate for
    --l_cache, not --lr."""
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
