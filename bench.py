"""
bench.py: speed, memory and numerics figures of the generator and the trainer, one printed line
per measurement (--json adds a dict as the last line). BENCHMARKS.md has each figure's reading,
command and results.

Figures (--figures; 1-5 by default): 1 sampler against model.generate; 2 trainer tokens/s and
peak memory; 3 weight broadcast; 4 generator vs trainer log-probs; 5 decode roofline; 6 wall-clock
per --mode; 7 FSDP2; memory; efficiency; stability; replay; plan_rss; gpu (on a GPU, first: bench_gpu).

    python bench.py                            # CPU, about 70 s
    python bench.py --device cuda --dtype bfloat16 --size 0.5b --new_tokens 512 --mem_seqs 16
    python bench.py --figures memory --json
    python bench.py --figures stability
    python bench.py --figures gpu --json       # a GPU, under 8 minutes
    python bench.py --write_model runs/qwen2-0.5b --size 0.5b --dtype bfloat16  # for --model
"""

import argparse
import contextlib
import copy
import ctypes
import json
import math
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import time

# -----------------------------------------------------------------------------
# flags

GPU_PARTS = ("kernels", "sampler", "trainer")  # figure gpu's, each in its own process
FIGURES = ("1", "2", "3", "4", "5", "6", "7", "memory", "efficiency", "stability", "replay",
           "plan_rss", "gpu")

SIZE_FLAGS = [
    ("repeats", 3, "timed runs of each side; the best is reported"),
    ("batch", 64, "figure 1: prompts sampled at once (= slots)"),
    ("prompt_len", 16, "figure 1: prompt tokens"),
    ("new_tokens", 32, "figure 1: tokens sampled per prompt"),
    ("task_prompts", 256, "figure 1b: toy-task prompts (continuous batching)"),
    ("task_new_tokens", 64, "figure 1b: max tokens per sample (eos ends one)"),
    ("train_seqs", 8, "figure 2: sequences per forward+backward"),
    ("train_len", 128, "figure 2: tokens per sequence"),
    ("mem_vocab", 151936, "figure 2 memory: vocab (Qwen2's)"),
    ("mem_seqs", 1, "figure 2 memory: sequences"),
    ("mem_len", 1024, "figure 2 memory: tokens per sequence"),
    ("chunk", 8192, "figure 2: sequence_logprobs chunk, vocabulary rows (0: train.py's, by "
                    "plan.LOGITS_BYTES)"),
    ("bcast_mb", 500, "figure 3: size of the extra broadcast buffer, MB"),
    ("agree_seqs", 8, "figure 4: samples per setting"),
    ("target", 0.9, "figure 6: held-out pass rate to reach"),
    ("pipeline_steps", 100, "figure 6: optimizer steps per run"),
    ("train_flags", "", "figure 6: extra train.py flags for every run, e.g. '--keep_truncated'"),
    ("fsdp_steps", 2, "figure 7: optimizer steps per run"),
    ("stability_seeds", "0,1,2,3,4", "figure stability: the seeds, comma-separated"),
    ("stability_preset", "toy", "figure stability: toy (the default run), study (the study's "
     "task and settings as study.py runs them) or toy-hard (the fifth study design's)"),
    ("stability_load", "pinned", "figure stability: pinned (the worst case: every token k "
     "versions old), idle, or hogs (two CPU-bound processes beside each run)"),
    ("stability_dir", "runs/stability", "figure stability: where its runs go (kept; a finished "
     "one-process run is reused)"),
    ("stability_flags", "", "figure stability: more train.py flags for every run, e.g. "
     "'--lr 3e-4' (the old default, which collapsed)"),
    ("replay_run", "", "figure replay: a toy run folder with a checkpoint every 2 steps"),
    ("replay_steps", "30,32,34,36,38,40,42,44", "figure replay: the checkpoints to read (even "
     "steps; the attribution needs the one 8 steps before each too)"),
    ("fsdp_seqs", 4, "figure 7: sequences per step"),
    ("fsdp_len", 64, "figure 7: tokens per sequence"),
]


def get_args(argv=None):
    ap = argparse.ArgumentParser(description="ScaleRL benchmarks",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="model weights dtype")
    ap.add_argument("--size", default="small", choices=list(SIZES),
                    help="the random-weight Qwen2 config (besides the toy)")
    ap.add_argument("--figures", default="1,2,3,4,5",
                    help=f"comma-separated figures to run: {', '.join(FIGURES)}")
    ap.add_argument("--fsdp_size", default="medium", choices=list(SIZES),
                    help="figure 7: the Qwen2 config trained")
    for flag, default, help_ in SIZE_FLAGS:
        ap.add_argument(f"--{flag}", type=type(default), default=default, help=help_)
    ap.add_argument("--fp32_head", action="store_true",
                    help="figure 1: our sampler computes the LM head in float32 (train.py's "
                         "default; model.generate keeps the head in the model dtype)")
    ap.add_argument("--write_model", default="", metavar="DIR",
                    help="save the random-weight --size config (--dtype) with the toy tokenizer "
                         "to DIR, for train.py --model DIR (a real architecture on the toy task), "
                         "and exit")
    ap.add_argument("--gpu_part", default="", choices=["", *GPU_PARTS],
                    help="figure gpu: run this one of its parts here (the figure runs each so)")
    ap.add_argument("--json", action="store_true",
                    help="print every figure as one JSON dict, last line")
    args = ap.parse_args(argv)
    unknown = set(args.figures.split(",")) - set(FIGURES)
    if unknown:
        ap.error(f"--figures: no figure {', '.join(sorted(unknown))} (the figures: "
                 f"{', '.join(FIGURES)})")
    return args


SIZES = {  # --size: the random-weight Qwen2 configs (models, below)
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, intermediate_size=1408, vocab_size=32000,
                  tie_word_embeddings=False),
    "medium": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                   num_key_value_heads=4, intermediate_size=4096, vocab_size=32000,
                   tie_word_embeddings=False),
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                 tie_word_embeddings=True),  # Qwen2-0.5B's shape
}


if __name__ == "__main__":  # flags, --help and their errors before torch's seconds of imports
    get_args()

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen2Config,
                          Qwen2ForCausalLM)

import config
import faults
from checks import check_supported
from data import prompt_ids, score_samples, special_tokens
from runs import read_jsonl
from generate import Decoder, Sample, drive, generate, tensor_core_head
import generate as gen_module
from hub import hide_progress_bars
from loss import LengthControl, make_batch, policy_loss
import metrics
import paged_attention
import pipeline
from plan import (LOGITS_BYTES, PlanRun, head_chunk, head_peak, kv_bytes_per_token, mean_length,
                  memory_plan, plan_activations, plan_lines, plan_param_count, plan_params, plan_shape,
                  plan_trainer)
import study
from toy import toy_model_dir, toy_problems
import train
import trainer as trainer_module
from trainer import (LogProbs, _Head, collate, kernels_line, micro_batches, packed_logprobs,
                     sequence_logprobs, shard_trainer)

# -----------------------------------------------------------------------------
# models (random weights, no download)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def qwen2_model(config, device, dtype, seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(max_position_embeddings=32768, **config)
    return Qwen2ForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def bench_models(args):
    device, dtype = args.device, DTYPES[args.dtype]
    toy = (AutoModelForCausalLM.from_pretrained(toy_model_dir())
           .to(device=device, dtype=dtype).eval())
    models = [("toy", toy), (f"qwen2-{args.size}", qwen2_model(SIZES[args.size], device, dtype))]
    for _, m in models:
        check_supported(m)
    return models


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def random_ids(n, length, vocab, seed, device):
    g = torch.Generator().manual_seed(seed)
    # 0 is often eos/pad
    return torch.randint(1, vocab, (n, length), generator=g).to(device)

# -----------------------------------------------------------------------------
# figure 1: sampler


def time_ours(model, prompts, new_tokens, fp32_head=False):
    sync(model.device)
    t0 = time.perf_counter()
    out = generate(model, prompts, eos_id=-1, think_end=[-2], interrupt_ids=[],
                   think_budget=new_tokens, answer_budget=0, interrupt=False, slots=len(prompts),
                   temperature=1.0, fp32_head=fp32_head)
    sync(model.device)
    assert all(len(s.tokens) == new_tokens for s in out)
    return time.perf_counter() - t0


def time_hf(model, ids, new_tokens):
    sync(model.device)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                         top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         pad_token_id=0)
    sync(model.device)
    assert out.shape == (ids.size(0), ids.size(1) + new_tokens)
    return time.perf_counter() - t0


def bench_sampler(name, model, args):
    ids = random_ids(args.batch, args.prompt_len, model.config.vocab_size, 0, args.device)
    prompts = ids.tolist()
    # warm-up (CUDA graphs)
    time_ours(model, prompts, args.new_tokens, args.fp32_head)
    time_hf(model, ids[:2], 2)
    ours, hf, ours1, hf1 = [], [], [], []
    for _ in range(args.repeats):  # alternate: the same load for both
        ours.append(time_ours(model, prompts, args.new_tokens, args.fp32_head))
        hf.append(time_hf(model, ids, args.new_tokens))
        # one new token: the prefill and a step, what a call costs besides its decode steps
        ours1.append(time_ours(model, prompts, 1, args.fp32_head))
        hf1.append(time_hf(model, ids, 1))
    tokens = args.batch * args.new_tokens
    r = {"model": name, "params": n_params(model), "batch": args.batch,
         "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "fp32_head": args.fp32_head,
         "ours_tok_s": tokens / min(ours), "hf_tok_s": tokens / min(hf), "ours_s": ours, "hf_s": hf,
         "ours_fixed_s": min(ours1), "hf_fixed_s": min(hf1)}
    r["ratio"] = r["ours_tok_s"] / r["hf_tok_s"]
    steps = max(1, args.new_tokens - 1)
    for side in ("ours", "hf"):
        r[f"{side}_step_ms"] = (min(r[f"{side}_s"]) - r[f"{side}_fixed_s"]) / steps * 1e3
    roof = ""
    if args.device == "cuda":
        context = args.prompt_len + args.new_tokens // 2
        r["roofline_tok_s"] = decode_roofline(model.config.to_dict(), args.batch, context,
                                              copy_bandwidth(), args.fp32_head,
                                              model.dtype.itemsize)["tok_s"]
        roof = (f" | {r['ours_tok_s'] / r['roofline_tok_s']:.1%} of the HBM roofline "
                f"({r['roofline_tok_s']:.0f} tok/s)")
    print(f"1 sampler   | {name} ({r['params'] / 1e6:.2f}M, {args.dtype}, ours fp32_head "
          f"{args.fp32_head}) | batch {args.batch} x ({args.prompt_len} + {args.new_tokens}) | "
          f"ours {r['ours_tok_s']:.0f} tok/s | model.generate {r['hf_tok_s']:.0f} tok/s | "
          f"ours/hf {r['ratio']:.2f} (best of {args.repeats} each, alternating){roof} | a call "
          f"of one token (prefill) ours {r['ours_fixed_s'] * 1e3:.1f} ms, hf "
          f"{r['hf_fixed_s'] * 1e3:.1f} ms; each further step ours {r['ours_step_ms']:.2f} ms, "
          f"hf {r['hf_step_ms']:.2f} ms")
    return r


def copy_bandwidth(gb=1.0):
    x = torch.empty(int(gb * 2 ** 30), dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(5):
        sync("cuda")
        t0 = time.perf_counter()
        y.copy_(x)
        sync("cuda")
        best = min(best, time.perf_counter() - t0)
    return 2 * x.numel() / best

def task_prompts(tokenizer, n):
    return [prompt_ids(tokenizer, p["prompt"]) for p in toy_problems(n, 0)]


def time_ours_task(model, prompts, eos_id, max_new, slots):
    sync(model.device)
    t0 = time.perf_counter()
    out = generate(model, prompts, eos_id=eos_id, think_end=[-2], interrupt_ids=[],
                   think_budget=max_new, answer_budget=0, interrupt=False, slots=slots,
                   temperature=1.0, fp32_head=False)
    sync(model.device)
    return time.perf_counter() - t0, sum(len(s.tokens) for s in out)


def time_hf_task(model, prompts, eos_id, max_new, batch):
    """-> (seconds, tokens up to each row's eos, as ours)."""
    batches = []  # pad before the clock
    for a in range(0, len(prompts), batch):
        part = prompts[a:a + batch]
        width = max(map(len, part))
        ids = torch.tensor([[eos_id] * (width - len(p)) + p for p in part], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in part],
                            device=model.device)
        batches.append((ids, mask))
    sync(model.device)
    t0, tokens = time.perf_counter(), 0
    for ids, mask in batches:
        out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=max_new, eos_token_id=eos_id,
                             pad_token_id=eos_id)
        for row in out[:, ids.size(1):].tolist():
            tokens += row.index(eos_id) + 1 if eos_id in row else len(row)
    sync(model.device)
    return time.perf_counter() - t0, tokens


def bench_sampler_task(model, args):
    """Figure 1b: toy completions, whose lengths vary."""
    tokenizer = AutoTokenizer.from_pretrained(toy_model_dir())
    prompts, eos_id = task_prompts(tokenizer, args.task_prompts), tokenizer.eos_token_id
    time_ours_task(model, prompts[:2], eos_id, 2, 2)
    time_hf_task(model, prompts[:2], eos_id, 2, 2)
    ours, hf = [], []
    for _ in range(args.repeats):
        ours.append(time_ours_task(model, prompts, eos_id, args.task_new_tokens, args.batch))
        hf.append(time_hf_task(model, prompts, eos_id, args.task_new_tokens, args.batch))
    r = {"model": "toy", "prompts": len(prompts), "batch": args.batch,
         "max_new_tokens": args.task_new_tokens, "ours_tok_s": max(n / s for s, n in ours),
         "hf_tok_s": max(n / s for s, n in hf), "ours": ours, "hf": hf,
         "mean_len": sum(n for _, n in ours + hf) / len(ours + hf) / len(prompts)}
    r["ratio"] = r["ours_tok_s"] / r["hf_tok_s"]
    print(f"1 sampler   | toy task, lengths vary (mean {r['mean_len']:.1f} of max "
          f"{args.task_new_tokens}) | {len(prompts)} prompts, batch {args.batch} | "
          f"ours (continuous batching) {r['ours_tok_s']:.0f} tok/s | "
          f"model.generate ({-(-len(prompts) // args.batch)} batches) {r['hf_tok_s']:.0f} tok/s | "
          f"ours/hf {r['ratio']:.2f} (best of {args.repeats} each, alternating)")
    return r

# -----------------------------------------------------------------------------
# figure 2: trainer


def naive_logprobs(model, ids, attention_mask):
    """Every position's float32 logits at once, then log_softmax."""
    logits = model(input_ids=ids, attention_mask=attention_mask).logits[:, :-1].float()
    return logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def loss_step(model, ids, path, chunk):
    attn = torch.ones_like(ids)
    if path == "naive":
        logp = naive_logprobs(model, ids, attn)
    else:
        logp = sequence_logprobs(model, ids, attn, fp32_head=True, chunk=chunk)
    cispo_backward(logp)
    return logp.detach()


def cispo_backward(logp):
    """On-policy CISPO with random advantages, backward."""
    N = logp.size(0)
    adv = torch.randn(N, generator=torch.Generator().manual_seed(1)).to(logp.device)
    group = torch.arange(N, device=logp.device) // 2
    loss = policy_loss(logp, logp.detach(), adv, torch.ones_like(logp), group)
    loss.backward()
    return loss.item()


def bench_trainer_speed(name, model, args):
    ids = random_ids(args.train_seqs, args.train_len, model.config.vocab_size, 2, args.device)
    model.train()
    times = []
    for _ in range(args.repeats + 1):
        sync(args.device)
        t0 = time.perf_counter()
        loss_step(model, ids, "chunked", args.chunk)
        sync(args.device)
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    model.eval()
    r = {"model": name, "seqs": args.train_seqs, "len": args.train_len,
         "tok_s": ids.numel() / min(times[1:])}
    print(f"2 trainer   | {name} ({args.dtype}) | {args.train_seqs} x {args.train_len} tokens | "
          f"forward+backward {r['tok_s']:.0f} tok/s (best of {args.repeats})")
    return r


def memory_now(device):
    """Bytes in use now; the peak counter reset."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    # glibc: mmap blocks >= 64 KB, so RSS follows live tensors
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)
    except (OSError, AttributeError):
        pass  # not glibc
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM
    except OSError:
        pass  # the peak then counts the set-up too
    return _proc_status("VmRSS")


def memory_peak(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return _proc_status("VmHWM")


def _proc_status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def memory_worker(path, vocab, seqs, length, chunk, device, dtype):
    """One loss forward+backward, in a fresh process."""
    config = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=vocab, tie_word_embeddings=True)
    model = qwen2_model(config, device, dtype).train()
    ids = random_ids(seqs, length, vocab, 3, device)
    before = memory_now(device)
    t0 = time.perf_counter()
    logp = loss_step(model, ids, path, chunk)
    sync(device)
    seconds = time.perf_counter() - t0
    return {"peak_bytes": memory_peak(device) - before, "seconds": seconds,
            "logp": logp.float().cpu().tolist(),
            "grad": model.model.norm.weight.grad.float().cpu().tolist()}


def in_fresh_process(fn, *args):
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def bench_trainer_memory(args):
    common = (args.mem_vocab, args.mem_seqs, args.mem_len, args.chunk, args.device,
              DTYPES[args.dtype])
    naive = in_fresh_process(memory_worker, "naive", *common)
    chunked = in_fresh_process(memory_worker, "chunked", *common)
    diff = max(abs(a - b) for ra, rb in zip(naive["logp"], chunked["logp"]) for a, b in zip(ra, rb))
    tokens = args.mem_seqs * (args.mem_len - 1)
    r = {"vocab": args.mem_vocab, "seqs": args.mem_seqs, "len": args.mem_len, "chunk": args.chunk,
         "logits_fp32_gb": tokens * args.mem_vocab * 4 / 1e9,
         "naive_peak_gb": naive["peak_bytes"] / 1e9, "chunked_peak_gb": chunked["peak_bytes"] / 1e9,
         "naive_tok_s": tokens / naive["seconds"], "chunked_tok_s": tokens / chunked["seconds"],
         "max_abs_logp_diff": diff}
    r["peak_ratio"] = (r["naive_peak_gb"] / r["chunked_peak_gb"] if chunked["peak_bytes"]
                       else math.inf)  # under a page, at the smallest sizes
    print(f"2 memory    | vocab {args.mem_vocab}, hidden 64, {args.mem_seqs} x {args.mem_len} "
          f"tokens (naive fp32 logits {r['logits_fp32_gb']:.2f} GB) | "
          f"peak naive {r['naive_peak_gb']:.2f} GB | chunked ({args.chunk}) "
          f"{r['chunked_peak_gb']:.2f} GB | naive/chunked {r['peak_ratio']:.1f}x | "
          f"tok/s naive {r['naive_tok_s']:.0f} chunked {r['chunked_tok_s']:.0f} | "
          f"max |logp diff| {diff:.1e}")
    return r


def paper_scale_logits(vocab=151936, seqs=768, length=4096):
    r = {"vocab": vocab, "seqs": seqs, "len": length, "naive_gb": seqs * length * vocab * 4 / 1e9,
         "naive_per_seq_gb": length * vocab * 4 / 1e9, "chunked_gb": LOGITS_BYTES / 1e9}
    print(f"2 arithmetic| vocab {vocab}, {seqs} x {length} tokens: naive fp32 logits "
          f"{r['naive_gb']:.0f} GB ({r['naive_per_seq_gb']:.2f} GB per sequence) | chunked: "
          f"{r['chunked_gb'] * 1e3:.0f} MB of logits at once per micro-batch (plan.LOGITS_BYTES), "
          "not measured")
    return r

# -----------------------------------------------------------------------------
# figure 3: broadcast


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def broadcast_worker(rank, port, sizes, repeats, backend, queue):
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = {}
    for name, numel in sizes:
        buf = torch.ones(numel, dtype=torch.float32, device=device)
        dist.broadcast(buf, 0)
        times = []
        for _ in range(repeats):
            dist.barrier()
            sync(device)
            t0 = time.perf_counter()
            dist.broadcast(buf, 0)
            sync(device)
            dt = torch.tensor([time.perf_counter() - t0], device=device)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            times.append(dt.item())
        results[name] = times
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def bench_broadcast(args, models):
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print("3 broadcast | skipped: nccl needs 2 GPUs, this machine has fewer")
        return {"skipped": "fewer than 2 GPUs"}
    backend = "nccl" if args.device == "cuda" else "gloo"
    sizes = ([(f"{name} weights", n_params(m)) for name, m in models]
             + [(f"{args.bcast_mb} MB buffer", args.bcast_mb * 10**6 // 4)])
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.SimpleQueue()
    torch.multiprocessing.spawn(broadcast_worker,
                                args=(free_port(), sizes, args.repeats, backend, queue), nprocs=2)
    times = queue.get()
    out = []
    for name, numel in sizes:
        mb, best = numel * 4 / 1e6, min(times[name])
        out.append({"buffer": name, "mb": mb, "seconds": best, "mb_s": mb / best,
                    "backend": backend})
        print(f"3 broadcast | {name}, {mb:.1f} MB float32 | {backend}, 2 processes | "
              f"{best * 1e3:.1f} ms | {mb / best:.0f} MB/s (best of {args.repeats})")
    return out

# -----------------------------------------------------------------------------
# figure 4: log-prob agreement


@torch.no_grad()
def logprob_agreement(model, seqs, prompt_len, new_tokens, fp32_head):
    """-> (mean, max) |generator - trainer log-prob|."""
    ids = random_ids(seqs, prompt_len, model.config.vocab_size, 4, model.device)
    out = generate(model, ids.tolist(), eos_id=-1, think_end=[-2], interrupt_ids=[],
                   think_budget=new_tokens, answer_budget=0, interrupt=False, slots=seqs,
                   temperature=1.0, fp32_head=fp32_head)
    full = torch.cat([ids, torch.tensor([s.tokens for s in out], device=ids.device)], 1)
    trainer = sequence_logprobs(model, full, torch.ones_like(full),
                                fp32_head=fp32_head)[:, prompt_len - 1:]
    gen_logp = torch.tensor([s.logps for s in out], device=ids.device)
    diff = (trainer.float() - gen_logp).abs()
    return diff.mean().item(), diff.max().item()


def bench_agreement(name, model, args):
    out = []
    for dtype in ("float32", "bfloat16"):
        m = model if dtype == args.dtype else copy.deepcopy(model).to(DTYPES[dtype])
        for fp32_head in (True, False):
            mean, mx = logprob_agreement(m, args.agree_seqs, args.prompt_len,
                                         args.new_tokens, fp32_head)
            out.append({"model": name, "dtype": dtype, "fp32_head": fp32_head, "mean_abs": mean,
                        "max_abs": mx})
            print(f"4 agreement | {name} {dtype} fp32_head={fp32_head} | "
                  f"{args.agree_seqs} x {args.new_tokens} sampled tokens | "
                  f"generator vs trainer log-prob |diff| mean {mean:.2e} max {mx:.2e}")
    return out

# -----------------------------------------------------------------------------
# figure 6: pipeline


PIPELINE_RUNS = (("one process", 1, []), ("sync", 2, ["--mode", "sync"]),
                 ("ppo_offpolicy-8", 2, ["--mode", "ppo_offpolicy"]),
                 ("pipeline-8", 2, ["--mode", "pipeline"]))


def bench_pipeline(args):
    """train.py in each mode: wall-clock to --target, busy fractions."""
    import tempfile
    rows, root = [], os.path.dirname(os.path.abspath(__file__))
    for name, world, flags in PIPELINE_RUNS:
        out = tempfile.mkdtemp(prefix="bench-pipeline-")
        launcher = ([sys.executable] if world == 1 else
                    [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
                     "--master_port", str(free_port())])
        cmd = launcher + [os.path.join(root, "train.py"), "--out", out,
                          "--steps", str(args.pipeline_steps), "--save_every", "0", *flags,
                          *args.train_flags.split()]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n"
                               f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
        records = [rec for _, rec in read_jsonl(os.path.join(out, "metrics.jsonl"))]
        train = [r for r in records if r.get("kind") == "train"]
        hit = next((r for r in records
                    if r.get("kind") == "eval" and r["pass_rate"] >= args.target), None)
        weights = [r["dt_ms"] for r in train]
        busy = {key: sum(r[key] * w for r, w in zip(train, weights)) / sum(weights)
                for key in ("gen_busy", "train_busy")}
        final = [r for r in records if r.get("kind") == "eval"][-1]
        row = {"run": name, "ranks": world,
               "to_target_s": hit["compute_s"] / world if hit else None,
               "target_step": hit["step"] if hit else None, "final_pass_rate": final["pass_rate"],
               "train_s": train[-1]["compute_s"] / world, "wall_s": time.perf_counter() - t0,
               "lag_mean": sum(r["lag"] for r in train) / len(train), **busy}
        rows.append(row)
        reached = (f"{row['to_target_s']:.1f} s (step {row['target_step']})" if hit
                   else "not reached")
        print(f"pipeline | {name:16s} | ranks {world} | to pass rate {args.target}: {reached} | "
              f"final {row['final_pass_rate']:.3f} | training {row['train_s']:.1f} s | "
              f"busy gen {row['gen_busy']:.2f} train {row['train_busy']:.2f} | "
              f"lag {row['lag_mean']:.2f} | whole run {row['wall_s']:.0f} s", flush=True)
    return rows

# -----------------------------------------------------------------------------
# figure 5: roofline


def decode_roofline(config, batch=64, context=1024, hbm_bytes_s=3.35e12, fp32_head=True,
                    bytes_per_weight=2, quiet=True):
    """Decode tokens/s if each step reads all weights and KV from HBM."""
    c = config
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    embed = c["vocab_size"] * c["hidden_size"]
    per_layer = (c["hidden_size"] * head_dim
                 * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"])
                 + 3 * c["hidden_size"] * c["intermediate_size"])
    body = c["num_hidden_layers"] * per_layer
    head_bytes = embed * (4 if fp32_head else bytes_per_weight)
    weight_bytes = body * bytes_per_weight + head_bytes
    kv_bytes = (batch * context * c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim
                * bytes_per_weight)
    steps = hbm_bytes_s / (weight_bytes + kv_bytes)
    r = {"batch": batch, "context": context, "weight_gb": weight_bytes / 1e9,
         "kv_gb": kv_bytes / 1e9, "steps_s": steps, "tok_s": steps * batch, "fp32_head": fp32_head}
    if quiet:
        return r
    print(f"5 roofline  | 0.5B-class bf16, H100 {hbm_bytes_s / 1e12:.2f} TB/s, batch {batch}, "
          f"context {context} | weights {r['weight_gb']:.2f} GB (fp32 head {fp32_head}) + KV "
          f"{r['kv_gb']:.2f} GB per step | <= {steps:.0f} steps/s = {r['tok_s']:.0f} tok/s | "
          f"arithmetic, not measured")
    return r

# -----------------------------------------------------------------------------
# figure efficiency


NO_KERNEL = {"aten::" + name for name in (  # allocations, metadata and casts to the same dtype
    "empty", "empty_like", "empty_strided", "new_empty", "resize_", "_unsafe_view", "detach_", "to",
    "type_as", "lift_fresh", "resolve_conj", "result_type", "promote_types")}


def _launches(event):
    """Kernels under a profiler event on CPU: its innermost ATen ops that compute (views,
    allocations and casts to the same dtype launch none)."""
    below = sum(_launches(e) for e in event.cpu_children)
    if below or not event.name.startswith("aten::") or event.name in NO_KERNEL:
        return below
    op = getattr(torch.ops.aten, event.name[6:], None)
    return int(op is not None and not any(getattr(op, o).is_view for o in op.overloads()))


def kernels_of(fn, device, steps=2):
    """Kernels one call of fn launches, counted by torch.profiler: on CUDA its kernels, on CPU the
    ATen ops that would be (_launches)."""
    fn()  # warm-up: one-time work is not a call's
    cuda = torch.device(device).type == "cuda"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                + [torch.profiler.ProfilerActivity.CUDA] * cuda) as prof:
        for _ in range(steps):
            fn()
        sync(device)
    events = prof.events()
    n = (sum(e.device_type == torch.autograd.DeviceType.CUDA for e in events) if cuda
         else sum(_launches(e) for e in events if e.cpu_parent is None))
    return round(n / steps)


def efficiency_sampler(args, rows=64, max_len=2048):
    """KV bytes a decode step at mixed lengths reads over the rows' own keys, the attention kernel
    that reads them, and the kernels one step launches (a decoder of --size's depth, narrow)."""
    device, dtype = args.device, DTYPES[args.dtype]
    tiny = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=256, tie_word_embeddings=False)
    lens = torch.randint(64, max_len + 1, (rows,), generator=torch.Generator().manual_seed(0))

    def decoder(model):
        dec = Decoder(model, rows, max_len, 4, eos_id=-1, think_end=[-2],
                      interrupt_ids=[], think_budget=max_len, answer_budget=0, interrupt=False,
                      temperature=1.0, fp32_head=False, seed=0, version=0, graphs=False)
        dec.pos.copy_(lens - 1)  # what is read depends on lengths alone
        for r, n in enumerate(lens.tolist()):  # each row its own blocks, as in a real step
            dec.reserve(r, n)
        dec._tables()
        return dec

    model = qwen2_model(tiny, device, dtype)
    dec, read, sdpa = decoder(model), [0], torch.nn.functional.scaled_dot_product_attention
    per_token = kv_bytes_per_token(model.config, dtype) // model.config.num_hidden_layers

    def counted(q, k, v, **kw):
        read[0] += k.numel() * k.element_size() + v.numel() * v.element_size()
        return sdpa(q, k, v, **kw)
    if dec.kernel == "groups":
        torch.nn.functional.scaled_dot_product_attention = counted
        try:
            dec._step(rows, dec.attention_plan(lens.tolist()), dec.off[:rows])
        finally:
            torch.nn.functional.scaled_dot_product_attention = sdpa
        read[0] //= model.config.num_hidden_layers
    else:  # flash-attn's and torch's kernels read tiles of 128 keys; the Triton one masks its loads
        tile = 1 if dec.kernel == "triton" else 128
        read[0] = int(((lens + tile - 1) // tile * tile).sum()) * per_token * 2
    out = {"decode_kernel": dec.kernel,
           "decode_kv_read_ratio": read[0] / (int(lens.sum()) * per_token)}
    layers = SIZES[args.size]["num_hidden_layers"]
    dec = decoder(qwen2_model(dict(tiny, num_hidden_layers=layers), device, dtype))
    plan = dec.attention_plan(lens.tolist())
    out["decode_kernels_per_step"] = kernels_of(lambda: dec._step(rows, plan, dec.off[:rows]),
                                                device)
    print(f"efficiency  | sampler decode step, {rows} rows of 64..{max_len} keys, {layers} "
          f"layers | " + " | ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                    for k, v in out.items()))
    return out

class LengthsDecoder(Decoder):
    """A Decoder whose step runs no model: sample `key` is lengths[key] tokens (truncated at the
    budget, else eos). Its KV pool and bookkeeping (reserve, release, collect) are Decoder's own."""

    lengths, decoded, admitted, steps = (), 0, 0, 0

    def admit(self, slots, prompts, keys):
        rows = torch.tensor(slots)
        self.n[rows], self.limit[rows] = 0, torch.tensor([self.lengths[k] for k in keys])
        self.cut[rows] = self.think_budget  # the budget: the finish reason of a full-length row
        self.live[rows], LengthsDecoder.admitted = True, self.admitted + len(slots)

    def step(self, R, lengths):
        live, n = self.live[:R], self.n[:R]
        LengthsDecoder.decoded, LengthsDecoder.steps = self.decoded + int(live.sum()), self.steps + 1
        n += live
        self.pos[:R] += live
        over = live & (n >= self.limit[:R])
        self.finish[:R] += over * torch.where(self.limit[:R] >= self.cut[:R], 3, 1)
        self.live[:R] &= ~over


def long_tailed_lengths(n, budget, reach, seed=0):
    """n sample lengths: `reach` of them the whole budget, the rest log-uniform in 16..budget."""
    rng = np.random.default_rng(seed)
    return [budget if rng.random() < reach else int(np.exp(rng.uniform(np.log(16), np.log(budget))))
            for _ in range(n)]


def admission_run(prompts, lengths, slots, budget, blocks, sync_every, block=gen_module.BLOCK):
    """The real sampler loop over LengthsDecoder -> ({tag: Sample}, tokens decoded, admissions,
    decode steps)."""
    model = qwen2_model(dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, intermediate_size=8, vocab_size=16), "cpu",
                        torch.float32)
    LengthsDecoder.lengths, LengthsDecoder.decoded = lengths, 0
    LengthsDecoder.admitted = LengthsDecoder.steps = 0
    real, gen_module.Decoder = gen_module.Decoder, LengthsDecoder
    try:
        steps = gen_module.sampler(model, eos_id=-1, think_end=[-2], interrupt_ids=[], think_budget=budget,
                            answer_budget=0, max_prompt_len=max(map(len, prompts)),
                            interrupt=False, slots=slots, sync_every=sync_every, blocks=blocks,
                            block=block)
        done = drive(steps, [(p, k, k) for k, p in enumerate(prompts)])
    finally:
        gen_module.Decoder = real
    return done, LengthsDecoder.decoded, LengthsDecoder.admitted, LengthsDecoder.steps


def efficiency_admission(slots=128, prompts=256, budget=8192, reach=0.945, sync_every=8,
                         block=gen_module.BLOCK, seed=0, quiet=False):
    """Decoded tokens the sampler throws away when rows restart (decode_tokens_discarded: thrown
    away / kept), the KV pool sized at the mean length (plan.slots_in) against one that holds
    every row at the full budget; the samples must be the same."""
    rng = np.random.default_rng(seed)
    ids = [[1] * int(rng.integers(budget // 160 + 1, budget // 20)) for _ in range(prompts)]
    lengths = long_tailed_lengths(prompts, budget, reach, seed)
    max_len = max(map(len, ids)) + budget
    mean = 1 + slots * -(-mean_length(max_len, budget) // block)
    out = {}
    for name, blocks in (("full", None), ("mean", mean)):
        done, decoded, admitted, steps = admission_run(ids, lengths, slots, budget, blocks, sync_every,
                                                block)
        kept = sum(len(s.tokens) for s in done.values())
        out[name] = {"discarded": (decoded - kept) / kept, "restarts": admitted - prompts,
                     "steps": steps,
                     "samples": {k: (len(s.tokens), s.finish) for k, s in done.items()}}
    full, mean_pool = out["full"], out["mean"]
    r = {"decode_tokens_discarded": mean_pool["discarded"], "restarts": mean_pool["restarts"],
         "samples_equal_full_pool": mean_pool["samples"] == full["samples"],
         "discarded_full_pool": full["discarded"], "decode_steps": mean_pool["steps"],
         "decode_steps_full_pool": full["steps"]}
    if not quiet:
        print(f"efficiency  | sampler admission, {prompts} prompts, {slots} slots, budget {budget} "
              f"({reach:.1%} reach it), sync_every {sync_every}, KV pool at the mean length "
              f"({mean} blocks of {block}) | decode_tokens_discarded {r['decode_tokens_discarded']:.3f} "
              f"({r['restarts']} restarts) | decode steps {r['decode_steps']} (full pool "
              f"{r['decode_steps_full_pool']}) | samples as with a full pool "
              f"{r['samples_equal_full_pool']}", flush=True)
    return r


# -----------------------------------------------------------------------------
# figure 7: FSDP2 under a memory cap


def fsdp_worker(rank, world, port, config, cap_bytes, args, queue):
    """One trainer rank, unsharded or FSDP2, under RLIMIT_DATA (cap_bytes)."""
    import resource
    faults.pick_threads(world)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=__import__("datetime").timedelta(seconds=120))
    rss0 = memory_now("cpu")
    if cap_bytes:
        limit = _proc_status("VmData") + cap_bytes
        resource.setrlimit(resource.RLIMIT_DATA,
                           (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    result = {"rank": rank, "world": world, "cap_bytes": cap_bytes, "losses": []}
    try:
        model = qwen2_model(config, "cpu", torch.float32).train()
        result["params"] = n_params(model)
        forward = LogProbs(model)
        if world > 1:
            forward = shard_trainer(model, dist.group.WORLD, "cpu")
        result["local_params"] = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                                     for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for step in range(args.fsdp_steps):
            ids = random_ids(args.fsdp_seqs, args.fsdp_len, config["vocab_size"],
                             10 * step + rank, "cpu")
            logp = forward(ids.flatten(), [args.fsdp_len] * args.fsdp_seqs, True, 1.0)  # packed
            result["losses"].append(cispo_backward(logp))
            opt.step()
            opt.zero_grad(set_to_none=True)
        result["ok"] = True
    except RuntimeError as err:
        result["ok"], result["error"] = False, str(err).splitlines()[0][:160]
    result["peak_bytes"] = memory_peak("cpu") - rss0
    queue.put(result)
    if world > 1 and result["ok"]:
        dist.destroy_process_group()


def run_fsdp(world, config, cap_bytes, args):
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.SimpleQueue()
    torch.multiprocessing.spawn(fsdp_worker,
                                args=(world, free_port(), config, cap_bytes, args, queue),
                                nprocs=world, join=True)
    return sorted((queue.get() for _ in range(world)), key=lambda r: r["rank"])


def bench_fsdp(args):
    """Peaks of one unsharded and two FSDP2 trainers; then capped halfway."""
    config = SIZES[args.fsdp_size]
    free = {}
    for world in (1, 2):
        free[world] = run_fsdp(world, config, 0, args)
    peak1, peak2 = free[1][0]["peak_bytes"], max(r["peak_bytes"] for r in free[2])
    cap = (peak1 + peak2) // 2
    out = {"config": args.fsdp_size, "params": free[1][0]["params"], "cap_bytes": cap, "runs": []}
    for capped in (0, cap):
        for world in (1, 2):
            rows = free[world] if not capped else run_fsdp(world, config, cap, args)
            for r in rows:
                out["runs"].append(r)
                who = "unsharded" if world == 1 else f"FSDP2 rank {r['rank']} of {world}"
                limit = f"{capped / 1e9:.2f} GB" if capped else "none"
                what = ("losses " + ", ".join(f"{x:.4f}" for x in r["losses"]) if r["ok"]
                        else f"FAILED: {r['error']}")
                print(f"7 fsdp      | qwen2-{args.fsdp_size} ({out['params'] / 1e6:.1f}M) | "
                      f"{who} holds {r.get('local_params', 0) / 1e6:.1f}M params | cap {limit} | "
                      f"peak {r['peak_bytes'] / 1e9:.2f} GB | {what}")
    return out

# -----------------------------------------------------------------------------
# figure memory


CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "configs")
PLAN_SHAPES = ("Qwen2.5-0.5B", "Qwen2.5-1.5B", "Qwen2.5-7B", "Qwen3-0.6B")
# one 8 x 80 GB node, 16 x 16 x 8k
NODE_RUN = dict(prompts=16, samples=16, prompt_len=512, think_budget=7168, answer_budget=1024,
                phrase_len=20, micro_tokens=8192, fsdp=True, trainers=2, generators=6)


def recipe_run(recipe, **sizes):
    r = config.RECIPES[recipe]
    return dict(prompts=r["prompts"], samples=r["samples"], prompt_len=512,
                think_budget=r["think_budget"], answer_budget=r["answer_budget"], phrase_len=20,
                micro_tokens=8192, **sizes)


# the README's real-model commands
README_RUN = recipe_run("one_gpu")
README_NODE_RUN = recipe_run("paper", fsdp=True, trainers=2, generators=6)


def shape_config(name, **changes):
    with open(os.path.join(CONFIGS, f"{name}.json")) as f:
        return AutoConfig.for_model(**{**json.load(f), **changes})


def saved_bytes(fn, model):
    """fn() -> (bytes saved for the backward, parameters excluded; its result)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def saved_bytes_per_token(model, lengths=(32, 64), **kw):
    device, vocab = model.device, model.config.vocab_size
    sizes = [saved_bytes(lambda: sequence_logprobs(model, random_ids(1, n, vocab, n, device),
                                                   **kw), model)[0] for n in lengths]
    return (sizes[1] - sizes[0]) / (lengths[1] - lengths[0])


def saved_by_part(model, **kw):
    """Saved bytes per token -> {layer, rest}."""
    inner, whole = model.model, saved_bytes_per_token(model, **kw)
    layers = inner.layers
    inner.layers = layers[:1]
    try:
        one = saved_bytes_per_token(model, **kw)
    finally:
        inner.layers = layers
    per_layer = (whole - one) / (len(layers) - 1)
    return {"layer": per_layer, "rest": one - per_layer}


def two_layer_model(name, dtype=torch.bfloat16, **changes):
    """A published shape, 2 layers, zero weights (random init is slow)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    config = shape_config(name, num_hidden_layers=2, **changes)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # no_init_weights skips the tie: a tied shape had its own head
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model.train()


def measured_figures(name):
    """-> {figure: (planned, measured)} of a shape."""
    full = shape_config(name)
    s, model = plan_shape(full), two_layer_model(name)
    act = plan_activations(s, 2)
    on, off = saved_by_part(model, checkpoint_layers=True), saved_by_part(model,
                                                                         checkpoint_layers=False)
    dec = Decoder(model, 2, 64, 8, eos_id=0, think_end=[1], interrupt_ids=[2], think_budget=4,
                  answer_budget=4, interrupt=True, temperature=1.0, fp32_head=True, seed=0,
                  version=0, graphs=False)
    tokens = dec.cache[0][0][..., 0, 0].numel()  # in its pool of blocks
    kv = sum(k.nbytes + v.nbytes for k, v in dec.cache) / tokens * s["L"] / 2
    del model, dec
    out = {"saved_checkpointed_layer": (act["checkpointed"], on["layer"]),
           "saved_recomputed_layer": (act["layer"], off["layer"]),
           "saved_head": (act["head"], on["rest"]),
           "kv_cache": (kv_bytes_per_token(full, torch.bfloat16), kv)}
    return out | optimizer_figures(name)


def optimizer_figures(name):
    """Bytes per parameter of a replicated bf16 trainer, planned and measured after a step."""
    model = two_layer_model(name, vocab_size=4096, bos_token_id=None, eos_token_id=None)
    s = plan_shape(model.config)
    n = plan_param_count(s)
    plan = plan_trainer(s, 2, 0, True, False, 1)
    master = [torch.nn.Parameter(p.detach().float()) for p in model.parameters()]
    opt = torch.optim.AdamW(master)
    sequence_logprobs(model, random_ids(1, 16, 4096, 0, "cpu")).sum().backward()
    for p, m in zip(model.parameters(), master):
        m.grad = p.grad.float()
    opt.step()
    state = sum(t.nbytes for st in opt.state.values() for t in st.values() if t.dim())
    grads = sum(p.grad.nbytes for p in model.parameters()) + sum(m.grad.nbytes for m in master)
    measured = {"weights": sum(p.nbytes for p in model.parameters()),
                "float32 master": sum(m.nbytes for m in master), "AdamW state": state,
                "gradients": grads}
    return {f"{k} per parameter": (plan[k] / n, v / n) for k, v in measured.items()}


def figures_line(name, figures):
    worst = max(abs(m / p - 1) for p, m in figures.values())
    per_token = " | ".join(f"{k} {p:,.0f} / {m:,.0f}" for k, (p, m) in figures.items()
                           if "parameter" not in k)
    per_param = ", ".join(f"{k.removesuffix(' per parameter')} {p:.1f} / {m:.1f}"
                          for k, (p, m) in figures.items() if "parameter" in k)
    verdict = "within 10%" if worst <= 0.1 else "OFF BY MORE THAN 10%"
    return (f"memory | {name} | planned / measured, bytes per token: {per_token} | per parameter: "
            f"{per_param} | worst {worst:.1%}: {verdict}"), worst


def print_plan(name, config, run):
    plan = memory_plan(config, run)
    print(f"memory | {name}")
    print("\n".join(plan_lines(plan, run, config.max_position_embeddings)), flush=True)
    return plan


def bench_memory_plan(args):
    """Memory plans of real shapes, checked against measurements."""
    out = {}
    for name in PLAN_SHAPES:
        figures = measured_figures(name)
        line, worst = figures_line(name, figures)
        print(line, flush=True)
        plan = print_plan(f"{name}, 16 x 16 x 8k on 8 x 80 GB: 6 generators, 2 FSDP2 trainers",
                          shape_config(name), PlanRun(**NODE_RUN))
        out[name] = {"saved_bytes_per_token_layer": figures["saved_checkpointed_layer"][1],
                     "figures": figures, "worst_error": worst, "sequences": plan["sequences"],
                     "roles": plan["roles"]}
    wide = print_plan("Qwen2.5-7B at 32768 tokens per micro-batch", shape_config("Qwen2.5-7B"),
                      PlanRun(**{**NODE_RUN, "micro_tokens": 32768}))
    readme = print_plan("the README's Qwen3-0.6B command (--recipe one_gpu), one process on one "
                        "80 GB GPU", shape_config("Qwen3-0.6B"), PlanRun(**README_RUN))
    node = print_plan("the README's 8-GPU command: Qwen2.5-7B, the paper's recipe, 6 generators, 2 "
                      "FSDP2 trainers", shape_config("Qwen2.5-7B"),
                      PlanRun(**README_NODE_RUN))
    return out | {"Qwen2.5-7B micro_tokens 32768": wide["roles"], "readme": readme["roles"],
                  "readme_node": node["roles"]}


# -----------------------------------------------------------------------------
# figure plan_rss


RSS_SHAPE = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=512, vocab_size=32000, tie_word_embeddings=True)


def peak_rss(cmd, seconds):
    proc = subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    peak, t0 = 0, time.time()
    while proc.poll() is None and time.time() - t0 < seconds:
        with contextlib.suppress(OSError, StopIteration), open(f"/proc/{proc.pid}/status") as f:
            peak = max(peak, next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmHWM:")))
        time.sleep(0.2)
    proc.kill()
    return peak, proc.communicate()[0]


def bench_plan_rss(args, seconds=40):
    """The printed memory plan against the run's peak RSS on CPU."""
    import tempfile
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = AutoTokenizer.from_pretrained(toy_model_dir())
        qwen2_model(dict(RSS_SHAPE, eos_token_id=tokenizer.eos_token_id), "cpu",
                    torch.bfloat16).save_pretrained(tmp + "/model")
        tokenizer.save_pretrained(tmp + "/model")
        base = [sys.executable, "train.py", "--model", tmp + "/model", "--val_size", "20"]
        for name, extra in (("eval_only", ["--eval_only"]),
                            ("train", ["--out", tmp + "/run", "--save_every", "0"])):
            peak, text = peak_rss(base + extra, seconds)
            plan = float(re.findall(r"total ([\d.]+): fits", text)[0]) * 1e9
            out[name] = {"plan_gb": plan / 1e9, "peak_rss_gb": peak / 1e9, "ratio": peak / plan}
            print(f"plan_rss | {name}, paper recipe, Qwen2 {RSS_SHAPE['hidden_size']} wide, "
                  f"{RSS_SHAPE['num_hidden_layers']} layers on CPU | plan {plan / 1e9:.2f} GB | "
                  f"peak RSS {peak / 1e9:.2f} GB in {seconds} s ({peak / plan:.2f} x the plan)",
                  flush=True)
    return out


# -----------------------------------------------------------------------------
# figure stability


HERE = os.path.dirname(os.path.abspath(__file__))
HOG = [sys.executable, "-c", "while True: pass"]
# the README's torchrun form: the launcher's rendezvous a file, the ranks' store on 127.0.0.1 alone
LOOPBACK_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


# toy-hard: the fifth study design's task
HARD_OPS, HARD_STEPS = 4, 200
HARD_FLAGS = ["--think_budget", "32", "--lr", "2e-4", "--eval_every", "10", "--eval_samples", "1",
              "--save_every", "0"]


def stability_flags(args, folder):
    """train.py's flags of the preset: toy, study or toy-hard."""
    if args.stability_preset == "toy":
        return []
    if args.stability_preset == "study":
        return study.task_flags(study.make_problems(os.path.join(folder, "study")), study.STEPS)
    data = study.make_problems(folder, max_ops=HARD_OPS)
    return ["--model", toy_model_dir(preset="toy-hard"), "--data", data[0], "--val_data", data[1],
            "--steps", str(HARD_STEPS), *HARD_FLAGS]


def stability_run(cmd, out, hogs=()):
    """-> (metrics records, steps warned at)."""
    beside = [subprocess.Popen(h, stdout=subprocess.DEVNULL) for h in hogs]
    try:
        with open(out + ".log", "w") as log:
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=HERE,
                                  env=dict(os.environ, **LOOPBACK_ENV))
    finally:
        for h in beside:
            h.kill()
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: see {out}.log")
    text = open(out + ".log").read()
    warned = [int(n) for n in re.findall(r"^warning: step (\d+)", text, re.M)]
    return [r for _, r in read_jsonl(os.path.join(out, "metrics.jsonl"))], warned


def stability_seed(args, seed, folder, flags):
    """One-process (reused) and torchrun runs of a seed -> its row."""
    one = os.path.join(folder.replace(f"-{args.stability_load}", "-one", 1), f"one-s{seed}")
    common = ["--seed", str(seed), "--overwrite", *flags, *args.stability_flags.split()]
    if not os.path.exists(os.path.join(one, "metrics.jsonl")) or not any(
            r.get("kind") == "eval" and r["step"] == train_steps(one)
            for _, r in read_jsonl(os.path.join(one, "metrics.jsonl"))):
        stability_run([sys.executable, "train.py", "--out", one, *common], one)
    ranks = os.path.join(folder, f"{args.stability_load}-s{seed}")
    launch = study.local_torchrun(2)
    pinned = args.stability_load == "pinned"
    train_cmd = ["train.py", "--out", ranks, *common] + (["--micro_tokens", "1"] if pinned else [])
    cmd = (launch + ["--no-python", "sh", "-c",
                     "exec taskset -c $LOCAL_RANK " + " ".join([sys.executable, *train_cmd])]
           if pinned else launch + train_cmd)
    hogs = ([["taskset", "-c", "0", *HOG]] * 2 if pinned else
            [HOG, HOG] if args.stability_load == "hogs" else [])
    records, warned = stability_run(cmd, ranks, hogs)
    return stability_row(seed, [r for _, r in read_jsonl(os.path.join(one, "metrics.jsonl"))],
                         records, warned)


def train_steps(out):
    return next(r["steps"] for _, r in read_jsonl(os.path.join(out, "metrics.jsonl"))
                if r.get("kind") == "config")


def stability_row(seed, one, ranks, warned):
    """A seed's row. Fell: more than metrics.HELD_OUT_DROP_ALARM below its best. Held: final >= one-
    process final - 0.03, nothing under 0.6 after step 30."""
    evals = lambda rs: [r for r in rs if r["kind"] == "eval"]
    steps = [r for r in ranks if r["kind"] == "train" and r["kept_prompts"]]
    after = [r["pass_rate"] for r in evals(ranks) if r["step"] > 30]
    k = max(r["lag_max"] for r in steps)
    row = {"seed": seed, "one_final": evals(one)[-1]["pass_rate"],
           "final": evals(ranks)[-1]["pass_rate"], "lowest_after_30": min(after),
           "lag_mean": sum(r["lag"] for r in steps) / len(steps),
           "at_max_lag": sum(r["lag"] >= k - 0.5 for r in steps) / len(steps), "max_lag": k,
           "max_trunc": max(r["trunc"] for r in ranks if r["kind"] == "train"),
           "max_forget": max(r.get("forget", 0.0) for r in steps), "warned": warned,
           "steps": max(r["step"] for r in ranks if r["kind"] == "train")}
    rates = [r["pass_rate"] for r in evals(ranks)]
    row["fall"] = max(max(rates[:i + 1]) - rate for i, rate in enumerate(rates))
    row["fell"] = row["fall"] > metrics.HELD_OUT_DROP_ALARM
    row["held"] = row["final"] >= row["one_final"] - 0.03 and row["lowest_after_30"] >= 0.6
    return row


def bench_stability(args):
    """PipelineRL-8 against one process, seed by seed."""
    folder = os.path.join(args.stability_dir, f"{args.stability_preset}-{args.stability_load}"
                          + "".join(args.stability_flags.split()).replace("--", "-"))
    os.makedirs(folder, exist_ok=True)
    os.makedirs(folder.replace(f"-{args.stability_load}", "-one", 1), exist_ok=True)
    flags, rows = stability_flags(args, args.stability_dir), []
    for seed in map(int, args.stability_seeds.split(",")):
        row = stability_seed(args, seed, folder, flags)
        rows.append(row)
        print(f"stability | {args.stability_preset} {args.stability_load} seed {seed} | one "
              f"process {row['one_final']:.3f} | torchrun {row['final']:.3f} (lowest after step "
              f"30: {row['lowest_after_30']:.3f}, largest fall {row['fall']:.3f}) | lag "
              f"{row['lag_mean']:.2f} mean, "
              f"{row['at_max_lag']:.0%} of steps at {row['max_lag']:.0f} | max trunc "
              f"{row['max_trunc']:.3f} | max forget {row['max_forget']:.3f} | warnings at "
              f"{row['warned'] or 'none'} | {'fell' if row['fell'] else 'no fall'} | "
              f"{'held' if row['held'] else 'NOT HELD'}", flush=True)
    print(f"stability | {sum(r['held'] for r in rows)} of {len(rows)} held")
    return rows


# -----------------------------------------------------------------------------
# figure replay


def replay_load(run, step, args):
    """-> (model, bias-corrected AdamW second moments, lr, eps)."""
    path = os.path.join(run, f"ckpt-{step:06d}")
    _, model = train.load_model(path, args, torch.device("cpu"))
    opt = torch.load(os.path.join(path, "state.pt"), weights_only=True)["optimizer"]
    group = opt["param_groups"][0]
    v = [st["exp_avg_sq"] / (1 - group["betas"][1] ** float(st["step"]))
         for _, st in sorted(opt["state"].items())]
    return model, v, group["lr"], group["eps"]


def answer_start(tokens, think_end):
    E = len(think_end)
    return next((i + E for i in range(len(tokens) - E + 1) if tokens[i:i + E] == think_end), None)


def replay_probe(model, contexts, the, grad=False):
    """Mean log-odds of `the` after each context."""
    ids, attn, *_ = collate([c[:-1] for c in contexts],
                                  [Sample(0, [c[-1], the], [0.0] * 2, [1] * 2, [0] * 2, "eos")
                                   for c in contexts], 0, "cpu")
    with torch.set_grad_enabled(grad):
        lp = sequence_logprobs(model, ids, attn)
        at = torch.tensor([len(c) - 1 for c in contexts])
        val = lp[torch.arange(len(contexts)), at]
        odds = (val - torch.log1p(-val.exp().clamp(max=1 - 1e-7))).mean()
    if grad:
        model.zero_grad()
        odds.backward()
        return odds.item(), [p.grad.clone() for p in model.parameters()]
    return odds.item()


def replay_batch(model, version, seed, env):
    tok, args, problems, ids = env
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(problems), 16, replace=False).tolist()
    items = [(ids[i], seed * 10 ** 6 + 8 * j + k, (j, k))
             for j, i in enumerate(idx) for k in range(8)]
    steps = pipeline.make_sampler(model, tok, args, max(map(len, ids)), version)
    done = drive(steps, items)
    groups = []
    for j, i in enumerate(idx):
        samples = [done[(j, k)] for k in range(8)]
        _, correct, rewards = score_samples(tok, samples, [problems[i]] * 8)
        groups.append({"index": i, "prompt": ids[i], "samples": samples, "correct": correct,
                       "rewards": rewards})
    return make_batch(groups, length=LengthControl.from_args(args),
                      keep_truncated=args.keep_truncated, zero_var_filter=args.zero_var_filter,
                      adv_norm=args.adv_norm)


def replay_terms(model, batch, step, think_end):
    """Gradients through each term's tokens; the forget."""
    rows = batch.rows
    prompts, samples = [batch.prompt_ids[r] for r in rows], [batch.samples[r] for r in rows]
    ids, attn, mask, gen_logp, _ = collate(prompts, samples, 0, "cpu", step)
    ans = torch.zeros_like(mask, dtype=torch.bool)
    for i, (p, s) in enumerate(zip(prompts, samples)):
        cut = answer_start(s.tokens, think_end) or len(s.tokens)
        ans[i, len(p) - 1 + cut:len(p) - 1 + len(s.tokens)] = True
    pos = (batch.adv > 0)[:, None].expand_as(ans)
    terms, out = {"all": (pos | ~pos, False), "positive": (pos, False), "negative": (~pos, False),
                  "answer": (ans, False), "thinking": (~ans, False),
                  "all, rho = 1": (pos | ~pos, True)}, {}
    for name, (chosen, no_is) in terms.items():
        logp = sequence_logprobs(model, ids, attn)
        logp = torch.where(chosen, logp, logp.detach())
        loss = policy_loss(logp, logp.detach() if no_is else gen_logp, batch.adv, mask,
                           batch.group[rows])
        model.zero_grad()
        loss.backward()
        out[name] = [p.grad.clone() for p in model.parameters()]
    lost, sure = metrics.forgetting(logp.detach(), gen_logp, mask)
    return out, float(lost / max(int(sure), 1))


def bench_replay(args):
    """What moved a collapsing run, from its checkpoints."""
    targs = config.get_args(["--out", os.path.join(args.replay_run, "replay")])
    problems, val = train.load_data(targs)
    steps = [int(x) for x in args.replay_steps.split(",")]
    first, _, _, _ = replay_load(args.replay_run, steps[0], targs)
    tok = AutoTokenizer.from_pretrained(os.path.join(args.replay_run, f"ckpt-{steps[0]:06d}"))
    think_end = special_tokens(tok)["think_end"]
    val_ids, ids = train.tokenize_prompts(tok, val), train.tokenize_prompts(tok, problems)
    gargs = config.get_args([])
    gargs.temperature = 0.0  # greedy
    greedy = pipeline.make_sampler(first, tok, gargs, max(map(len, val_ids)))
    greedy = drive(greedy, [(p, 0, i) for i, p in enumerate(val_ids)])
    contexts, nexts = [], []
    for i, p in enumerate(val_ids):
        t, cut = greedy[i].tokens, answer_start(greedy[i].tokens, think_end)
        if cut is not None and cut < len(t):
            contexts.append(p + t[:cut])
            nexts.append(t[cut])
    the = max(set(nexts), key=nexts.count)
    env, rows = (tok, targs, problems, ids), []
    for step in steps:
        rows.append(replay_step(args.replay_run, step, env, contexts, the, think_end))
    return rows


def replay_step(run, step, env, contexts, the, think_end):
    """One checkpoint's row: probe, fresh samples, stale vs on-policy effects."""
    tok, targs, problems, ids = env
    model, v, lr, eps = replay_load(run, step, targs)
    odds, probe_grad = replay_probe(model, contexts, the, grad=True)
    fresh = replay_batch(model, step, 7 + step, env)
    after = [s.tokens[answer_start(s.tokens, think_end):][:1] for s in fresh.samples
             if answer_start(s.tokens, think_end) is not None]
    row = {"step": step, "log_odds": odds, "fresh_trunc": float(fresh.truncated.float().mean()),
           "fresh_not_the": float(np.mean([t != [the] for t in after])) if after else 1.0}
    effect = lambda g: -lr * sum((a * b / (c.sqrt() + eps)).sum().item()
                                 for a, b, c in zip(probe_grad, g, v))
    if os.path.exists(os.path.join(run, f"ckpt-{step - 8:06d}")):
        old = replay_load(run, step - 8, targs)[0]
        for kind, sampler_model, version in (("stale", old, step - 8), ("onpolicy", model, step)):
            batch = replay_batch(sampler_model, version, 100 * step, env)
            if batch.rows:
                grads, forget = replay_terms(model, batch, step, think_end)
                row[kind] = {name: effect(g) for name, g in grads.items()} | {"forget": forget}
    print(f"replay | step {step} | log-odds p(the | </think>) {odds:.2f} | fresh samples: "
          f"trunc {row['fresh_trunc']:.3f}, not ' The' after </think> {row['fresh_not_the']:.3f}"
          + "".join(f" | {kind}: forget {row[kind]['forget']:.4f}, effect of one step: " +
                    ", ".join(f"{k} {x:+.2f}" for k, x in row[kind].items() if k != "forget")
                    for kind in ("stale", "onpolicy") if kind in row), flush=True)
    return row


def write_model(args):
    """A random-weight Qwen2 folder with the toy tokenizer, for train.py --model."""
    tokenizer = AutoTokenizer.from_pretrained(toy_model_dir())
    model = qwen2_model(dict(SIZES[args.size], bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id), "cpu", DTYPES[args.dtype])
    model.save_pretrained(args.write_model)
    tokenizer.save_pretrained(args.write_model)
    print(f"wrote qwen2-{args.size} ({n_params(model) / 1e6:.1f}M params, random weights, "
          f"{args.dtype}) with the toy tokenizer to {args.write_model}")


def study_step_lengths(seed=0):
    path = toy_model_dir(preset="toy-hard")
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    args = config.get_args(["--model", path, "--seed", str(seed), *study.TASK])
    problems = [p for p in toy_problems(10 * args.prompts, seed, "toy-hard")
                if len(p["steps"]) <= study.MAX_OPS][:args.prompts]
    ids = train.tokenize_prompts(tok, problems)
    done = drive(pipeline.make_sampler(model.eval(), tok, args, max(map(len, ids))),
                 [(p, j * args.samples + k, (j, k)) for j, p in enumerate(ids)
                  for k in range(args.samples)])
    return [len(ids[j]) + len(s.tokens) for (j, _), s in done.items()]


def budget_8k_lengths(seed=0, prompts=8, samples=16, think=7168, answer=1024):
    """A made-up, seeded mix."""
    rng = np.random.default_rng(seed)
    lengths = []
    for _ in range(prompts):
        p = int(rng.integers(50, 400))
        for _ in range(samples):
            c = (rng.integers(64, think + answer) if rng.random() < 0.5 else
                 rng.integers(think * 5 // 6, think) + 12 + rng.integers(16, answer))
            lengths.append(p + int(c))
    return lengths


def efficiency_trainer(micro_tokens=8192):
    """Real tokens / tokens the layers compute, packed (meta device, shapes only) and right-padded.
    """
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape_config("Qwen2.5-0.5B",
                                                              num_hidden_layers=1))
    computed = []
    model.model.layers[0].register_forward_pre_hook(
        lambda m, a: computed.append(a[0].shape[0] * a[0].shape[1]))
    out = {}
    for name, lengths in (("study", study_step_lengths()), ("8k", budget_8k_lengths())):
        computed.clear()
        parts = micro_batches(lengths, micro_tokens)
        with torch.no_grad():
            for part in parts:
                ids = torch.zeros(sum(lengths[i] for i in part), dtype=torch.long, device="meta")
                packed_logprobs(model, ids, [lengths[i] for i in part])
        rows, padded = sorted(lengths, reverse=True), 0
        while rows:
            n = max(1, min(len(rows), micro_tokens // rows[0]))
            padded, rows = padded + n * rows[0], rows[n:]
        out[f"trainer_token_efficiency_{name}"] = sum(lengths) / sum(computed)
        out[f"trainer_token_efficiency_{name}_padded"] = sum(lengths) / padded
        print(f"efficiency | trainer, {name} step: {len(lengths)} rows, {sum(lengths):,} tokens in "
              f"{len(parts)} micro-batches of --micro_tokens {micro_tokens}: the layers compute "
              f"{sum(computed):,} tokens, efficiency {sum(lengths) / sum(computed):.3f} (right-padded "
              f"{sum(lengths) / padded:.3f})", flush=True)
    out["trainer_token_efficiency"] = min(out["trainer_token_efficiency_study"],
                                          out["trainer_token_efficiency_8k"])
    return out


# -----------------------------------------------------------------------------
# figure gpu: one command on a GPU, each part in its own process under its own timeout


GPU_PEAKS = (("H200", 4.8e12, 989e12), ("H100 PCIe", 2.0e12, 756e12),
             ("H100 NVL", 3.9e12, 835e12), ("H100", 3.35e12, 989e12),
             ("A100", 2.0e12, 312e12))  # datasheets: HBM bytes/s, dense bf16 FLOP/s
GPU_TESTS = "cuda"  # test_all.py's tests that need CUDA carry it in their names
DECODE_PATHS = (*paged_attention.PAGED, "groups")  # CUDA's paged kernels, and CPU's per length group


def gpu_parts(timeouts=(150, 60, 150, 90)):
    """(name, command, timeout s) of figure gpu: 7.5 min in all, within its 8."""
    part = lambda name: [sys.executable, os.path.join(HERE, "bench.py"), "--gpu_part", name,
                         "--json"]
    commands = ([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                 os.path.join(HERE, "test_all.py"), "-k", GPU_TESTS],
                part("kernels"), part("sampler"), part("trainer"))
    return [(name, cmd, t) for name, cmd, t in
            zip(("tests", "kernels", "sampler", "trainer"), commands, timeouts)]


def run_parts(parts):
    """Each (name, command, timeout s) in its own process group, its output printed after it: one
    that fails or hangs (killed at its timeout) is reported and the next still runs -> {name: ..}.
    """
    out = {}
    for name, cmd, timeout in parts:
        print(f"gpu | {name}: running (timeout {timeout} s)", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            text, timed_out = proc.communicate(timeout=timeout)[0], False
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the part and whatever it started
            text, timed_out = proc.communicate()[0], True
        lines = text.splitlines()
        figures = None
        if lines and lines[-1].startswith("{"):
            with contextlib.suppress(ValueError):
                figures = json.loads(lines.pop())
        for line in lines:
            print(f"gpu | {name} | {line}")
        status = (f"TIMED OUT after {timeout} s" if timed_out else
                  "ok" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})")
        out[name] = {"status": status, "seconds": time.perf_counter() - t0, "figures": figures}
        print(f"gpu | {name}: {status} in {out[name]['seconds']:.0f} s", flush=True)
    return out


def gpu_peaks():
    """-> (HBM bytes/s, dense bf16 FLOP/s, a line naming them) for this GPU."""
    name = torch.cuda.get_device_name()
    key, hbm, flops = next((p for p in GPU_PEAKS if p[0] in name), ("H100", 3.35e12, 989e12))
    said = "" if key in name else f", an unknown GPU: {key} SXM's assumed"
    return hbm, flops, (f"{name}: peak HBM {hbm / 1e12:.2f} TB/s, bf16 {flops / 1e12:.0f} "
                        f"TFLOP/s dense{said}")


def decode_path(kernel, q, k, v, pos, table, scale):
    """One of DECODE_PATHS on rows at positions pos over their block tables."""
    plan = (("groups", [(slice(0, q.size(0)), table.size(1) * k.size(1), True, 0)])
            if kernel == "groups" else (kernel,))
    how = paged_attention.attention_inputs(plan, pos, q.dtype, table, k.size(1))
    return paged_attention.decode_attention(q, k, v, scale, how)


def gpu_kernels():
    """The CUDA kernels against their exact references: each decode path against SDPA over each
    row's own keys, the trainer's varlen attention against SDPA per sample in float32, the
    head (trainer._Head) against the float32 head, its peak against plan.head_peak."""
    return {**gpu_attention("cuda", torch.bfloat16), **gpu_head("cuda")}


def gpu_attention(device, dtype):
    """Each decode path (DECODE_PATHS) and the trainer's varlen attention against SDPA."""
    g = torch.Generator(device=device).manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g, device=device, dtype=dtype)
    H, K, D, block, out = 14, 2, 64, gen_module.BLOCK, {}
    lens = [1, block - 1, block + 3, 5 * block, 37, 3 * block]
    width = -(-max(lens) // block)
    table = torch.randperm(len(lens) * width, device=device).view(len(lens), width).int() + 1
    q, k, v = rand(len(lens), 1, H, D), rand(1 + table.numel(), block, K, D), rand(
        1 + table.numel(), block, K, D)

    def row(r, n):  # SDPA over row r's own n keys, read through its block table
        keys = (c[table[r].long()].reshape(-1, K, D)[:n].transpose(0, 1)[None].float()
                for c in (k, v))
        return F.scaled_dot_product_attention(q[r].transpose(0, 1)[None].float(), *keys,
                                              scale=D ** -0.5, enable_gqa=True)[0, :, 0]
    ref = torch.stack([row(r, n) for r, n in enumerate(lens)])
    chosen = paged_attention.decode_kernel(torch.device(device), dtype, D, block)
    for kernel in DECODE_PATHS:
        try:
            got = decode_path(kernel, q, k, v, torch.tensor(lens, device=device) - 1, table,
                              D ** -0.5)
            diff = (got.float() - ref).abs().max().item()
            said = f"max |diff| {diff:.1e} against SDPA over each row's keys"
        except Exception as err:
            diff, said = None, f"does not run: {type(err).__name__}: {str(err)[:160]!r}"
        out[f"decode_{kernel}"] = diff
        print(f"gpu kernels | decode {kernel}{' (the sampler chooses it)' * (kernel == chosen)}: "
              f"{said}", flush=True)
    lens = [1000, 37, 2048, 511]
    cu = F.pad(torch.tensor(lens, device=device).cumsum(0), (1, 0)).int()
    q, k, v = rand(sum(lens), H, D), rand(sum(lens), K, D), rand(sum(lens), K, D)
    got = trainer_module.varlen_attention(q, k, v, lens, cu, D ** -0.5)
    ref = trainer_module.varlen_attention(q.float(), k.float(), v.float(), lens, cu, D ** -0.5)
    out["trainer_varlen"] = (got.float() - ref).abs().max().item()
    kernel = ("flash-attn" if trainer_module.flash_attn_varlen_func is not None else
              "torch varlen_attn" if trainer_module.varlen_attn is not None else "SDPA per sample")
    print(f"gpu kernels | trainer attention ({kernel}): max |diff| {out['trainer_varlen']:.1e} "
          "against SDPA per sample in float32", flush=True)
    return out


def gpu_head(device, T=4096):
    """trainer._Head at the 0.5B shape against the float32 head; its time, and its peak against
    the plan's (what it saves, plan.head_peak)."""
    s = plan_shape(shape_config("Qwen2.5-0.5B"))
    V, d = s["V"], s["d"]
    g = torch.Generator(device=device).manual_seed(1)
    h = torch.randn(T, d, generator=g, device=device).bfloat16().requires_grad_()
    w = (torch.randn(V, d, generator=g, device=device) / d ** 0.5).bfloat16().requires_grad_()
    targets = torch.randint(0, V, (T,), generator=g, device=device)
    tc = tensor_core_head("cuda", torch.bfloat16, True)
    args = (targets, 1.0, head_chunk(T), torch.bfloat16 if tc else torch.float32, tc)
    for _ in range(2):  # the second timed, after a warm-up
        h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before, t0 = torch.cuda.memory_allocated(), time.perf_counter()
        lp = _Head.apply(h, w, *args)
        lp.sum().backward()
        torch.cuda.synchronize()
        seconds, peak = time.perf_counter() - t0, torch.cuda.max_memory_allocated() - before
    h32, w32 = (x.detach().float().requires_grad_() for x in (h, w))
    want = F.linear(h32, w32).log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    want.sum().backward()
    grad = lambda a, b: ((a.float() - b).norm() / b.norm()).item()
    r = {"head_logp_max_diff": (lp.detach() - want).abs().max().item(),
         "head_grad_h_rel": grad(h.grad, h32.grad), "head_grad_w_rel": grad(w.grad, w32.grad),
         "head_peak_gb": peak / 1e9, "head_tflop_s": 8 * V * d * T / seconds / 1e12,
         "head_plan_gb": (T * plan_activations(s, 2)["head"] + head_peak(s, 2)) / 1e9}
    print(f"gpu kernels | head ({'tensor cores' if tc else 'float32 GEMMs'}), {T} tokens x vocab "
          f"{V} x {d}: max |logp diff| {r['head_logp_max_diff']:.1e}, gradient |diff| / |grad| "
          f"states {r['head_grad_h_rel']:.1e} weight {r['head_grad_w_rel']:.1e} against the "
          f"float32 head | {seconds * 1e3:.1f} ms forward+backward, {r['head_tflop_s']:.0f} "
          f"TFLOP/s | peak {r['head_peak_gb']:.2f} GB (the plan's {r['head_plan_gb']:.2f})",
          flush=True)
    return r


def gpu_model(device="cuda"):
    """Qwen2.5-0.5B's shape, random bf16 weights (no download)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(shape_config("Qwen2.5-0.5B"),
                                                 dtype=torch.bfloat16)
    return model.eval()


def matmul_params(config):
    """Parameters of the model's matrix products (the embedding's lookup is none, a tied head
    one)."""
    s = plan_shape(config)
    return s["L"] * plan_params(s)[0] + s["V"] * s["d"]


def gpu_sampler(batches=(64, 256), prompt_len=16, new_tokens=256, device="cuda"):
    """The 0.5B-shape sampler (float32 head, CUDA graphs) at each batch: tokens/s, the fraction of
    the HBM roofline (weights and the mean KV read once a step) and MFU."""
    hbm, flops, peaks = gpu_peaks()
    print(f"gpu sampler | {peaks}", flush=True)
    model, out = gpu_model(device), {}
    s, n = plan_shape(model.config), matmul_params(model.config)
    for batch in batches:
        prompts = random_ids(batch, prompt_len, model.config.vocab_size, 0, device).tolist()
        time_ours(model, prompts, new_tokens, True)  # warm-up: the CUDA graphs
        tok_s = batch * new_tokens / time_ours(model, prompts, new_tokens, True)
        context = prompt_len + new_tokens // 2
        # the tensor-core head reads the bf16 weight, else a float32 copy
        roof = decode_roofline(model.config.to_dict(), batch, context, hbm,
                               not tensor_core_head("cuda", torch.bfloat16, True), 2)["tok_s"]
        mfu = tok_s * (2 * n + 4 * s["L"] * s["H"] * s["D"] * context) / flops
        out[f"sampler_b{batch}"] = {"tok_s": tok_s, "roofline": tok_s / roof, "mfu": mfu}
        print(f"gpu sampler | 0.5B shape, bf16, float32 head, batch {batch} x ({prompt_len} + "
              f"{new_tokens}): {tok_s:,.0f} tok/s | {tok_s / roof:.1%} of the HBM roofline "
              f"({roof:,.0f} tok/s) | MFU {mfu:.1%}", flush=True)
    return out


def gpu_trainer(tokens=8192, repeats=3, device="cuda"):
    """The 0.5B-shape trainer's forward+backward of one row of `tokens` (layers checkpointed,
    float32 head, as train.py runs it): tokens/s, MFU (6 N per token and causal attention, the
    recomputation not counted) and its peak."""
    _, flops, peaks = gpu_peaks()
    print(f"gpu trainer | {peaks}", flush=True)
    model = gpu_model(device).train()
    s, n = plan_shape(model.config), matmul_params(model.config)
    ids = random_ids(1, tokens, model.config.vocab_size, 2, device)[0]
    times = []
    for _ in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        packed_logprobs(model, ids, [tokens]).sum().backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    tok_s = tokens / min(times[1:])
    work = 6 * n * tokens + 6 * s["L"] * s["H"] * s["D"] * tokens ** 2
    r = {"trainer_tok_s": tok_s, "trainer_mfu": work / min(times[1:]) / flops,
         "trainer_peak_gb": torch.cuda.max_memory_allocated() / 1e9}
    print(f"gpu trainer | 0.5B shape, bf16, one row of {tokens} tokens, forward+backward: "
          f"{tok_s:,.0f} tok/s | MFU {r['trainer_mfu']:.1%} | peak {r['trainer_peak_gb']:.1f} GB "
          f"(best of {repeats} after a warm-up)", flush=True)
    return r


def bench_gpu():
    """Figure gpu: the CUDA tests, the kernels, the 0.5B sampler and trainer, each timed out on
    its own."""
    print(f"gpu | {gpu_peaks()[2]}", flush=True)
    return run_parts(gpu_parts())


GPU_PART = dict(zip(GPU_PARTS, (gpu_kernels, gpu_sampler, gpu_trainer)))


def main(args):
    hide_progress_bars()
    faults.pick_threads()
    if args.write_model:
        return write_model(args)
    t_start = time.perf_counter()
    figures = set(args.figures.split(","))
    if ("gpu" in figures or args.gpu_part) and not torch.cuda.is_available():
        sys.exit(f"bench.py --figures gpu: needs a CUDA GPU; torch {torch.__version__} sees none "
                 "(BENCHMARKS.md lists the GPU figures as not measured)")
    if args.gpu_part:
        part = GPU_PART[args.gpu_part]()
        if args.json:
            print(json.dumps(part))
        return
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "none"
    print(f"torch {torch.__version__} | device {args.device} ({gpu}) | dtype {args.dtype} | "
          f"threads {torch.get_num_threads()} | 1-min load average before the run "
          f"{os.getloadavg()[0]:.2f}")
    kernels = kernels_line(Qwen2Config(**SIZES[args.size]), torch.device(args.device),
                           DTYPES[args.dtype], True)
    print(kernels)
    models = (bench_models(args) if figures - {"memory", "stability", "replay", "efficiency",
                                               "plan_rss", "gpu"} else [])
    results = {"args": vars(args), "torch": torch.__version__, "gpu": gpu, "kernels": kernels}
    if "gpu" in figures:  # first: the other figures may hold the GPU's memory
        results["gpu_figures"] = bench_gpu()
    if "1" in figures:
        results["sampler"] = [bench_sampler(name, m, args) for name, m in models]
        results["sampler_task"] = bench_sampler_task(models[0][1], args)
    if "2" in figures:
        results["trainer"] = [bench_trainer_speed(name, m, args) for name, m in models]
        results["memory"] = bench_trainer_memory(args)
        results["paper_logits"] = paper_scale_logits()
    if "3" in figures:
        results["broadcast"] = bench_broadcast(args, models)
    if "4" in figures:
        results["agreement"] = [r for name, m in models for r in bench_agreement(name, m, args)]
    if "5" in figures:
        results["roofline"] = [decode_roofline(SIZES["0.5b"], context=ctx, fp32_head=h, quiet=False)
                               for ctx, h in ((1024, False), (1024, True), (8192, True))]
    if "6" in figures:
        results["pipeline"] = bench_pipeline(args)
    if "7" in figures:
        results["fsdp"] = bench_fsdp(args)
    if "efficiency" in figures:
        results.setdefault("efficiency", {}).update(efficiency_sampler(args))
        admission = efficiency_admission()
        results["efficiency"].update({k: admission[k] for k in ("decode_tokens_discarded",
                                                                "restarts", "decode_steps",
                                                                "decode_steps_full_pool")})
    if "memory" in figures:
        results["memory_plan"] = bench_memory_plan(args)
    if "efficiency" in figures:
        results.setdefault("efficiency", {}).update(efficiency_trainer())
    if "stability" in figures:
        results["stability"] = bench_stability(args)
    if "plan_rss" in figures:
        results["plan_rss"] = bench_plan_rss(args)
    if "replay" in figures:
        results["replay"] = bench_replay(args)
    results["seconds"] = time.perf_counter() - t_start
    print(f"total {results['seconds']:.0f} s")
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main(get_args())
