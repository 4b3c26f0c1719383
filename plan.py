"""
plan.py: the memory plan, the bytes each role will hold and whether they fit the device. Rank 0
prints it at start-up (print_memory_plan). Start at memory_plan; a sampler's slots and KV blocks
on a GPU are fit_slots (what --gen_memory of the free memory holds).
"""

import math
import os
from dataclasses import dataclass

import torch

import generate


def peak_gb(model, reset=True):
    """The CUDA peak since the last reset, GB; None off CUDA."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device) / 1e9
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
    return peak


def device_bytes(device):
    """The device's memory: a GPU's, or on CPU the machine's."""
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# the trainer's layer recomputation and head chunks (trainer.py): here, where the plan reads them
CHECKPOINT_ABOVE = 4
LOGITS_BYTES = 2 ** 28  # the trainer's head: logits per chunk


def checkpointing(n_layers, checkpoint_layers=None):
    """on, off, or auto (above CHECKPOINT_ABOVE layers)."""
    if checkpoint_layers in (None, "auto"):
        return n_layers > CHECKPOINT_ABOVE
    if checkpoint_layers in (True, "on", False, "off"):
        return checkpoint_layers in (True, "on")
    raise ValueError(f"checkpoint_layers must be auto, on or off, got {checkpoint_layers!r}")


def fsdp_sync_once(n_params, device_bytes):
    """--fsdp: reduce-scatter once a step where float32 gradients fit an eighth of the device."""
    return 4 * n_params <= device_bytes / 8


def in_flight(args, n_gens, k):
    """A generator's most sequences in flight: its share of k + 1 batches."""
    return math.ceil((k + 1) * args.prompts / n_gens) * args.samples


def plan_shape(config):
    """The sizes a Llama / Qwen / Mistral config's memory depends on."""
    get = lambda key: getattr(config, key, None)
    d, H = config.hidden_size, config.num_attention_heads
    return dict(d=d, L=config.num_hidden_layers, H=H, K=get("num_key_value_heads") or H,
                D=generate.head_dim_of(config), I=config.intermediate_size, V=config.vocab_size,
                tied=bool(get("tie_word_embeddings")), qk_norm=config.model_type == "qwen3",
                qkv_bias=config.model_type == "qwen2" or bool(get("attention_bias")),
                o_bias=bool(get("attention_bias")), mlp_bias=bool(get("mlp_bias")))


def plan_params(s):
    """-> parameters of (a layer, the embedding, the untied head, the final norm)."""
    d, H, K, D = s["d"], s["H"], s["K"], s["D"]
    attn = (d * D * (2 * H + 2 * K) + s["qkv_bias"] * D * (H + 2 * K) + s["o_bias"] * d
            + s["qk_norm"] * 2 * D)
    mlp = 3 * d * s["I"] + s["mlp_bias"] * (2 * s["I"] + d)
    return attn + mlp + 2 * d, s["V"] * d, (not s["tied"]) * s["V"] * d, d


def plan_param_count(s):
    """Every parameter of the model."""
    layer, embed, head, norm = plan_params(s)
    return s["L"] * layer + embed + head + norm


def weights_problem(config, held, unit, dtype, device):
    """The parameters config's sizes make, against those its weight files hold (held, in unit:
    checks.weight_elements) and the device's memory, before any layer is built -> one line, or
    None."""
    s = plan_shape(config)
    need = plan_param_count(s)
    if need > held:
        return (f"config.json's sizes make {need:,} parameters ({s['L']} layers of "
                f"{plan_params(s)[0]:,}, vocab_size {s['V']} x hidden_size {s['d']}); the weight "
                f"files hold {held:,}{unit}: a config.json for another model, or weights missing?")
    if need * dtype.itemsize > (room := device_bytes(device)):
        return (f"its {need:,} parameters take {need * dtype.itemsize / 1e9:.2g} GB in "
                f"{str(dtype).removeprefix('torch.')}, more than the device's {room / 1e9:.2g} GB")
    return None


def plan_activations(s, size):
    """Bytes per token saved for the backward, per layer (checkpointed or not) and the head."""
    d, H, K, D, b = s["d"], s["H"], s["K"], s["D"], size
    norms = 2 * ((4 + 2 * b) * d + 4)
    attn = b * D * (2 * H + 2 * K) + 4 * H + s["qk_norm"] * ((4 + b) * D + 4) * (H + K)
    # outside the layers: the final norm's input and output, each target and its float32
    # log-sum-exp (trainer._Head), rope's cos and sin, the positions
    return {"layer": norms + attn + 4 * b * s["I"], "checkpointed": b * d,
            "head": 2 * b * d + 8 + 4 + 2 * D * b + 8}


def head_chunk(tokens):
    """The trainer's head: vocabulary rows per chunk, LOGITS_BYTES of float32 logits at `tokens`."""
    return max(1, LOGITS_BYTES // (4 * max(1, tokens)))


def head_peak(s, size):
    """The trainer's head in its backward beyond what it saves (trainer._Head): the head's gradient
    in the weights' dtype, and at most 4 chunks' float32 logits and their temporaries."""
    return size * s["V"] * s["d"] + 4 * LOGITS_BYTES


def plan_trainer(s, size, micro_tokens, ckpt, fsdp, trainers, longest=0, sync_once=False):
    """The bytes one trainer rank holds -> {part: bytes}; NCCL's buffers not counted."""
    layer, embed, head, norm = plan_params(s)
    P, root, half, n = plan_param_count(s), embed + head + norm, size < 4, trainers
    act = plan_activations(s, size)
    tokens = max(micro_tokens, longest)
    saved = s["L"] * (act["checkpointed"] if ckpt else act["layer"]) + act["head"]
    recomputed = tokens * (ckpt * act["layer"] + 3 * size * s["I"])
    reduce_scatter = fsdp * 2 * (size + 4) * layer
    backward = tokens * saved + max(recomputed, head_peak(s, size)) + reduce_scatter
    return {"weights": (root + 2 * layer) * size if fsdp else P * size,
            "float32 master": 4 * P / n if fsdp else 4 * P * half,
            "AdamW state": 8 * P / (n if fsdp else 1),
            "gradients": (4 * P / n + root * size + sync_once * 4 * P if fsdp
                          else (size + 4 * half) * P),
            "activations": max(backward, 4 * P / (n if fsdp else 1)
                               - ((2 * root + 2 * layer) * size if fsdp else half * size * P))}


def kv_bytes_per_token(config, dtype):
    return (2 * config.num_hidden_layers * config.num_key_value_heads
            * generate.head_dim_of(config) * dtype.itemsize)


def decoder_bytes(config, dtype, max_len, max_new, fp32_head, n_ids=3, block=generate.BLOCK):
    """What a generate.Decoder allocates -> (bytes per slot, per KV block, fixed bytes)."""
    size, D = dtype.itemsize, generate.head_dim_of(config)
    per_slot = (6 * 8 + 4 + 4 * -(-max_len // block)
                + (max_new + 1) * (8 + max(size, 4) + 1 + 8 + 8))
    copy = fp32_head and size < 4
    fixed = (2 * max_len * D * size
             + copy * 4 * config.vocab_size * config.hidden_size + 8 * (n_ids + 1)
             + qkv_bytes(config, dtype))
    return per_slot, kv_bytes_per_token(config, dtype) * block, fixed


def qkv_bytes(config, dtype):
    """The sampler's fused q/k/v weights (generate.fused_qkv)."""
    D = generate.head_dim_of(config)
    width = (config.num_attention_heads + 2 * config.num_key_value_heads) * D
    bias = config.model_type == "qwen2" or getattr(config, "attention_bias", False)
    norm = (config.num_attention_heads + config.num_key_value_heads) * D
    return (config.num_hidden_layers * dtype.itemsize
            * (width * (config.hidden_size + bias) + norm * (config.model_type == "qwen3")))


def free_device_bytes(device):
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def mean_length(max_len, max_new):
    """A row's mean length in flight, which sizes the pool: its prompt and half its budget."""
    return max_len - max_new // 2


def slots_in(room, config, dtype, max_len, max_new, fp32_head=True, cap=None,
             block=generate.BLOCK):
    """-> (rows that fit at mean_length, at most cap; blocks in the rest, at most all rows at
    max_len, scratch included; rows without the cap), or (0, 0, _) if one row at max_len does not
    fit."""
    per_slot, per_block, fixed = decoder_bytes(config, dtype, max_len, max_new, fp32_head,
                                               block=block)
    width, mean = -(-max_len // block), -(-mean_length(max_len, max_new) // block)
    fit = max(0, int((room - fixed - per_block) // (per_slot + mean * per_block)))
    slots = min(fit, cap or fit)
    blocks = min(1 + slots * width, int((room - fixed - slots * per_slot) // per_block))
    return (slots, blocks, fit) if blocks >= 1 + width else (0, 0, fit)


def fit_slots(model, max_len, max_new, gen_memory=0.85, cap=None, fp32_head=True, most=None):
    """A sampler's slots and KV pool -> (slots, KV blocks or None: all slots at max_len, a line
    saying why). On CUDA what gen_memory x the free memory holds (vLLM's gpu_memory_utilization;
    slots_in), at most cap and `most` rows; elsewhere cap or generate.CPU_SLOTS."""
    p = next(model.parameters())
    if p.device.type != "cuda":
        return cap or generate.CPU_SLOTS, None, None
    free, block = free_device_bytes(p.device), generate.BLOCK
    caps = [c for c in (cap, most) if c]
    slots, blocks, fit = slots_in(gen_memory * free, model.config, p.dtype, max_len, max_new,
                                  fp32_head, min(caps) if caps else None)
    per_block = kv_bytes_per_token(model.config, p.dtype) * block
    if not slots:
        raise ValueError(f"one sequence of {max_len} tokens needs "
                         f"{-(-max_len // block) * per_block / 1e9:.2f} GB of KV cache; "
                         f"{gen_memory} x {free / 1e9:.2f} GB free is not enough (raise "
                         "--gen_memory, lower the budgets, or use a device with more memory)")
    bound = (f", --slots {cap}" if cap and cap == slots else
             f", at most {most} in flight" if most and most == slots else "")
    return slots, blocks, (
        f"sampler: {slots} sequences of up to {max_len} tokens at once, KV cache {blocks} blocks "
        f"of {block} tokens, {blocks * per_block / 1e9:.1f} GB (--gen_memory {gen_memory} of the "
        f"{free / 1e9:.1f} GB free after the weights fits {fit} rows of "
        f"{mean_length(max_len, max_new)} tokens, the mean{bound})")


def plan_generator(config, s, dtype, max_len, max_new, room, slots=None, fp32_head=True,
                   prefill_tokens=generate.PREFILL_TOKENS):
    """The sampler's bytes beyond the weights -> (parts, sequences, KV blocks, tokens and bytes a
    block); room None (CPU): slots or CPU_SLOTS rows, each at max_len, in blocks of at most a row."""
    block = generate.kv_block("cuda" if room is not None else "cpu", max_len)
    per_slot, per_block, fixed = decoder_bytes(config, dtype, max_len, max_new, fp32_head,
                                               block=block)
    seqs = slots or generate.CPU_SLOTS
    blocks = 1 + seqs * -(-max_len // block)
    if room is not None:
        seqs, blocks, _ = slots_in(room, config, dtype, max_len, max_new, fp32_head, slots)
    b = dtype.itemsize
    prefill = prefill_tokens * b * (4 * s["d"] + 2 * s["D"] * (s["H"] + s["K"]) + 3 * s["I"])
    return ({"decoder": fixed + seqs * per_slot, "KV cache": blocks * per_block,
             "workspace": seqs * 3 * 4 * s["V"] + prefill}, seqs, blocks, block, per_block)


@dataclass
class PlanRun:
    """A run's sizes, as the memory plan reads them."""
    prompts: int
    samples: int
    prompt_len: int  # the longest prompt
    think_budget: int
    answer_budget: int
    phrase_len: int
    micro_tokens: int
    dtype: torch.dtype = torch.bfloat16
    ckpt_layers: object = "auto"
    fsdp: bool = False
    trainers: int = 1
    generators: int = 0  # 0: one process
    device_bytes: float = 80e9
    gen_memory: float = 0.85
    sized: bool = True  # KV cache sized by memory (CUDA)
    slots: int = None
    lag: int = 8
    fp32_head: bool = True
    evaluate: int = 0  # --eval_only's samples


def memory_plan(config, run):
    """The bytes each role holds and whether they fit -> {"roles": {role: {..}}, ...}."""
    s, size = plan_shape(config), run.dtype.itemsize
    ckpt = checkpointing(s["L"], run.ckpt_layers)
    max_len, max_new = generate.cache_length(run.prompt_len, run.think_budget, run.answer_budget,
                                             [0] * run.phrase_len)
    trainer = plan_trainer(s, size, run.micro_tokens, ckpt, run.fsdp, run.trainers, longest=max_len,
                           sync_once=fsdp_sync_once(plan_param_count(s), run.device_bytes))
    resident = sum(trainer[k] for k in ("weights", "float32 master", "AdamW state"))
    weights = plan_param_count(s) * size
    held = resident if run.generators == 0 and not run.evaluate else weights
    room = run.gen_memory * (run.device_bytes - held) if run.sized else None
    most = run.evaluate or in_flight(run, max(run.generators, 1), run.lag if run.generators else 0)
    caps = [c for c in (run.slots, most if run.sized else None) if c]
    gen, seqs, blocks, block, per_block = plan_generator(config, s, run.dtype, max_len, max_new, room,
                                              min(caps, default=None), run.fp32_head)
    if run.evaluate:
        roles = {"eval": (1, {"weights": weights, **gen}, weights + sum(gen.values()), seqs)}
    elif run.generators == 0:  # the larger phase
        roles = {"one process": (1, {**trainer, **gen},
                                 max(sum(trainer.values()), resident + sum(gen.values())), seqs)}
    else:
        roles = {"trainer": (run.trainers, trainer, sum(trainer.values()), run.samples),
                 "generator": (run.generators, {"weights": weights, **gen},
                               weights + sum(gen.values()), seqs)}
    return {"roles": {r: {"count": n, "parts": parts, "total": total,
                          "fits": total <= run.device_bytes and holds >= run.samples}
                      for r, (n, parts, total, holds) in roles.items()},
            "shape": s, "ckpt": ckpt, "max_len": max_len, "sequences": seqs, "blocks": blocks,
            "block": block, "per_block": per_block,
            "mean_len": mean_length(max_len, max_new),
            "per_token": plan_activations(s, size)}


def plan_lines(plan, run, context=None):
    """The plan in a few printed lines (GB = 1e9 bytes)."""
    s, act, gb = plan["shape"], plan["per_token"], lambda x: f"{x / 1e9:.1f}"
    lines = [f"memory plan per rank (GB = 1e9 bytes) on a {gb(run.device_bytes)} GB device, "
             f"{str(run.dtype).removeprefix('torch.')}:"]
    for role, r in plan["roles"].items():
        parts = " | ".join(f"{k} {gb(v)}" for k, v in r["parts"].items())
        lines.append(f"  {role} (x{r['count']}): {parts} | total {gb(r['total'])}: "
                     + ("fits" if r["fits"] else "DOES NOT FIT"))
    per_layer = act["checkpointed"] if plan["ckpt"] else act["layer"]
    if not run.evaluate:
        lines.append(f"    a micro-batch of {run.micro_tokens} tokens saves "
                     f"{per_layer / 1e3:.1f} KB per token x {s['L']} "
                     f"{'checkpointed ' * plan['ckpt']}layers + head {act['head'] / 1e3:.1f} KB"
                     + (f"; the layer recomputed in the backward {act['layer'] / 1e3:.1f} KB per "
                        "token" if plan["ckpt"] else ""))
    where = (f"; {plan['sequences'] * run.generators} over {run.generators} generators"
             if run.generators else "")
    lines.append(f"    sampler: {plan['sequences']} sequences of up to {plan['max_len']} tokens at "
                 f"once ({plan['mean_len']} at the mean), KV cache {plan['blocks']} blocks of "
                 f"{plan['block']} tokens ({plan['per_block'] / 1e6:,.1f} MB each){where}, for "
                 + (f"{run.evaluate} held-out samples" if run.evaluate else
                    f"a batch of {run.prompts * run.samples}")
                 + (f"; the model's context {context}" if context else ""))
    return lines


def print_memory_plan(config, args, ctx, device, prompt_len, phrase_len, evaluate=0):
    """Rank 0 at start-up: the run's memory plan, printed -> the plan."""
    trainers, cuda = ctx.n_trainers if ctx else 1, device.type == "cuda"
    seq = prompt_len + args.think_budget + args.answer_budget + phrase_len
    groups = -(-args.prompts // trainers)
    run = PlanRun(prompts=args.prompts, samples=args.samples, prompt_len=prompt_len,
                  think_budget=args.think_budget, answer_budget=args.answer_budget,
                  phrase_len=phrase_len,
                  micro_tokens=args.micro_tokens or groups * args.samples * seq,
                  dtype=getattr(torch, args.dtype),
                  ckpt_layers=args.ckpt_layers, fsdp=bool(ctx and args.fsdp),
                  trainers=trainers, generators=ctx.n_gens if ctx else 0,
                  device_bytes=device_bytes(device),
                  gen_memory=args.gen_memory, sized=cuda, slots=args.slots,
                  lag=ctx.k if ctx else 0, fp32_head=args.fp32_head, evaluate=evaluate)
    if evaluate:
        run.samples = args.eval_samples
    plan = memory_plan(config, run)
    print("\n".join(plan_lines(plan, run, getattr(config, "max_position_embeddings", None))),
          flush=True)
    return plan
