"""
trainer.py: a trainer's side of ScaleRL (arXiv 2510.13786): its weights, float32 master copies of
bf16 ones, AdamW with a linear warm-up, a step's rows packed into micro-batches, the log-probs of
those packed samples with section 3.2's float32 LM head (the sampler's is generate.py's), and
FSDP2 sharding over the trainer ranks (--fsdp).

Start at `Trainer` (train.make_trainer makes it; `ShardedTrainer` with --fsdp): train.train_step
calls its `micro_batches`, `logprobs` (packed_logprobs), `accumulate`, `reduce_grads`,
`clip_grads`, then steps its AdamW.

    torchrun_local --nproc_per_node 4 train.py --gen_ranks 2 --fsdp   # 2 trainers, sharded
    python -m pytest -q test_all.py -k "fsdp or micro_batches or packed_logprobs"
"""

import contextlib
import inspect
import os

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM

from generate import BLOCK, head_dim_of, mm32, tensor_core_head
from metrics import print0
from paged_attention import decode_kernel
import pipeline
import ranks
import plan
from runs import check_shards_written, private_folder, safe_load_planner, shard_reader

try:  # attention within each packed sample on CUDA
    from flash_attn import flash_attn_varlen_func
except ImportError:
    flash_attn_varlen_func = None
varlen_attn = None
if torch.cuda.is_available():  # CUDA's alone: its import pulls torch's compiler (~1 s a start)
    with contextlib.suppress(ImportError):
        from torch.nn.attention.varlen import varlen_attn

PACKED = "scalerl_packed"  # the attention implementation decoder_states registers
SHARDS = "shards"  # a --fsdp checkpoint's sharded state

# -----------------------------------------------------------------------------
# the trainer's log-probs


def attention_kernel(device, dtype):
    """varlen_attention's kernel here: flash-attn's, torch's varlen_attn (CUDA, 16-bit), else SDPA
    per sample."""
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        if flash_attn_varlen_func is not None:
            return "flash"
        if varlen_attn is not None:
            return "varlen"
    return "sdpa"


def varlen_attention(q, k, v, lens, cu, scale):
    """Causal attention within each sample of a packed row: a flash kernel on CUDA, else exact SDPA.
    """
    kernel = attention_kernel(q.device, q.dtype)
    if kernel == "flash":
        return flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens),
                                      softmax_scale=scale, causal=True)
    if kernel == "varlen":
        return _torch_varlen(q, k, v, cu, max(lens), scale)
    t = lambda x: x.transpose(0, 1)[None]
    out = [F.scaled_dot_product_attention(t(a), t(b), t(c), is_causal=True, scale=scale,
                                          enable_gqa=True)[0].transpose(0, 1)
           for a, b, c in zip(q.split(lens), k.split(lens), v.split(lens)) if len(a)]
    return out[0] if len(out) == 1 else torch.cat(out)


def _torch_varlen(q, k, v, cu, longest, scale):
    params = inspect.signature(varlen_attn).parameters
    kw = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "enable_gqa" in params:
        kw["enable_gqa"] = True
    else:
        k, v = (x.repeat_interleave(q.size(1) // x.size(1), 1) for x in (k, v))
    if "scale" in params:
        kw["scale"] = scale
    else:
        q = q * (scale * q.size(-1) ** 0.5)
    return varlen_attn(q, k, v, cu, cu, longest, longest, **kw)


DECODE_NAMES = {"flash": "flash-attn flash_attn_with_kvcache (paged)",
                "varlen": "torch varlen_attn (paged)", "triton": "Triton paged_decode (paged)",
                "groups": "SDPA per length group"}
TRAINER_NAMES = {"flash": "flash-attn flash_attn_varlen_func", "varlen": "torch varlen_attn",
                 "sdpa": "SDPA per sample"}


def kernels_line(config, device, dtype, fp32_head):
    """The kernels in force for a model of `config` on device in dtype, so that a fallback shows
    (the start-up line, bench.py): the sampler's decode attention, the trainer's packed attention,
    the LM head. CUDA with no paged decode attention: decode_kernel's one-line RuntimeError."""
    decode = decode_kernel(device, dtype, head_dim_of(config), BLOCK)
    head = ("bf16 GEMM, float32 out (tensor cores)" if tensor_core_head(device.type, dtype,
                                                                          fp32_head)
            else str(torch.promote_types(dtype, torch.float32) if fp32_head else dtype))
    return (f"kernels: decode attention {DECODE_NAMES[decode]} | trainer attention "
            f"{TRAINER_NAMES[attention_kernel(device, dtype)]} | head "
            f"{head.removeprefix('torch.')}")


def _packed_attention(module, q, k, v, attention_mask, dropout=0.0, scaling=None, packed=None,
                      **_):
    t = lambda x: x[0].transpose(0, 1)
    return varlen_attention(t(q), t(k), t(v), *packed, scaling)[None], None


def decoder_states(model, ids, lens, checkpoint_layers=None):
    """The last layer's output (1, T, d) of samples packed into one row; checkpoints non-reentrant
    (FSDP2)."""
    from transformers import AttentionInterface
    AttentionInterface.register(PACKED, _packed_attention)
    inner = model.model
    x = inner.embed_tokens(ids)[None]
    n = torch.tensor(lens, device=ids.device)
    cu = F.pad(n.cumsum(0), (1, 0)).to(torch.int32)
    pos = (torch.arange(len(ids), device=ids.device)
           - torch.repeat_interleave(cu[:-1].long(), n, output_size=len(ids)))[None]
    rope = inner.rotary_emb(x, pos)
    recompute = plan.checkpointing(len(inner.layers), checkpoint_layers)
    for layer in inner.layers:
        x = (checkpoint(_layer, layer, x, *rope, pos, (lens, cu), use_reentrant=False)
             if recompute else _layer(layer, x, *rope, pos, (lens, cu)))
    return x


def _layer(layer, x, cos, sin, pos, packed):
    config = layer.self_attn.config
    impl, config._attn_implementation = config._attn_implementation, PACKED
    try:
        return layer(x, position_embeddings=(cos, sin), position_ids=pos, packed=packed)
    finally:
        config._attn_implementation = impl


def _gemm(a, b, dtype, tensor_core):
    """a @ b with a and b in dtype -> float32 or wider (on tensor cores: float32 output)."""
    a, b = a.to(dtype), b.to(dtype)
    return mm32(a, b) if tensor_core else (a @ b).to(torch.promote_types(dtype, torch.float32))


class _Head(torch.autograd.Function):
    """log p(targets) of normed states h (T, d) under the LM head w (V, d), in chunks of `chunk`
    vocabulary rows (logits O(T x chunk)); the GEMMs' inputs in dtype (float32: section 3.2's
    float32 head), float32 or wider out. Start at packed_logprobs."""

    @staticmethod
    def forward(ctx, h, w, targets, temperature, chunk, dtype, tensor_core):
        x, lse, picked = h.to(dtype), [], 0
        for a in range(0, len(w), chunk):
            logits = _head_logits(x, w[a:a + chunk], temperature, dtype, tensor_core)
            lse.append(logits.logsumexp(-1))
            inside, at = _in_chunk(targets, a, logits.size(1))
            picked = picked + torch.where(inside, logits.gather(1, at[:, None])[:, 0], 0)
        lse = torch.stack(lse).logsumexp(0)
        ctx.save_for_backward(h, w, targets, lse)
        ctx.args = temperature, chunk, dtype, tensor_core
        return picked - lse

    @staticmethod
    def backward(ctx, g):
        h, w, targets, lse = ctx.saved_tensors
        temperature, chunk, dtype, tensor_core = ctx.args
        x, scale = h.to(dtype), g / temperature if temperature not in (0, 1) else g
        grad_h = torch.zeros(h.shape, dtype=lse.dtype, device=h.device)
        # why: each chunk of w's rows gets its gradient from one GEMM over all T tokens, written
        # once in w's dtype; no float32 copy of w, no per-chunk V x d gradients to sum
        grad_w = torch.empty_like(w) if ctx.needs_input_grad[1] else None
        for a in range(0, len(w), chunk):
            logits = _head_logits(x, w[a:a + chunk], temperature, dtype, tensor_core)
            # d log p(target) / d logits = onehot(target) - softmax
            p = logits.sub_(lse[:, None]).exp_().mul_(-scale[:, None])
            inside, at = _in_chunk(targets, a, p.size(1))
            p = p.scatter_add_(1, at[:, None], torch.where(inside, scale, 0)[:, None]).to(dtype)
            grad_h += _gemm(p, w[a:a + chunk], dtype, tensor_core)
            if grad_w is not None:
                grad_w[a:a + chunk] = _gemm(p.t(), x, dtype, tensor_core)
        return grad_h.to(h.dtype), grad_w, None, None, None, None, None


def _head_logits(x, w, temperature, dtype, tensor_core):
    logits = _gemm(x, w.t(), dtype, tensor_core)
    return logits / temperature if temperature not in (0, 1) else logits


def _in_chunk(targets, a, n):
    """Which targets fall in vocabulary rows a..a+n, and their column there (0 where not)."""
    inside = (targets >= a) & (targets < a + n)
    return inside, torch.where(inside, targets - a, 0)


def packed_logprobs(model, ids, lens, fp32_head=True, temperature=1.0, chunk=None,
                    checkpoint_layers=None):
    """log p(next token) of packed samples -> (N, max(lens) - 1), with grad; the head in chunks of
    `chunk` vocabulary rows (_Head; memory O(tokens x chunk), by default plan.LOGITS_BYTES)."""
    states = decoder_states(model, ids, lens, checkpoint_layers)[0, :-1]
    w = model.lm_head.weight
    # CUDA bf16: the float32 head as bf16 GEMMs with float32 output (the same logits, tensor cores)
    tensor_core = tensor_core_head(w.device.type, w.dtype, fp32_head)
    dtype = (torch.promote_types(w.dtype, torch.float32) if fp32_head and not tensor_core
             else w.dtype)
    chunk = chunk or plan.head_chunk(len(states))
    h = checkpoint(model.model.norm, states, use_reentrant=False)
    flat = torch.cat([_Head.apply(h, w, ids[1:], temperature, chunk, dtype, tensor_core),
                      states.new_zeros(1, dtype=torch.float32)])
    # drop each sample's last position
    return torch.nn.utils.rnn.pad_sequence([r[:-1] for r in flat.split(lens)], batch_first=True)


def sequence_logprobs(model, ids, attention_mask=None, fp32_head=True, temperature=1.0,
                      chunk=None, checkpoint_layers=None):
    if attention_mask is not None and (attention_mask[:, 1:] > attention_mask[:, :-1]).any():
        raise ValueError("sequence_logprobs needs right-padded rows (real tokens, then padding)")
    N, T = ids.shape
    lens = attention_mask.sum(1).tolist() if attention_mask is not None else [T] * N
    lp = packed_logprobs(model, torch.cat([row[:L] for row, L in zip(ids, lens)]), lens,
                         fp32_head, temperature, chunk, checkpoint_layers)
    return F.pad(lp, (0, T - 1 - lp.size(1)))

# -----------------------------------------------------------------------------
# a step's rows


def collate(prompt_ids, samples, pad_id, device, step=0):
    """Right-padded rows -> ids, attention, and per target token the loss mask, generator log-probs,
    lag."""
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
    rows = [p + s.tokens for p, s in zip(prompt_ids, samples)]
    return torch.tensor([t for r in rows for t in r], device=device), [len(r) for r in rows]


def micro_batches(lengths, budget):
    """Rows packed first-fit into micro-batches of at most `budget` tokens (0: one) -> positions."""
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

# -----------------------------------------------------------------------------
# the trainer


def master_weights(model, saved=None):
    """Half-dtype weights: float32 copies for AdamW (bf16 steps round small updates away), else
    None."""
    params = list(model.parameters())
    if params[0].dtype not in (torch.bfloat16, torch.float16):
        return None
    return [torch.nn.Parameter(s.to(p.device) if s is not None else p.detach().float())
            for p, s in zip(params, saved or [None] * len(params))]


class Trainer:
    """The replicated trainer: AdamW with a linear warm-up on float32 weights; `version` counts its
    steps."""
    sharded = False
    def __init__(self, args, model, ctx, state, ckpt=None, pad_id=0):
        self.args, self.model, self.ctx, self.ckpt, self.pad_id = args, model, ctx, ckpt, pad_id
        # None: one process
        self.ranks_sum = None if ctx is None else self.all_sum
        self.n_params = sum(p.numel() for p in model.parameters())
        self.master = self.optimized_weights(state)
        # under bf16 AdamW steps float32 masters: a bf16 step would round small updates away
        self.opt = torch.optim.AdamW(self.master or model.parameters(), lr=args.lr,
                                     eps=args.adam_eps, weight_decay=args.weight_decay,
                                     betas=(0.9, 0.999))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: self.warmup(s))
        # version: the weights' policy version, which equals the optimizer steps taken
        self.version, self.bad_steps = state.get("step", 0), 0
        if state:
            self.load_state_dict(state)

    def warmup(self, s):
        return min(1.0, (s + 1) / self.args.warmup)

    def optimized_weights(self, state):
        """The float32 weights AdamW steps (None: the model's)."""
        return master_weights(self.model, state.get("master"))

    def logprobs(self, ids, lens):
        return packed_logprobs(self.model, ids, lens, self.args.fp32_head, self.args.temperature,
                               checkpoint_layers=self.args.ckpt_layers)

    def all_sum(self, sums):
        """Sum a dict over the trainer ranks."""
        return ranks.all_reduce_stats(self.ctx, sums)[0]

    def any_rank(self, flag):
        """Is `flag` set on any trainer rank? (a collective: every trainer calls it, so also a
        barrier)"""
        return self.all_sum({"flag": bool(flag)})["flag"] > 0

    def clip_grads(self):
        """-> the gradient norm before clipping."""
        stepped = self.master or list(self.model.parameters())
        norm = torch.nn.utils.clip_grad_norm_(stepped, self.args.grad_clip or float("inf"))
        return pipeline.whole(norm).item()

    def zero_grad(self):
        self.opt.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

    def micro_batches(self, batch):
        return micro_batches([len(batch.prompt_ids[r]) + len(batch.samples[r].tokens)
                              for r in batch.rows], self.args.micro_tokens)

    def accumulate(self):
        """After each micro-batch's backward: half-dtype gradients move into the float32 copies."""
        for p, m in zip(self.model.parameters(), self.master or []):
            if p.grad is not None:
                m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad)
                p.grad = None

    def reduce_grads(self):
        """Sum the trainers' gradients."""
        if self.ctx is not None:
            ranks.all_reduce_grads(self.ctx, self.master or list(self.model.parameters()))

    def copy_master(self):
        """The model's weights := the float32 copies."""
        if self.master:
            with torch.no_grad():
                for p, m in zip(self.model.parameters(), self.master):
                    p.copy_(m)

    def skip_step(self, loss, norm):
        """No update; --max_bad_steps in a row stop the run."""
        self.bad_steps += 1
        print0(f"step {self.version + 1}: loss {loss} / gradient norm {norm}: not finite, "
               f"optimizer step skipped ({self.bad_steps} in a row, --max_bad_steps "
               f"{self.args.max_bad_steps})", flush=True)
        if self.bad_steps >= self.args.max_bad_steps:
            raise SystemExit(f"error: {self.bad_steps} consecutive steps with a non-finite loss "
                             f"or gradient (up to step {self.version + 1}); stopping. The last "
                             "checkpoint holds the last good weights.")

    def whole_model(self, device=None):
        """The model that is saved and evaluated: a replicated trainer's own."""
        return self.model

    def save_shards(self, folder):
        """FSDP2 only."""

    def optimizer_state(self):
        return {"optimizer": self.opt.state_dict(),
                "master": [m.detach().cpu() for m in self.master] if self.master else None}

    def state_dict(self):
        return {**self.optimizer_state(), "scheduler": self.sched.state_dict(),
                "step": self.version, "torch_rng": torch.get_rng_state()}

    def load_state_dict(self, state):
        """A checkpoint's state (checks.check_resumed_state checked it); AdamW's hyperparameters
        stay this run's own, from its flags: a saved maximize or amsgrad would change the step."""
        own = [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]
        self.load_optimizer(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        for group, hyper in zip(self.opt.param_groups, own):
            group.update(hyper, lr=self.args.lr * self.warmup(self.sched.last_epoch))
        self.sched.base_lrs = [self.args.lr] * len(self.opt.param_groups)

    def load_optimizer(self, saved):
        self.opt.load_state_dict(saved)

# -----------------------------------------------------------------------------
# FSDP2 (--fsdp)


class LogProbs(torch.nn.Module):
    """The trainer's forward as one module, for FSDP2's hooks."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, lens, fp32_head, temperature, checkpoint_layers=None):
        return packed_logprobs(self.model, ids, lens, fp32_head, temperature,
                               checkpoint_layers=checkpoint_layers)


def shard_trainer(model, trainers, device, dtype=torch.float32):
    """--fsdp: FSDP2 over the trainers, a unit per layer -> the LogProbs to call."""
    # imported here: ~1 CPU-s that runs without --fsdp need not pay
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    mesh = DeviceMesh.from_group(trainers, "cuda" if str(device).startswith("cuda") else "cpu")
    # the float32 shards are AdamW's masters: gathered in --dtype, gradients reduced in float32
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    wrapped = LogProbs(model)
    fully_shard(wrapped, mesh=mesh, mp_policy=mp)
    for m in wrapped.modules():
        if isinstance(m, FSDPModule):  # not inherited
            # the loss already weighs each row in the whole batch: sum over the trainers, no mean
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return wrapped


def sharded_state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    weights, optimizer = get_state_dict(model, opt)
    return {"model": weights, "optimizer": optimizer}


def set_sharded_state(model, opt, state):
    from torch.distributed.checkpoint.state_dict import set_state_dict
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


class ShardedTrainer(Trainer):
    """--fsdp: model and AdamW state sharded over the trainers (FSDP2); whole weights are gathered a
    parameter at a time."""
    sharded = True

    def optimized_weights(self, state):
        """Shard the model in place (float32 shards)."""
        model, ctx = self.model, self.ctx
        self.dtype = dtype = next(model.parameters()).dtype
        if dtype != torch.float32:
            model.float()
        self.forward = shard_trainer(model, ctx.trainers, ctx.device, dtype)
        self.sync_once = plan.fsdp_sync_once(self.n_params, plan.device_bytes(ctx.device))
        local = sum(p.to_local().numel() for p in model.parameters())
        print0(f"FSDP2: trainer 0 holds {local} of {self.n_params} parameters (and their AdamW "
               "state)", flush=True)
        return None

    def logprobs(self, ids, lens):
        return self.forward(ids, lens, self.args.fp32_head, self.args.temperature,
                            self.args.ckpt_layers)

    def micro_batches(self, batch):
        """A trainer with fewer micro-batches runs empty passes: each is a chain of collectives."""
        parts = super().micro_batches(batch)
        self.n_all = int(ranks.all_reduce_stats(self.ctx, {}, {"n": len(parts)})[1]["n"])
        self.done = 0
        self.forward.set_requires_gradient_sync(not self.sync_once or self.n_all == 1)
        # FSDP2's all-gathers and reduce-scatters are collectives: every trainer runs n_all passes
        for _ in range(len(parts), self.n_all):
            ids = torch.full((2,), self.pad_id, device=self.ctx.device)
            (self.logprobs(ids, [2]).sum() * 0).backward()
            self.accumulate()
        return parts

    def accumulate(self):
        """Reduce-scatter after the last micro-batch (or after each: plan.fsdp_sync_once)."""
        self.done += 1
        self.forward.set_requires_gradient_sync(not self.sync_once or self.done >= self.n_all - 1)

    def reduce_grads(self):
        pass  # FSDP2 reduce-scatters the gradients in the backward

    def whole_model(self, device=None):
        """The whole model in --dtype on trainer 0 (a collective; None elsewhere)."""
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
                    params[name].copy_(full)
        return whole.to(device) if whole is not None and device else whole

    def save_shards(self, folder):
        """Each trainer writes its shards and AdamW state."""
        import torch.distributed.checkpoint as dcp
        self.any_rank(False)  # a barrier: rank 0 made the folder
        with private_folder(folder) as where:  # that folder, even if renamed mid-save
            dcp.save(sharded_state(self.model, self.opt),
                     checkpoint_id=os.path.join(where, SHARDS), process_group=self.ctx.trainers)
            written = ranks.shards_written(self.ctx, os.path.basename(folder))
            if written:  # trainer 0: the folder becomes the checkpoint only if whole in its view
                check_shards_written(os.path.join(folder, SHARDS), written,
                                     os.path.join(where, SHARDS))

    def optimizer_state(self):
        return {"optimizer": None, "master": None, "shards": SHARDS}

    def load_optimizer(self, saved):
        """This trainer's saved shards and their AdamW state."""
        import torch.distributed.checkpoint as dcp
        folder = os.path.join(self.ckpt, SHARDS)
        state = sharded_state(self.model, self.opt)
        dcp.load(state, storage_reader=shard_reader(folder),  # nothing in the folder runs code
                 process_group=self.ctx.trainers, planner=safe_load_planner())
        set_sharded_state(self.model, self.opt, state)
