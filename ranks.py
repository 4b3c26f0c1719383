"""
ranks.py: the torchrun ranks: who trains and who generates, each rank's device and each group's
backend, the TCP store bound to MASTER_ADDR (the run's small state: version, stop, status/<rank>,
genstats/<rank>), the held-out eval handshake on the store, and the collectives over the trainers
(gradients, step statistics), and a verified group's wire format (pack_group, receive_rows). Start
at setup; which group goes where and when, and the weight exchange, are pipeline.py's. What the ranks
must agree on (--out, the resume point) rank 0 decides and shares (share_run).

    torchrun_local --nproc_per_node 2 train.py    # README, "Generator and trainer ranks"
"""

import contextlib
import ipaddress
import json
import os
import secrets
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

import runs
from faults import (get_int, pick_threads, printable, record_error, role_of, set_status,
                    wait_until, watch)
from generate import FINISH, Sample
from hub import one_line

_BEACON = []  # rank 0's store that proves a start's token (restart_token)


def default_gen_ranks(world):
    return world - max(1, world // 4)


def n_generators(gen_ranks, world):
    """--gen_ranks as a count, a fraction of the ranks (0.8 of 80: the paper's 64 generators and
    16 trainers; at least one of each), or 0: the default split."""
    if 0 < gen_ranks < 1:
        return min(world - 1, max(1, round(gen_ranks * world)))
    return gen_ranks if gen_ranks > 0 else default_gen_ranks(world)


def generator_rank(gen_ranks):
    """Is this process a generator rank (the last --gen_ranks)?"""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return world > 1 and int(os.environ["RANK"]) >= world - n_generators(gen_ranks, world)

# -----------------------------------------------------------------------------
# set-up


@dataclass
class Live:
    """What changes while a rank runs."""
    status: str = "starting"
    received: int = 0  # rollout groups this trainer has taken
    early: dict = field(default_factory=dict)  # groups received before their step
    genstats_before: list = None  # trainer 0: the generators' counters at the last step
    gen_rates: dict = field(default_factory=lambda: {"gen_busy": 0.0, "gen_tok_s": 0.0})
    heartbeat: threading.Thread = None
    stopping: threading.Event = field(default_factory=threading.Event)
    failing: bool = False  # this rank's own failure is under way (faults.fail)


@dataclass
class Context:
    """One rank's place in the run and its channels: fixed by setup (length by meet)."""
    rank: int
    world: int
    n_trainers: int
    n_gens: int
    device: str
    timeout: float
    mode: str
    k: int  # the lag bound
    prompts: int
    samples: int
    store: object
    weights: object  # trainer 0 + the generators
    trainers: object
    rollouts: object
    length: int = 0  # a packed rollout row's tokens per sample
    live: Live = field(default_factory=Live)


def check_launcher():
    """`srun python train.py`: SLURM's tasks without torchrun would each be a one-process run."""
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "1")
    if "RANK" not in os.environ and tasks.isdigit() and int(tasks) > 1:
        sys.exit(f"error: started by srun as task {os.environ.get('SLURM_PROCID', '?')} of {tasks} "
                 "without torchrun: each task would train alone, a one-process run of its own; "
                 "run one torchrun per node, `srun --ntasks-per-node 1 torchrun ... train.py ...` "
                 "(README, \"Several nodes\")")


def setup(args):
    """Join torchrun's group -> this rank's Context; None for one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return None
    rank = int(os.environ["RANK"])
    n_gens = n_generators(args.gen_ranks, world)
    n_trainers = world - n_gens
    if not 1 <= n_gens < world:
        sys.exit(f"error: --gen_ranks {n_gens} with {world} ranks: "
                 "need at least one generator and one trainer")
    if args.prompts % n_trainers:
        sys.exit(f"error: --prompts {args.prompts} must be a multiple of the {n_trainers} trainer "
                 "ranks")
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) and not args.resume:
        sys.exit("error: torchrun --max-restarts restarts the ranks with this same command, which "
                 "would then find this run in --out and stop: add --resume (with nothing to resume "
                 "yet, a run starts fresh)")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    timeout = timedelta(seconds=args.timeout)
    store = own_store(rank, world, local_world, timeout)
    # the default group (rollouts, barriers) is gloo on every rank: nothing in it depends on devices
    dist.init_process_group("gloo", timeout=timeout, rank=rank, world_size=world, store=store)
    trainers, gens = list(range(n_trainers)), list(range(n_trainers, world))
    plan = decide_plan(store, rank, world, local_facts(args, n_gens), trainers, gens, args.timeout)
    if plan["devices"][rank] is None:
        pick_threads(local_world)
    else:
        torch.cuda.set_device(plan["devices"][rank])
    ctx = Context(rank=rank, world=world, n_trainers=n_trainers, n_gens=n_gens,
                  device=plan["name"][rank], timeout=args.timeout, mode=args.mode,
                  k=1 if args.mode == "sync" else args.max_lag,
                  prompts=args.prompts, samples=args.samples, store=store,
                  # rollouts are CPU tensors sent point to point: the default group, gloo
                  weights=None, trainers=None, rollouts=dist.group.WORLD)
    watch(ctx, args.heartbeat_timeout)  # all have met: from here one that fails stops the others
    if rank == 0:
        print("\n".join([plan["line"], *plan["roles"]]), flush=True)
    # every rank creates every group, in the same order, with rank 0's backends
    ctx.weights = dist.new_group([0] + gens, timeout=timeout, backend=plan["weights"])
    ctx.trainers = dist.new_group(trainers, timeout=timeout, backend=plan["trainers"])
    return ctx


def agree(ctx, key, value):
    """Rank 0's value (JSON) for every rank: what the ranks must not judge each on its own."""
    if ctx.rank == 0:
        ctx.store.set(f"agreed/{key}", json.dumps(value))
        return value
    wait_until(ctx, lambda: ctx.store.check([f"agreed/{key}"]), f"rank 0's {key}")
    return json.loads(ctx.store.get(f"agreed/{key}"))


def share_run(ctx, args, ckpt, state):
    """Under torchrun: rank 0's --out and resume point (it alone checked, locked and marked --out with
    a fresh nonce: runs.prepare_out_dir) for every rank, once each node's first rank has proved that its
    --out is that folder; no rank of a node touches --out before -> (checkpoint or None, its state)."""
    if ctx is None:
        return ckpt, state
    facts = agree(ctx, "run", runs.run_facts(args, ckpt) if ctx.rank == 0 else None)
    first = ctx.rank - int(os.environ.get("LOCAL_RANK", "0"))  # torchrun numbers a node's ranks in a row
    if ctx.rank == first:
        runs.check_same_out(args, facts)
        ctx.store.set(f"out_seen/{first}", "1")
    else:
        wait_until(ctx, lambda: ctx.store.check([f"out_seen/{first}"]), f"rank {first} to find --out")
    if ctx.rank == 0:
        return ckpt, state
    runs.hold(args.out)
    return runs.resume_facts(args, facts)


def own_store(rank, world, local_world, timeout):
    """The run's TCP store: rank 0's, bound to MASTER_ADDR alone (torch's binds every interface, and
    whoever reaches a store can stop the run), or torchrun's shared one (the launcher's, its default)
    under a prefix fresh to this start, which rank 0 draws and proves current (restart_token): a restart
    (--max-restarts) meets none of the last start's keys, which stopped restarted ranks in gloo's
    connectFullMesh ("Connection refused")."""
    host, port, family, address = store_address(rank, world, local_world)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return tcp_store(family, address if rank == 0 else None, host, port, world, timeout)
    agent = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"train.py/{restart_token(agent, rank, family, address, timeout)}", agent)


def store_address(rank, world, local_world):
    """MASTER_ADDR resolved -> (host, port, family, address); a loopback address pins gloo and nccl to
    lo where the whole run is on one machine, and stops a run over several nodes in one line."""
    host, port = os.environ["MASTER_ADDR"].strip("[]"), int(os.environ["MASTER_PORT"])
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    launcher = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if ipaddress.ip_address(address[0]).is_loopback:
        if world == local_world:  # one machine: the whole run on the loopback interface
            for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                os.environ.setdefault(name, "lo")
        elif not (ifname == "lo" or ifname and launcher):
            # several nodes (Debian's /etc/hosts maps the hostname to 127.0.1.1): the others cannot
            # reach it, unless the nodes are simulated on one machine (lo), or the launcher's store
            # listens on every interface and gloo and nccl take the one named
            sys.exit(f"error: rank {rank} on {socket.gethostname()}: MASTER_ADDR {host} resolves "
                     f"to {address[0]}, a loopback address, in a run over several nodes ({world} "
                     f"ranks, {local_world} here): the other nodes cannot reach it; make {host} "
                     "resolve to the address the nodes share (or give torchrun --local-addr with "
                     "it) and set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME to that interface "
                     "(README, \"Several nodes\"; nodes simulated on one machine: "
                     "GLOO_SOCKET_IFNAME=lo)")
    return host, port, family, address


def restart_token(launcher, rank, family, address, timeout):
    """This start's token, the same on every rank: rank 0 draws it and announces it in the launcher's
    store with the address of a small store of its own that holds it; an announcement left by the last
    start names a store that is gone (or holds another token)."""
    if rank == 0:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:  # no packet sent: a route looked up
            probe.connect(address)
            mine = probe.getsockname()[0]
        beacon = tcp_store(family, (mine, 0), mine, 0, 1, timeout)
        _BEACON.append(beacon)  # held while this process lives
        token = secrets.token_hex(8)
        beacon.set("token", token)
        launcher.set("train.py/start", f"{mine} {beacon.port} {token}")
        return token
    deadline = time.time() + timeout.total_seconds()
    while True:
        mine, at, token = launcher.get("train.py/start").decode().split()
        with contextlib.suppress(OSError, RuntimeError):  # torch's DistError and its kin
            socket.create_connection((mine, int(at)), timeout=2).close()  # refused: a stale entry
            beacon = dist.TCPStore(mine, int(at), 1, is_master=False, timeout=timeout)
            if beacon.get("token").decode() == token:
                return token
        if time.time() > deadline:
            raise TimeoutError(f"rank {rank} found no announcement of rank 0 in "
                               f"{timeout.total_seconds():.0f} s (--timeout)")
        time.sleep(0.2)


def tcp_store(family, bind, host, port, world, timeout):
    """A TCPStore: its server (bind: the address, else a client) on that address alone."""
    listening = None
    if bind:
        with socket.socket(family, socket.SOCK_STREAM) as server:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(bind)
            server.listen(world)
            port = server.getsockname()[1]
            listening = server.detach()
    return dist.TCPStore(host, port, world, is_master=bind is not None, timeout=timeout,
                         master_listen_fd=listening)


def local_facts(args, n_gens):
    """What this rank sees, for rank 0's plan: its host, its device (LOCAL_RANK's GPU among those
    visible) and that GPU's identity, and its own answers to what every rank must agree on."""
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    gpus = torch.cuda.device_count() if cuda else 0
    device = int(os.environ.get("LOCAL_RANK", os.environ["RANK"])) % gpus if gpus else None
    # SLURM's one GPU per task shows each rank a different cuda:0: the UUID tells GPUs apart
    return {"host": socket.gethostname(), "cuda": cuda, "gens": n_gens, "device": device,
            "gpu": str(torch.cuda.get_device_properties(device).uuid) if gpus else None}


def decide_plan(store, rank, world, facts, trainers, gens, timeout):
    """Every rank's facts through the store; rank 0 decides the plan (device_plan) and shares it;
    a rank whose own answers differ from rank 0's stops with one line, the others with it."""
    store.set(f"facts/{rank}", json.dumps(facts))
    if rank == 0:
        store_wait(store, [f"facts/{r}" for r in range(world)], timeout, "every rank's devices")
        every = [json.loads(store.get(f"facts/{r}")) for r in range(world)]
        plan = device_plan(every, trainers, gens)
        plan["refused"] = {r: why for r, f in enumerate(every)
                           if (why := disagreement(f, every[0]))}
        store.set("plan", json.dumps(plan))
    store_wait(store, ["plan"], timeout, "rank 0's device plan")
    plan = json.loads(store.get("plan"))
    if plan["refused"]:
        refused = {int(r): why for r, why in plan["refused"].items()}  # JSON's keys are strings
        stop_together(store, rank, world, refused, "plan")
    return plan


def disagreement(mine, first):
    """A rank's answers against rank 0's -> what differs (one line), or None."""
    if mine["gens"] != first["gens"]:
        return (f"--gen_ranks gives {mine['gens']} generators here, {first['gens']} on rank 0 "
                f"({first['host']}): start every node with the same flags")
    if mine["cuda"] != first["cuda"]:
        where = lambda f: "on GPUs" if f["cuda"] else "on the CPU"  # noqa: E731
        return (f"this rank runs {where(mine)}, rank 0 ({first['host']}) {where(first)}: every "
                "rank must (the same GPUs on every node, or --device cpu everywhere)")
    return None


def stop_together(store, rank, world, refused, check):
    """A start-up check failed ({rank: why}): a rank it names says why, as torchrun's root cause
    (its error file, else stderr); the others point to the first one named, after it has said it (up
    to 5 s); all exit 2, rank 0 (the store's host) last, once every rank has read the verdict (or
    30 s passed: one is gone)."""
    store.add(f"{check}/read", 1)
    if rank in refused:
        line = printable(f"train.py: error: rank {rank} on {socket.gethostname()}: {refused[rank]}")
        if not record_error(line, shown="\n" + line):
            print(line, file=sys.stderr, flush=True)
        store.set(f"{check}/said", "1")
    else:
        record_error(f"stopped with rank {min(refused)}, whose start-up check failed (the root "
                     "cause)", later=True)
        t0 = time.time()
        while not store.check([f"{check}/said"]) and time.time() - t0 < 5:
            time.sleep(0.05)
    t0 = time.time()
    while rank == 0 and int(store.add(f"{check}/read", 0)) < world and time.time() - t0 < 30:
        time.sleep(0.05)
    sys.exit(2)


def store_wait(store, keys, timeout, what):
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except RuntimeError as err:  # DistStoreError's wait timeout, or the store gone
        sys.exit(f"error: waited {timeout:g} s (--timeout) for {what}: {one_line(err)}")


def device_plan(facts, trainers, gens):
    """Rank 0's plan from every rank's facts: each rank's device (its LOCAL_RANK's GPU) and each
    group's backend: gloo where two of its ranks share a GPU (nccl cannot join them), told by host
    and GPU UUID; and the role map, a line per node."""
    world = len(facts)
    where = [(f["host"], f["gpu"]) for f in facts]
    roles = role_map([f["host"] for f in facts], len(trainers))
    if not facts[0]["cuda"]:
        return {"devices": [None] * world, "name": ["cpu"] * world, "weights": "gloo",
                "trainers": "gloo", "roles": roles,
                "line": f"devices: {world} ranks on the CPU, every group over gloo"}
    backend = lambda group: "nccl" if len({where[r] for r in group}) == len(group) else "gloo"
    devices = [f["device"] for f in facts]
    plan = {"devices": devices, "name": [f"cuda:{d}" for d in devices], "roles": roles,
            "weights": backend([0] + gens), "trainers": backend(trainers)}
    shared = len(set(where)) < world
    plan["line"] = (f"devices: {world} ranks on {len(set(where))} GPU(s) over "
                    f"{len({f['host'] for f in facts})} node(s), each its LOCAL_RANK's GPU "
                    f"({'some ranks share a GPU' if shared else 'one GPU per rank'}); "
                    f"weight broadcast over {plan['weights']}, gradients over {plan['trainers']}"
                    + (" (nccl cannot join two ranks on one GPU)"
                       if "gloo" in (plan["weights"], plan["trainers"]) else ""))
    return plan


def role_map(hosts, n_trainers):
    """A line per node, in rank order: which ranks train and which generate there."""
    def spans(ranks):
        runs = []
        for r in ranks:
            if runs and runs[-1][1] == r - 1:
                runs[-1][1] = r
            else:
                runs.append([r, r])
        return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
    lines = []
    for host in dict.fromkeys(hosts):
        mine = [r for r, h in enumerate(hosts) if h == host]
        train, gen = [r for r in mine if r < n_trainers], [r for r in mine if r >= n_trainers]
        lines.append(f"node {host}: " + ", ".join(
            [f"{len(train)} trainer(s) (ranks {spans(train)})"] * bool(train) +
            [f"{len(gen)} generator(s) (ranks {spans(gen)})"] * bool(gen)))
    return lines


def meet(ctx, version, length, layout):
    """Once the model is loaded: rank 0 publishes the starting version and what its weight
    broadcast sends (layout); each generator checks it against what it receives into; every rank
    waits for all."""
    ctx.length = length
    if ctx.rank == 0:
        ctx.store.set("version", str(version))
        ctx.store.set("stop", "0")
        ctx.store.set("layout", json.dumps(layout))
    gens = range(ctx.n_trainers, ctx.world)
    if ctx.rank in gens:
        # polled: a blocking store wait would hold the store's connection from the heartbeat
        wait_until(ctx, lambda: ctx.store.check(["layout"]), "trainer 0's weight layout")
        ctx.store.set(f"layout/{ctx.rank}", layout_mismatch(json.loads(ctx.store.get("layout")),
                                                            layout) or "")
    wait_until(ctx, lambda: ctx.store.check([f"layout/{r}" for r in gens]), "the generators' weights")
    refused = {r: why for r in gens if (why := ctx.store.get(f"layout/{r}").decode())}
    if refused:  # the broadcast sends bare bytes: a mismatch is garbage or a hang
        stop_together(ctx.store, ctx.rank, ctx.world, refused, "layout")
    dist.barrier(group=ctx.rollouts)


def layout_mismatch(sent, mine):
    """Trainer 0's weight layout against a generator's -> the first difference (one line), or
    None."""
    if sent["bucket_mb"] != mine["bucket_mb"]:
        return (f"--bucket_mb {mine['bucket_mb']} here, {sent['bucket_mb']} on trainer 0: the "
                "weight broadcast's buckets would differ; start every node with the same flags")
    for i, (a, b) in enumerate(zip(sent["params"] + [None], mine["params"] + [None])):
        if a != b:
            show = lambda p: f"{p[0]} {tuple(p[1])} {p[2]}" if p else "nothing"  # noqa: E731
            return (f"the weight broadcast does not match: parameter {i} is {show(a)} on trainer 0 "
                    f"but {show(b)} here; every rank must load the same --model with the same "
                    "--dtype")
    return None


def part(ctx):
    """Clean shutdown: the heartbeat joined first, then the ranks part."""
    set_status(ctx, "finished")
    ctx.store.add("finished", 1)
    ctx.live.stopping.set()
    ctx.live.heartbeat.join(timeout=ctx.timeout)
    dist.barrier(group=ctx.rollouts)
    dist.destroy_process_group()

# -----------------------------------------------------------------------------
# a checkpoint's parts: --fsdp's shards, the generators' curricula


def shards_written(ctx, name):
    """Each trainer, once its shards of checkpoint `name` are written: its word and host, into the
    store. -> trainer 0: {rank: {"host": ...}}, once every trainer sent its word; others: None."""
    ctx.store.set(f"shards/{name}/{ctx.rank}", json.dumps({"host": socket.gethostname()}))
    if ctx.rank != 0:
        return None
    keys = {r: f"shards/{name}/{r}" for r in range(ctx.n_trainers)}
    try:
        wait_until(ctx, lambda: ctx.store.check(list(keys.values())),
                   f"every trainer's word that its shards of {name} are written")
    except TimeoutError as err:
        silent = [role_of(ctx, r) for r, k in keys.items() if not ctx.store.check([k])]
        raise TimeoutError(f"{err}; no word from {', '.join(silent)}: {name} is not saved") \
            from None
    return {r: json.loads(ctx.store.get(k)) for r, k in keys.items()}


def generator_states(ctx, step):
    """Trainer 0, saving checkpoint `step`: every generator's curriculum at that step, asked for
    through the store (pipeline.send_state answers) -> {str(rank): its state}."""
    ctx.store.set("save_request", str(step))
    keys = {r: f"genstate/{step}/{r}" for r in range(ctx.n_trainers, ctx.world)}
    try:
        wait_until(ctx, lambda: ctx.store.check(list(keys.values())),
                   f"the generators' curricula at step {step}, for its checkpoint")
    except TimeoutError as err:
        silent = [role_of(ctx, r) for r, k in keys.items() if not ctx.store.check([k])]
        raise TimeoutError(f"{err}; none from {', '.join(silent)}") from None
    states = {str(r): json.loads(ctx.store.get(k)) for r, k in keys.items()}
    for k in keys.values():
        ctx.store.delete_key(k)
    return states

# -----------------------------------------------------------------------------
# a held-out eval on trainer 0


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

# -----------------------------------------------------------------------------
# collectives over the trainers


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
# the generators' counters, read from the store


def generator_stats(ctx):
    store, out = ctx.store, []
    for r in range(ctx.n_trainers, ctx.world):
        out.append(json.loads(store.get(f"genstats/{r}")) if store.check([f"genstats/{r}"]) else {})
    return out


def busy_metrics(ctx, dt, rstats, train_s, sync_s, sync_bytes):
    """Trainer 0's per-step view of both roles: busy fractions, sync speed, tokens/s."""
    wait_s, live = rstats["wait_s"], ctx.live
    now = generator_stats(ctx)
    before = live.genstats_before or [{}] * len(now)
    d = [{key: s.get(key, 0.0) - b.get(key, 0.0) for key in ("wall", "idle", "sync", "tokens")}
         for s, b in zip(now, before)]
    # a generator that has not published since keeps its old counters
    live.genstats_before = [s if x["wall"] > 0 else b for s, b, x in zip(now, before, d)]
    busy = [(x["wall"] - x["idle"] - x["sync"]) / x["wall"] for x in d if x["wall"] > 0]
    if busy:
        live.gen_rates = {"gen_busy": sum(busy) / len(busy),
                          "gen_tok_s": sum(x["tokens"] / x["wall"] for x in d if x["wall"] > 0)}
    return {**live.gen_rates, "train_busy": train_s / dt,
            "wait_ms": wait_s * 1000, "sync_ms": sync_s * 1000,
            "sync_MBps": sync_bytes / 1e6 / sync_s if sync_s else 0.0,
            "retired": sum(s.get("retired", 0) for s in now),
            "epoch": max((s.get("epoch", 0) for s in now), default=0),
            **({"gen_peak_gb": max(s["peak_gb"] for s in now if s.get("peak_gb"))}
               if any(s.get("peak_gb") for s in now) else {})}


# -----------------------------------------------------------------------------
# rollouts on the wire: a verified group as float32 rows, sent point to point to its trainer

# gen rank, gi, prompt index, prompt len, completion len, correct, reward, finish
HEADER = 8


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


def receive_rows(ctx):
    rows = torch.empty(ctx.samples, HEADER + 4 * ctx.length)
    dist.irecv(rows, src=None, group=ctx.rollouts, tag=1).wait(timedelta(seconds=ctx.timeout))
    ctx.live.received += 1
    return rows


def drain(ctx, step):
    """After the last step: stop the generators, take the groups in flight."""
    if ctx.rank == 0:
        ctx.store.set("last_step", str(step))
        ctx.store.set("stop", "1")
    wait_until(ctx, lambda: get_int(ctx, "generators_done") == ctx.n_gens, "the generators to stop")
    while get_int(ctx, f"sent/{ctx.rank}") > ctx.live.received:
        receive_rows(ctx)
