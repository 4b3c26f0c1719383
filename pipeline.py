"""
pipeline.py: generator and trainer ranks under torch.distributed (arXiv 2510.13786, section
3.1). Start at LocalRollouts (one process) and RemoteRollouts (a trainer rank), chosen by
train.rollout_source, then run_generator.

Under torchrun, ranks 0..T-1 train; the others (--gen_ranks) sample, verify and send whole groups
to the trainers and run the held-out evals; trainer 0 broadcasts the weights after each step.
Small state lives in the TCP store; every wait has a deadline (faults.py).

--mode pipeline (PipelineRL-k): generators never stop, take new weights between decode steps, and
admit_ok keeps every token at most k versions old. ppo_offpolicy: k batches on frozen weights.
sync: k = 1.
"""

import copy
import ipaddress
import json
import math
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from data import Curriculum, score_samples, special_tokens
import evals
from faults import STOP, Stopped, get_int, set_status, stop_requested, wait_until, watch
from generate import FINISH, Sample, packed_logprobs, sampler
import generate
from loss import length_penalty
from plan import in_flight, peak_gb

# gen rank, gi, prompt index, prompt len, completion len, correct, reward, finish
HEADER = 8


def default_gen_ranks(world):
    return world - max(1, world // 4)


def n_generators(args, world):
    return args.gen_ranks if args.gen_ranks > 0 else default_gen_ranks(world)


def generator_rank(args):
    """Is this process a generator rank (the last --gen_ranks)?"""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return world > 1 and int(os.environ["RANK"]) >= world - n_generators(args, world)

# -----------------------------------------------------------------------------
# set-up


@dataclass
class Context:
    """One rank's place in the run and its channels."""
    rank: int
    world: int
    n_trainers: int
    n_gens: int
    role: str
    device: str
    timeout: float
    mode: str
    k: int  # the lag bound
    prompts: int
    samples: int
    fsdp: bool
    store: object
    weights: object  # trainer 0 + the generators
    trainers: object
    rollouts: object
    length: int = 0
    status: str = "starting"
    received: int = 0
    early: dict = field(default_factory=dict)
    genstats_before: list = None
    gen_rates: dict = field(default_factory=lambda: {"gen_busy": 0.0, "gen_tok_s": 0.0})
    heartbeat: threading.Thread = None
    stopping: threading.Event = field(default_factory=threading.Event)


def setup(args):
    """Join torchrun's group -> this rank's Context; None for one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return None
    rank = int(os.environ["RANK"])
    n_gens = n_generators(args, world)
    n_trainers = world - n_gens
    if not 1 <= n_gens < world:
        sys.exit(f"error: --gen_ranks {n_gens} with {world} ranks: "
                 "need at least one generator and one trainer")
    if args.prompts % n_trainers:
        sys.exit(f"error: --prompts {args.prompts} must be a multiple of the {n_trainers} trainer "
                 "ranks")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    trainers, gens = list(range(n_trainers)), list(range(n_trainers, world))
    plan = device_plan(world, local_world, torch.cuda.device_count() if cuda else 0, trainers, gens)
    if cuda:
        torch.cuda.set_device(plan["devices"][rank])
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group(plan["default"], timeout=timeout, rank=rank, world_size=world,
                            store=own_store(rank, world, timeout))
    if rank == 0:
        print(plan["line"], flush=True)
    ctx = Context(rank=rank, world=world, n_trainers=n_trainers, n_gens=n_gens,
                  role="trainer" if rank < n_trainers else "generator", device=plan["name"][rank],
                  timeout=args.timeout, mode=args.mode,
                  k=1 if args.mode == "sync" else args.max_lag,
                  prompts=args.prompts, samples=args.samples, fsdp=args.fsdp,
                  store=dist.distributed_c10d._get_default_store(),
                  # every rank creates every group, in the same order
                  weights=dist.new_group([0] + gens, timeout=timeout, backend=plan["weights"]),
                  trainers=dist.new_group(trainers, timeout=timeout, backend=plan["trainers"]),
                  rollouts=dist.new_group(backend="gloo", timeout=timeout) if cuda else None)
    watch(ctx, args.heartbeat_timeout)
    return ctx


def own_store(rank, world, timeout):
    """The TCP store, bound to MASTER_ADDR alone (torch's binds every interface); None if the
    launcher hosts it."""
    host, port = os.environ["MASTER_ADDR"].strip("[]"), int(os.environ["MASTER_PORT"])
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    if ipaddress.ip_address(address[0]).is_loopback:
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(name, "lo")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    listening = None
    if rank == 0:
        with socket.socket(family, kind, proto) as server:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(address)
            server.listen(world)
            listening = server.detach()
    return dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout,
                         master_listen_fd=listening)


def start(ctx, version, length):
    """Once the model is loaded: rank 0 publishes the starting version."""
    ctx.length = length
    if ctx.rank == 0:
        ctx.store.set("version", str(version))
        ctx.store.set("stop", "0")
    dist.barrier(group=ctx.rollouts)


def device_plan(world, local_world, n_gpus, trainers, gens):
    """Each rank's GPU (round-robin) and each group's backend: gloo where ranks share a GPU."""
    ranks = range(world)
    if not n_gpus:
        return {"devices": [None] * world, "name": ["cpu"] * world, "default": "gloo",
                "weights": "gloo", "trainers": "gloo",
                "line": f"devices: {world} ranks on the CPU, every group over gloo"}
    devices = [(r % local_world) % n_gpus for r in ranks]
    where = [(r // local_world, devices[r]) for r in ranks]
    backend = lambda group: "nccl" if len({where[r] for r in group}) == len(group) else "gloo"
    plan = {"devices": devices, "name": [f"cuda:{d}" for d in devices], "default": backend(ranks),
            "weights": backend([0] + gens), "trainers": backend(trainers)}
    shared = len(set(where)) < world
    plan["line"] = (f"devices: {world} ranks on {min(n_gpus, local_world)} GPU(s) per node, "
                    f"round-robin ({'some ranks share a GPU' if shared else 'one GPU per rank'}); "
                    f"weight broadcast over {plan['weights']}, gradients over {plan['trainers']}"
                    + (" (nccl cannot join two ranks on one GPU)"
                       if "gloo" in plan.values() else ""))
    return plan


def on_trainer0(ctx, step, evaluate):
    """A held-out eval on trainer 0; the other trainers wait on the store."""
    if ctx is None:
        return evaluate()
    if ctx.rank != 0:
        return wait_for_eval(ctx, step)
    set_status(ctx, f"evaluating step {step}")
    evaluate()
    done_evaluating(ctx, step)


def done_evaluating(ctx, step):
    set_status(ctx, f"evaluated step {step}")
    ctx.store.set("evaluated", str(step))


def wait_for_eval(ctx, step):
    wait_until(ctx,
               lambda: ctx.store.check(["evaluated"]) and int(ctx.store.get("evaluated")) >= step,
               f"trainer 0's held-out eval at step {step}")


def finish(ctx):
    """Clean shutdown: the heartbeat joined first, then the ranks part."""
    set_status(ctx, "finished")
    ctx.store.add("finished", 1)
    ctx.stopping.set()
    ctx.heartbeat.join(timeout=ctx.timeout)
    dist.barrier(group=ctx.rollouts)
    dist.destroy_process_group()

# -----------------------------------------------------------------------------
# data plane


def admit_ok(gi, version, k, prompts):
    """PipelineRL-k: start group gi at weights `version` only if its batch is at most k ahead; a
    sample older than k is never made."""
    return gi // prompts <= version + k


def trainer_of(gi, prompts, n_trainers):
    """The trainer that trains group gi."""
    return (gi % prompts) % n_trainers


def pack_group(gen_rank, group, length):
    """A group -> float32 rows: header | ids | log-probs | mask | versions."""
    prompt, samples = group["prompt"], group["samples"]
    rows = torch.zeros(len(samples), HEADER + 4 * length)
    for row, s, c, r in zip(rows, samples, group["correct"], group["rewards"]):
        n, P = len(s.tokens), len(prompt)
        if P + n > length or max(prompt + s.tokens) >= 2 ** 24:
            raise ValueError(f"cannot pack: {P}+{n} tokens > {length} or a token id >= 2**24")
        row[:HEADER] = torch.tensor([gen_rank, group["gi"], group["index"], P, n, float(c), r,
                                     FINISH.index(s.finish)])
        body = row[HEADER:].view(4, length)
        body[0, :P + n] = torch.tensor(prompt + s.tokens, dtype=torch.float)
        body[1, :n], body[2, :n], body[3, :n] = (torch.tensor(x, dtype=torch.float)
                                                 for x in (s.logps, s.mask, s.versions))
    return rows


def unpack_group(rows):
    length = (rows.size(1) - HEADER) // 4
    gen_rank, gi, index, P = (int(x) for x in rows[0, :4].tolist())
    samples = []
    for row in rows:
        n, f = int(row[4]), int(row[7])
        body = row[HEADER:].view(4, length)
        samples.append(Sample(index, [int(x) for x in body[0, P:P + n].tolist()],
                              body[1, :n].tolist(), [int(x) for x in body[2, :n].tolist()],
                              [int(x) for x in body[3, :n].tolist()], FINISH[f]))
    return {"gen_rank": gen_rank, "gi": gi, "index": index,
            "prompt": [int(x) for x in rows[0, HEADER:HEADER + P].tolist()], "samples": samples,
            "correct": [bool(c) for c in rows[:, 5].tolist()], "rewards": rows[:, 6].tolist()}


def weight_buckets(tensors, bucket_mb):
    """Tensors in consecutive same-dtype buckets of at most bucket_mb."""
    buckets, size = [], 0
    for t in tensors:
        if not buckets or buckets[-1][-1].dtype != t.dtype or size + t.nbytes > bucket_mb * 2 ** 20:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += t.nbytes
    return buckets


def whole_weights(model, dtype=None):
    """The parameters made whole one at a time, cast to dtype."""
    for _, p in model.named_parameters():
        yield whole(p if dtype is None else p.to(dtype))


def whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@torch.no_grad()
def send_weights(ctx, model, bucket_mb, dtype):
    """Trainer 0 broadcasts the weights by buckets (--fsdp: every trainer helps make each whole) ->
    bytes."""
    metas = [torch.empty(p.shape, dtype=dtype, device="meta") for _, p in model.named_parameters()]
    whole, nbytes = whole_weights(model, dtype), 0
    for bucket in weight_buckets(metas, bucket_mb):
        parts = [next(whole) for _ in bucket]
        if ctx.rank == 0:
            flat = torch.cat([t.reshape(-1) for t in parts])
            dist.broadcast(flat, src=0, group=ctx.weights)
            nbytes += flat.nbytes
    return nbytes


@torch.no_grad()
def broadcast_weights(ctx, model, bucket_mb, into=None):
    """A generator's side of send_weights, into its parameters or `into` -> bytes."""
    params, nbytes = [p for _, p in model.named_parameters()], 0
    for bucket, targets in zip(weight_buckets(params, bucket_mb),
                               weight_buckets(into or params, bucket_mb)):
        flat = torch.empty(sum(p.numel() for p in bucket), dtype=bucket[0].dtype,
                           device=bucket[0].device)
        dist.broadcast(flat, src=0, group=ctx.weights)
        offset = 0
        for t in targets:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
        nbytes += flat.nbytes
    return nbytes


GRAD_BUCKET_MB = 64


def all_reduce_grads(ctx, params, bucket_mb=GRAD_BUCKET_MB):
    """Sum the trainers' gradients, in float32 buckets, once per step."""
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for bucket in weight_buckets(params, bucket_mb):
        flat = torch.cat([p.grad.reshape(-1).float() for p in bucket])
        dist.all_reduce(flat, group=ctx.trainers)
        for p, g in zip(bucket, flat.split([p.numel() for p in bucket])):
            p.grad.copy_(g.view_as(p))


def all_reduce_stats(ctx, sums, maxes=None):
    """Sum (and max) small dicts over the trainers."""
    if ctx is None:
        return sums, maxes or {}
    device = ctx.device
    v = torch.tensor([float(x) for x in sums.values()], dtype=torch.float64, device=device)
    dist.all_reduce(v, group=ctx.trainers)
    sums = dict(zip(sums, v.tolist()))
    if maxes:
        m = torch.tensor([float(x) for x in maxes.values()], dtype=torch.float64, device=device)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ctx.trainers)
        maxes = dict(zip(maxes, m.tolist()))
    return sums, maxes or {}

# -----------------------------------------------------------------------------
# rollout sources


class LocalRollouts:
    """One process: the generator code in-process, as generator 0 of 1 under --mode sync."""

    def __init__(self, args, model, tokenizer, problems, prompt_ids, version, saved=None):
        self.args, self.done, self.said = args, [], False
        self.gen = new_generator(args, model, tokenizer, problems, prompt_ids, 0, 1, version,
                                 self.done.append, saved)
        self.share = args.prompts

    def say(self, line):
        print(line, flush=True)
        self.said = True

    def get(self, step):
        """Batch `step` -> (groups, stats); (None, None) if a signal stops the sampling."""
        gen, t0 = self.gen, time.time()
        B = self.args.prompts
        peak_gb(gen.model)
        items = admit(gen, range(step * B, (step + 1) * B))
        if gen.exhausted:
            return [], {}
        start_sampler(gen, step, say=None if self.said else self.say)
        sampler_step(gen, items, step)
        while gen.open:
            if STOP:
                return None, None
            sampler_step(gen, [], step)
        gen.steps.close()
        sampled = time.time()
        finish_groups(gen, wait=True)
        groups = sorted(self.done, key=lambda g: g["gi"])
        self.done.clear()
        stats = {"too_old": 0, "wait_s": 0.0, "gen_s": sampled - t0,
                 "verify_s": time.time() - sampled, "retired": len(gen.prompts.curriculum.retired),
                 "epoch": gen.prompts.curriculum.epoch, "gen_peak_gb": peak_gb(gen.model),
                 "gen_tokens": sum(len(g["prompt"]) + len(s.tokens) for g in groups
                                   for s in g["samples"])}
        return groups, stats

    def publish(self, trainer, last, evaluate=False):
        """The weights are the trainer's own: nothing moves. -> (seconds, bytes)."""
        self.gen.prompts.forget_before(trainer.version)
        return 0.0, 0

    def stop_requested(self):
        return bool(STOP)

    def held_out(self, step, trainer, evaluate, stamp):
        evaluate(trainer.eval_model())

    def evals_done(self, wait=False):
        return []

    def busy(self, dt, rstats, train_s, sync_s, sync_bytes):
        return {"retired": rstats["retired"], "epoch": rstats["epoch"],
                "gen_busy": (dt - train_s) / dt, "train_busy": train_s / dt, "sync_ms": 0.0,
                "generate_ms": rstats["gen_s"] * 1000, "verify_ms": rstats["verify_s"] * 1000,
                "train_ms": train_s * 1000,
                **({"gen_peak_gb": rstats["gen_peak_gb"]} if rstats["gen_peak_gb"] else {})}

    def uncounted(self):
        return 0.0

    def state_dict(self, version):
        return {"curriculum": self.gen.prompts.state_at(version).state_dict()}

    def close(self, version):
        pass


class RemoteRollouts:
    """A trainer rank: its share of each batch comes from the generator ranks."""

    def __init__(self, ctx, args):
        self.ctx, self.args = ctx, args
        self.share = args.prompts // ctx.n_trainers
        # PipelineRL: the generators evaluate while training goes on
        self.on_generators = ctx.mode == "pipeline"
        self.pending = []
        self.eval_wait = 0.0

    def get(self, step):
        evaluating = bool(self.pending)
        groups, stats = receive_groups(self.ctx, step)
        self.eval_wait = stats["wait_s"] if evaluating else 0.0
        return groups, stats

    def publish(self, trainer, last, evaluate=False):
        """A step's weights to the generators; evaluate: they run its held-out eval."""
        on_generators = evaluate and self.on_generators
        if on_generators and self.ctx.rank == 0:
            t0 = time.time()
            for step, _ in self.pending:
                self.wait_for_eval(step)
            self.eval_wait += time.time() - t0
            self.ctx.store.set(f"eval_request/{trainer.version}", "1")
        return publish_weights(self.ctx, trainer, trainer.version, last and not on_generators,
                               self.args.bucket_mb, getattr(torch, self.args.dtype))

    def stop_requested(self):
        return stop_requested(self.ctx)

    def held_out(self, step, trainer, evaluate, stamp):
        """A held-out eval of `step`: on the generators, or on trainer 0."""
        if not self.on_generators:
            model = trainer.eval_model(self.ctx.device)
            return on_trainer0(self.ctx, step, lambda: evaluate(model))
        if self.ctx.rank == 0:
            self.ctx.store.set(f"eval_request/{step}", "1")
            self.pending.append((step, stamp))

    def evals_done(self, wait=False):
        """Trainer 0: the generators' finished evals -> [(step, records, stamp)]."""
        ctx, done = self.ctx, []
        gens = range(ctx.n_trainers, ctx.world)
        while self.pending and (wait or self.eval_ready(self.pending[0][0])):
            step, stamp = self.pending.pop(0)
            self.wait_for_eval(step)
            records = [x for r in gens for x in json.loads(ctx.store.get(f"eval/{step}/{r}"))]
            done.append((step, records, stamp))
        return done

    def eval_ready(self, step):
        return self.ctx.store.check([f"eval/{step}/{r}"
                                     for r in range(self.ctx.n_trainers, self.ctx.world)])

    def wait_for_eval(self, step):
        if not self.eval_ready(step):
            wait_until(self.ctx, lambda: self.eval_ready(step),
                       f"the generators' held-out eval of step {step}",
                       status=f"evaluating: waiting for the generators' eval of step {step}")

    def busy(self, dt, rstats, train_s, sync_s, sync_bytes):
        return {**busy_metrics(self.ctx, dt, rstats, train_s, sync_s, sync_bytes),
                "eval_wait_ms": self.eval_wait * 1000}

    def uncounted(self):
        """Trainer 0's seconds waiting for the generators' evals: not compute."""
        return self.eval_wait

    def state_dict(self, version):
        return {}

    def close(self, version):
        drain(self.ctx, version)
        finish(self.ctx)

# -----------------------------------------------------------------------------
# the trainers' side


def _receive_one(ctx):
    rows = torch.empty(ctx.samples, HEADER + 4 * ctx.length)
    dist.irecv(rows, src=None, group=ctx.rollouts, tag=1).wait(timedelta(seconds=ctx.timeout))
    ctx.received += 1
    return rows


def receive_groups(ctx, step):
    """This trainer's share of batch `step`, in order -> (groups, stats)."""
    rank, k, B = ctx.rank, ctx.k, ctx.prompts
    want = [gi for gi in range(step * B, (step + 1) * B)
            if trainer_of(gi, B, ctx.n_trainers) == rank]
    early, stats = ctx.early, {"too_old": 0, "received": 0, "wait_s": 0.0, "gen_tokens": 0}
    while any(gi not in early for gi in want):
        missing = [gi for gi in want if gi not in early]
        stats["wait_s"] += wait_until(ctx, lambda: get_int(ctx, f"sent/{rank}") > ctx.received
                                      or get_int(ctx, "exhausted") > 0,
                                      f"rollouts for step {step + 1} "
                                      f"(groups {missing[0]}..{missing[-1]})")
        if get_int(ctx, f"sent/{rank}") <= ctx.received:
            break
        group = unpack_group(_receive_one(ctx))
        ctx.store.add(f"received_from/{group['gen_rank']}/{rank}", 1)
        stats["received"] += 1
        stats["gen_tokens"] += sum(len(group["prompt"]) + len(s.tokens) for s in group["samples"])
        early[group["gi"]] = group
    got = [early.pop(gi) for gi in want if gi in early]
    for group in got:
        oldest = min((v for s in group["samples"] for v, m in zip(s.versions, s.mask) if m),
                     default=step)
        stats["too_old"] += step - oldest > k
    set_status(ctx, f"training step {step + 1}")
    return got, stats


def publish_weights(ctx, trainer, step, last, bucket_mb, dtype=torch.float32):
    """After a step: announce version `step`, broadcast it (every k steps unless pipeline)."""
    if (last or step % (1 if ctx.mode == "pipeline" else ctx.k)
            or (ctx.rank != 0 and not trainer.sharded)):
        return 0.0, 0
    t0 = time.time()
    set_status(ctx, f"broadcasting weights version {step}")
    if ctx.rank == 0:
        ctx.store.set("version", str(step))
    nbytes = send_weights(ctx, trainer.model, bucket_mb, dtype)
    if ctx.rank != 0:
        return 0.0, 0
    if str(ctx.device).startswith("cuda"):  # nccl returns before the transfer ends
        torch.cuda.synchronize(ctx.device)
    return time.time() - t0, nbytes


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
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    wrapped = LogProbs(model)
    fully_shard(wrapped, mesh=mesh, mp_policy=mp)
    for m in wrapped.modules():
        if isinstance(m, FSDPModule):  # not inherited
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


def generator_stats(ctx):
    store, out = ctx.store, []
    for r in range(ctx.n_trainers, ctx.world):
        out.append(json.loads(store.get(f"genstats/{r}")) if store.check([f"genstats/{r}"]) else {})
    return out


def busy_metrics(ctx, dt, rstats, train_s, sync_s, sync_bytes):
    """Trainer 0's per-step view of both roles: busy fractions, sync speed, tokens/s."""
    wait_s = rstats["wait_s"]
    now = generator_stats(ctx)
    before = ctx.genstats_before or [{}] * len(now)
    d = [{key: s.get(key, 0.0) - b.get(key, 0.0) for key in ("wall", "idle", "sync", "tokens")}
         for s, b in zip(now, before)]
    # a generator that has not published since keeps its old counters
    ctx.genstats_before = [s if x["wall"] > 0 else b for s, b, x in zip(now, before, d)]
    busy = [(x["wall"] - x["idle"] - x["sync"]) / x["wall"] for x in d if x["wall"] > 0]
    if busy:
        ctx.gen_rates = {"gen_busy": sum(busy) / len(busy),
                         "gen_tok_s": sum(x["tokens"] / x["wall"] for x in d if x["wall"] > 0)}
    return {**ctx.gen_rates, "train_busy": train_s / dt,
            "wait_ms": wait_s * 1000, "sync_ms": sync_s * 1000,
            "sync_MBps": sync_bytes / 1e6 / sync_s if sync_s else 0.0,
            "retired": sum(s.get("retired", 0) for s in now),
            "epoch": max((s.get("epoch", 0) for s in now), default=0),
            **({"gen_peak_gb": max(s["peak_gb"] for s in now if s.get("peak_gb"))}
               if any(s.get("peak_gb") for s in now) else {})}


def drain(ctx, step):
    """After the last step: stop the generators, take the groups in flight."""
    if ctx.rank == 0:
        ctx.store.set("last_step", str(step))
        ctx.store.set("stop", "1")
    wait_until(ctx, lambda: get_int(ctx, "generators_done") == ctx.n_gens, "the generators to stop")
    while get_int(ctx, f"sent/{ctx.rank}") > ctx.received:
        _receive_one(ctx)

# -----------------------------------------------------------------------------
# a generator


@dataclass
class Generator:
    """A generator's state: on a generator rank, or inside the one-process loop."""
    args: object
    model: object
    tokenizer: object
    problems: list
    prompt_ids: list
    index: int
    n_gens: int
    prompts: object  # Prompts
    send: object
    start_version: int
    version: int
    steps: object = None
    slots: int = 0
    free: int = 0
    admitted: int = 0
    exhausted: bool = False
    open: dict = field(default_factory=dict)
    tokens: int = 0
    verifying: list = field(default_factory=list)
    verifier: object = field(default_factory=lambda: ThreadPoolExecutor(max_workers=1))
    # held-out evals
    val: list = None
    val_ids: list = None
    eval_version: int = None
    eval_items: list = field(default_factory=list)
    eval_want: int = 0
    eval_t0: float = 0.0
    eval_shown: float = 0.0
    eval_done: dict = field(default_factory=dict)
    evaluated: set = field(default_factory=set)
    report_eval: object = None
    staged: list = None
    staged_version: int = -1
    # a generator rank: sends in flight, and its time
    sends: list = field(default_factory=list)
    pruned: list = None
    curriculum_path: str = ""
    t0: float = field(default_factory=time.time)
    idle: float = 0.0
    idle_since: float = None
    sync: float = 0.0
    last_poll: float = 0.0
    last_stats: float = 0.0


def new_generator(args, model, tokenizer, problems, prompt_ids, g, n_gens, version, send,
                  saved=None):
    return Generator(args, model, tokenizer, problems, prompt_ids, g, n_gens,
                     Prompts(len(problems), g, n_gens, args, saved), send, version, version)


def sampler_most(args, ctx):
    """The most sequences a training run's sampler holds."""
    return in_flight(args, ctx.n_gens if ctx else 1, ctx.k if ctx else 0)


def start_sampler(gen, version, k=0, say=None):
    longest = max(map(len, gen.prompt_ids + (gen.val_ids or [])))
    gen.steps = make_sampler(gen.model, gen.tokenizer, gen.args, longest, version, say=say,
                             most=in_flight(gen.args, gen.n_gens, k))
    _, gen.free = next(gen.steps)
    gen.slots = gen.free


def make_sampler(model, tokenizer, args, max_prompt_len, version=0, cap=None, say=None,
                 most=None):
    """generate.sampler with the run's flags."""
    interrupt, _ = length_control(args)
    special = special_tokens(tokenizer, model)
    caps = [c for c in (args.slots, cap) if c]
    slots, blocks, why = generate.fit_slots(
        model, *generate.cache_length(max_prompt_len, args.think_budget, args.answer_budget,
                                      special["interrupt_ids"], interrupt),
        args.gen_memory, min(caps) if caps else None, args.fp32_head, most)
    if why and say:
        say(why)
    return sampler(model, **special, think_budget=args.think_budget,
                   answer_budget=args.answer_budget, max_prompt_len=max_prompt_len,
                   interrupt=interrupt, slots=slots, blocks=blocks, temperature=args.temperature,
                   fp32_head=args.fp32_head, seed=args.seed, version=version)


def length_control(args):
    """ScaleRL's length control (--length_control) -> (forced interruptions?, length penalty or
    None)."""
    if args.length_control != "penalty":
        return args.length_control == "interrupt", None
    l_max = args.l_max or args.think_budget + args.answer_budget
    return False, lambda lengths: length_penalty(lengths, l_max, args.l_cache or l_max // 7)


class Prompts:
    """No-Positive-Resampling over generator g's prompts (every n_gens-th): the curriculum, and per
    batch in flight the state a resume there starts from."""

    def __init__(self, n_problems, g, n_gens, args, saved=None):
        self.mine, self.batch = list(range(g, n_problems, n_gens)), args.prompts
        self.curriculum = Curriculum(len(self.mine), args.seed + 1 + g)
        if saved:
            self.curriculum.load_state_dict(saved)
        self.curriculum.npr = args.no_positive_resampling
        self.at = {}

    def pick(self, gi):
        """Group gi's slot in self.mine; StopIteration once every prompt is retired."""
        if gi // self.batch not in self.at:
            self.at[gi // self.batch] = copy.deepcopy(self.curriculum)
        (c,) = self.curriculum.next_batch(1)
        return c

    def record(self, gi, c, pass_rate):
        for curriculum in [self.curriculum] + [s for b, s in self.at.items()
                                               if gi // self.batch < b]:
            curriculum.record(c, pass_rate)

    def state_at(self, step):
        return self.at.get(step, self.curriculum)

    def forget_before(self, version):
        self.at = {b: c for b, c in self.at.items() if b >= version}


def group_items(prompt, gi, G):
    """Group gi's items: sample j's noise key is gi * 1024 + j, whoever samples it."""
    return [(prompt, gi * 1024 + j, (gi, j)) for j in range(G)]


def admit(gen, gis):
    """A group per global index -> sampler items."""
    items, G = [], gen.args.samples
    for gi in gis:
        try:
            c = gen.prompts.pick(gi)
        except StopIteration as err:
            print(f"generator {gen.index}: {err}", flush=True)
            gen.exhausted = True
            break
        gen.admitted += 1
        gen.open[gi] = {"c": c, "samples": [None] * G}
        items += group_items(gen.prompt_ids[gen.prompts.mine[c]], gi, G)
    return items


def sampler_step(gen, items, version, evals=()):
    """One sampler step; completed groups go to the verifier."""
    finished, gen.free = gen.steps.send((list(evals) + items, version))
    for (gi, j), sample in finished:
        gen.tokens += len(sample.tokens)
        if gi == "eval":
            gen.eval_done[j] = sample
            continue
        group = gen.open[gi]
        group["samples"][j] = sample
        if all(group["samples"]):
            del gen.open[gi]
            verify_beside(gen, gi, group["c"], group["samples"])
    if gen.eval_version is not None and len(gen.eval_done) == gen.eval_want:
        finish_eval(gen)
    finish_groups(gen)


def verify_beside(gen, gi, c, samples):
    """Verify a group in the verifier's thread while decoding goes on."""
    problems = [gen.problems[gen.prompts.mine[c]]] * len(samples)
    future = gen.verifier.submit(score_samples, gen.tokenizer, samples, problems,
                                 unsafe_code=gen.args.unsafe_code_exec)
    gen.verifying.append((gi, c, samples, future))


def finish_groups(gen, wait=False):
    """Verified groups, in order: record pass rates (and in the resume copies), send."""
    while gen.verifying and (wait or gen.verifying[0][3].done()):
        gi, c, samples, future = gen.verifying.pop(0)
        _, correct, rewards = future.result()
        i = gen.prompts.mine[c]
        gen.prompts.record(gi, c, sum(correct) / len(samples))
        gen.send({"gi": gi, "index": i, "prompt": gen.prompt_ids[i], "samples": samples,
                  "correct": correct, "rewards": rewards})


EVAL_SHARE = 0.5


def start_eval(gen, version):
    gen.eval_version, gen.eval_done, gen.eval_t0 = version, {}, time.time()
    gen.eval_shown = gen.eval_t0
    gen.eval_items = evals.held_out_items(gen.val_ids, gen.args.eval_samples, gen.index, gen.n_gens)
    gen.eval_want = len(gen.eval_items)


def eval_progress(gen, v, done, every=10.0):
    """Every `every` s, the first generator says how far its share of a held-out eval is."""
    now = time.time()
    if gen.index == 0 and gen.eval_version is not None and now - gen.eval_shown >= every:
        gen.eval_shown, spent = now, now - gen.eval_t0
        eta = f"ETA {(gen.eval_want - done) * spent / done:.0f} s" if done else "none finished yet"
        print(f"generator 0: held-out eval of step {v}: {done}/{gen.eval_want} samples in "
              f"{spent:.0f} s, {eta}", flush=True)


def eval_share(gen):
    running = gen.eval_want - len(gen.eval_items) - len(gen.eval_done)
    n = max(0, min(max(1, int(gen.slots * EVAL_SHARE)) - running, gen.free))
    items, gen.eval_items = gen.eval_items[:n], gen.eval_items[n:]
    return items


def finish_eval(gen):
    gen.report_eval(gen.eval_version, evals.score_held_out(gen.tokenizer, gen.eval_done, gen.val,
                                                           gen.args.unsafe_code_exec))
    gen.evaluated.add(gen.eval_version)
    gen.eval_version, gen.eval_done = None, {}
    if gen.staged_version > gen.version:
        with torch.no_grad():
            for p, s in zip((p for _, p in gen.model.named_parameters()), gen.staged):
                p.copy_(s)
        take_weights(gen, gen.staged_version)

# -----------------------------------------------------------------------------
# a generator rank's life


def run_generator(ctx, args, model, tokenizer, problems, prompt_ids, start_version,
                  curriculum_path, val, val_ids):
    """A generator rank's whole life, until the trainers say stop."""
    saved = None
    if args.resume and os.path.exists(curriculum_path):
        with open(curriculum_path) as f:
            saved = json.load(f)
    gen = new_generator(args, model, tokenizer, problems, prompt_ids, ctx.rank - ctx.n_trainers,
                        ctx.n_gens, start_version, lambda group: send_group(ctx, gen, group), saved)
    gen.pruned, gen.curriculum_path, gen.val, gen.val_ids = ([0] * ctx.n_trainers, curriculum_path,
                                                             val, val_ids)
    gen.report_eval = lambda v, records: ctx.store.set(f"eval/{v}/{ctx.rank}", json.dumps(records))
    say = lambda line: print(f"generator rank {ctx.rank}: {line}", flush=True)  # noqa: E731
    start_sampler(gen, start_version, ctx.k, say)
    set_status(ctx, "generating")
    try:
        while True:
            (generate_pipelined if ctx.mode == "pipeline" else generate_frozen)(ctx, gen)
    except Stopped:
        pass
    last = int(ctx.store.get("last_step"))
    _save_curriculum(gen.prompts.state_at(last), curriculum_path)
    publish_stats(ctx, gen, force=True)
    ctx.store.add("generators_done", 1)
    set_status(ctx, "waiting for trainers to take the last rollouts")
    for _, work, _ in gen.sends:
        work.wait(timedelta(seconds=ctx.timeout))


def generate_pipelined(ctx, gen):
    """PipelineRL-k, one round: new weights, admit what the lag rule allows, sample."""
    version = poll(ctx, gen)
    evals = eval_share(gen)
    free = gen.free - len(evals)
    items = (admit_ranked(ctx, gen, next_groups(ctx, gen, math.ceil(free / gen.args.samples),
                                                version))
             if free > 0 else [])
    if items or evals or gen.free < gen.slots:
        done, v = len(gen.eval_done), gen.eval_version
        sampler_step(gen, items, version, evals)
        if v is not None and len(gen.eval_done) != done:  # restarts the trainers' deadlines
            ctx.store.add("eval_progress", 1)
            done = len(gen.eval_done)
            set_status(ctx, f"generating; evaluating step {v} ({done}/{gen.eval_want})"
                       if gen.eval_version is not None else "generating")
            eval_progress(gen, v, done)
        return
    if gen.verifying:
        finish_groups(gen, wait=True)
        return
    gen.idle_since = time.time()
    wait_until(ctx,
               lambda: (next_groups(ctx, gen, 1, poll(ctx, gen)) and not get_int(ctx, "exhausted")
                        or gen.eval_items),
               f"weights that let group {next_groups(ctx, gen, 1, 10 ** 9)[0]} start "
               f"(PipelineRL-{ctx.k})")
    gen.idle += time.time() - gen.idle_since
    gen.idle_since = None


def generate_frozen(ctx, gen):
    """ppo_offpolicy / sync, one round: k batches on frozen weights, then wait."""
    v, k, B = gen.version, ctx.k, ctx.prompts
    sampler_step(gen, admit_ranked(ctx, gen, [v * B + j for j in
                                              range(gen.index, (k - v % k) * B, ctx.n_gens)]), v)
    while gen.free < gen.slots:
        poll(ctx, gen, apply=False)
        sampler_step(gen, [], v)
    finish_groups(gen, wait=True)
    gen.idle_since = time.time()
    wait_until(ctx, lambda: poll(ctx, gen) >= v + k - v % k,
               f"weights version {v + k - v % k} (frozen for {k} steps)")
    gen.idle += time.time() - gen.idle_since
    gen.idle_since = None


def admit_ranked(ctx, gen, gis):
    items = admit(gen, gis)
    if gen.exhausted and not get_int(ctx, "exhausted"):
        ctx.store.add("exhausted", 1)
    return items


def poll(ctx, gen, apply=True):
    """Stop? New weights? An eval asked? -> the weights version in the model."""
    if time.time() - gen.last_poll < 0.01:
        return gen.version
    gen.last_poll = time.time()
    stop_requested(ctx)  # first: a stop after a signal exits with the signal's status
    if ctx.store.get("stop") == b"1":
        raise Stopped
    version = int(ctx.store.get("version"))
    if apply and version > max(gen.version, gen.staged_version):
        t0 = time.time()
        set_status(ctx, f"receiving weights version {version}")
        if gen.eval_version is None:
            broadcast_weights(ctx, gen.model, gen.args.bucket_mb)
            take_weights(gen, version)
        else:
            gen.staged = stage_weights(ctx, gen.model, gen.args.bucket_mb, gen.staged)
            gen.staged_version = version
        gen.sync += time.time() - t0
        if gen.idle_since is not None:
            gen.idle_since += time.time() - t0
        set_status(ctx, "generating")
    if (gen.eval_version is None and gen.version not in gen.evaluated
            and ctx.store.check([f"eval_request/{gen.version}"])):
        start_eval(gen, gen.version)
    publish_stats(ctx, gen)
    return gen.version


def take_weights(gen, version):
    every, before = gen.args.save_every, gen.version
    gen.version = version
    if every and version // every > before // every:
        b = version // every * every  # versions may step over b
        _save_curriculum(gen.prompts.state_at(b), gen.curriculum_path)
    gen.prompts.forget_before(version)


def stage_weights(ctx, model, bucket_mb, staged=None):
    staged = staged or [torch.empty(p.shape, dtype=p.dtype) for _, p in model.named_parameters()]
    broadcast_weights(ctx, model, bucket_mb, into=staged)
    return staged


def publish_stats(ctx, gen, force=False):
    now = time.time()
    if force or now - gen.last_stats > 0.1:
        gen.last_stats = now
        idle = gen.idle + (now - gen.idle_since if gen.idle_since else 0.0)
        ctx.store.set(f"genstats/{ctx.rank}", json.dumps({
            "wall": now - gen.t0, "idle": idle, "sync": gen.sync, "tokens": gen.tokens,
            "retired": len(gen.prompts.curriculum.retired), "epoch": gen.prompts.curriculum.epoch,
            "peak_gb": peak_gb(gen.model, reset=False)}))


def next_groups(ctx, gen, n_groups, version):
    B = ctx.prompts
    gis = [gen.start_version * B + j * ctx.n_gens + gen.index
           for j in range(gen.admitted, gen.admitted + n_groups)]
    return [gi for gi in gis if admit_ok(gi, version, ctx.k, B)]


def send_group(ctx, gen, group):
    """A verified group to its trainer (isend); forget the sends already received."""
    dst = trainer_of(group["gi"], ctx.prompts, ctx.n_trainers)
    rows = pack_group(ctx.rank, group, ctx.length)
    gen.sends.append((dst, dist.isend(rows, dst=dst, group=ctx.rollouts, tag=1), rows))
    ctx.store.add(f"sent/{dst}", 1)
    if len(gen.sends) > 2 * math.ceil((ctx.k + 1) * ctx.prompts / ctx.n_gens):
        for t in range(ctx.n_trainers):
            done = get_int(ctx, f"received_from/{ctx.rank}/{t}")
            for x in [x for x in gen.sends if x[0] == t][:done - gen.pruned[t]]:
                x[1].wait()
                gen.sends.remove(x)
                gen.pruned[t] += 1


def _save_curriculum(curriculum, path):
    from runs import replace_file
    replace_file(path, lambda f: json.dump(curriculum.state_dict(), f))
