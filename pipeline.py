"""
pipeline.py: generator and trainer ranks under torch.distributed (arXiv 2510.13786, section
3.1). Start at LocalRollouts (one process) and RemoteRollouts (a trainer rank), chosen by
train.rollout_source, then run_generator.

Under torchrun, ranks 0..T-1 train; the others (--gen_ranks) sample, verify and send whole groups
to the trainers and run the held-out evals; trainer 0 broadcasts the weights after each step.
The ranks, their devices and the TCP store that holds the small state are ranks.py's; every
wait has a deadline (faults.py).

--mode pipeline (PipelineRL-k): generators never stop, take new weights between decode steps, and
admit_ok keeps every token at most k versions old. ppo_offpolicy: k batches on frozen weights.
sync: k = 1. Each rule is one section below: "PipelineRL-k: the lag rule", "the weight exchange".
"""

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from checks import resumed_curriculum
from data import Prompts, score_samples, special_tokens
from evals import EvalShare, score_held_out
from faults import STOP, Stopped, get_int, set_status, stop_requested, wait_until
from generate import sampler
import generate
from loss import LengthControl
from plan import fit_slots, in_flight, peak_gb
from ranks import (busy_metrics, drain, generator_states, on_trainer0, pack_group, part,
                   receive_rows, unpack_group, weight_buckets)


# -----------------------------------------------------------------------------
# rollout sources


class LocalRollouts:
    """One process: the generator code in-process, as generator 0 of 1 under --mode sync."""

    def __init__(self, args, model, tokenizer, problems, prompt_ids, version, saved=None):
        self.args, self.done, self.said = args, [], False
        self.gen = new_gen_state(args, model, tokenizer, problems, prompt_ids, 0, 1, version,
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
        if gen.sampling.exhausted:
            return [], {}
        start_sampler(gen, step, say=None if self.said else self.say)
        sampler_step(gen, items, step)
        while gen.sampling.open:
            if STOP:
                return None, None
            sampler_step(gen, [], step)
        gen.sampling.steps.close()
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
        evaluate(trainer.whole_model())

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
            model = trainer.whole_model(self.ctx.device)
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
        """Trainer 0: every generator's curriculum at `version`, sent through the store (a
        generator needs no shared disk)."""
        return {"curricula": generator_states(self.ctx, version)} if self.ctx.rank == 0 else {}

    def close(self, version):
        """The end; trainer 0 names each eval a signal left unfinished on the generators."""
        for step, _ in self.pending:
            print(f"held-out eval of step {step}: cut short by the signal; "
                  + ("--resume redoes it" if step == version else
                     f"lost (training went on to step {version}, and the generators no longer hold "
                     f"the weights of step {step})"), flush=True)
        drain(self.ctx, version)
        part(self.ctx)

# -----------------------------------------------------------------------------
# the trainers' side


def trainer_of(gi, prompts, n_trainers):
    """The trainer that trains group gi."""
    return (gi % prompts) % n_trainers


def receive_groups(ctx, step):
    """This trainer's share of batch `step`, in order -> (groups, stats)."""
    rank, k, B = ctx.rank, ctx.k, ctx.prompts
    want = [gi for gi in range(step * B, (step + 1) * B)
            if trainer_of(gi, B, ctx.n_trainers) == rank]
    early, stats = ctx.live.early, {"too_old": 0, "received": 0, "wait_s": 0.0, "gen_tokens": 0}
    while any(gi not in early for gi in want):
        missing = [gi for gi in want if gi not in early]
        stats["wait_s"] += wait_until(ctx, lambda: get_int(ctx, f"sent/{rank}") > ctx.live.received
                                      or get_int(ctx, "exhausted") > 0,
                                      f"rollouts for step {step + 1} "
                                      f"(groups {missing[0]}..{missing[-1]})")
        if get_int(ctx, f"sent/{rank}") <= ctx.live.received:
            break
        group = unpack_group(receive_rows(ctx))
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


# -----------------------------------------------------------------------------
# a generator: its state, one small dataclass per role, then sampling, verifying and evals


@dataclass
class SamplerState:
    """The sampler and the groups admitted to it; an open group waits for its last sample."""
    start_version: int  # this generator's group indices count from this batch (next_groups)
    steps: object = None  # the generate.sampler coroutine
    slots: int = 0
    free: int = 0
    admitted: int = 0
    exhausted: bool = False
    open: dict = field(default_factory=dict)
    tokens: int = 0


@dataclass
class Verifier:
    """Finished groups, verified in one thread beside the sampler, then sent in order."""
    send: object  # a verified group -> its trainer (or the one-process batch)
    verifying: list = field(default_factory=list)
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(max_workers=1))


@dataclass
class WeightState:
    """The weights version in the model, and newer weights staged on the host during an eval."""
    version: int
    staged: list = None
    staged_version: int = -1


@dataclass
class RankState:
    """A generator rank's sends in flight, the checkpoint it last sent its state for, and where its
    time went."""
    pruned: list  # per trainer: the sends already waited on and forgotten
    sent_state: int = -1
    sends: list = field(default_factory=list)
    t0: float = field(default_factory=time.time)
    idle: float = 0.0
    idle_since: float = None
    sync: float = 0.0
    last_poll: float = 0.0
    last_stats: float = 0.0


@dataclass
class GenState:
    """A generator: on a generator rank, or inside the one-process loop."""
    args: object
    model: object
    tokenizer: object
    problems: list
    prompt_ids: list
    index: int
    n_gens: int
    prompts: Prompts  # No-Positive-Resampling over this generator's prompts (data.py)
    sampling: SamplerState
    verifier: Verifier
    weights: WeightState
    evals: EvalShare = field(default_factory=EvalShare)
    rank: RankState = None  # a generator rank only


def new_gen_state(args, model, tokenizer, problems, prompt_ids, g, n_gens, version, send,
                  saved=None):
    prompts = Prompts(len(problems), g, n_gens, args.prompts, args.seed,
                      args.no_positive_resampling, saved)
    return GenState(args, model, tokenizer, problems, prompt_ids, g, n_gens, prompts,
                    SamplerState(version), Verifier(send), WeightState(version))


def sampler_most(args, ctx):
    """The most sequences a training run's sampler holds."""
    return in_flight(args, ctx.n_gens if ctx else 1, ctx.k if ctx else 0)


def start_sampler(gen, version, k=0, say=None):
    longest = max(map(len, gen.prompt_ids + (gen.evals.val_ids or [])))
    gen.sampling.steps = make_sampler(gen.model, gen.tokenizer, gen.args, longest, version,
                                      say=say, most=in_flight(gen.args, gen.n_gens, k))
    _, gen.sampling.free = next(gen.sampling.steps)
    gen.sampling.slots = gen.sampling.free


def make_sampler(model, tokenizer, args, max_prompt_len, version=0, cap=None, say=None,
                 most=None):
    """generate.sampler with the run's flags."""
    interrupt = LengthControl.from_args(args).interrupt
    special = special_tokens(tokenizer, model)
    caps = [c for c in (args.slots, cap) if c]
    slots, blocks, why = fit_slots(
        model, *generate.cache_length(max_prompt_len, args.think_budget, args.answer_budget,
                                      special["interrupt_ids"], interrupt),
        args.gen_memory, min(caps) if caps else None, args.fp32_head, most)
    if why and say:
        say(why)
    return sampler(model, **special, think_budget=args.think_budget,
                   answer_budget=args.answer_budget, max_prompt_len=max_prompt_len,
                   interrupt=interrupt, slots=slots, blocks=blocks, temperature=args.temperature,
                   fp32_head=args.fp32_head, seed=args.seed, version=version)


def group_items(prompt, gi, G):
    """Group gi's items: sample j's noise key is gi * 1024 + j, whoever samples it."""
    return [(prompt, gi * 1024 + j, (gi, j)) for j in range(G)]


def admit(gen, gis):
    """A group per global index -> sampler items."""
    s, items, G = gen.sampling, [], gen.args.samples
    for gi in gis:
        try:
            c = gen.prompts.pick(gi)
        except StopIteration as err:
            print(f"generator {gen.index}: {err}", flush=True)
            s.exhausted = True
            break
        s.admitted += 1
        s.open[gi] = {"c": c, "samples": [None] * G}
        items += group_items(gen.prompt_ids[gen.prompts.mine[c]], gi, G)
    return items


def sampler_step(gen, items, version, share=()):
    """One sampler step; completed groups go to the verifier."""
    s, e = gen.sampling, gen.evals
    finished, s.free = s.steps.send((list(share) + items, version))
    for (gi, j), sample in finished:
        s.tokens += len(sample.tokens)
        if gi == "eval":
            e.done[j] = sample
            continue
        group = s.open[gi]
        group["samples"][j] = sample
        if all(group["samples"]):
            del s.open[gi]
            verify_beside(gen, gi, group["c"], group["samples"])
    if e.version is not None and len(e.done) == e.want:
        finish_eval(gen)
    finish_groups(gen)


def verify_beside(gen, gi, c, samples):
    """Verify a group in the verifier's thread while decoding goes on."""
    # scoring (a code group: its tests in the sandbox) would stall many decode steps
    problems = [gen.problems[gen.prompts.mine[c]]] * len(samples)
    future = gen.verifier.pool.submit(score_samples, gen.tokenizer, samples, problems,
                                      unsafe_code=gen.args.unsafe_code_exec)
    gen.verifier.verifying.append((gi, c, samples, future))


def finish_groups(gen, wait=False):
    """Verified groups, in order: record pass rates (and in the resume copies), send."""
    v = gen.verifier
    while v.verifying and (wait or v.verifying[0][3].done()):
        gi, c, samples, future = v.verifying.pop(0)
        _, correct, rewards = future.result()
        i = gen.prompts.mine[c]
        gen.prompts.record(gi, c, sum(correct) / len(samples))
        v.send({"gi": gi, "index": i, "prompt": gen.prompt_ids[i], "samples": samples,
                "correct": correct, "rewards": rewards})


def finish_eval(gen):
    """A finished share: scored, reported, then the weights that waited for it."""
    e = gen.evals
    e.report(e.version, score_held_out(gen.tokenizer, e.done, e.val, gen.args.unsafe_code_exec))
    e.evaluated.add(e.version)
    e.version, e.done = None, {}
    take_staged(gen)

# -----------------------------------------------------------------------------
# PipelineRL-k: the lag rule
# Paper 3.1: generators never stop, and group gi (of batch gi // B) starts only on weights at most
# k versions behind its batch, so no trained token is older than k, by back-pressure alone: nothing
# is dropped. PPO-off-policy-k (and sync, k = 1): k batches on frozen weights, then wait.


def admit_ok(gi, version, k, prompts):
    """PipelineRL-k: start group gi at weights `version` only if its batch is at most k ahead; a
    sample older than k is never made."""
    return gi // prompts <= version + k


def next_groups(ctx, gen, n_groups, version):
    """This generator's next n_groups group indices (every n_gens-th) that admit_ok lets start."""
    B, s = ctx.prompts, gen.sampling
    gis = [s.start_version * B + j * ctx.n_gens + gen.index
           for j in range(s.admitted, s.admitted + n_groups)]
    return [gi for gi in gis if admit_ok(gi, version, ctx.k, B)]


def generate_round(ctx, gen):
    """--mode pipeline samples on under the lag rule; ppo_offpolicy and sync freeze the weights."""
    (generate_pipelined if ctx.mode == "pipeline" else generate_frozen)(ctx, gen)


def generate_pipelined(ctx, gen):
    """PipelineRL-k, one round: new weights, admit what the lag rule allows, sample."""
    s, e = gen.sampling, gen.evals
    version = poll(ctx, gen)
    share = e.take(s.slots, s.free)
    free = s.free - len(share)
    items = (admit_ranked(ctx, gen, next_groups(ctx, gen, math.ceil(free / gen.args.samples),
                                                version))
             if free > 0 else [])
    if items or share or s.free < s.slots:
        done, v = len(e.done), e.version
        sampler_step(gen, items, version, share)
        if v is not None and len(e.done) != done:  # restarts the trainers' deadlines
            ctx.store.add("eval_progress", 1)
            done = len(e.done)
            set_status(ctx, f"generating; evaluating step {v} ({done}/{e.want})"
                       if e.version is not None else "generating")
            if e.progress and e.version is not None:
                e.progress.update(done)
        return
    if gen.verifier.verifying:
        finish_groups(gen, wait=True)
        return
    wait_idle(ctx, gen,
              lambda: (next_groups(ctx, gen, 1, poll(ctx, gen)) and not get_int(ctx, "exhausted")
                       or e.items),
              f"weights that let group {next_groups(ctx, gen, 1, 10 ** 9)[0]} start "
              f"(PipelineRL-{ctx.k})")


def generate_frozen(ctx, gen):
    """ppo_offpolicy / sync, one round: k batches on frozen weights, then wait."""
    s, v, k, B = gen.sampling, gen.weights.version, ctx.k, ctx.prompts
    sampler_step(gen, admit_ranked(ctx, gen, [v * B + j for j in
                                              range(gen.index, (k - v % k) * B, ctx.n_gens)]), v)
    while s.free < s.slots:
        poll(ctx, gen, apply=False)
        sampler_step(gen, [], v)
    finish_groups(gen, wait=True)
    wait_idle(ctx, gen, lambda: poll(ctx, gen) >= v + k - v % k,
              f"weights version {v + k - v % k} (frozen for {k} steps)")

# -----------------------------------------------------------------------------
# the weight exchange
# In-flight weight updates (paper 3.1): after each optimizer step trainer 0 broadcasts the weights
# in flat buckets and a generator takes them between two decode steps, keeping its KV cache, so
# sampling never stops for a sync (ppo_offpolicy and sync: every k steps, between frozen rounds).


def whole_weights(model, dtype=None):
    """The parameters made whole one at a time, cast to dtype."""
    for _, p in model.named_parameters():
        yield whole(p if dtype is None else p.to(dtype))


def whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def weight_layout(model, bucket_mb):
    """What the broadcast moves: each parameter's name, shape and dtype, and the bucket size
    (checked once at start-up, ranks.meet: the receiver buckets by its own)."""
    return {"bucket_mb": bucket_mb, "params": [[n, list(p.shape), str(p.dtype).split(".")[-1]]
                                               for n, p in model.named_parameters()]}


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


def publish_weights(ctx, trainer, step, last, bucket_mb, dtype=torch.float32):
    """After a step: announce version `step`, broadcast it (every k steps unless pipeline)."""
    # ppo_offpolicy: the generators are frozen between rounds of k steps and take no other version
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


@torch.no_grad()
def receive_weights(ctx, model, bucket_mb, into=None):
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


def update_weights(ctx, gen, version):
    """poll's weight part: weights `version` into the model, or staged on the host."""
    t0, w = time.time(), gen.weights
    set_status(ctx, f"receiving weights version {version}")
    if gen.evals.version is None:
        receive_weights(ctx, gen.model, gen.args.bucket_mb)
        take_weights(gen, version)
    else:  # an eval samples with its own step's weights to the end: the new ones wait
        w.staged = w.staged or [torch.empty(p.shape, dtype=p.dtype)
                                for _, p in gen.model.named_parameters()]
        receive_weights(ctx, gen.model, gen.args.bucket_mb, into=w.staged)
        w.staged_version = version
    gen.rank.sync += time.time() - t0
    if gen.rank.idle_since is not None:  # receiving counts as sync, not idle
        gen.rank.idle_since += time.time() - t0
    set_status(ctx, "generating")


def take_staged(gen):
    """After an eval: the weights staged during it into the model."""
    if gen.weights.staged_version > gen.weights.version:
        with torch.no_grad():
            for p, s in zip((p for _, p in gen.model.named_parameters()), gen.weights.staged):
                p.copy_(s)
        take_weights(gen, gen.weights.staged_version)


def take_weights(gen, version):
    """The model holds `version` now: forget the resume copies of older batches (no checkpoint of
    theirs is asked for any more)."""
    gen.weights.version = version
    gen.prompts.forget_before(version)

# -----------------------------------------------------------------------------
# a generator rank's life


def run_generator(ctx, args, model, tokenizer, problems, prompt_ids, ckpt, state, val, val_ids):
    """A generator rank's whole life, until the trainers say stop; ckpt, state: the checkpoint it
    resumes (None, {}: a new run)."""
    g, start_version = ctx.rank - ctx.n_trainers, state.get("step", 0)
    # over data.Prompts' share: every n_gens-th prompt from g
    saved = resumed_curriculum(ckpt, state, ctx.rank, len(range(g, len(problems), ctx.n_gens)))
    gen = new_gen_state(args, model, tokenizer, problems, prompt_ids, g, ctx.n_gens, start_version,
                        lambda group: send_group(ctx, gen, group), saved)
    gen.rank = RankState([0] * ctx.n_trainers)
    gen.evals = EvalShare(val, val_ids, report=lambda v, records: ctx.store.set(
        f"eval/{v}/{ctx.rank}", json.dumps(records)))
    say = lambda line: print(f"generator rank {ctx.rank}: {line}", flush=True)  # noqa: E731
    start_sampler(gen, start_version, ctx.k, say)
    set_status(ctx, "generating")
    try:
        while True:
            generate_round(ctx, gen)
    except Stopped:
        pass
    publish_stats(ctx, gen, force=True)
    ctx.store.add("generators_done", 1)
    set_status(ctx, "waiting for trainers to take the last rollouts")
    for _, work, _ in gen.rank.sends:
        work.wait(timedelta(seconds=ctx.timeout))


def admit_ranked(ctx, gen, gis):
    items = admit(gen, gis)
    if gen.sampling.exhausted and not get_int(ctx, "exhausted"):
        ctx.store.add("exhausted", 1)
    return items


def wait_idle(ctx, gen, ready, what):
    """wait_until ready(), the time counted idle."""
    r = gen.rank
    r.idle_since = time.time()
    wait_until(ctx, ready, what)
    r.idle += time.time() - r.idle_since
    r.idle_since = None


def poll(ctx, gen, apply=True):
    """Stop? New weights? An eval asked? -> the weights version in the model."""
    w, e = gen.weights, gen.evals
    if time.time() - gen.rank.last_poll < 0.01:
        return w.version
    gen.rank.last_poll = time.time()
    stop_requested(ctx)  # first: a stop after a signal exits with the signal's status
    if ctx.store.get("stop") == b"1":
        raise Stopped
    send_state(ctx, gen)
    version = int(ctx.store.get("version"))
    if apply and version > max(w.version, w.staged_version):
        update_weights(ctx, gen, version)
    if (e.version is None and w.version not in e.evaluated
            and ctx.store.check([f"eval_request/{w.version}"])):
        e.start(w.version, gen.args.eval_samples, gen.index, gen.n_gens)
    publish_stats(ctx, gen)
    return w.version


def send_state(ctx, gen):
    """A checkpoint under way (trainer 0's save_request): this generator's curriculum at its step,
    into the store for trainer 0 to save. Every batch before that step is verified and recorded (its
    groups were trained), and no later weights came yet: the copy held for that step is final."""
    if not ctx.store.check(["save_request"]):
        return
    step = int(ctx.store.get("save_request"))
    if step != gen.rank.sent_state:
        ctx.store.set(f"genstate/{step}/{ctx.rank}", json.dumps(gen.prompts.state_at(step)
                                                                 .state_dict()))
        gen.rank.sent_state = step


def publish_stats(ctx, gen, force=False):
    now, r = time.time(), gen.rank
    if force or now - r.last_stats > 0.1:
        r.last_stats = now
        idle = r.idle + (now - r.idle_since if r.idle_since else 0.0)
        ctx.store.set(f"genstats/{ctx.rank}", json.dumps({
            "wall": now - r.t0, "idle": idle, "sync": r.sync, "tokens": gen.sampling.tokens,
            "retired": len(gen.prompts.curriculum.retired), "epoch": gen.prompts.curriculum.epoch,
            "peak_gb": peak_gb(gen.model, reset=False)}))


def send_group(ctx, gen, group):
    """A verified group to its trainer (isend); forget the sends already received."""
    r, dst = gen.rank, trainer_of(group["gi"], ctx.prompts, ctx.n_trainers)
    rows = pack_group(ctx.rank, group, ctx.length)
    r.sends.append((dst, dist.isend(rows, dst=dst, group=ctx.rollouts, tag=1), rows))
    ctx.store.add(f"sent/{dst}", 1)
    # an isend's rows must live until received; past twice what can be in flight, forget those
    # the trainers counted (rarely: a store read per trainer)
    if len(r.sends) > 2 * math.ceil((ctx.k + 1) * ctx.prompts / ctx.n_gens):
        for t in range(ctx.n_trainers):
            done = get_int(ctx, f"received_from/{ctx.rank}/{t}")
            for x in [x for x in r.sends if x[0] == t][:done - r.pruned[t]]:
                x[1].wait()
                r.sends.remove(x)
                r.pruned[t] += 1

