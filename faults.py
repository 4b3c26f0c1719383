"""
faults.py: nothing hangs or fails silently: clean stops on signals (stop_on_signals), deadlines
(wait_until), heartbeats (watch), one-line failure reports (report_failure), and printable: what an
error line quotes from an input, shown without the control characters a terminal would act on.
"""

import contextlib
import json
import math
import os
import re
import signal
import socket
import sys
import threading
import time

_CURRENT = {}  # for report_failure

STOP = {}  # {"name": "SIGINT", "at": time.time()}
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # C0, DEL and C1: a terminal acts on them


class Stopped(Exception):
    """Raised inside a generator when the trainers have finished."""


def stop_on_signals():
    """SIGINT / SIGTERM: stop cleanly after the step under way; a repeat 3 s later exits at once."""
    def handler(signum, frame):
        name, quiet = signal.Signals(signum).name, int(os.environ.get("RANK", "0")) != 0
        if STOP and time.time() - STOP["at"] > 3:  # within 3 s: torchrun's copy of the same one
            os.write(2, f"\n{name} again: exiting now, without saving\n".encode())
            os._exit(128 + signum)
        if not STOP:  # only a flag: an exception here could be swallowed
            STOP.update(name=name, at=time.time())
            if not quiet:  # os.write: print() is not safe inside a signal handler
                os.write(2, f"\n{name}: stopping; the last step to finish will be saved ({name} "
                            "again, 3 s from now or later: exit at once without saving)\n".encode())
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def stop_requested(ctx):
    """Has a signal asked this process, or any rank (through the store), to stop?"""
    if ctx is None:
        return bool(STOP)
    if STOP and not STOP.get("told"):
        ctx.store.set("interrupted", STOP["name"])
        STOP["told"] = True
    elif not STOP and ctx.store.check(["interrupted"]):
        STOP.update(name=ctx.store.get("interrupted").decode(), at=time.time(), told=True)
    return bool(STOP)


def role_of(ctx, r):
    return f"rank {r} ({'trainer' if r < ctx.n_trainers else 'generator'})"


def pick_threads(local_world=None):
    """torch's CPU threads for this process, every entry point's -> their count: the cores shared
    among a machine's local_world ranks (torchrun's OMP_NUM_THREADS=1 overruled); one process
    (None) half of them unless OMP_NUM_THREADS says (threads on a busy machine's cores wait on each
    other: BENCHMARKS.md section 9)."""
    import torch  # here: config.py imports this file before torch is imported
    cores = os.cpu_count() or 1
    if local_world:
        torch.set_num_threads(max(1, cores // local_world))
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, min(torch.get_num_threads(), cores // 2)))
    return torch.get_num_threads()


def set_status(ctx, text):
    ctx.live.status = text
    ctx.store.set(f"status/{ctx.rank}", text)


def get_int(ctx, key):
    return int(ctx.store.add(key, 0))  # a missing counter reads 0


def watch(ctx, limit):
    """Start this rank's heartbeat thread."""
    ctx.live.heartbeat = threading.Thread(target=_heartbeat, args=(ctx, limit), daemon=True)
    ctx.live.heartbeat.start()
    _CURRENT["ctx"] = ctx


def _heartbeat(ctx, limit):
    """Bump this rank's counter every second; exit if another rank's stops for `limit` s."""
    store, me, world = ctx.store, ctx.rank, ctx.world
    last = {r: (-1, time.time()) for r in range(world) if r != me}
    beat = [time.time()]  # a stopped store host hangs store calls: _store_watchdog times them
    threading.Thread(target=_store_watchdog, args=(ctx, limit, beat), daemon=True).start()
    try:
        while not ctx.live.stopping.is_set():
            beat[0] = time.time()
            store.add(f"heartbeat/{me}", 1)
            if int(store.add("finished", 0)):
                beat[0] = math.inf
                return  # a clean shutdown
            if int(store.add("failed", 0)) and not ctx.live.failing:
                _stop_after_failure(ctx)
            for r, (count, since) in last.items():
                now = int(store.add(f"heartbeat/{r}", 0))
                if now != count:
                    last[r] = (now, time.time())
                elif time.time() - since > limit:
                    status = (store.get(f"status/{r}").decode() if store.check([f"status/{r}"])
                              else "?")
                    _die(f"{role_of(ctx, r)} sent no heartbeat for {limit:.0f} s (dead or stopped; "
                         f"its last status: {status}); {role_of(ctx, me)} was {ctx.live.status}")
            ctx.live.stopping.wait(1.0)
    except Exception as err:  # the store's host (rank 0 or the launcher) is gone
        _die(f"lost the rendezvous store ({err}); rank 0 or the launcher probably died; "
             f"{role_of(ctx, me)} was {ctx.live.status}")


def _store_watchdog(ctx, limit, beat):
    """Exit when the heartbeat loop has not begun a round for `limit` s."""
    while not ctx.live.stopping.wait(1.0):
        if time.time() - beat[0] > limit:
            _die(f"the rendezvous store did not answer for {limit:.0f} s: its host, "
                 f"{role_of(ctx, 0)} or the launcher, is stopped or hung; "
                 f"{role_of(ctx, ctx.rank)} was {ctx.live.status}")


def report_failure(err):
    """As a rank fails: what it was doing, and which ranks' heartbeats stood still for 3 s."""
    ctx = _CURRENT.get("ctx")
    if ctx is None:
        return
    store, me = ctx.store, ctx.rank
    ctx.live.failing = True  # its own failure: not stopped by another's
    try:
        before = {r: int(store.add(f"heartbeat/{r}", 0)) for r in range(ctx.world) if r != me}
        time.sleep(3.0)
        gone = [f"{role_of(ctx, r)}, last status: "
                f"{store.get(f'status/{r}').decode() if store.check([f'status/{r}']) else '?'}"
                for r, n in before.items() if int(store.add(f"heartbeat/{r}", 0)) == n]
    except Exception:
        gone = ["the rendezvous store (rank 0 or the launcher)"]
    fail(ctx, f"{role_of(ctx, me)} on {host()} failed while {ctx.live.status}: {type(err).__name__}: "
              f"{str(err).splitlines()[0] if str(err) else ''}; "
              f"not responding: {'; '.join(gone) or 'none'}", prefix="ERROR: ")


def record_error(line, later=False, shown=None):
    """This rank's failure line into torchrun's error file (later: not the root cause)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    info = {"py_callstack": line if shown is None else shown,  # what the report shows
            "timestamp": str(int(time.time()) + 10 * bool(later))}
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": info}}, f)
        return True
    except OSError:
        return False


def printable(text):
    """text as one line a terminal only shows: whitespace controls become spaces, the others \\xNN
    (an escape sequence in a file name or a template's message clears no screen)."""
    return CONTROL.sub(lambda m: " " if m[0] in "\t\n\r\v\f" else f"\\x{ord(m[0]):02x}", str(text))


def say_error(line):
    """A user error, said once. Once the ranks have met (ranks.setup), the first rank to fail says it with
    its rank and host (fail); before, every rank meets the same one (a flag): each node's first rank says it
    as its report's root cause, the others point to it."""
    line = printable(line)
    if _CURRENT.get("ctx") is not None:
        return fail(_CURRENT["ctx"], line, code=2)
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if local != 0:
        record_error(f"the same error as rank {rank - local} (the root cause, below)", later=True)
        _wait_for_first_rank()
    elif not record_error(line, shown="\n" + line):
        print(line, file=sys.stderr, flush=True)


def _wait_for_first_rank(limit=5.0):
    """Until this node's first rank has written its error file (torchrun's attempt_N/<local rank>/
    error.json), at most `limit` s: torchrun stops the other ranks (SIGTERM) at the first exit, and
    reports as the root cause what it has seen, which must be that rank's line."""
    path, local = os.environ.get("TORCHELASTIC_ERROR_FILE", ""), os.environ.get("LOCAL_RANK")
    first = (os.path.basename(os.path.dirname(path)) == local
             and os.path.join(os.path.dirname(os.path.dirname(path)), "0", "error.json"))
    deadline = time.time() + limit
    while first and not os.path.exists(first) and time.time() < deadline:
        time.sleep(0.05)


def host():
    return socket.gethostname()


def fail(ctx, line, prefix="", code=1):
    """This rank fails with `line` (and exits with `code`). The first rank to fail in the run says it, with
    its rank and host, as torchrun's root cause (its error file, else stderr); a later one with the same line
    points to it, another line is said too; every other rank stops on the store within seconds, with the
    same exit code (_stop_after_failure)."""
    ctx.live.failing = True
    me, store = f"{role_of(ctx, ctx.rank)} on {host()}", ctx.store
    try:
        first = int(store.add("failed", 1)) == 1
        if first:
            store.set("failure", json.dumps({"who": me, "line": line, "node": _node(), "code": code}))
        else:
            store.add("failure_seen", 1)
            root = json.loads(store.get("failure"))
    except Exception:  # the store's host is gone: say it here
        first = True
    if not first and root["line"] == line:
        record_error(f"the same error as {root['who']} (the root cause)", later=True)
        return _after_root(ctx, root)
    said = printable(line if me in line else f"{line} ({me})")
    if not record_error(said, later=not first, shown="\n" + said):
        print(prefix + said, file=sys.stderr, flush=True)
    if not first:
        return _after_root(ctx, root)
    deadline = time.time() + 3  # the store's host waits until the others have read it (or 3 s)
    with contextlib.suppress(Exception):
        while int(store.add("failure_seen", 0)) < ctx.world - 1 and time.time() < deadline:
            time.sleep(0.05)
        store.set("failure_exits", "1")


def _node():
    """This node's first rank (torchrun numbers a node's ranks in a row)."""
    return int(os.environ.get("RANK", "0")) - int(os.environ.get("LOCAL_RANK", "0"))


def _after_root(ctx, root):
    """Under torchrun, on the failed rank's node, exit only after it (up to 5 s): torchrun reports the
    failures it has seen when it notices the first (every 0.1 s), and the first must be the root cause."""
    deadline = time.time() + 5
    with contextlib.suppress(Exception):
        while (os.environ.get("TORCHELASTIC_ERROR_FILE") and root["node"] == _node()
               and time.time() < deadline):
            if ctx.store.check(["failure_exits"]):
                time.sleep(0.3)
                break
            time.sleep(0.05)


def _stop_after_failure(ctx):
    """Another rank failed (fail): this one stops, naming it (its node's first rank says so)."""
    ctx.store.add("failure_seen", 1)
    root = json.loads(ctx.store.get("failure"))
    line = printable(f"{root['who']} failed (the root cause); {role_of(ctx, ctx.rank)} on {host()} "
                     f"stops, it was {ctx.live.status}")
    if not record_error(line, later=True) and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print(f"ERROR: {line}", file=sys.stderr, flush=True)
    _after_root(ctx, root)
    sys.stdout.flush()
    os._exit(root["code"])


def _die(message):
    message = printable(message)
    record_error(message)
    print(f"ERROR: {message}; exiting", file=sys.stderr, flush=True)
    os._exit(1)


def wait_until(ctx, ready, what, status=None):
    """Poll ready() until true, or raise TimeoutError naming `what` after --timeout seconds. The
    deadline restarts while trainer 0 evaluates or the generators' held-out evals progress."""
    set_status(ctx, status or f"waiting for {what}")
    t0, pause, evals = time.time(), 0.0005, get_int(ctx, "eval_progress")
    while not ready():
        if time.time() - t0 > ctx.timeout:
            now = get_int(ctx, "eval_progress")
            if now != evals or (ctx.store.check(["status/0"])
                                and ctx.store.get("status/0").startswith(b"evaluating")):
                t0, evals = time.time(), now
                continue
            raise TimeoutError(
                f"{role_of(ctx, ctx.rank)} waited {ctx.timeout} s for {what} (--timeout)")
        time.sleep(pause)
        pause = min(2 * pause, 0.02)
    return time.time() - t0
