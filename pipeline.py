"""
pipeline.py: generator ranks and trainer ranks under torch.distributed (arXiv 2510.13786,
section 3.1: PPO-off-policy-k and PipelineRL-k).

`torchrun --nproc_per_node W train.py` starts W ranks; train.py calls setup() here, which splits
them: ranks 0..T-1 are trainers (rank 0 also logs and checkpoints), ranks T..W-1 are
generators, which also run the held-out evals (--gen_ranks, default W - max(1, W // 4): 1 of 2,
3 of 4, 6 of 8; the paper used 64 of 80).

    generators
        --(whole groups: ids, gen log-probs, masks, versions, rewards; gloo p2p)------>  trainers
    trainer 0
        --(all weights, flat buckets, broadcast after every optimizer step)---------->  generators
    trainers
        <-(gradients all-reduced: data parallel, every trainer holds the full model)->  trainers

Three modes (--mode), one mechanism:
- pipeline (PipelineRL-k, ScaleRL's choice): generators never stop. Between two decode steps a
  generator picks up new weights (the KV cache of its running sequences stays) and stamps every
  token with the version that produced it. As in the paper (section 3.1), the trainers wait if they
  get k steps ahead of the generators (k = --max_lag, 8 in ScaleRL). Every prompt group has a global
  index gi; batch s (the batch trainer step s + 1 trains on) is groups s*B .. s*B + B - 1
  (B = --prompts), and each trainer takes exactly its share of them, waiting for late ones. A
  generator with weights version v starts group gi only if gi // B <= v + k (admit_ok), so no token
  trained at version s is older than s - k: the lag bound holds by back-pressure and nothing is
  dropped (`too_old` counts violations: always 0). Generator g owns every n_gens-th index (gi = g,
  g + n_gens, ...), so no index is taken twice.
- ppo_offpolicy (PPO-off-policy-k): generators produce k batches with frozen weights, wait while the
  trainers take k steps on them, then receive the new weights. Lag is 0..k-1.
- sync: ppo_offpolicy with k = 1 (generate one batch, train one step).

Control plane and data plane. Small state (weight version, counters of groups sent and received,
heartbeats, each rank's status) lives in the torch.distributed TCP store. Tensors go through
torch.distributed: rollouts by gloo isend/irecv (CPU tensors; a receiver posts a recv only once the
store says a message is waiting, so no receive can wait on a message that was never sent), weights
and gradients over nccl on CUDA (gloo on CPU). GPUs are dealt round-robin over the local ranks, so
ranks may share one (one GPU, two ranks: generator and trainer side by side); a group whose ranks
share a GPU talks over gloo, which nccl cannot do (device_plan; rank 0 logs the plan).

Nothing hangs: every cross-rank wait has a deadline (--timeout) and names what it waited for
(in the frozen modes, where trainer 0 runs the held-out evals, the others wait on the store
meanwhile, past the deadline); a heartbeat thread in every rank bumps a counter in the store and
watches the others': a rank that is dead or stopped (SIGKILL, SIGSTOP, a crash) is named within
--heartbeat_timeout seconds (default 60) and every other rank exits with status 1. A finished run
drains the rollouts in flight and exits cleanly.

Readings chosen:
- "Lag" of a token = the trainer's policy version when it trains on it minus the version that
  sampled it.
- Data-parallel trainers all-reduce (sum) their gradients, each having scaled its loss by its share
  of the global batch (prompt groups, samples or tokens, per --agg): the gradient is exactly the
  single-trainer full-batch gradient. The batch-normalized advantage uses the std of the whole
  batch (all trainers). Hand-written instead of DDP's wrapper, which needs every forward to go
  through it; here the loss runs the decoder and the float32 head separately (generate.py).
- --fsdp shards the trainers' model and AdamW state over the trainer ranks with FSDP2 (fully_shard:
  each decoder layer one unit, embedding + norm + head one unit, around a LogProbs module whose
  forward is the loss's). Gradients are reduce-scattered as sums, like the replicas' all-reduce, so
  the steps are the same (tested). The trainers make the weights whole one parameter, or one
  broadcast bucket, at a time for each broadcast, eval and checkpoint (whole_weights); no trainer
  keeps a whole copy. A checkpoint's model folder holds the whole weights; each trainer writes and
  reads back its own float32 shards and AdamW state (torch.distributed.checkpoint).
- Curriculum: each generator owns the prompts i with i % n_generators == its index and runs
  No-Positive-Resampling on them; its state (curriculum-rankN.json) is saved next to the trainer's
  checkpoints.
- One process runs the same generator code (LocalRollouts: admit, sampler step, verify, send) over
  an in-process queue; a trainer rank reads the generators' groups (RemoteRollouts).
- Compute (compute_s) = training wall-clock x world size: every device is counted, busy or not.

    LOCAL="--rdzv-backend c10d --rdzv-conf store_type=file --local-addr 127.0.0.1"  # loopback
    torchrun $LOCAL --nproc_per_node 2 train.py
        # 1 generator + 1 trainer, CPU, gloo
    torchrun $LOCAL --nproc_per_node 4 train.py --gen_ranks 2 --fsdp
        # 2 generators + 2 trainers, model and AdamW state sharded over the trainers
    torchrun $LOCAL --nproc_per_node 2 train.py --mode ppo_offpolicy
        # PPO-off-policy-8 (k = --max_lag)
    torchrun $LOCAL --nproc_per_node 8 train.py --model DIR --data FILE --gen_ranks 6 --fsdp
        # one 8-GPU node, nccl, the paper's recipe
    torchrun $LOCAL --nproc_per_node 2 train.py --device cuda
        # one GPU shared by both ranks; weights over gloo
"""

import copy
import ipaddress
import json
import math
import os
import signal
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
from generate import FINISH, Sample, packed_logprobs, sampler
import generate
from loss import length_penalty

# per packed row: generator rank, group index, prompt index, prompt length, completion length,
# correct, reward, finish
HEADER = 8


_CURRENT = {}  # this process's ctx, for report_failure


class Stopped(Exception):
    """Raised inside a generator when the trainers have finished."""


STOP = {}  # set by a SIGINT / SIGTERM: {"name": "SIGINT", "at": time.time()}


def peak_gb(model, reset=True):
    """The CUDA allocator's peak since the last reset, in GB: a role's peak memory (one process:
    sampling, then the step, each counting all the process holds; a generator rank: its whole
    run). None off CUDA."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device) / 1e9
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
    return peak


def stop_on_signals():
    """SIGINT (Ctrl-C) and SIGTERM ask for a clean stop: the last step to finish is saved and the
    --resume command printed (train.py). One process drops a step still sampling and finishes one
    already training; under torchrun the trainers finish the step under way. A generator that gets
    one passes it on through the store. The handler only sets a flag (an exception raised at an
    arbitrary point, inside the sampler's generator for one, can be swallowed). A repeat within 3 s
    is the same request (under torchrun Ctrl-C reaches a rank twice: from the terminal and from
    torchrun); a later one exits at once, without saving."""
    def handler(signum, frame):
        name, quiet = signal.Signals(signum).name, int(os.environ.get("RANK", "0")) != 0
        if STOP and time.time() - STOP["at"] > 3:
            os.write(2, f"\n{name} again: exiting now, without saving\n".encode())
            os._exit(128 + signum)
        if not STOP:
            STOP.update(name=name, at=time.time())
            if not quiet:  # os.write: print() is not safe inside a signal handler
                os.write(2, f"\n{name}: stopping; the last step to finish will be saved ({name} "
                            "again, 3 s from now or later: exit at once without saving)\n".encode())
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def stop_requested(ctx):
    """Has a signal asked this run to stop: this process, or under torchrun any rank (through the
    store)?"""
    if ctx is None:
        return bool(STOP)
    if STOP and not STOP.get("told"):
        ctx.store.set("interrupted", STOP["name"])
        STOP["told"] = True
    # another rank's: this one stops as if it got it too
    elif not STOP and ctx.store.check(["interrupted"]):
        STOP.update(name=ctx.store.get("interrupted").decode(), at=time.time(), told=True)
    return bool(STOP)


def default_gen_ranks(world):
    return world - max(1, world // 4)


def n_generators(args, world):
    """--gen_ranks, or its default for `world` ranks."""
    return args.gen_ranks if args.gen_ranks > 0 else default_gen_ranks(world)


def generator_rank(args):
    """Is this process one of the generator ranks (under torchrun: the last --gen_ranks ranks)?"""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return world > 1 and int(os.environ["RANK"]) >= world - n_generators(args, world)

# -----------------------------------------------------------------------------
# set-up: roles, process groups, the store, heartbeats


@dataclass
class Context:
    """One rank's place in the run and its channels: written by setup() and the functions here
    only."""
    rank: int
    world: int
    n_trainers: int
    n_gens: int
    role: str  # "trainer" or "generator"
    device: str
    timeout: float  # --timeout: the deadline of every cross-rank wait
    mode: str  # --mode
    k: int  # the lag bound (--max_lag; 1 for sync)
    prompts: int  # groups per batch (--prompts)
    samples: int  # samples per group (--samples)
    fsdp: bool
    store: object  # the TCP store: versions, counters, statuses, heartbeats
    weights: object  # process group: trainer 0 + the generators (weight broadcast)
    trainers: object  # process group: the trainers (gradients, stats)
    rollouts: object  # process group: everyone, gloo (packed groups)
    length: int = 0  # tokens per packed sample (start())
    status: str = "starting"
    received: int = 0  # groups this trainer has received
    early: dict = field(default_factory=dict)  # groups received before their batch, by global index
    genstats_before: list = None  # the generators' counters at the last busy_metrics()
    # the generators' busy fraction and tokens/s at the last step any of them had published since
    gen_rates: dict = field(default_factory=lambda: {"gen_busy": 0.0, "gen_tok_s": 0.0})
    # _heartbeat's thread; finish() stops it before the ranks part
    heartbeat: threading.Thread = None
    stopping: threading.Event = field(default_factory=threading.Event)


def setup(args):
    """Join the process group started by torchrun -> this rank's Context, or None for one
    process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return None
    rank = int(os.environ["RANK"])  # devices: device_plan over the local ranks
    n_gens = n_generators(args, world)
    n_trainers = world - n_gens
    if not 1 <= n_gens < world:  # checked before any rank waits on another
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
    else:  # ranks on one machine share its cores
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
    ctx.heartbeat = threading.Thread(target=_heartbeat, args=(ctx, args.heartbeat_timeout),
                                     daemon=True)
    ctx.heartbeat.start()
    _CURRENT["ctx"] = ctx
    return ctx


def own_store(rank, world, timeout):
    """The TCP store of the ranks when no launcher hosts it (torchrun's does unless
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): rank 0 hosts it on a socket bound to MASTER_ADDR alone,
    since torch's TCPStore server listens on every interface whatever address it is given, and
    whoever reaches a store can read and set its keys (stop or corrupt the run). None where the
    launcher hosts it (init_process_group joins that one). On a loopback MASTER_ADDR (one machine)
    gloo and nccl listen on the loopback interface too (unless GLOO_SOCKET_IFNAME /
    NCCL_SOCKET_IFNAME say otherwise)."""
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
            listening = server.detach()  # the store's from here
    return dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout,
                         master_listen_fd=listening)


def start(ctx, version, length):
    """Every rank, once the model is loaded: rank 0 publishes the starting weights `version` (the
    resumed step); rollouts travel as packed rows of `length` tokens per sample."""
    ctx.length = length
    if ctx.rank == 0:
        ctx.store.set("version", str(version))
        ctx.store.set("stop", "0")
    dist.barrier(group=ctx.rollouts)


def device_plan(world, local_world, n_gpus, trainers, gens):
    """Which device each rank uses and which backend each process group talks over.

    On GPUs, local rank i takes GPU i % n_gpus (round-robin), so several ranks may share one GPU
    (one GPU, `torchrun --nproc_per_node 2`: generator and trainer side by side, as colocated
    set-ups do). NCCL cannot join two ranks on the same GPU in one communicator, so a group whose
    ranks share a GPU talks over gloo (it moves CUDA tensors through host memory: slower, but it
    works); the others keep NCCL. Without GPUs everything is gloo on the CPU. -> {devices, name,
    default, weights, trainers, line}."""
    ranks = range(world)
    if not n_gpus:
        return {"devices": [None] * world, "name": ["cpu"] * world, "default": "gloo",
                "weights": "gloo", "trainers": "gloo",
                "line": f"devices: {world} ranks on the CPU, every group over gloo"}
    devices = [(r % local_world) % n_gpus for r in ranks]
    # (node, GPU): what must differ inside one NCCL group
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


def role_of(ctx, r):
    return f"rank {r} ({'trainer' if r < ctx.n_trainers else 'generator'})"


def set_status(ctx, text):
    ctx.status = text
    ctx.store.set(f"status/{ctx.rank}", text)


def get_int(ctx, key):
    return int(ctx.store.add(key, 0))  # add 0: reads a counter, and a missing counter reads 0


def _heartbeat(ctx, limit):
    """Bump this rank's counter every second; exit the process if another rank's stops moving. Ends
    when finish() sets ctx.stopping, or once any rank has finished (ranks then leave at their own
    pace). A store whose host is stopped (rank 0 under the README's one-machine torchrun, which
    hosts it) answers nothing, and its clients wait without end: measured, a SIGSTOPped trainer 0
    froze the generator for as long as it stayed stopped, with no line. So the loop has a deadline
    of its own, kept by _store_watchdog."""
    store, me, world = ctx.store, ctx.rank, ctx.world
    last = {r: (-1, time.time()) for r in range(world) if r != me}
    beat = [time.time()]  # when the loop last began a round
    threading.Thread(target=_store_watchdog, args=(ctx, limit, beat), daemon=True).start()
    try:
        while not ctx.stopping.is_set():
            beat[0] = time.time()
            store.add(f"heartbeat/{me}", 1)
            if int(store.add("finished", 0)):
                beat[0] = math.inf
                return  # a clean shutdown is under way: ranks leave at their own pace
            for r, (count, since) in last.items():
                now = int(store.add(f"heartbeat/{r}", 0))
                if now != count:
                    last[r] = (now, time.time())
                elif time.time() - since > limit:
                    status = (store.get(f"status/{r}").decode() if store.check([f"status/{r}"])
                              else "?")
                    _die(f"{role_of(ctx, r)} sent no heartbeat for {limit:.0f} s (dead or stopped; "
                         f"its last status: {status}); {role_of(ctx, me)} was {ctx.status}")
            ctx.stopping.wait(1.0)
    except Exception as err:  # the store is hosted by rank 0 or the launcher: one of them is gone
        _die(f"lost the rendezvous store ({err}); rank 0 or the launcher probably died; "
             f"{role_of(ctx, me)} was {ctx.status}")


def _store_watchdog(ctx, limit, beat):
    """Exit the process when the heartbeat loop has not begun a round for `limit` seconds: its
    store calls hang, so the store's host (rank 0, or the launcher) is stopped or hung."""
    while not ctx.stopping.wait(1.0):
        if time.time() - beat[0] > limit:
            _die(f"the rendezvous store did not answer for {limit:.0f} s: its host, "
                 f"{role_of(ctx, 0)} or the launcher, is stopped or hung; "
                 f"{role_of(ctx, ctx.rank)} was {ctx.status}")


def report_failure(err):
    """Called as a rank fails: name what it was doing and which ranks stopped answering (those whose
    heartbeat does not move for 3 s), so a gloo 'connection reset' says who is gone."""
    ctx = _CURRENT.get("ctx")
    if ctx is None:
        return
    store, me = ctx.store, ctx.rank
    try:
        before = {r: int(store.add(f"heartbeat/{r}", 0)) for r in range(ctx.world) if r != me}
        time.sleep(3.0)
        gone = [f"{role_of(ctx, r)}, last status: "
                f"{store.get(f'status/{r}').decode() if store.check([f'status/{r}']) else '?'}"
                for r, n in before.items() if int(store.add(f"heartbeat/{r}", 0)) == n]
    except Exception:
        gone = ["the rendezvous store (rank 0 or the launcher)"]
    line = (f"{role_of(ctx, me)} failed while {ctx.status}: {type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}; "
            f"not responding: {'; '.join(gone) or 'none'}")
    record_error(line)
    print(f"ERROR: {line}", file=sys.stderr, flush=True)


def record_error(line, later=False, shown=None):
    """Under torchrun: the one line this rank fails with (a user error; why it stopped waiting for
    another rank; what it was doing as it crashed) into its error file (TORCHELASTIC_ERROR_FILE,
    which torchrun sets), in the form of torch's ErrorHandler, so that torchrun's failure report
    shows it where it would say "To enable traceback see: ...". later: stamped 10 s later, so that
    another rank's line is the report's root cause (its first failure); shown: what the report
    prints instead of the line. -> whether the file was written (nothing outside torchrun)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    # the report shows py_callstack
    info = {"py_callstack": line if shown is None else shown,
            "timestamp": str(int(time.time()) + 10 * bool(later))}
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": info}}, f)
        return True
    except OSError:
        return False


def say_error(line):
    """A user error's one line, which every rank meets: said once. Under torchrun rank 0's error
    file holds it, shown by torchrun's failure report last, as its root cause, on a line of its
    own; the other ranks' files point to it. Printed where no such file is written."""
    if int(os.environ.get("RANK", "0")) != 0:
        record_error("the same error as rank 0 (the root cause, below)", later=True)
    elif not record_error(line, shown="\n" + line):
        print(line, file=sys.stderr, flush=True)


def _die(message):
    record_error(message)
    print(f"ERROR: {message}; exiting", file=sys.stderr, flush=True)
    os._exit(1)


def wait_until(ctx, ready, what, status=None):
    """Poll ready() until true; a deadline of --timeout seconds, then an error naming what was
    awaited. The deadline does not run out while trainer 0 evaluates or waits for the generators'
    eval, nor while the generators' held-out evals make progress (they share the generators' time
    with training groups); a stuck eval still runs it out. status: this rank's status meanwhile
    (default: waiting for `what`)."""
    set_status(ctx, status or f"waiting for {what}")
    t0, pause, evals = time.time(), 0.0005, get_int(ctx, "eval_progress")
    while not ready():
        if time.time() - t0 > ctx.timeout:
            now = get_int(ctx, "eval_progress")  # the generators' held-out samples done
            if now != evals or (ctx.store.check(["status/0"])
                                and ctx.store.get("status/0").startswith(b"evaluating")):
                t0, evals = time.time(), now
                continue
            raise TimeoutError(
                f"{role_of(ctx, ctx.rank)} waited {ctx.timeout} s for {what} (--timeout)")
        time.sleep(pause)
        pause = min(2 * pause, 0.02)
    return time.time() - t0


def on_trainer0(ctx, step, evaluate):
    """A held-out eval of `step`: trainer 0 runs evaluate() (one process: it is trainer 0); the
    other trainers wait for it on the store, not in a collective, and meanwhile trainer 0's status
    keeps every rank's wait from running out (wait_until), however long the eval takes."""
    if ctx is None:
        return evaluate()
    if ctx.rank != 0:
        return wait_for_eval(ctx, step)
    set_status(ctx, f"evaluating step {step}")
    evaluate()
    done_evaluating(ctx, step)


def done_evaluating(ctx, step):
    """Trainer 0, after its held-out eval of `step` (meanwhile its status said "evaluating", which
    keeps the other ranks' waits from running out: wait_until): the other trainers may go on
    (wait_for_eval)."""
    set_status(ctx, f"evaluated step {step}")
    ctx.store.set("evaluated", str(step))


def wait_for_eval(ctx, step):
    """Trainers other than trainer 0 wait here, not in a collective (whose deadline would run out),
    while trainer 0 evaluates step `step`."""
    wait_until(ctx,
               lambda: ctx.store.check(["evaluated"]) and int(ctx.store.get("evaluated")) >= step,
               f"trainer 0's held-out eval at step {step}")


def finish(ctx):
    """Clean shutdown, called by every rank at its end. The heartbeat thread is stopped and joined
    first: left running, it could be inside a store call when rank 0 (the store's host) exits, and
    abort the process."""
    set_status(ctx, "finished")
    ctx.store.add("finished", 1)
    ctx.stopping.set()
    ctx.heartbeat.join(timeout=ctx.timeout)
    dist.barrier(group=ctx.rollouts)
    dist.destroy_process_group()

# -----------------------------------------------------------------------------
# data plane: packed groups, weight broadcast, gradient all-reduce


def admit_ok(gi, version, k, prompts):
    """PipelineRL-k: may a generator whose weights are `version` start group gi? Only if the batch
    it belongs to (gi // prompts) is at most k steps ahead, so its oldest token is at most k
    versions old when a trainer takes it. What happens to a sample older than k: it is never made. A
    generator k batches ahead waits for new weights instead of sampling (the trainers'
    back-pressure); nothing is sampled and then dropped (receive_groups counts violations as
    too_old, and tests keep it 0)."""
    return gi // prompts <= version + k


def trainer_of(gi, prompts, n_trainers):
    """The trainer that trains group gi: each trainer takes prompts / n_trainers groups of every
    batch."""
    return (gi % prompts) % n_trainers


def pack_group(gen_rank, group, length):
    """One prompt's group (finish_group's dict) -> float32 (G, HEADER + 4 * length): header |
    prompt+completion ids | gen log-probs | mask | versions (the last three aligned with the
    completion). Ids and versions are exact in float32 below 2**24; the reward travels as
    float32."""
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
    """Inverse of pack_group -> dict(gen_rank, gi, index, prompt, samples, correct, rewards)."""
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
    """The model's tensors (tied ones once, named_parameters order) in consecutive same-dtype
    buckets of at most bucket_mb."""
    buckets, size = [], 0
    for t in tensors:
        if not buckets or buckets[-1][-1].dtype != t.dtype or size + t.nbytes > bucket_mb * 2 ** 20:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += t.nbytes
    return buckets


def whole_weights(model, dtype=None):
    """The model's parameters in named_parameters order, made whole one at a time: a sharded
    (FSDP2) one is all-gathered, a collective over the trainers, its shard cast to `dtype` first
    (when given: half the bytes move for bf16); at most one whole parameter exists at a time."""
    for _, p in model.named_parameters():
        yield whole(p if dtype is None else p.to(dtype))


def whole(t):
    """A sharded tensor (a DTensor, under --fsdp) made whole, a collective over the trainers;
    any other tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@torch.no_grad()
def send_weights(ctx, model, bucket_mb, dtype):
    """Trainer 0 broadcasts the model's weights to the generators in `dtype`, bucket by bucket, cut
    as broadcast_weights cuts them on the generators' side; under FSDP2 every trainer takes part in
    making each parameter whole (whole_weights) only as its bucket goes out, so one bucket of whole
    weights exists at a time, not the model. -> bytes sent (0 on the other trainers)."""
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
    """A generator's side of one weight broadcast (trainer 0's: send_weights): received, bucket by
    bucket, into its model's parameters, or into `into` (tensors of their shapes: stage_weights)
    -> bytes moved."""
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


GRAD_BUCKET_MB = 64  # all_reduce_grads: a bucket's float32 copy, not every gradient's at once


def all_reduce_grads(ctx, params, bucket_mb=GRAD_BUCKET_MB):
    """Sum the trainers' gradients of `params` (each already scaled by its share of the global
    batch), once per step, bucket by bucket, in float32: bf16 gradients are rounded once, after the
    sum, not at every step of the reduction."""
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
    """Sum (and max) small dicts of numbers over the trainer ranks."""
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
# rollout sources: where the training loop gets its groups and sends its weights. Chosen once at
# start-up (train.rollout_source): the loop reads the same with one process and under torchrun.


class LocalRollouts:
    """One process: the generator code that generator ranks run (admit, sampler_step,
    finish_group) runs here, as generator 0 of 1 under --mode sync: get(step) samples batch `step`
    (its groups step*B .. step*B + B - 1) with the weights of version `step` and returns it whole;
    the sampler reads the trainer's own weights, so publish() has nothing to send. `python train.py`
    and `torchrun ... --mode sync` are the same experiment (tested)."""

    def __init__(self, args, model, tokenizer, problems, prompt_ids, version, saved=None):
        self.args, self.done, self.said = args, [], False
        self.gen = new_generator(args, model, tokenizer, problems, prompt_ids, 0, 1, version,
                                 self.done.append, saved)
        self.share = args.prompts  # the groups a full batch gives this trainer

    def say(self, line):
        """The sampler's size, said once."""
        print(line, flush=True)
        self.said = True

    def get(self, step):
        """Batch `step` -> (groups in index order, stats); fewer groups once the curriculum has
        retired every prompt; (None, None) when a signal stops the sampling under way (nothing of
        it is used, and the curriculum saved is the one from before it: state_dict)."""
        gen, t0 = self.gen, time.time()
        B = self.args.prompts
        peak_gb(gen.model)  # the peak from here is this sampling's
        items = admit(gen, range(step * B, (step + 1) * B))
        if gen.exhausted:
            return [], {}
        start_sampler(gen, step, say=None if self.said else self.say)
        sampler_step(gen, items, step)
        while gen.open:
            if STOP:
                return None, None
            sampler_step(gen, [], step)
        gen.steps.close()  # its KV cache is freed before the step trains
        sampled = time.time()
        finish_groups(gen, wait=True)  # the verification not done beside the sampling
        groups = sorted(self.done, key=lambda g: g["gi"])
        self.done.clear()
        stats = {"too_old": 0, "wait_s": 0.0, "gen_s": sampled - t0,
                 "verify_s": time.time() - sampled, "retired": len(gen.curriculum.retired),
                 "epoch": gen.curriculum.epoch, "gen_peak_gb": peak_gb(gen.model),
                 "gen_tokens": sum(len(g["prompt"]) + len(s.tokens) for g in groups
                                   for s in g["samples"])}
        return groups, stats

    def publish(self, trainer, last, evaluate=False):
        """The weights are the trainer's own: nothing moves; the curriculum copies that a resume
        before this version would need are dropped. -> (seconds, bytes)."""
        self.gen.snapshots = {b: c for b, c in self.gen.snapshots.items() if b >= trainer.version}
        return 0.0, 0

    def stop_requested(self):
        return bool(STOP)

    def held_out(self, step, trainer, evaluate, stamp):
        """A held-out eval of `step`: evaluate(model), here and now."""
        evaluate(trainer.eval_model())

    def evals_done(self, wait=False):
        return []

    def busy(self, dt, rstats, train_s, sync_s, sync_bytes):
        """One process alternates: busy generating and verifying (rstats' seconds), then
        training."""
        return {"retired": rstats["retired"], "epoch": rstats["epoch"],
                "gen_busy": (dt - train_s) / dt, "train_busy": train_s / dt, "sync_ms": 0.0,
                "generate_ms": rstats["gen_s"] * 1000, "verify_ms": rstats["verify_s"] * 1000,
                "train_ms": train_s * 1000,
                **({"gen_peak_gb": rstats["gen_peak_gb"]} if rstats["gen_peak_gb"] else {})}

    def uncounted(self):
        return 0.0  # evals run between steps, outside them

    def state_dict(self, version):
        """The curriculum a resume at `version` starts from."""
        return {"curriculum": self.gen.snapshots.get(version, self.gen.curriculum).state_dict()}

    def close(self, version):
        pass


class RemoteRollouts:
    """A trainer rank: its share of every batch comes from the generator ranks (receive_groups),
    and trainer 0 broadcasts the weights after every step (publish_weights). Generators keep their
    own curriculum files."""

    def __init__(self, ctx, args):
        self.ctx, self.args = ctx, args
        self.share = args.prompts // ctx.n_trainers
        # PipelineRL: the generators run the held-out evals, with the weights of the step they
        # evaluate, and training goes on meanwhile; the frozen modes evaluate on trainer 0
        self.on_generators = ctx.mode == "pipeline"
        self.pending = []  # trainer 0: the evals asked of the generators, (step, stamp), in order
        self.eval_wait = 0.0  # trainer 0: this step's seconds waited while the generators evaluate

    def get(self, step):
        evaluating = bool(self.pending)  # trainer 0: the generators owe it an eval
        groups, stats = receive_groups(self.ctx, step)
        self.eval_wait = stats["wait_s"] if evaluating else 0.0
        return groups, stats

    def publish(self, trainer, last, evaluate=False):
        """After a step: its weights to the generators (publish_weights). evaluate: they run a
        held-out eval of this version, asked before they get it, so none takes a newer one first
        (while one runs, a generator keeps the newer weights on the host until it is done); the
        generators evaluate one version at a time, so trainer 0 first waits for the eval before
        (a wait only when evals take longer than --eval_every steps; the other trainers go on,
        up to a batch they lack, or under --fsdp the broadcast's gather). After the last step the
        weights go out for its eval alone."""
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
        """A held-out eval of `step`: asked of the generators (stamp: the compute at `step`, for
        its log line once its results are in: evals_done), or evaluate(model) on trainer 0 while
        the other trainers wait."""
        if not self.on_generators:
            model = trainer.eval_model(self.ctx.device)  # --fsdp: a collective, every trainer
            return on_trainer0(self.ctx, step, lambda: evaluate(model))
        if self.ctx.rank == 0:
            self.ctx.store.set(f"eval_request/{step}", "1")  # step 0, or an early end's last step
            self.pending.append((step, stamp))

    def evals_done(self, wait=False):
        """Trainer 0: the generators' evals whose every share is in, in order -> [(step, records,
        stamp)]; wait: all of them (while they run, trainer 0's status keeps the other ranks'
        waits from running out)."""
        ctx, done = self.ctx, []
        gens = range(ctx.n_trainers, ctx.world)
        while self.pending and (wait or self.eval_ready(self.pending[0][0])):
            step, stamp = self.pending.pop(0)
            self.wait_for_eval(step)
            records = [x for r in gens for x in json.loads(ctx.store.get(f"eval/{step}/{r}"))]
            done.append((step, records, stamp))
        return done

    def eval_ready(self, step):
        """Has every generator reported its share of the eval of `step`?"""
        return self.ctx.store.check([f"eval/{step}/{r}"
                                     for r in range(self.ctx.n_trainers, self.ctx.world)])

    def wait_for_eval(self, step):
        """Trainer 0 waits for the generators' eval of `step` (its status keeps the other ranks'
        waits from running out meanwhile: the eval has no deadline of its own)."""
        if not self.eval_ready(step):
            wait_until(self.ctx, lambda: self.eval_ready(step),
                       f"the generators' held-out eval of step {step}",
                       status=f"evaluating: waiting for the generators' eval of step {step}")

    def busy(self, dt, rstats, train_s, sync_s, sync_bytes):
        return {**busy_metrics(self.ctx, dt, rstats, train_s, sync_s, sync_bytes),
                "eval_wait_ms": self.eval_wait * 1000}

    def uncounted(self):
        """This step's seconds that are not compute: trainer 0's waits while the generators run a
        held-out eval (for rollouts, or for the eval itself), as the frozen modes' evals on
        trainer 0 are not compute either."""
        return self.eval_wait

    def state_dict(self, version):
        return {}

    def close(self, version):
        """After the last step: drain the generators, then leave with the other ranks."""
        drain(self.ctx, version)
        finish(self.ctx)

# -----------------------------------------------------------------------------
# the trainer's side of the ranks


def _receive_one(ctx):
    """The next packed group sent to this trainer (the store said one is waiting) -> rows."""
    rows = torch.empty(ctx.samples, HEADER + 4 * ctx.length)
    dist.irecv(rows, src=None, group=ctx.rollouts, tag=1).wait(timedelta(seconds=ctx.timeout))
    ctx.received += 1
    return rows


def receive_groups(ctx, step):
    """This trainer's share of batch `step` (groups step*B .. step*B + B - 1 with
    trainer_of == rank), in index order, waiting for late ones; groups of later batches that arrive
    first are kept in ctx.early. -> (groups, stats); fewer groups only when generators ran out of
    prompts. Nothing is dropped: too_old counts groups with a token more than k versions old
    (admit_ok makes it 0)."""
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
            break  # a generator has no prompts left
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
    """After each optimizer step: announce version `step`, trainer 0 broadcasts (send_weights;
    sharded trainers all take part in making the weights whole) -> (seconds, bytes).
    ppo_offpolicy/sync: only every k steps. After the last step: no broadcast."""
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
    if str(ctx.device).startswith("cuda"):  # nccl returns once the transfer is queued: time its end
        torch.cuda.synchronize(ctx.device)
    return time.time() - t0, nbytes


class LogProbs(torch.nn.Module):
    """The trainer's forward (decoder, then the float32 head in chunks: generate.packed_logprobs)
    as one module, so that FSDP2's hooks around its forward gather the embedding, final norm and
    head (a call to model.model alone would find them sharded)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, lens, fp32_head, temperature, checkpoint_layers=None):
        return packed_logprobs(self.model, ids, lens, fp32_head, temperature,
                               checkpoint_layers=checkpoint_layers)


def shard_trainer(model, trainers, device, dtype=torch.float32):
    """--fsdp: shard the model over the process group `trainers` with FSDP2 (each decoder layer one
    unit, the rest one unit) -> the LogProbs module to call for the loss. Gradients are summed
    across trainers, not averaged: each trainer's loss is already weighted by its share of the
    global batch. The shards stay float32 (AdamW's master weights); the forward and backward run on
    weights gathered in `dtype`, the gradients are reduced in float32."""
    # imported here, as in the other --fsdp functions: FSDP2, DTensor and distributed checkpoints
    # cost each rank ~1 CPU-s of imports at start, which a run without --fsdp need not pay
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    mesh = DeviceMesh.from_group(trainers, "cuda" if str(device).startswith("cuda") else "cpu")
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    wrapped = LogProbs(model)
    fully_shard(wrapped, mesh=mesh, mp_policy=mp)
    for m in wrapped.modules():
        if isinstance(m, FSDPModule):  # per unit: the setting is not inherited
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return wrapped


def fsdp_sync_once(n_params, device_bytes):
    """--fsdp: whether a trainer sums its micro-batches' gradients unsharded (in float32, 4 bytes a
    parameter) and reduce-scatters once a step (FSDP2's set_requires_gradient_sync), or
    reduce-scatters after every micro-batch: once where those gradients take at most an eighth of
    the device (a 0.5B-1.5B model on 80 GB; not a 7B: 30 GB, the memory sharding exists to save)."""
    return 4 * n_params <= device_bytes / 8


def device_bytes(device):
    """The device's memory: a GPU's, or on CPU the machine's."""
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def sharded_state(model, opt):
    """--fsdp: this trainer's float32 shards and their AdamW state, as torch.distributed.checkpoint
    saves and loads them (each trainer its own part; nothing is gathered)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    weights, optimizer = get_state_dict(model, opt)
    return {"model": weights, "optimizer": optimizer}


def set_sharded_state(model, opt, state):
    """--fsdp on resume: the shards loaded (sharded_state's) into the model and the optimizer."""
    from torch.distributed.checkpoint.state_dict import set_state_dict
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def generator_stats(ctx):
    """Each generator's latest published counters (busy seconds, tokens, ...)."""
    store, out = ctx.store, []
    for r in range(ctx.n_trainers, ctx.world):
        out.append(json.loads(store.get(f"genstats/{r}")) if store.check([f"genstats/{r}"]) else {})
    return out


def busy_metrics(ctx, dt, rstats, train_s, sync_s, sync_bytes):
    """Trainer 0's per-step view of both roles: busy fractions since the last step, sync speed,
    tokens/s."""
    wait_s = rstats["wait_s"]
    now = generator_stats(ctx)
    before = ctx.genstats_before or [{}] * len(now)
    d = [{key: s.get(key, 0.0) - b.get(key, 0.0) for key in ("wall", "idle", "sync", "tokens")}
         for s, b in zip(now, before)]
    # a generator publishes at most every 0.1 s: one that has not since the last step keeps its
    # old counters here (the next difference spans both steps), and the last rates stand
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
    """After the last step (`step`: the last one trained): stop the generators, take every group
    still in flight, so they exit cleanly; each saves its curriculum as it was for a resume at
    `step`."""
    if ctx.rank == 0:
        ctx.store.set("last_step", str(step))
        ctx.store.set("stop", "1")
    wait_until(ctx, lambda: get_int(ctx, "generators_done") == ctx.n_gens, "the generators to stop")
    while get_int(ctx, f"sent/{ctx.rank}") > ctx.received:
        _receive_one(ctx)

# -----------------------------------------------------------------------------
# a generator: the same code on a generator rank and inside the one-process loop


@dataclass
class Generator:
    """A generator's state, shared by the functions after it. `send` says where a finished, verified
    group goes: to its trainer rank (run_generator) or back to the one-process loop
    (LocalRollouts)."""
    args: object
    model: object  # the weights it samples with (new ones are copied in: poll)
    tokenizer: object
    problems: list  # every training problem, and their prompts as token ids
    prompt_ids: list
    index: int  # g: this generator's index among the generators
    n_gens: int
    mine: list  # the problems it owns (i % n_gens == g); its curriculum picks among them
    curriculum: Curriculum
    send: object  # send(group): where a finished group goes
    start_version: int  # the weights version it started from (the resumed step)
    version: int  # the weights version now in its model
    steps: object = None  # the sampler: steps.send((new items, version)) -> (finished, free slots)
    slots: int = 0  # the sampler's rows
    free: int = 0  # free sampler slots
    admitted: int = 0  # groups started since start_version
    exhausted: bool = False  # its curriculum has retired every prompt
    # global index gi -> {"c": curriculum slot, "samples": [G]}
    open: dict = field(default_factory=dict)
    # batch b -> the curriculum for a resume at step b (see admit)
    snapshots: dict = field(default_factory=dict)
    tokens: int = 0  # completion tokens generated
    # groups sampled, being verified beside the sampler: (gi, c, samples, future), in order
    verifying: list = field(default_factory=list)
    verifier: object = field(default_factory=lambda: ThreadPoolExecutor(max_workers=1))
    # held-out evals (a generator rank under PipelineRL): the held-out problems, the version being
    # evaluated and its samples so far, the versions done, the weights received meanwhile
    val: list = None
    val_ids: list = None
    eval_version: int = None
    eval_items: list = field(default_factory=list)  # items not yet given to the sampler
    eval_want: int = 0
    eval_done: dict = field(default_factory=dict)
    evaluated: set = field(default_factory=set)
    report_eval: object = None  # report_eval(version, records): the eval's results, to trainer 0
    staged: list = None
    staged_version: int = -1
    # a generator rank's own bookkeeping (run_generator): its sends not yet known to be received
    # (trainer, isend work, rows), per trainer the sends forgotten, where its curriculum is saved,
    # and its time: since start, idle (k batches ahead, or frozen weights), receiving weights
    sends: list = field(default_factory=list)
    pruned: list = None
    curriculum_path: str = ""
    t0: float = field(default_factory=time.time)
    idle: float = 0.0
    idle_since: float = None  # the start of a wait under way
    sync: float = 0.0
    last_poll: float = 0.0
    last_stats: float = 0.0


def new_generator(args, model, tokenizer, problems, prompt_ids, g, n_gens, version, send,
                  saved=None):
    """Generator g of n_gens, its sampler started on `model` at weights version `version`; saved:
    its curriculum's state on a resume."""
    mine, curriculum = curriculum_of(len(problems), g, n_gens, args, saved)
    return Generator(args, model, tokenizer, problems, prompt_ids, g, n_gens, mine, curriculum,
                     send, version, version)


def in_flight(args, n_gens, k):
    """The most sequences a generator can have in flight: its share of k + 1 batches (at weights
    v the lag rule, admit_ok, starts groups of batches up to v + k, and batches before v are
    trained; one process, k = 0: one batch)."""
    return math.ceil((k + 1) * args.prompts / n_gens) * args.samples


def sampler_most(args, ctx):
    """The most sequences a training run's sampler holds (the memory plan's bound): a generator
    rank's in_flight, or one process's; a held-out eval's sampler holds no more."""
    return in_flight(args, ctx.n_gens if ctx else 1, ctx.k if ctx else 0)


def start_sampler(gen, version, k=0, say=None):
    """The generator's sampler, started at weights version `version`: its slots (as many sequences
    as fit, generate.fit_slots, on CUDA at most what lag k lets it have in flight) all free; its
    prompts: the training ones and, on a generator rank, the held-out ones too."""
    longest = max(map(len, gen.prompt_ids + (gen.val_ids or [])))
    gen.steps = make_sampler(gen.model, gen.tokenizer, gen.args, longest, version, say=say,
                             most=in_flight(gen.args, gen.n_gens, k))
    _, gen.free = next(gen.steps)
    gen.slots = gen.free


def make_sampler(model, tokenizer, args, max_prompt_len, version=0, cap=None, say=None,
                 most=None):
    """generate.sampler with the run's settings: the one place train.py's flags reach the
    sampler (training rollouts and held-out evals alike). Its slots: on CUDA as many sequences as
    --gen_memory of the free memory holds at their mean length (generate.fit_slots: say(line) says
    how many), at most --slots, cap and most (the sequences it can have in flight); elsewhere
    --slots (128 by default), at most cap."""
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


def sample_all(steps, items, stop=None):
    """Run a sampler made by make_sampler over `items` [(prompt ids, noise key, tag)] until every
    one has finished -> {tag: Sample}; None once stop() is true (polled between decode steps)."""
    next(steps)
    out, new = {}, items
    while len(out) < len(items):
        if stop is not None and stop():
            steps.close()
            return None
        finished, _ = steps.send((new, 0))
        new = []
        out.update(finished)
    steps.close()
    return out


def length_control(args):
    """--length_control, ScaleRL's choice of how long samples may be (paper section 3.2) -> (does
    the sampler force the interruption, the length penalty of a correct answer as a function of
    the completion lengths or None). interrupt: forced interruptions in the thinking budget's last
    sixth (ScaleRL); penalty: clip((L_max - |y|) / L_cache - 1, -1, 0) added to correct answers;
    none: the budgets' hard truncation only."""
    if args.length_control != "penalty":
        return args.length_control == "interrupt", None
    l_max = args.l_max or args.think_budget + args.answer_budget
    return False, lambda lengths: length_penalty(lengths, l_max, args.l_cache or l_max // 7)


def curriculum_of(n_problems, g, n_gens, args, saved=None):
    """Generator g's share of the training problems (every n_gens-th) and the curriculum that picks
    among them, No-Positive-Resampling as --no_positive_resampling says now (paper section 3.2; a
    saved state keeps its history) -> (their indices, Curriculum). The one-process loop is
    generator 0 of 1: with one generator, `python train.py` and `torchrun ... --mode sync` serve
    the same prompts in the same order."""
    mine = list(range(g, n_problems, n_gens))
    curriculum = Curriculum(len(mine), args.seed + 1 + g)
    if saved:
        curriculum.load_state_dict(saved)
    curriculum.npr = args.no_positive_resampling
    return mine, curriculum


def group_items(prompt, gi, G):
    """The sampler items of group gi (the run's gi-th group: step * prompts + its place in the
    batch): its prompt G times, sample j with the noise key gi * 1024 + j, tagged (gi, j). Every
    layout of the ranks draws a group's samples from these keys, so a group's noise does not depend
    on who samples it."""
    return [(prompt, gi * 1024 + j, (gi, j)) for j in range(G)]


def admit(gen, gis):
    """Start one group of G samples per global index (the curriculum picks each prompt) -> sampler
    items (prompt ids, noise key, tag (gi, j)). Before the first group of a batch b, a copy of the
    curriculum is kept: with the pass rates of earlier batches recorded into it as they come
    (finish_group), it is the state a resume at step b must start from (the live one has served up
    to k batches more by then). When every prompt is retired: the items so far, and
    gen.exhausted."""
    items, G, B = [], gen.args.samples, gen.args.prompts
    for gi in gis:
        if gi // B not in gen.snapshots:
            gen.snapshots[gi // B] = copy.deepcopy(gen.curriculum)
        try:
            (c,) = gen.curriculum.next_batch(1)
        except StopIteration as err:
            print(f"generator {gen.index}: {err}", flush=True)
            gen.exhausted = True
            break
        gen.admitted += 1
        gen.open[gi] = {"c": c, "samples": [None] * G}
        items += group_items(gen.prompt_ids[gen.mine[c]], gi, G)
    return items


def sampler_step(gen, items, version, evals=()):
    """One send to the sampler (queue held-out `evals`, then `items`; decode); the groups it
    completes go to the verifier (verify_beside), held-out samples to the eval under way; groups
    verified are sent."""
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
    """Verify a finished group in the verifier's thread, beside the sampler (the verifier's reward
    and correctness of each sample, data.py): decoding goes on meanwhile."""
    problems = [gen.problems[gen.mine[c]]] * len(samples)
    future = gen.verifier.submit(score_samples, gen.tokenizer, samples, problems,
                                 unsafe_code=gen.args.unsafe_code_exec)
    gen.verifying.append((gi, c, samples, future))


def finish_groups(gen, wait=False):
    """The verified groups, in the order they were sampled (wait: all of them): record each one's
    pass rate in the curriculum (and in the copies kept for resumes at later batches), send it."""
    while gen.verifying and (wait or gen.verifying[0][3].done()):
        gi, c, samples, future = gen.verifying.pop(0)
        _, correct, rewards = future.result()
        i, G = gen.mine[c], len(samples)
        for curriculum in [gen.curriculum] + [s for b, s in gen.snapshots.items()
                                              if gi // gen.args.prompts < b]:
            curriculum.record(c, sum(correct) / G)
        gen.send({"gi": gi, "index": i, "prompt": gen.prompt_ids[i], "samples": samples,
                  "correct": correct, "rewards": rewards})


EVAL_SHARE = 0.5  # the most of a generator's sampler slots a held-out eval takes at once


def start_eval(gen, version):
    """A held-out eval of the weights the generator holds (`version`), asked by trainer 0: its share
    of the held-out samples goes to the sampler beside the training groups (eval_share); newer
    weights wait on the host until it is done (poll), so every sample is of `version`."""
    gen.eval_version, gen.eval_done = version, {}
    gen.eval_items = held_out_items(gen.val_ids, gen.args.eval_samples, gen.index, gen.n_gens)
    gen.eval_want = len(gen.eval_items)


def eval_share(gen):
    """The held-out items to queue now: into free slots, at most EVAL_SHARE of the slots in flight,
    so the training groups the trainers wait for are never queued behind a whole eval."""
    running = gen.eval_want - len(gen.eval_items) - len(gen.eval_done)
    n = max(0, min(max(1, int(gen.slots * EVAL_SHARE)) - running, gen.free))
    items, gen.eval_items = gen.eval_items[:n], gen.eval_items[n:]
    return items


def finish_eval(gen):
    """The eval's samples verified and reported; the weights received meanwhile taken."""
    gen.report_eval(gen.eval_version, score_held_out(gen.tokenizer, gen.eval_done, gen.val,
                                                     gen.args.unsafe_code_exec))
    gen.evaluated.add(gen.eval_version)
    gen.eval_version, gen.eval_done = None, {}
    if gen.staged_version > gen.version:
        with torch.no_grad():
            for p, s in zip((p for _, p in gen.model.named_parameters()), gen.staged):
                p.copy_(s)
        take_weights(gen, gen.staged_version)


EVAL_KEY = 10 ** 12  # held-out sample i's noise key: EVAL_KEY + i, at every eval


def held_out_items(val_ids, k, g=0, n_gens=1):
    """The sampler items of generator g's share of a held-out eval, mean@k over the n prompts:
    sample i (of n x k) is prompt i % n with the noise key EVAL_KEY + i, tagged ("eval", i); the
    generators share the prompts out (every n_gens-th), so each prompt's k samples are one
    generator's. One process: all of them, as every eval draws them."""
    n = len(val_ids)
    return [(val_ids[i % n], EVAL_KEY + i, ("eval", i)) for i in range(n * k)
            if (i % n) % n_gens == g]


def score_held_out(tokenizer, done, val, unsafe_code=False):
    """Held-out samples {i: Sample} -> [[i, correct, truncated, interrupted, length]] (verified;
    plain numbers: they travel to trainer 0 as JSON)."""
    idx, n = sorted(done), len(val)
    _, correct, _ = score_samples(tokenizer, [done[i] for i in idx], [val[i % n] for i in idx],
                                  unsafe_code=unsafe_code)
    return [[i, c, done[i].finish == "truncated", 0 in done[i].mask, len(done[i].tokens)]
            for i, c in zip(idx, correct)]

# -----------------------------------------------------------------------------
# a generator rank's life


def run_generator(ctx, args, model, tokenizer, problems, prompt_ids, start_version,
                  curriculum_path, val, val_ids):
    """A generator rank's whole life: sample groups, verify them, send them, take new weights, run
    its share of the held-out evals trainer 0 asks for (PipelineRL); until the trainers say stop.
    Then it saves its curriculum and waits until its last sends are received."""
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
    # args.steps, or the step the trainers stopped at (drain)
    last = int(ctx.store.get("last_step"))
    _save_curriculum(gen.snapshots.get(last, gen.curriculum), curriculum_path)
    publish_stats(ctx, gen, force=True)
    ctx.store.add("generators_done", 1)
    set_status(ctx, "waiting for trainers to take the last rollouts")
    for _, work, _ in gen.sends:
        work.wait(timedelta(seconds=ctx.timeout))


def generate_pipelined(ctx, gen):
    """PipelineRL-k, one round: take new weights if any, admit the groups the lag rule allows into
    free slots, run the sampler; with nothing running and nothing admissible (k batches ahead),
    wait."""
    version = poll(ctx, gen)
    evals = eval_share(gen)
    free = gen.free - len(evals)
    items = (admit_ranked(ctx, gen, next_groups(ctx, gen, math.ceil(free / gen.args.samples),
                                                version))
             if free > 0 else [])
    if items or evals or gen.free < gen.slots:
        done, v = len(gen.eval_done), gen.eval_version
        sampler_step(gen, items, version, evals)
        if v is not None and len(gen.eval_done) != done:  # progress: the trainers' waits go on
            ctx.store.add("eval_progress", 1)
            done = len(gen.eval_done)
            set_status(ctx, f"generating; evaluating step {v} ({done}/{gen.eval_want})"
                       if gen.eval_version is not None else "generating")
        return
    if gen.verifying:  # nothing to decode: the groups under verification go out first
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
    """ppo_offpolicy / sync, one round: sample the batches for the steps up to the next multiple of
    k with frozen weights, then wait for the weights of that step."""
    v, k, B = gen.version, ctx.k, ctx.prompts
    sampler_step(gen, admit_ranked(ctx, gen, [v * B + j for j in
                                              range(gen.index, (k - v % k) * B, ctx.n_gens)]), v)
    while gen.free < gen.slots:  # until every sample of these batches is done
        poll(ctx, gen, apply=False)
        sampler_step(gen, [], v)
    finish_groups(gen, wait=True)
    gen.idle_since = time.time()
    wait_until(ctx, lambda: poll(ctx, gen) >= v + k - v % k,
               f"weights version {v + k - v % k} (frozen for {k} steps)")
    gen.idle += time.time() - gen.idle_since
    gen.idle_since = None


def admit_ranked(ctx, gen, gis):
    """admit(), and the trainers told once this generator has no prompt left."""
    items = admit(gen, gis)
    if gen.exhausted and not get_int(ctx, "exhausted"):
        ctx.store.add("exhausted", 1)
    return items


def poll(ctx, gen, apply=True):
    """Stop? New weights? A held-out eval asked of the weights it holds? (reads the store at most
    every 10 ms) -> the weights version in the model. New weights are received into the model's
    own parameters, between two sampler steps; while a held-out eval runs, into a copy on the host,
    taken once the eval is done (start_eval)."""
    if time.time() - gen.last_poll < 0.01:
        return gen.version
    gen.last_poll = time.time()
    if ctx.store.get("stop") == b"1":
        raise Stopped
    stop_requested(ctx)  # a signal to this generator: the trainers stop after their step under way
    version = int(ctx.store.get("version"))
    # trainer 0 is in the broadcast of `version`, waiting for us
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
        if gen.idle_since is not None:  # a wait under way: this was sync time, not idle time
            gen.idle_since += time.time() - t0
        set_status(ctx, "generating")
    if (gen.eval_version is None and gen.version not in gen.evaluated
            and ctx.store.check([f"eval_request/{gen.version}"])):
        start_eval(gen, gen.version)
    publish_stats(ctx, gen)
    return gen.version


def take_weights(gen, version):
    """The weights of `version` are in the model now: checkpoints trainer 0 saved since get their
    curriculum file, and the copies a stop before `version` would need are dropped."""
    every, before = gen.args.save_every, gen.version
    gen.version = version
    if every and version // every > before // every:  # trainer 0 saved a checkpoint at step b
        b = version // every * every  # (ppo_offpolicy's versions step by k and may pass over b)
        _save_curriculum(gen.snapshots.get(b, gen.curriculum), gen.curriculum_path)
    gen.snapshots = {b: c for b, c in gen.snapshots.items() if b >= version}


def stage_weights(ctx, model, bucket_mb, staged=None):
    """A generator's side of one weight broadcast, received into host copies of its parameters
    (staged: the copies of an earlier one, overwritten) instead of the parameters -> the copies.
    One bucket at a time is on the device."""
    staged = staged or [torch.empty(p.shape, dtype=p.dtype) for _, p in model.named_parameters()]
    broadcast_weights(ctx, model, bucket_mb, into=staged)
    return staged


def publish_stats(ctx, gen, force=False):
    """This generator's counters into the store (at most every 0.1 s), for trainer 0's
    busy_metrics."""
    now = time.time()
    if force or now - gen.last_stats > 0.1:
        gen.last_stats = now
        # a wait under way counts
        idle = gen.idle + (now - gen.idle_since if gen.idle_since else 0.0)
        ctx.store.set(f"genstats/{ctx.rank}", json.dumps({
            "wall": now - gen.t0, "idle": idle, "sync": gen.sync, "tokens": gen.tokens,
            "retired": len(gen.curriculum.retired), "epoch": gen.curriculum.epoch,
            "peak_gb": peak_gb(gen.model, reset=False)}))


def next_groups(ctx, gen, n_groups, version):
    """pipeline: the global indices of this generator's next groups (every n_gens-th; batches before
    the resumed version are done), as many as n_groups and as the lag rule allows at `version`."""
    B = ctx.prompts
    gis = [gen.start_version * B + j * ctx.n_gens + gen.index
           for j in range(gen.admitted, gen.admitted + n_groups)]
    # the rule is monotone in gi: a prefix
    return [gi for gi in gis if admit_ok(gi, version, ctx.k, B)]


def send_group(ctx, gen, group):
    """A verified group to the trainer that trains it (isend); then forget the sends the trainers
    have received."""
    dst = trainer_of(group["gi"], ctx.prompts, ctx.n_trainers)
    rows = pack_group(ctx.rank, group, ctx.length)
    gen.sends.append((dst, dist.isend(rows, dst=dst, group=ctx.rollouts, tag=1), rows))
    ctx.store.add(f"sent/{dst}", 1)
    # received sends, in order
    if len(gen.sends) > 2 * math.ceil((ctx.k + 1) * ctx.prompts / ctx.n_gens):
        for t in range(ctx.n_trainers):
            done = get_int(ctx, f"received_from/{ctx.rank}/{t}")
            for x in [x for x in gen.sends if x[0] == t][:done - gen.pruned[t]]:
                x[1].wait()
                gen.sends.remove(x)
                gen.pruned[t] += 1


def _save_curriculum(curriculum, path):
    """As JSON: plain data, which loading cannot turn into code (a pickle could)."""
    from runs import replace_file  # never through a link planted in --out
    replace_file(path, lambda f: json.dump(curriculum.state_dict(), f))

# -----------------------------------------------------------------------------
# memory plan: the bytes each role will hold, from the model's config and the run's sizes (rank 0
# prints it at start-up; bench.py --figures memory prints it for real shapes on an 8-GPU node and
# checks its per-token figures against measurements)


def plan_shape(config):
    """What a Llama / Qwen2 / Qwen3 / Mistral config's memory depends on: width d, layers L, heads
    H, kv heads K, head dim D, MLP width I, vocab V, a tied head, Qwen3's q/k norms, the biases."""
    get = lambda key: getattr(config, key, None)
    d, H = config.hidden_size, config.num_attention_heads
    return dict(d=d, L=config.num_hidden_layers, H=H, K=get("num_key_value_heads") or H,
                D=generate.head_dim_of(config), I=config.intermediate_size, V=config.vocab_size,
                tied=bool(get("tie_word_embeddings")), qk_norm=config.model_type == "qwen3",
                qkv_bias=config.model_type == "qwen2" or bool(get("attention_bias")),
                o_bias=bool(get("attention_bias")))


def plan_params(s):
    """Parameter counts -> (one decoder layer, the embedding, the untied LM head (0 when tied), the
    final norm)."""
    d, H, K, D = s["d"], s["H"], s["K"], s["D"]
    attn = (d * D * (2 * H + 2 * K) + s["qkv_bias"] * D * (H + 2 * K) + s["o_bias"] * d
            + s["qk_norm"] * 2 * D)
    return attn + 3 * d * s["I"] + 2 * d, s["V"] * d, (not s["tied"]) * s["V"] * d, d


def plan_param_count(s):
    """Every parameter of the model."""
    layer, embed, head, norm = plan_params(s)
    return s["L"] * layer + embed + head + norm


def plan_activations(s, size):
    """Bytes per token that the trainer's forward (generate.packed_logprobs) saves for the
    backward, `size` the weights' bytes per element (checked against saved-tensor hooks in the
    tests and bench.py) -> {"layer": a decoder layer run without checkpointing, or the one being
    recomputed in the backward: its two RMSNorms keep their float32 input, rsqrt and two outputs,
    SDPA its q, k, v, output and float32 logsumexp (Qwen3's q/k norms add theirs), the MLP gate,
    up, their SiLU and product; "checkpointed": a checkpointed layer keeps its input alone;
    "head": the last layer's output (the head's chunks recompute the final norm), the token ids,
    and per position (one row's worth: shared by the rows and the layers) the rotary tables and
    the position ids}."""
    d, H, K, D, b = s["d"], s["H"], s["K"], s["D"], size
    norms = 2 * ((4 + 2 * b) * d + 4)
    attn = b * D * (2 * H + 2 * K) + 4 * H + s["qk_norm"] * ((4 + b) * D + 4) * (H + K)
    return {"layer": norms + attn + 4 * b * s["I"], "checkpointed": b * d,
            "head": b * d + 8 + 2 * D * b + 8}


def plan_trainer(s, size, micro_tokens, ckpt, fsdp, trainers, fp32_head=True, longest=0,
                 sync_once=False):
    """The bytes one trainer rank holds -> {part: bytes}. Replicated: the weights, a float32 master
    under a half dtype (AdamW steps it), AdamW's two float32 moments, the backward's gradients in
    the weights' dtype and their float32 accumulation. FSDP2: float32 shards (the master), their
    AdamW state and float32 gradients, 1/trainers each, and what is gathered in the weights' dtype:
    the root unit (embedding, final norm, head) for the whole step with its gradients, a layer and
    the prefetched next, and under sync_once (fsdp_sync_once) the whole model's float32 gradients
    summed unsharded over the micro-batches. "activations": the larger of the backward's peak and the optimizer step's.
    The backward's, per micro-batch of micro_tokens tokens (or the longest row, a longer row going
    alone): the saved activations, then the larger of the head's backward (the float32 copy of the
    head weight and its gradient, one chunk's logits, their softmax and gradients: 4 x
    generate.LOGITS_BYTES) and the layer recomputed in the backward with its MLP's gradients
    (3 x (tokens, I), an estimate), which run one after the other; under FSDP2, two layers'
    gradients in flight to the reduce-scatter (in the weights' dtype and float32). The step's:
    AdamW's foreach temporaries (a float32 copy of exp_avg_sq), less what the backward held that is
    freed by then (FSDP2's gathered weights and root gradients; a half dtype's gradients, moved
    into the float32 ones). NCCL's own buffers are outside torch's allocator and not counted."""
    layer, embed, head, norm = plan_params(s)
    P, root, half, n = plan_param_count(s), embed + head + norm, size < 4, trainers
    act = plan_activations(s, size)
    tokens = max(micro_tokens, longest)
    saved = s["L"] * (act["checkpointed"] if ckpt else act["layer"]) + act["head"]
    recomputed = tokens * (ckpt * act["layer"] + 3 * size * s["I"])
    head_backward = (fp32_head and half) * 2 * 4 * s["V"] * s["d"] + 4 * generate.LOGITS_BYTES
    reduce_scatter = fsdp * 2 * (size + 4) * layer
    backward = tokens * saved + max(recomputed, head_backward) + reduce_scatter
    return {"weights": (root + 2 * layer) * size if fsdp else P * size,
            "float32 master": 4 * P / n if fsdp else 4 * P * half,
            "AdamW state": 8 * P / (n if fsdp else 1),
            "gradients": (4 * P / n + root * size + sync_once * 4 * P if fsdp
                          else (size + 4 * half) * P),
            "activations": max(backward, 4 * P / (n if fsdp else 1)
                               - ((2 * root + 2 * layer) * size if fsdp else half * size * P))}


def plan_generator(config, s, dtype, max_len, max_new, room, slots=None, fp32_head=True,
                   prefill_tokens=generate.PREFILL_TOKENS):
    """The sampler's bytes beyond the weights -> ({part: bytes}, sequences in flight, blocks in its
    KV pool, bytes per block). room: what its Decoder may take (gen_memory x the memory free after
    the weights: generate.slots_in), or None where memory does not size it (CPU: slots, or
    generate.CPU_SLOTS, each at max_len). The workspace (an estimate): the decode step's float32
    logits, their exp and a copy per row, and one prefill forward's largest tensors (hidden
    states, q/k/v, attention output, the MLP's three)."""
    per_slot, per_block, fixed = generate.decoder_bytes(config, dtype, max_len, max_new, fp32_head)
    seqs = slots or generate.CPU_SLOTS
    blocks = 1 + seqs * -(-max_len // generate.BLOCK)
    if room is not None:
        seqs, blocks, _ = generate.slots_in(room, config, dtype, max_len, max_new, fp32_head, slots)
    b = dtype.itemsize
    prefill = prefill_tokens * b * (4 * s["d"] + 2 * s["D"] * (s["H"] + s["K"]) + 3 * s["I"])
    return ({"decoder": fixed + seqs * per_slot, "KV cache": blocks * per_block,
             "workspace": seqs * 3 * 4 * s["V"] + prefill}, seqs, blocks, per_block)


@dataclass
class PlanRun:
    """A run's sizes, as the memory plan reads them."""
    prompts: int
    samples: int
    prompt_len: int  # the longest prompt, tokens
    think_budget: int
    answer_budget: int
    phrase_len: int  # the interruption phrase, tokens
    micro_tokens: int  # tokens per forward/backward
    dtype: torch.dtype = torch.bfloat16
    ckpt_layers: object = "auto"  # generate.checkpointing's
    fsdp: bool = False
    trainers: int = 1
    generators: int = 0  # 0: one process, trainer and sampler in turn on one device
    device_bytes: float = 80e9
    gen_memory: float = 0.85
    sized: bool = True  # the KV cache sized by memory (CUDA), else by slots
    slots: int = None
    lag: int = 8  # the lag bound k (--max_lag): what a generator can have in flight (in_flight)
    fp32_head: bool = True
    evaluate: int = 0  # --eval_only's held-out samples: no trainer, a sampler of at most these


def memory_plan(config, run):
    """The bytes each role holds (plan_trainer, plan_generator) and whether they fit the device ->
    {"roles": {role: {"count", "parts", "total", "fits"}}, "shape", "ckpt", "max_len", "sequences",
    "blocks", "per_block", "mean_len", "per_token"}. One process holds the trainer's weights,
    master and AdamW state throughout, then in turn its gradients and activations or the
    sampler's cache: its total is the larger phase. A sampler fits if it holds one group of
    samples at the mean length (generate.slots_in)."""
    s, size = plan_shape(config), run.dtype.itemsize
    ckpt = generate.checkpointing(s["L"], run.ckpt_layers)
    max_len, max_new = generate.cache_length(run.prompt_len, run.think_budget, run.answer_budget,
                                             [0] * run.phrase_len)
    trainer = plan_trainer(s, size, run.micro_tokens, ckpt, run.fsdp, run.trainers, run.fp32_head,
                           longest=max_len,
                           sync_once=fsdp_sync_once(plan_param_count(s), run.device_bytes))
    resident = sum(trainer[k] for k in ("weights", "float32 master", "AdamW state"))
    weights = plan_param_count(s) * size
    held = resident if run.generators == 0 and not run.evaluate else weights
    room = run.gen_memory * (run.device_bytes - held) if run.sized else None
    most = run.evaluate or in_flight(run, max(run.generators, 1), run.lag if run.generators else 0)
    caps = [c for c in (run.slots, most if run.sized else None) if c]
    gen, seqs, blocks, per_block = plan_generator(config, s, run.dtype, max_len, max_new, room,
                                         min(caps, default=None), run.fp32_head)
    if run.evaluate:
        roles = {"eval": (1, {"weights": weights, **gen}, weights + sum(gen.values()), seqs)}
    elif run.generators == 0:
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
            "per_block": per_block, "mean_len": generate.mean_length(max_len, max_new),
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
                 f"{generate.BLOCK} tokens ({plan['per_block'] / 1e6:,.1f} MB each){where}, for "
                 + (f"{run.evaluate} held-out samples" if run.evaluate else
                    f"a batch of {run.prompts * run.samples}")
                 + (f"; the model's context {context}" if context else ""))
    return lines


def print_memory_plan(config, args, ctx, device, prompt_len, phrase_len, evaluate=0):
    """Rank 0 at start-up: the run's memory plan on this device (one device per rank; on CPU the
    machine's memory), printed -> the plan. Micro-batches hold --micro_tokens tokens (0: a
    trainer's whole share of the batch, at the full budget). evaluate: --eval_only's samples."""
    trainers, cuda = ctx.n_trainers if ctx else 1, device.type == "cuda"
    seq = prompt_len + args.think_budget + args.answer_budget + phrase_len
    groups = -(-args.prompts // trainers)
    total = (torch.cuda.get_device_properties(device).total_memory if cuda
             else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    run = PlanRun(prompts=args.prompts, samples=args.samples, prompt_len=prompt_len,
                  think_budget=args.think_budget, answer_budget=args.answer_budget,
                  phrase_len=phrase_len,
                  micro_tokens=args.micro_tokens or groups * args.samples * seq,
                  dtype=getattr(torch, args.dtype),
                  ckpt_layers=args.ckpt_layers, fsdp=bool(ctx and args.fsdp),
                  trainers=trainers, generators=ctx.n_gens if ctx else 0, device_bytes=total,
                  gen_memory=args.gen_memory, sized=cuda, slots=args.slots,
                  lag=ctx.k if ctx else 0, fp32_head=args.fp32_head, evaluate=evaluate)
    if evaluate:
        run.samples = args.eval_samples  # it fits if it holds one prompt's samples
    plan = memory_plan(config, run)
    print("\n".join(plan_lines(plan, run, getattr(config, "max_position_embeddings", None))),
          flush=True)
    return plan
