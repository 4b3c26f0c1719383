"""
test_all.py: every test of the project, fast, on CPU.

    python -m pytest -n 2 --dist loadgroup test_all.py
"""

from pathlib import Path
import ast
import collections
import contextlib
import errno
import functools
import hashlib
import importlib.util
import inspect
import ipaddress
import io
import itertools
import json
import math
import multiprocessing
import os
import pickle
import random
import re
import runpy
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tokenize
import types

import numpy as np
from scipy import stats
import pytest
import torch
import torch.distributed.run
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import (AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

import bench
import checks
import config
import data
from data import INTERRUPT_PHRASE
import evals
import hub
import faults
import generate as gen
import paged_attention as pa
import pipeline
import plan
import plots
import ranks
from plan import (PlanRun, decoder_bytes, fit_slots, in_flight, kv_bytes_per_token, memory_plan,
                  plan_activations, plan_param_count, plan_shape, plan_trainer, slots_in)
import runs
import train
import trainer
import loss
from loss import advantages, length_penalty, policy_loss, zero_variance_keep
import metrics
from metrics import drift_by_lag, ratio_stats
from sandbox import extract_code, score_code, score_code_batch
from verify import extract_answer, score, score_batch
import fit
import sandbox
import study
import toy
import verify


# ---------------------------------------------------------------------------------------------
# helpers shared by several sections: the repository root, a code test set and the fenced
# response that carries a program, a copy of the embedded toy model,
# a short train.py run on it in this process, and train.py processes forked from a preloaded server

ROOT = Path(__file__).resolve().parent
if os.environ.get("PYTEST_XDIST_WORKER"):  # -n 2: two workers on 2 cores; two torch threads each would thrash
    torch.set_num_threads(1)

SUM = {"inputs": ["1 2\n", "-5 5\n", "100 23"], "outputs": ["3\n", "0", "123\n"]}


def fenced(code, tag="python"):
    return f"<think>\nplan\n</think>\nHere it is:\n```{tag}\n{code}\n```\n"


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    """A copy of the embedded toy model outside the source tree (toy.py's build: test_data_build_*)."""
    out = tmp_path_factory.mktemp("toy") / "model"
    shutil.copytree(toy.toy_model_dir(), out)
    return str(out)


def run_train(toy_dir, out, *flags):
    args = config.get_args(["--model", toy_dir, "--out", str(out), "--prompts", "4", "--samples", "4", "--steps", "2",
                           "--eval_every", "2", "--val_size", "4", "--eval_samples", "1", "--save_every", "0",
                           *flags])
    train.main(args)
    return [json.loads(ln) for ln in open(out / "metrics.jsonl")]


# Multi-rank tests start train.py ranks by forking them from one server process that has imported
# test_all.py (so train.py and all it imports) and the Llama modeling code once: a rank then starts in
# ~0.1 s instead of paying ~5 s of CPU for imports, most of what a short multi-rank run costs. The ranks
# still run train.py as their __main__, with their own environment, argv and output; the README's first
# torchrun command covers a fresh interpreter's start and exit (launcher and ranks), and the stalled-trainer
# test torchrun's own launcher, forked (launch(torchrun=True)).
FORKS = multiprocessing.get_context("forkserver")
FORKS.set_forkserver_preload(["test_all", "transformers.models.llama.modeling_llama"])
# A process's first from_pretrained builds transformers' checkpoint-conversion table (~1 s of regex
# compiling) and keeps it: loaded once here, on import, every rank forked from the server has it.
AutoModelForCausalLM.from_pretrained(toy.toy_model_dir())
toy.toy_task(0)  # and the embedded task at the default seed (toy.py keeps it): ~0.1-0.3 CPU-s a run


def run_train_py(argv, env, log, slow=None, record=None, root=ROOT, script="train.py", cwd=None):
    """In a forked process: `python train.py *argv` with env added to the environment, output to log;
    slow=(role, seconds): this rank, the last of its role, sleeps that long before each of its steps;
    record: a file that every group's sampler items are appended to (record_groups); root: another copy
    of the project, whose train.py runs on its own modules, imported afresh from it (torch, transformers
    and the Llama modeling code stay the server's), in that folder; script: another of its scripts; cwd: the
    working folder, when not root's."""
    if root != ROOT:  # slow_down and record_groups patch the server's modules, which the copy does not use
        assert not (slow or record), "slow and record act on this checkout's modules, not another copy's"
        for name, module in list(sys.modules.items()):
            path = getattr(module, "__file__", None) or ""
            if path.startswith(str(ROOT) + os.sep) and "site-packages" not in path:
                del sys.modules[name]
        sys.path.insert(0, str(root))
    os.chdir(cwd or root)
    os.environ.update(env)
    if slow:
        slow_down(*slow)
    if record:
        pipeline.group_items = record_groups(record)
    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 would in a fresh process: ranks share the cores
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.argv = [str(root / script), *argv]
    runpy.run_path(str(root / script), run_name="__main__")


def slow_down(role, seconds):
    """A straggler, for the lag tests: the last trainer sleeps before each weight broadcast (after its optimizer
    step), the last rank (a generator) before each of its polls (between two decode steps)."""
    rank, world, name = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), {"trainer": "publish_weights",
                                                                                 "generator": "poll"}[role]
    last = world - 1 if role == "generator" else 0  # the tests run one trainer
    if rank == last:
        real = getattr(pipeline, name)
        setattr(pipeline, name, lambda *a, **k: (time.sleep(seconds), real(*a, **k))[1])


def record_groups(path, real=pipeline.group_items):
    """pipeline.group_items, also appending each item it makes to `path` as a JSON line [gi, noise key,
    prompt ids]: what a run sampled from, whichever process sampled it."""
    def recording(prompt, gi, G):
        items = real(prompt, gi, G)
        with open(path, "a") as f:
            f.writelines(json.dumps([gi, key, list(p)]) + "\n" for p, key, _ in items)
        return items
    return recording


class Forked:
    """One forked process of train.py (or another of the project's scripts: run_train_py), with the
    subprocess.Popen calls the tests make."""

    def __init__(self, argv, env, log, slow=None, record=None, root=ROOT, script="train.py", cwd=None):
        self.log = log
        self.proc = FORKS.Process(target=run_train_py, args=(argv, env, str(log), slow, record, root, script, cwd))
        self.proc.start()
        self.pid = self.proc.pid

    @property
    def returncode(self):
        return self.proc.exitcode

    def poll(self):
        return self.proc.exitcode

    def wait(self, timeout=None):
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired("train.py", timeout)
        return self.proc.exitcode

    def communicate(self, timeout=None):
        self.wait(timeout)
        return Path(self.log).read_text(), None

    def send_signal(self, sig):  # as Popen's: nothing once the process has ended (the server reaps it)
        if self.proc.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self):
        self.send_signal(signal.SIGKILL)


# =============================================================================
# the README's commands. First in the file: one of the longest tests (a torchrun run of fresh interpreters
# among them), and pytest-xdist starts tests in file order; started last, it left a core idle for ~20 s

# what the README-commands test does not run here, and why
README_SKIP = [(r"pip install", "installs"), (r"pytest", "the tests themselves"),
               (r"bench\.py", "benchmarks: BENCHMARKS.md"), (r"study\.py", "test_study_quick_* runs the study"),
               (r"\b(Qwen|openai|POLARIS-Project|HuggingFaceH4)/", "a Hub id: no network here"),
               (r"--device cuda", "no GPU here")]
# the sizes every train.py command runs with here (flags given last win)
README_SHRINK = "--steps 4 --eval_every 1 --prompts 2 --samples 2 --val_size 4 --eval_samples 1 --save_every 2"


def readme_commands(text):
    """The README's shell commands, in order: the lines of its ```bash blocks, continuations joined."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip():
                lines.append(line.split("  #")[0].strip())
    return lines


def test_every_readme_command_runs_in_order_in_a_fresh_clone(tmp_path):
    """Every command of the README, in the order written, in a copy of the repository's files, with the
    training runs shrunk (README_SHRINK): none fails, and none collides with another's run folder; the ones
    that cannot run here (an install, a Hub id, a GPU) are named. The first torchrun command runs as written,
    the launcher and its ranks fresh interpreters, and listens on the loopback interface alone (launcher,
    store, gloo): under `torchrun --standalone` (or without flags) the launcher's store listened on every
    interface, and a process that was no rank listed its keys, set one and stopped the run. The other
    commands run the copy's script on its own modules, with the command's arguments and folder, in processes
    forked from the preloaded server (Forked; a torchrun command's ranks with the environment torchrun gives
    them): what that leaves out is ~5 CPU-s of imports per process, and the same launcher again."""
    clone = clone_files(tmp_path / "clone")
    setup, ran, skipped = [], [], []
    for cmd in readme_commands((ROOT / "README.md").read_text()):
        why = next((why for pattern, why in README_SKIP if re.search(pattern, cmd)), None)
        if why:
            skipped.append(why)
            continue
        if re.match(r"(export )?\w+=|\w+\(\) \{", cmd):  # a variable or function the commands after it use
            setup.append(cmd)
            continue
        cmd = cmd.replace("ckpt-000150", "ckpt-000004") + (" " + README_SHRINK if "train.py" in cmd else "")
        words, log = shlex.split(cmd), tmp_path / f"command{len(ran)}"
        if words[0].startswith("torchrun") and not any(c.startswith("torchrun") for c in ran):
            real = re.sub(r"(?<!\w)torchrun ", f"{sys.executable} -m torch.distributed.run ", "; ".join(setup + [cmd]))
            rc, out, err, listened = run_listening(real, clone)
            assert rc == 0, f"{cmd}:\n{out[-1500:]}{err[-1500:]}"
            assert "master_addr is only used" not in err  # the one-machine flags are torchrun's whole story
            assert len(listened) >= 2 and all((a.ipv4_mapped if a.version == 6 and a.ipv4_mapped else a).is_loopback
                                              for a in listened.values()), (cmd, listened)  # launcher, store, gloo
        else:
            assert words[0] in ("python", "torchrun", "torchrun_local") and "&" not in cmd and "|" not in cmd, cmd
            rcs, outs = finish_all(fork_command(words, f"{log}.log", root=clone), timeout=300)
            flat = "fit.py" in words and "a flat series" in outs[0]  # a 4-step run has no curve to fit
            assert rcs == [0] * len(rcs) or flat, f"{cmd}:\n" + "\n".join(o[-1500:] for o in outs)
        ran.append(cmd)
    assert sum("train.py" in c for c in ran) >= 4 and any("generate.py" in c for c in ran), ran
    assert any("fit.py" in c for c in ran) and sum(c.startswith("torchrun") for c in ran) >= 2, ran
    assert "a Hub id: no network here" in skipped


def clone_files(clone):
    """A copy of the repository's files (git ls-files) at `clone` -> clone."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    for f in files:
        (clone / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, clone / f)
    return clone


def readme_sbatch(text):
    """The README's multi-node batch script (its ```sh block with #SBATCH) -> (the variables it sets, exported
    or not: {name: value as written}, the words of its srun line)."""
    block = next(b for b in re.findall(r"```sh\n(.*?)```", text, re.S) if "#SBATCH" in b)
    assigned, srun = {}, None
    for line in block.replace("\\\n", " ").splitlines():
        line = line.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("srun "):
            srun = line
        else:  # NAME=$(a command), or [export] NAME=value ...
            words = [line] if "=$(" in line else shlex.split(line.removeprefix("export "))
            assert all(re.match(r"\w+=", w) for w in words), line
            assigned.update(w.split("=", 1) for w in words)
    return assigned, srun


def test_readme_multinode_script_runs_as_written_on_two_simulated_nodes(tmp_path):
    """The README's sbatch script, its variables and srun line as written, on two simulated nodes of two ranks
    each: SLURM's variables for 2 nodes of 2 GPUs, the rendezvous at 127.0.0.1 (a free port), the site's
    interfaces lo, --out and HF_HOME one absolute path, the toy in place of the Hub ids and a few steps; two
    torchrun agents, each started from its own copy of the project. Both finish; the role map names the
    ranks; --gen_ranks 0.8 of 4 is 3 generators."""
    assigned, srun = readme_sbatch((ROOT / "README.md").read_text())
    port = bench.free_port()
    swap = {"HEAD": "127.0.0.1", "OUT": str(tmp_path / "run"), "HF_HOME": str(tmp_path / "hf"),
            "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    slurm = {"SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "2", "SLURM_JOB_ID": f"sim{port}"}
    assert set(swap) <= set(assigned) and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in assigned
    values = {**assigned, **swap, **slurm}
    line = re.sub(r"\$(\w+)", lambda m: values[m.group(1)], srun).replace("127.0.0.1:29500", f"127.0.0.1:{port}")
    words = shlex.split(line)
    assert words[:2] == ["srun", "torchrun"] and "--max-restarts" in words and "--resume" in words, words
    script = words.index("train.py")
    train = words[script + 1:]
    for flag in ("--model", "--data"):  # Hub ids: the toy here, with no network
        at = train.index(flag)
        assert re.fullmatch(r"[\w-]+/[\w.-]+", train[at + 1]), train
        del train[at:at + 2]
    env = {k: values[k] for k in assigned if k != "OUT" and k != "HEAD"}  # what the script exports
    argv = ["--run-path", "--start-method", "fork", *words[2:script], "train.py", *train, *PIPE_FLAGS, "--steps", "3"]
    node1 = clone_files(tmp_path / "node1")
    agents = [Forked(argv, env, tmp_path / f"node{n}.log", root=root, script=torch.distributed.run.__file__)
              for n, root in enumerate((ROOT, node1))]
    rcs, outs = finish_all(agents, timeout=120)
    assert rcs == [0, 0], "\n".join(o[-3000:] for o in outs)
    out = "\n".join(outs)
    assert [r["step"] for r in train_records(tmp_path / "run")] == [1, 2, 3]
    host = socket.gethostname()
    assert f"node {host}: 1 trainer(s) (ranks 0), 3 generator(s) (ranks 1-3)" in out, out[-3000:]
    assert "devices: 4 ranks on the CPU" in out and "done in" in out
    assert not (node1 / "runs").exists() and not (ROOT / "runs" / "run").exists()


def code_lines(path):
    """Lines holding code: not blank, not only a comment, not part of a docstring (the README's "code lines")."""
    src = Path(path).read_text()
    docs = set()
    for node in ast.walk(ast.parse(src)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docs.update(range(first.lineno, first.end_lineno + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in skip:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - docs)


def test_readme_files_table_names_every_file_with_its_lines_and_code_lines():
    """The README's file table lists every top-level .py file once, with the line and code-line counts it has now, and
    the algorithm's total (the design card's seven files) is the table's sum."""
    text = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| `([\w.]+\.py)` \| ([\d,]+) \| ([\d,]+) \|", text, re.M)
    assert sorted(name for name, _, _ in rows) == sorted(p.name for p in ROOT.glob("*.py"))
    for name, lines, code in rows:
        path = ROOT / name
        assert (int(lines.replace(",", "")), int(code.replace(",", ""))) == (
            len(path.read_text().splitlines()), code_lines(path)), name
    core = ["train.py", "loss.py", "pipeline.py", "generate.py", "data.py", "verify.py", "fit.py"]
    assert [name for name, _, _ in rows[:7]] == core
    total = sum(code_lines(ROOT / name) for name in core)
    assert f"fit: {total:,} code lines)" in text


def listening_addresses(pids):
    """The TCP sockets the processes listen on, read from /proc/net/tcp and tcp6 -> {inode: address (ipaddress)}."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            inodes |= {link[8:-1] for link in links if link.startswith("socket:[")}
    found = {}
    for table in ("tcp", "tcp6"):
        for row in open(f"/proc/net/{table}").read().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN; the address: 32-bit words, each little-endian
                raw = bytes.fromhex(fields[1].split(":")[0])
                found[fields[9]] = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
    return found


def descendants(pid):
    """The pids of every process under `pid` (read from /proc), itself included."""
    parents = {}
    for child in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            parents[int(child)] = int(open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[1])
    found, todo = [pid], [pid]
    while todo:
        parent = todo.pop()
        kids = [c for c, p in parents.items() if p == parent]
        found += kids
        todo += kids
    return found


def run_listening(cmd, cwd, timeout=300):
    """`bash -c cmd`, and every 0.1 s while it runs the sockets its processes listen on ->
    (returncode, stdout, stderr, {inode: address} of the sockets seen)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p, seen, t0 = subprocess.Popen(["bash", "-c", cmd], cwd=cwd, stdout=out, stderr=err, text=True), {}, time.time()
        while p.poll() is None:
            seen.update(listening_addresses(descendants(p.pid)))
            if time.time() - t0 > timeout:
                p.kill()
            time.sleep(0.1)
        out.seek(0), err.seek(0)
        return p.returncode, out.read(), err.read(), seen


# =============================================================================
# loss.py: advantages, the four policy losses, the length penalty and the ratio statistics

# ---------------------------------------------------------------------------------------------
# loss.py: independent slow references (Python loops over samples and tokens, written straight
# from the paper, section 3.2: loss type, aggregation, advantage normalization) and fixtures


def slow_advantages(rewards, group, norm):
    r, g = rewards.tolist(), group.tolist()
    members = {k: [r[j] for j in range(len(r)) if g[j] == k] for k in set(g)}
    centred = [r[i] - statistics.mean(members[g[i]]) for i in range(len(r))]
    if norm == "batch":
        std = statistics.pstdev(centred)
        out = [a / (std + 1e-6) for a in centred]
    elif norm == "prompt":
        out = [centred[i] / (statistics.pstdev(members[g[i]]) + 1e-6) for i in range(len(r))]
    else:
        out = centred
    return torch.tensor(out, dtype=torch.float64)


def slow_policy_loss(logp, gen_logp, adv, mask, group, kind, agg, neg_trust=None):
    """Per-element torch ops so autograd gives the reference gradient; Python floats for sg().
    neg_trust: CISPO's tokens of a negative sample whose ratio is below it give 0 (and still count)."""
    eps_low, eps_high = {"cispo": (None, 4.0), "grpo": (0.2, 0.2), "dapo": (0.2, 0.28),
                         "gspo": (3e-3, 4e-3)}[kind]
    N, T = logp.shape
    terms, per_prompt = [], {}  # terms[i]: objective terms of sequence i's masked tokens
    for i in range(N):
        A = float(adv[i])
        toks = [t for t in range(T) if mask[i, t]]
        if kind == "gspo":
            o = 0.0 * logp[i, 0]  # a sequence without tokens: objective 0, still one of its group
            if toks:
                s = torch.exp(sum(logp[i, t] - gen_logp[i, t] for t in toks) / len(toks))
                clipped = min(max(s, torch.tensor(1 - eps_low)), torch.tensor(1 + eps_high))
                o = min(s * A, clipped * A)
            terms.append([o for t in toks])
            per_prompt.setdefault(int(group[i]), []).append(o)
            continue
        seq = []
        for t in toks:
            rho = torch.exp(logp[i, t] - gen_logp[i, t])
            if kind == "cispo" and neg_trust and A < 0 and rho.item() < neg_trust:
                seq.append(0.0 * logp[i, t])
            elif kind == "cispo":
                seq.append(min(rho.item(), eps_high) * A * logp[i, t])  # float weight: stop-grad
            else:
                clipped = min(max(rho, torch.tensor(1 - eps_low)), torch.tensor(1 + eps_high))
                seq.append(min(rho * A, clipped * A))
        terms.append(seq)
    if kind == "gspo" and agg == "prompt":  # a sequence-level objective: 1/G each within its prompt (GSPO)
        return -sum(sum(v) / len(v) for v in per_prompt.values()) / len(per_prompt)
    return -reference_aggregate(terms, group, agg)


def reference_aggregate(terms, group, agg):
    """The batch's objective from each sequence's per-token terms (terms[i]: its masked tokens'), by hand
    (section 3.2): token = the mean over every token of the batch, sample = the mean over sequences of each
    one's token mean, prompt = the mean over prompts of each group's token mean; no tokens count as 0."""
    if agg == "token":
        flat = [o for seq in terms for o in seq]
        return sum(flat) / len(flat)
    if agg == "sample":
        return sum(sum(seq) / len(seq) if seq else 0.0 for seq in terms) / len(terms)
    per_prompt = {}
    for i, seq in enumerate(terms):
        per_prompt.setdefault(int(group[i]), []).extend(seq)
    return sum(sum(o) / len(o) if o else 0.0 for o in per_prompt.values()) / len(per_prompt)


def make_batch(seed=0):
    """10 sequences, 5 prompt groups of uneven size with non-contiguous, unsorted ids, ragged
    masks (one sequence empty), ratios inside and outside every clip range, garbage padding."""
    gen = torch.Generator().manual_seed(seed)
    N, T = 10, 7
    group = torch.tensor([7, -3, 7, 42, 42, -3, 42, 5, 7, 100])
    rewards = torch.tensor([1, -1, -1, 1, 1, -1, -1, 1, 1, -1], dtype=torch.float64)
    lengths = torch.tensor([7, 3, 0, 5, 1, 7, 6, 2, 4, 7])
    mask = torch.arange(T)[None, :] < lengths[:, None]  # (N, T)
    logp = -3 * torch.rand(N, T, generator=gen, dtype=torch.float64)
    noise_scale = torch.tensor([1.0, 1e-3, 0.8, 2e-3, 0.9, 1.2, 1e-3, 0.7, 1.5, 1e-3], dtype=torch.float64)
    gen_logp = logp + noise_scale[:, None] * torch.randn(N, T, generator=gen, dtype=torch.float64)
    logp = torch.where(mask, logp, -50.0)  # padding values must not matter
    return rewards, group, mask, logp, gen_logp


def test_loss_batch_covers_all_clip_regimes():
    rewards, group, mask, logp, gen_logp = make_batch()
    rho = (logp - gen_logp).exp()[mask]
    assert (rho > 4).any() and (rho < 0.8).any() and (rho > 1.28).any()
    assert ((rho > 0.8) & (rho < 1.2)).any()
    seq = ((logp - gen_logp) * mask).sum(1) / mask.sum(1).clamp(min=1)
    s = seq.exp()[mask.any(1)]
    assert ((s > 1 - 3e-3) & (s < 1 + 4e-3)).any() and ((s < 1 - 3e-3) | (s > 1 + 4e-3)).any()


@pytest.mark.parametrize("norm", ["batch", "prompt", "none"])
@pytest.mark.parametrize("agg", ["token", "sample", "prompt"])
@pytest.mark.parametrize("kind", ["cispo", "grpo", "dapo", "gspo"])
def test_loss_policy_loss_matches_slow_reference(kind, agg, norm):
    rewards, group, mask, logp, gen_logp = make_batch()
    fast_logp = logp.clone().requires_grad_()
    fast = policy_loss(fast_logp, gen_logp, advantages(rewards, group, norm), mask, group, kind, agg)
    fast.backward()
    slow_logp = logp.clone().requires_grad_()
    slow = slow_policy_loss(slow_logp, gen_logp, slow_advantages(rewards, group, norm), mask, group, kind, agg)
    slow.backward()
    assert abs(fast.item() - slow.item()) < 1e-6
    assert torch.allclose(fast_logp.grad, slow_logp.grad, rtol=0, atol=1e-6)
    assert fast_logp.grad.abs().sum() > 0


def test_loss_gspo_weighs_each_sequence_1_over_g_within_its_prompt():
    """GSPO's objective is per sequence (s_i = exp(mean log rho), clipped): under the prompt average each prompt's
    G sequences weigh 1/G each (the paper's GSPO), not |y_i| / sum |y| as its objective spread over tokens gave."""
    rewards, group, mask, logp, gen_logp = make_batch()
    adv = advantages(rewards, group, "batch")
    eps_low, eps_high = 3e-3, 4e-3
    by_prompt = {}
    for i in range(len(group)):
        n = int(mask[i].sum())
        o = 0.0
        if n:  # a sequence without tokens counts in its group, with objective 0
            s = math.exp(float((logp[i] - gen_logp[i])[mask[i]].sum()) / n)
            o = min(s * float(adv[i]), min(max(s, 1 - eps_low), 1 + eps_high) * float(adv[i]))
        by_prompt.setdefault(int(group[i]), []).append(o)
    by_hand = -sum(sum(v) / len(v) for v in by_prompt.values()) / len(by_prompt)
    assert policy_loss(logp, gen_logp, adv, mask, group, "gspo", "prompt").item() == pytest.approx(by_hand, abs=1e-12)
    # and split into micro-batches with the whole batch's row weights, the same loss
    tokens = mask.sum(1)
    w = loss.row_weights(group, tokens, "prompt", loss.agg_counts(group, mask), kind="gspo")
    parts = [torch.arange(0, 4), torch.arange(4, 10)]
    split = sum(policy_loss(logp[p], gen_logp[p], adv[p], mask[p], group[p], "gspo", "prompt", weights=w[p]).item()
                for p in parts)
    assert split == pytest.approx(by_hand, abs=1e-12)


@pytest.mark.parametrize("norm", ["batch", "prompt", "none"])
def test_loss_advantages_match_statistics(norm):
    rewards = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, -1.0, 1.0, 0.5], dtype=torch.float64)
    group = torch.tensor([9, 2, 9, 2, 9, 30, 30, 4])  # uneven, one all-equal group, one singleton
    got = advantages(rewards, group, norm)
    assert got.shape == (8,)
    assert torch.allclose(got, slow_advantages(rewards, group, norm), rtol=0, atol=1e-9)
    # hand check, group 9 = [1, 1, -1]: mean 1/3, so A_0 = 2/3; population std sqrt(8/9)
    if norm == "none":
        assert abs(got[0].item() - 2 / 3) < 1e-12
    if norm == "prompt":
        assert abs(got[0].item() - (2 / 3) / (math.sqrt(8 / 9) + 1e-6)) < 1e-12


def test_loss_batch_advantages_split_over_trainers_equal_one_batch():
    """Two trainers, each with some prompt groups of the batch, normalize by the whole batch's std when
    all_sum adds their sums (as ranks.all_reduce_stats does): the same A as one trainer with all rows."""
    rewards = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, 0.5, 1.0, -1.0, 1.0, 1.0], dtype=torch.float64)
    group = torch.tensor([0, 0, 0, 1, 1, 2, 2, 3, 3, 3])
    centered = torch.cat([rewards[group == g] - rewards[group == g].mean() for g in range(4)])
    whole = centered / (centered.std(correction=0) + 1e-6)  # by hand
    assert torch.allclose(advantages(rewards, group, "batch"), whole, rtol=0, atol=1e-12)
    parts = [slice(0, 5), slice(5, 10)]  # trainer 0: groups 0, 1; trainer 1: groups 2, 3
    local = []  # each trainer's sums of its centered rewards
    for part in parts:
        adv = rewards[part] - torch.stack([rewards[part][group[part] == g].mean() for g in group[part]])
        local.append({"n": adv.numel(), "a": adv.sum().item(), "a2": (adv ** 2).sum().item()})
    total = {k: local[0][k] + local[1][k] for k in local[0]}  # what the all-reduce over both trainers gives
    shares = [advantages(rewards[part], group[part], "batch", all_sum=lambda d: total) for part in parts]
    assert torch.allclose(torch.cat(shares), whole, rtol=0, atol=1e-12)
    own = centered[parts[0]] / (centered[parts[0]].std(correction=0) + 1e-6)  # trainer 0's own std, by hand
    assert torch.allclose(advantages(rewards[parts[0]], group[parts[0]], "batch"), own, rtol=0, atol=1e-12)
    assert not torch.allclose(shares[0], own)  # not the part's std


def test_loss_zero_variance_keep():
    rewards = torch.tensor([1.0, -1.0, -1.0, -1.0, -1.0, 1.0, 1.0, 1.0, -1.0, 1.0])
    group = torch.tensor([5, 5, 9, 9, 9, 2, 2, 11, 5, 7])
    want = [True, True, False, False, False, False, False, False, True, False]
    assert zero_variance_keep(rewards, group).tolist() == want


def test_loss_truncated_samples_leave_the_batch_and_the_group_statistics():
    """Paper A.15's effective batch, by hand: group 0 keeps its three untruncated samples (mean 1/3),
    group 1's untruncated samples all agree, group 2 has one untruncated sample, group 3 none: dropped."""
    rewards = torch.tensor([1.0, -1, 1, 1, 1, -1, 1, 1, -1, 1, -1, -1, 1, -1, 1, -1])
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3])
    truncated = torch.tensor([0, 0, 0, 1, 0, 1, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1], dtype=torch.bool)
    keep = zero_variance_keep(rewards, group, ~truncated)
    assert keep.tolist() == [True, True, True] + [False] * 13
    adv = advantages(rewards[keep], group[keep], "none")
    assert torch.allclose(adv, torch.tensor([2 / 3, -4 / 3, 2 / 3]))
    # kept in, every group but group 3 has both rewards
    assert zero_variance_keep(rewards, group).tolist() == [True] * 12 + [True] * 4


def test_loss_length_penalty_points():
    l_max, l_cache = 14336, 2048
    lengths = torch.tensor([0, 100, l_max - l_cache, l_max - l_cache // 2, l_max, l_max + 500])
    want = [0.0, 0.0, 0.0, -0.5, -1.0, -1.0]
    assert length_penalty(lengths).tolist() == want
    assert length_penalty(torch.tensor([30, 40, 35]), l_max=40, l_cache=10).tolist() == [0.0, -1.0, -0.5]


def test_loss_cispo_gradient_is_stop_gradient_weight():
    rewards, group, mask, logp, gen_logp = make_batch(seed=1)
    adv = slow_advantages(rewards, group, "none")
    x = logp.clone().requires_grad_()
    policy_loss(x, gen_logp, adv, mask, group, kind="cispo", agg="token").backward()
    weight = (logp - gen_logp).exp().clamp(max=4.0)  # sg(min(rho, 4)); no d rho / d logp term
    want = -weight * adv[:, None] * mask / mask.sum()
    assert torch.allclose(x.grad, want, rtol=1e-12, atol=1e-15)


def test_loss_cispo_caps_ratio_at_4_and_optional_floor():
    logp = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    gen_logp = torch.tensor([[-4.0, -1.0, 4.0]], dtype=torch.float64)  # rho = e^3, 1, e^-5
    mask, group, adv = torch.ones(1, 3, dtype=torch.bool), torch.tensor([0]), torch.tensor([1.0])
    policy_loss(logp, gen_logp, adv, mask, group, kind="cispo", agg="token").backward()
    assert torch.allclose(logp.grad, -torch.tensor([[4.0, 1.0, math.exp(-5)]], dtype=torch.float64) / 3)
    logp.grad = None
    policy_loss(logp, gen_logp, adv, mask, group, kind="cispo", agg="token", eps_low=0.5, eps_high=8.0).backward()
    assert torch.allclose(logp.grad, -torch.tensor([[8.0, 1.0, 0.5]], dtype=torch.float64) / 3)


def test_loss_cispo_negative_trust_mask_drops_only_negative_tokens_already_below_it():
    """--neg_trust: a token of a negative-advantage sample whose ratio is under the bound gives no gradient (PPO's
    clip for A < 0); the same token of a positive sample, and negative ones at or above the bound, keep CISPO's
    gradient sg(min(rho, 4)) * A; the token still counts in the mean."""
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    gen_logp = torch.tensor([[-0.5, -1.1, -1.0], [-0.5, -1.1, -1.0]], dtype=torch.float64)  # rho e^-.5, e^.1, 1
    mask, group, adv = torch.ones(2, 3, dtype=torch.bool), torch.tensor([0, 0]), torch.tensor([1.0, -1.0])
    policy_loss(logp, gen_logp, adv, mask, group, kind="cispo", agg="token", neg_trust=0.8).backward()
    rho = torch.tensor([math.exp(-0.5), math.exp(0.1), 1.0], dtype=torch.float64)
    want = -torch.stack([rho, -rho * torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64)]) / 6  # rho e^-.5 < 0.8
    assert torch.allclose(logp.grad, want)


def test_loss_empty_masks_and_inf_padding_give_no_nan():
    logp = torch.tensor([[-1.0, -float("inf")], [-float("inf"), -float("inf")]], requires_grad=True)
    gen_logp = torch.tensor([[-1.5, -float("inf")], [-float("inf"), -float("inf")]])
    mask = torch.tensor([[1.0, 0.0], [0.0, 0.0]])  # float mask; group 8 has no tokens at all
    group, adv = torch.tensor([3, 8]), torch.tensor([1.0, -1.0])
    for kind in ["cispo", "grpo", "dapo", "gspo"]:
        for agg in ["token", "sample", "prompt"]:
            logp.grad = None
            loss = policy_loss(logp, gen_logp, adv, mask, group, kind, agg)
            loss.backward()
            assert torch.isfinite(loss) and torch.isfinite(logp.grad).all(), (kind, agg)
            assert logp.grad[mask == 0].abs().sum() == 0


def test_loss_ratio_stats():
    logp = torch.tensor([[-1.0, -1.0, 0.0], [-2.0, -9.0, -9.0]])
    gen_logp = torch.tensor([[-1.5, -3.0, 5.0], [-1.0, 0.0, 0.0]])  # diffs 0.5, 2.0, (pad), -1.0
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    stats = ratio_stats(logp.requires_grad_(), gen_logp, mask)
    assert stats == pytest.approx({"abs_diff_mean": 3.5 / 3, "abs_diff_max": 2.0, "frac_above_cap": 1 / 3})
    # the bound follows the loss: rho = e^0.5 = 1.65 and e^2 = 7.4 are above dapo's 1.28 and cispo's cap of 1.5
    assert ratio_stats(logp, gen_logp, mask, "dapo")["frac_above_cap"] == pytest.approx(2 / 3)
    assert ratio_stats(logp, gen_logp, mask, "cispo", eps_high=1.5)["frac_above_cap"] == pytest.approx(2 / 3)
    assert ratio_stats(logp, gen_logp, mask, "grpo", eps_high=1.0)["frac_above_cap"] == pytest.approx(1 / 3)  # 2.0 > ln 2


def test_loss_bad_names_raise():
    rewards, group, mask, logp, gen_logp = make_batch()
    adv = advantages(rewards, group)
    with pytest.raises(ValueError, match="cispo, grpo, dapo, gspo"):
        policy_loss(logp, gen_logp, adv, mask, group, kind="ppo")
    with pytest.raises(ValueError, match="prompt, sample, token"):
        policy_loss(logp, gen_logp, adv, mask, group, agg="seq")
    with pytest.raises(ValueError, match="batch, prompt, none"):
        advantages(rewards, group, norm="group")


@pytest.mark.parametrize("kind, high", [("grpo", 1.2), ("dapo", 1.28), ("gspo", 1.004)])
def test_policy_loss_clipped_kinds_stay_finite_when_the_ratio_overflows(kind, high):
    mask, group = torch.ones(1, 1, dtype=torch.bool), torch.tensor([0])
    for a, loss_expected in ((1.0, -high), (0.0, 0.0), (-1.0, math.exp(20.0))):  # rho = e^94.99 -> held at e^20
        logp = torch.tensor([[-0.01]], requires_grad=True)
        loss = policy_loss(logp, torch.tensor([[-95.0]]), torch.tensor([a]), mask, group, kind, "token")
        loss.backward()
        assert loss.item() == pytest.approx(loss_expected, rel=1e-5) and logp.grad.item() == 0.0
    logp = torch.tensor([[-1.0]], requires_grad=True)  # rho = e^5, A = -1: unclipped, unchanged
    loss = policy_loss(logp, torch.tensor([[-6.0]]), torch.tensor([-1.0]), mask, group, kind, "token")
    loss.backward()
    assert loss.item() == pytest.approx(math.exp(5.0), rel=1e-5)
    assert logp.grad.item() == pytest.approx(math.exp(5.0), rel=1e-5)  # d(-rho A)/d logp = rho
    logp = torch.tensor([[-0.01]], requires_grad=True)  # cispo needed no clamp: the weight is the cap 4
    loss = policy_loss(logp, torch.tensor([[-95.0]]), torch.tensor([1.0]), mask, group, "cispo", "token")
    loss.backward()
    assert loss.item() == pytest.approx(0.04) and logp.grad.item() == pytest.approx(-4.0)

# =============================================================================
# verify.py: math answers extracted and checked for equivalence, and the routing of math and code rewards

FIXTURES = Path(__file__).resolve().parent / "fixtures"  # what each file is, and its source: fixtures/README.md


def _jsonl(path):
    return [json.loads(line) for line in open(path)]


def _gsm8k_gold(row):
    return row["answer"].split("####")[-1].strip()


def test_verify_math500_answers_verify_against_themselves():
    rows = _jsonl(FIXTURES / "math500.jsonl")
    boxed = [f"<think>\nwork\n</think>\nSo the answer is $\\boxed{{{r['answer']}}}$." for r in rows]
    golds = [r["answer"] for r in rows]
    failed = [g for g, ok in zip(golds, score_batch(boxed, golds)) if not ok]
    failed_solutions = [r["answer"] for r in rows if not score(r["solution"], r["answer"])]
    print(f"\nMATH-500: {len(failed)}/500 fail as \\boxed{{answer}}, "
          f"{len(failed_solutions)}/500 fail from their own solution: {failed + failed_solutions}")
    assert failed == [] and failed_solutions == []


def test_verify_math500_wrong_answers_do_not_verify():
    golds = [r["answer"] for r in _jsonl(FIXTURES / "math500.jsonl")]
    responses, targets = [], []
    for i, gold in enumerate(golds):
        for offset in (137, 251):                 # another problem's answer (checked: no
            other = golds[(i + offset) % 500]     # pair at these offsets is equal but not
            if other != gold:                     # the same string)
                responses.append(f"\\boxed{{{other}}}")
                targets.append(gold)
        if re.fullmatch(r"-?\d+", gold):           # off by one, sign
            responses += [f"\\boxed{{{int(gold) + 1}}}", f"\\boxed{{{int(gold) - 1}}}"]
            targets += [gold, gold]
    wrongly_true = [(t, r) for t, r, ok in zip(targets, responses, score_batch(responses, targets)) if ok]
    assert len(responses) > 1200 and wrongly_true == []


def test_verify_gsm8k_answers_and_near_misses():
    golds = [_gsm8k_gold(r) for r in _jsonl(FIXTURES / "gsm8k_test_sample.jsonl")]
    for i, gold in enumerate(golds):
        value = int(gold.replace(",", ""))
        other = int(golds[i - 1].replace(",", ""))              # another problem's answer
        for response in (f"<think>\nadd them\n</think>\nShe makes $\\boxed{{{gold}}}$ dollars.",
                         f"She makes ${value} every day.\n#### {gold}", f"#### {value}"):
            assert verify.quick_check(extract_answer(response), gold) is True, (gold, response)
        for wrong in {value + 1, value - 1, -value or 1, other} - {value}:
            assert verify.quick_check(extract_answer(f"\\boxed{{{wrong}}}"), gold) is False, (gold, wrong)
    assert score("Janet makes 9 * 2 = $18.\n#### 18", "18")          # the public path too


def test_verify_plain_numbers_never_start_a_worker(monkeypatch):
    def no_worker(*args):
        raise AssertionError("plain numbers must be decided in-process")
    monkeypatch.setattr(verify, "_ask_worker", no_worker)
    pairs = [("\\boxed{72}", "72"), ("#### 1,000", "1000"), ("\\boxed{0.5}", "\\frac{1}{2}"),
             ("\\boxed{3/4}", "0.75"), ("\\boxed{-\\dfrac{3}{8}}", "-\\frac38"), ("\\boxed{73}", "72")]
    start = time.perf_counter()
    verdicts = [score(response, gold) for _ in range(200) for response, gold in pairs]
    per_call = (time.perf_counter() - start) / len(verdicts)
    print(f"\nin-process check: {per_call * 1e6:.0f} us per call")
    assert verdicts[:6] == [True] * 5 + [False] and per_call < 1e-3


EQUIVALENT = [  # (gold, answer)
    # fractions, decimals, prefixes, degrees, percent, units, thousands separators
    (r"\frac{1}{2}", "1/2"), (r"\frac{1}{2}", r"\dfrac{1}{2}"), (r"\frac{1}{2}", r"\tfrac12"),
    (r"\frac 34", "0.75"), ("0.5", r"\frac{1}{2}"), ("5", "x = 5"), ("x=5", "5"), ("5", "k=5"),
    (r"30^\circ", "30"), ("30", r"30^{\circ}"), (r"50\%", "50"), ("50", r"50\%"), (r"15\mbox{ cm}^2", "15"),
    (r"5.4 \text{ cents}", "5.4"), ("12", "12 inches"),
    ("1,000", "1000"), ("1000", "1,000"), (r"10,\!080", "10080"), (r"\$32,\!348", "32348"),
    # sets, lists, plus-minus, intervals, tuples, matrices
    (r"\{1,2\}", r"\{2,1\}"), ("3, 5, 7", "7,5,3"), ("-2,1", r"\{1, -2\}"),
    (r"1 \pm \sqrt{19}", r"1-\sqrt{19}, 1+\sqrt{19}"), (r"\{1\pm\sqrt{5},-2\}", r"-2, 1+\sqrt5, 1-\sqrt5"),
    ("(3,4]", r"\left(3, 4\right]"), (r"x \in [-2,7]", "[-2, 7]"),
    (r"(-\infty, 2) \cup (3, \infty)", r"(3,\infty)\cup(-\infty,2)"),
    (r"\left( 3, \frac{\pi}{2} \right)", r"(3, \pi/2)"), ("(6,31,-1)", "(6, 31, -1)"),
    (r"\begin{pmatrix} 1/5 \\ -18/5 \end{pmatrix}", r"\begin{bmatrix}0.2\\-\frac{18}{5}\end{bmatrix}"),
    # roots, pi, unsimplified expressions, functions, complex numbers, equations
    (r"\sqrt{8}", r"2\sqrt{2}"), (r"11\sqrt2", r"\sqrt{242}"), (r"\frac{\sqrt{3}}{3}", r"\frac{1}{\sqrt{3}}"),
    (r"\pi", r"\frac{2\pi}{2}"), (r"-\frac{\pi}{6}", r"-\pi/6"), (r"18+2\pi", r"2\pi+18"),
    (r"\frac{20000}{\pi}", r"20000/\pi"), ("x^2+2x+1", "(x+1)^2"), ("(a+5)(b+2)", "ab+2a+5b+10"),
    ("2k+2", "2(k+1)"), (r"\frac{11+9a}{20}", r"\frac{11}{20}+\frac{9a}{20}"),
    (r"\cot x", r"\frac{\cos x}{\sin x}"), ("-2 + 7i", "7i - 2"), ("2^{10}", "1024"), (r"\log_2 8", "3"),
    ("5!", "120"), (r"\binom{5}{2}", "10"), (r"1\frac{4}{5}", r"\frac{9}{5}"), (r"137 \frac{1}{2}", "137.5"),
    (".0000672", r"6.72\times10^{-5}"), ("y = 2x + 3", "y=3+2x"), ("5x - 7y + 11z + 4 = 0", "-10x+14y-22z-8=0"),
    # words, multiple choice, base-n
    (r"\text{(B)}", "B"), (r"\text{east}", "East"), ("204_5", "204_{5}"),
]

NEAR_MISSES = [  # (gold, answer)
    ("72", "73"), ("72", "-72"), (r"\frac{1}{2}", r"\frac{1}{3}"), (r"\frac{3}{4}", r"\frac{4}{3}"),
    ("0.5", "0.51"), ("5", "x = 6"), (r"30^\circ", r"\frac{\pi}{6}"), ("(1,2)", "(2,1)"), ("(15,-29)", "(15,29)"),
    ("(3,4]", "(3,4)"),
    ("[1,2)", "[1,2]"), (r"(-\infty, 0]", r"(-\infty, 0)"), (r"\{1,2\}", r"\{1,3\}"), (r"\{1,2\}", r"\{1,2,3\}"),
    (r"1 \pm \sqrt{19}", r"1+\sqrt{19}"), ("(1,2)", "1,2"), (r"\sqrt{8}", r"3\sqrt{2}"), (r"\pi", "3.14"),
    (r"12\pi", "12"), ("x^2+2x+1", "(x-1)^2"), ("2k+2", "2k+1"), (r"\frac{x+1}{2}", r"\frac{x}{2}+1"),
    ("-2 + 7i", "-2 - 7i"), ("3R^2", "3r^2"), ("204_5", "54"), (r"\text{(C)}", "D"), (r"\text{Evelyn}", "Navin"),
    (r"\text{east}", "e a s t"), ("5x - 7y + 11z + 4 = 0", "5x - 7y + 11z + 5 = 0"),
    (r"\begin{pmatrix} -1 & 0 \\ 0 & -1 \end{pmatrix}", r"\begin{pmatrix} -1 & 0 \\ 0 & 1 \end{pmatrix}"),
]


def test_verify_equivalent_rewrites():
    responses = [f"The answer is $\\boxed{{{answer}}}$." for _, answer in EQUIVALENT]
    verdicts = score_batch(responses, [gold for gold, _ in EQUIVALENT])
    assert [pair for pair, ok in zip(EQUIVALENT, verdicts) if not ok] == []


def test_verify_near_misses_are_false():
    responses = [f"The answer is $\\boxed{{{answer}}}$." for _, answer in NEAR_MISSES]
    verdicts = score_batch(responses, [gold for gold, _ in NEAR_MISSES])
    assert [pair for pair, ok in zip(NEAR_MISSES, verdicts) if ok] == []


def test_verify_extraction():
    cases = {
        r"<think>maybe \boxed{3}</think> so $\boxed{\frac{1}{2}}$": r"\frac{1}{2}",   # after </think>
        r"no think block: $\boxed{\frac{\sqrt{3}}{2}}$ done": r"\frac{\sqrt{3}}{2}",  # nested braces
        r"first \boxed{1}, then \boxed{2}": "2",                                      # last box wins
        r"\boxed 5 is it": "5", r"\fbox{7}": "7", r"\boxed{\{1,2\}}": r"\{1,2\}",
        r"so the answer is $\frac{1}{2}$.": r"\frac{1}{2}", "Final Answer: 42": "42", "Answer: 7": "7",
        "Final Answer: The final answer is $5$. I hope it is correct.": "5",
        "Janet makes $18 a day.\n#### 18": "18", "<think>\nok\n</think>\n42": "42",
        "<think>\nthe answer is \\boxed{7}": None,                     # interrupted while thinking
        r"\boxed{\frac{1}{2}": None, "": None, "a\nlong\nanswer without a box": None,
    }
    for response, answer in cases.items():
        assert extract_answer(response) == answer, response
    assert extract_answer(None) is None and extract_answer(b"\\boxed{1}") is None


def test_verify_interrupted_response_scores_false():
    assert not score("<think>\nI think it is \\boxed{5}, let me check", "5")
    assert score("<think>\nI think it is \\boxed{5}\n</think>\n\\boxed{5}", "5")


def test_verify_pathological_inputs_return_false_in_time():
    boxed = [r"9^{9^{9^9}}", r"(10^{9999})^{9999}", "100000!", r"10^{10^{10}}", r"e^{e^{e^{e^{10}}}}",
             r"\sin(2^{10000})", r"(x+1)^{10000}-(x+1)^{9999}", r"\binom{100000}{50000}",
             "(" * 5000 + "x" + ")" * 5000, "1" * (1 << 20), "-" * 901 + "5", "\ud800\udfff", "\x00\x01",
             r"\frac{1}{0}", "0^{-1}", "x^x^x^x", r"\frac{}{}",
             r"\begin{pmatrix}\end{pmatrix}", r"\left( \right]", ")("]
    inputs = [f"\\boxed{{{b}}}" for b in boxed] + ["\\boxed{" + "{" * 100_000, "x" * (1 << 20)]
    for response in inputs:
        start = time.perf_counter()
        verdict = score(response, "5", timeout=2.0)
        assert verdict is False and time.perf_counter() - start < 3.0, response[:40]
    for response, gold in ((None, "5"), (5, "5"), ("\\boxed{5}", None), ("\\boxed{5}", "")):
        assert score(response, gold) is False
    rng = random.Random(0)                                     # random LaTeX soup
    pieces = [r"\frac", "{", "}", "(", ")", "]", r"\sqrt", "^", "_", "x", "9", ".", ",", r"\pi", r"\pm",
              r"\{", "=", "-", r"\text{", r"\left(", r"\cup", "!", "|", r"\sin", r"\begin{pmatrix}", "&", r"\\",
              "%", "\udfff"]
    soup = ["\\boxed{" + "".join(rng.choices(pieces, k=rng.randint(1, 30))) + "}" for _ in range(300)]
    start = time.perf_counter()
    verdicts = score_batch(soup, ["".join(rng.choices(pieces, k=3)) for _ in soup], timeout=2.0)
    assert all(isinstance(v, bool) for v in verdicts) and time.perf_counter() - start < 20


def test_verify_slow_sympy_is_cut_off_and_the_worker_replaced():
    start = time.perf_counter()
    assert score(r"\boxed{\sqrt{9999!+1}}", "5", timeout=1.0) is False    # sympy factors 35k digits
    assert time.perf_counter() - start < 2.0
    assert score(r"\boxed{2\sqrt{2}}", r"\sqrt{8}") is True                 # a fresh worker answers


def test_verify_score_works_from_threads():
    results = {}
    pairs = [(r"\boxed{2\sqrt{2}}", r"\sqrt{8}"), (r"\boxed{(2,1)}", "(1,2)"), (r"\boxed{72}", "72")]
    threads = [threading.Thread(target=lambda i=i: results.update({i: score(*pairs[i % 3])}))
               for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results == {i: [True, False, True][i % 3] for i in range(6)}


def test_verify_score_batch_equals_score_item_by_item():
    rows = _jsonl(FIXTURES / "verify_pairs.jsonl")[1:][::7][:200]
    responses, golds = [r["response"] for r in rows], [r["gold"] for r in rows]
    batch = score_batch(responses, golds, workers=2)
    assert batch == [score(response, gold) for response, gold in zip(responses, golds)]
    assert len(batch) == 200 and 0 < sum(batch) < len(batch)


def test_verify_agrees_with_math_verify():
    """fixtures/verify_pairs.jsonl: 1548 (gold, response) pairs from MATH-500 answers (rewrites,
    sympy.latex forms, near misses, another problem's answer), 50 hand-written pairs and GSM8K
    test answers, with HF math-verify 0.9.0's verdict as `reference`
    (verify(parse('$\\boxed{' + gold + '}$'), parse(response))) and a `note` where that verdict
    is wrong. math-verify was installed only to build the file; the building script is not
    kept. A disagreement counts as agreement only when the row's note explains it."""
    rows = _jsonl(FIXTURES / "verify_pairs.jsonl")[1:]
    verdicts = score_batch([r["response"] for r in rows], [r["gold"] for r in rows])
    disagreements = [(r, v) for r, v in zip(rows, verdicts) if v != r["reference"]]
    unexplained = [r for r, _ in disagreements if not r.get("note")]
    print(f"\nagreement with math-verify: {1 - len(disagreements) / len(rows):.4f} raw, "
          f"{1 - len(unexplained) / len(rows):.4f} counting noted cases ({len(rows)} pairs)")
    for r, v in disagreements:
        print(f"  ours {v}, math-verify {r['reference']}: gold {r['gold']!r}, response {r['response'][-60:]!r}"
              f"{' | note: ' + r['note'] if r.get('note') else ''}")
    assert 1 - len(unexplained) / len(rows) >= 0.99

# -----------------------------------------------------------------------------
# math: the extraction cases of the issue


def test_verify_extraction_cases_of_the_issue():
    cases = {
        "<think>\nit is \\boxed{3}\n</think>\nSo $\\boxed{4}$.": "4",                    # after </think>
        "\\boxed{\\frac{\\sqrt{3}}{2}} and \\boxed{\\left\\{1,\\{2\\}\\right\\}}": "\\left\\{1,\\{2\\}\\right\\}",
        "so \\boxed 5.": "5", "\\fbox{6}": "6", "\\boxed{1}, \\fbox{2}, \\boxed{3}": "3",
        "Final Answer: 42": "42", "**Final Answer:** 12": "12", "**Final Answer**: $12$": "12",
        "Final Answer:\n\\frac{1}{2}": "\\frac{1}{2}", "**Answer:** 7": "7",
        "Natalia sold 48 + 24 = 72 clips.\n#### 72": "72", "#### 1,234": "1,234",
    }
    for response, answer in cases.items():
        assert extract_answer(response) == answer, response
    assert score("**Final Answer:** 12", "12") and score("#### 72", "72") and score("\\boxed 5", "5")


def test_verify_interrupted_response_never_answered():
    thinking = "<think>\nLet me add: 3 + 4 = 7, so \\boxed{7}. Let me check again"
    for response in (thinking + INTERRUPT_PHRASE, thinking + INTERRUPT_PHRASE + "\n\n",
                     thinking + INTERRUPT_PHRASE + " The final answer is", thinking):
        assert extract_answer(response) is None and score(response, "7") is False, response[-40:]
    assert score(thinking + INTERRUPT_PHRASE + " The answer is \\boxed{7}.", "7") is True

# -----------------------------------------------------------------------------
# math: fuzz


NASTY = [r"9^{9^{9^9}}", "100000!", r"(10^{9999})^{9999}", r"10^{10^{10}}", r"e^{e^{e^{e^{10}}}}",
         r"\binom{100000}{50000}", r"(x+1)^{10000}-(x+1)^{9999}", r"\frac{1}{0}", "0^{-1}", "x^x^x^x",
         r"\sqrt[0]{2}", r"\log_0 1", r"\sin(2^{10000})", r"\sqrt{-1}^{\sqrt{-1}}", r"\infty-\infty"]
PIECES = [r"\frac", "{", "}", "(", ")", "[", "]", r"\sqrt", "^", "_", "x", "y", "9", "99", ".", ",", r"\pi",
          r"\pm", r"\{", r"\}", "=", "-", "+", "*", "/", r"\text{", r"\left(", r"\right)", r"\cup", "!", "|",
          r"\sin", r"\log", r"\begin{pmatrix}", r"\end{pmatrix}", "&", r"\\", "%", "i", "e", r"\infty",
          r"\boxed{", r"\fbox", "</think>", "<think>", "####", "Final Answer:", "\ufffd", "\udfff", "\x00"]


def fuzz_cases(rng):
    """10,000 (response, gold) pairs: most decided in-process, about 1,700 go to the sympy workers."""
    cases = []
    for _ in range(9000):                                   # quick path: numbers, junk, huge text
        kind = rng.random()
        if kind < 0.5:
            cases.append((f"\\boxed{{{rng.randint(-10**6, 10**6)}}}", str(rng.randint(-10**6, 10**6))))
        elif kind < 0.8:
            junk = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 300))).decode("utf-8", errors="replace")
            cases.append((junk, rng.choice(["5", junk, r"\frac12"])))
        elif kind < 0.98:
            cases.append((f"#### {rng.random() * 10**rng.randint(0, 30)}", f"{rng.randint(0, 99)}/{rng.randint(1, 99)}"))
        else:
            big = rng.choice(["{", "(", "\\boxed{", "9", "x^", "\ufffd"]) * rng.randint(1 << 18, 1 << 20)
            cases.append(rng.choice([(big, "5"), ("\\boxed{5}", big), (big, big)]))
    for i in range(700):                                    # sympy path: soup, nesting, huge values
        soup = "".join(rng.choices(PIECES, k=rng.randint(1, 40)))
        deep = "(" * rng.randint(20, 80) + "x+1" + ")" * rng.randint(20, 80)
        answer = rng.choice([soup, deep, NASTY[i % len(NASTY)], "x" * rng.randint(990, 1010)])
        cases.append((f"<think>{soup}</think> \\boxed{{{answer}}}", rng.choice([soup, "x+1", NASTY[i % len(NASTY)]])))
    for _ in range(300):                                    # nasty golds and non-strings
        cases.append((rng.choice(["\\boxed{5}", "#### 7", None, 5, b"\\boxed{1}"]),
                      rng.choice(NASTY + [None, 7, "", "\udfff" * 2000])))
    rng.shuffle(cases)
    return cases


def test_verify_answer_key_prefilter_and_last_box_equal_the_regex_scans():
    """extract_answer skips the answer-key regex when _may_have_key says no key can match, and last_boxed
    searches from the end: on soups of keys in every case IGNORECASE matches (upper case, a long s), the
    prefilter says yes wherever the regex matches, and the last box equals the last match of a left-to-right
    scan."""
    rng = random.Random(2)
    parts = ["answer", "ANSWER", "an\u017fwer", "AnSwEr", "#", "##", "####", "final", "FINAL ", "the ", "is", ":", "*",
             " ", "\n", "5", "\u0131", "\u0130", "answeR:", "\\boxed{3}", "\\fbox{", "\\\\boxed", "}", "\\"]
    matched = 0
    for _ in range(20_000):
        text = "".join(rng.choices(parts, k=rng.randint(0, 10)))
        if verify._ANSWER_KEY.search(text):
            matched += 1
            assert verify._may_have_key(text), text
        ends = [m.end() for m in verify._BOX.finditer(text)]
        assert verify.last_boxed(text) == (verify._box_content(text, ends[-1]) if ends else None), text
    assert 5_000 < matched < 19_000 and not verify._may_have_key("{" * 1000 + "answe r")


def test_verify_fuzz_10k_adversarial_strings_never_raise_or_hang():
    cases = fuzz_cases(random.Random(0))
    timeout, exceptions, verdicts = 2.0, 0, []
    start = time.perf_counter()
    for chunk in range(0, 9800, 980):                      # most through score_batch, chunk by chunk
        part = cases[chunk:chunk + 980]
        batch_start = time.perf_counter()
        try:
            verdicts += score_batch([r for r, _ in part], [g for _, g in part], workers=2, timeout=timeout)
        except Exception:
            exceptions += 1
        assert time.perf_counter() - batch_start < 30.0
    max_call = 0.0
    for response, gold in cases[9800:]:                   # the rest one by one through score()
        call_start = time.perf_counter()
        try:
            verdicts.append(score(response, gold, timeout=timeout))
        except Exception:
            exceptions += 1
        max_call = max(max_call, time.perf_counter() - call_start)
    total = time.perf_counter() - start
    print(f"\nfuzz: {len(cases)} cases, {exceptions} exceptions, max score() call {max_call:.2f} s, "
          f"{total:.1f} s in all, {sum(verdicts)} True")
    assert len(cases) == 10_000 and exceptions == 0 and len(verdicts) == 10_000
    assert all(isinstance(v, bool) for v in verdicts)
    assert max_call < timeout + 2.0 and total < 60.0

# -----------------------------------------------------------------------------
# math and code: score_problems sends each problem to its verifier


def test_score_problems_routes_math_and_code():
    problems = [{"answer": "4", "domain": "math"}, {"tests": SUM, "domain": "code"}, {"answer": "5"},
                {"tests": SUM, "domain": "code"}]
    responses = ["</think> \\boxed{4}", fenced("a, b = map(int, input().split())\nprint(a + b)"), "\\boxed{4}",
                 fenced("print(3)")]
    assert verify.score_problems(responses, problems) == [True, True, False, False]

# -----------------------------------------------------------------------------
# math: multi-root answers, {,} separators, units, exact rationals, hedged \text


def _verdicts(cases):
    """score_batch on (answer, gold, expected) triples, each answer boxed after </think>."""
    responses = [f"<think>\nwork\n</think>\nSo $\\boxed{{{answer}}}$." for answer, _, _ in cases]
    return score_batch(responses, [gold for _, gold, _ in cases])


def test_verify_each_root_may_name_its_variable():
    cases = [(r"x = -1, x = 2", "-1, 2", True), (r"x=2 \text{ or } x=3", "2, 3", True),
             (r"x = 2 \text{ and } x = 3", r"\{3, 2\}", True), ("x=2, 3", "2,3", True),
             ("x = -1, x = 2", "x=-1, x=2", True), (r"x = 1, x = 2", "1, 2, 3", False),
             ("x=2", "2, 3", False), ("x=5, y=6", "5, 6", False), ("x = -1, x = 3", "-1, 2", False),
             (r"5 \text{ or } 6", "5", False), ("5 or 6", "5", False), ("x=5 or x=6", "5", False)]
    assert _verdicts(cases) == [expected for _, _, expected in cases]


def test_verify_latex_thousands_separator():
    cases = [("1{,}000", "1000", True), ("10{,}000", "10,000", True), (r"\$1{,}234{,}567", "1234567", True),
             ("1{,}000", "1001", False), ("1{,}5", "15", False)]
    assert _verdicts(cases) == [expected for _, _, expected in cases]


def test_verify_units_with_a_slash_or_a_power_are_dropped():
    cases = [(r"3 \text{ m/s}", "3", True), (r"4.5\ \text{km/h}", "4.5", True), (r"12 \text{ m/s}^2", "12", True),
             (r"5\text{/hour}", "5", True), (r"5 \text{ cm}^2", "5", True), (r"\text{5 cm}^2", "5", True),
             ("5 ft^2", "5", True), ("4.5 km/h", "4.5", True),
             (r"3\text{/}4", "34", False), (r"3\text{/}4", "0.75", True), (r"3 \text{ / } 4", "34", False),
             (r"3 \text{ m/s}", "4", False)]
    assert _verdicts(cases) == [expected for _, _, expected in cases]


def test_verify_rational_gold_is_compared_exactly():
    cases = [(r"\frac{1}{3} + 10^{-12}i", r"\frac13", False),
             (r"\sqrt{0.1111111111111}", r"\frac13", False),
             (r"\frac{1}{3}+\pi^{-50}", r"\frac13", False), (r"10^{-30}\pi", "0", False),
             ("0.3333333333333", r"\frac13", False),
             ("2/6", r"\frac13", True), (r"\dfrac{1}{3}", r"\frac13", True),
             (r"\frac{1}{\sqrt{9}}", r"\frac13", True), (r"\sqrt{3+2\sqrt{2}}-\sqrt{2}", "1", True),
             (r"\sin^2 x+\cos^2 x", "1", False), (r"\sin^2 x+\cos^2 x-1", "0", False),   # x: no number
             (r"\cos(\pi/3)", "0.5", True), (r"\frac{\sqrt2}{2}", r"\frac{1}{\sqrt2}", True)]
    assert _verdicts(cases) == [expected for _, _, expected in cases]


def test_verify_negated_or_hedged_text_is_not_a_unit():
    cases = [(r"\text{not } 5", "5", False), (r"5 \text{ is not correct}", "5", False),
             (r"\text{no solution except } 5", "5", False), (r"5 \text{ or perhaps } 6", "56", False),
             (r"\text{at least } 5", "5", False), ("5 or more", "5", False), ("5 or six", "5", False),
             (r"5 \text{ apples}", "5", False), (r"5 \text{ more cookies}", "5", False),  # no units: off the list
             ("18 dollars", "18", True),
             (r"5\text{ or }6", "6, 5", True), (r"5 \text{ OR } 6", "5, 6", True)]
    assert _verdicts(cases) == [expected for _, _, expected in cases]

# -----------------------------------------------------------------------------
# math: forged answers (a reward the policy can forge is a wrong reward)


FORGED_MATH = [  # (answer, gold): each scored True by fixed sample points x, y > 1 or a 1e-9 tolerance
    ("x", "|x|"), ("y-x", "|x-y|"), (r"\frac{|x|}{x}", "1"), ("4 + (97x-100)(97x-137)(97x-174)", "4"),
    (r"x + 10^{12} + 1", r"x + 10^{12}"), (r"y = 10^{12}x + 7", r"y = 10^{12}x + 5"),
    (r"\sqrt{x^2}", "x"), ("|x+y|", "x+y"), (r"\sqrt{x} + 10^{12} + 1", r"\sqrt{x} + 10^{12}"),
    (r"2^{40}x + 1", r"2^{40}x"), (r"\frac{x^2-1}{x-1} + 10^{-15}", "x+1"), (r"\ln(x^2)", r"2\ln x"),
    (r"\sin^2 x + \cos^2 x", "1"), (r"|(97x-100)(97x-137)|", "(97x-100)(97x-137)"),
]
GENUINE_MATH = [  # (answer, gold): exact rewrites that must stay True
    ("|x|", "|x|"), ("x+1", "1+x"), (r"\frac{1}{2}", "0.5"), ("y = 2x+5", "y=5+2x"), ("|-x|", "|x|"),
    (r"\sqrt{x^2}", "|x|"), ("|x|^2", "x^2"), (r"\frac{x^2-1}{x-1}", "x+1"), (r"10^{12}x + 5", r"5 + 10^{12}x"),
    (r"2x(\sin^2 x + \cos^2 x)", "2x"), (r"(\sqrt3+1)^2", r"4+2\sqrt3"), (r"\sqrt{10^{24}}", r"10^{12}"),
    ("2x + 4y = 6", "x + 2y = 3"), (r"\frac{\sqrt{x}}{2}", r"\sqrt{x}/2"), (r"|x-y|", "|y-x|"),
]
HEDGED = [  # (answer, gold): a qualifier or a negation changes the claim
    (r"\not= 5", "5"), (r"\neq=5", "5"), (r"\wrong=5", "5"), (r"5 \text{ maybe}", "5"), ("5 probably", "5"),
    (r"\text{approximately } 5", "5"), (r"5 \text{ guess}", "5"), ("5 max", "5"), (r"\text{minimum } 5", "5"),
    (r"5 \text{ upper bound}", "5"), (r"\text{about } 5", "5"), (r"\text{maybe } 5", "5"),
    (r"5\text{ is my guess}", "5"), ("5 maximum", "5"), (r"5 \text{ (lower bound)}", "5"),
]
PLAIN = [  # (answer, gold): forms Math-Verify accepts, kept
    ("x = 5", "5"), (r"5 \text{ cm}", "5"), (r"\text{(A)}", "A"), (r"\dfrac{1}{2}", "0.5"), ("1,000", "1000"),
    (r"\alpha = 5", "5"), (r"\theta=5", "5"), (r"5 \text{ min}", "5"), (r"12 \text{ sq. ft}", "12"),
]


def test_verify_forged_math_is_false_and_exact_rewrites_true():
    verdicts = _verdicts([(a, g, False) for a, g in FORGED_MATH] + [(a, g, True) for a, g in GENUINE_MATH])
    assert [pair for pair, ok in zip(FORGED_MATH, verdicts) if ok] == []
    assert [pair for pair, ok in zip(GENUINE_MATH, verdicts[len(FORGED_MATH):]) if not ok] == []


def test_verify_hedged_or_negated_answers_are_false():
    verdicts = _verdicts([(a, g, False) for a, g in HEDGED] + [(a, g, True) for a, g in PLAIN])
    assert [pair for pair, ok in zip(HEDGED, verdicts) if ok] == []
    assert [pair for pair, ok in zip(PLAIN, verdicts[len(HEDGED):]) if not ok] == []


DENIED = [r"5 \text{ false}", r"5 \text{ impossible}", r"5 \text{ is false}", "5 false", r"5 \text{ untrue}",
          r"5 \text{ invalid}", r"5 \text{ disproved}", r"5 \text{ nope}", r"5 \text{ apples}", "5 wrongly"]
UNITS = [r"5 \text{ cm}", r"5\text{ km/h}", r"5 \text{ inches}", r"5 \text{ degrees}", r"5 \text{ sq ft}",
         r"5 \text{ dollars}", "5 hours", r"5 \text{ units}", r"5 \text{ m}^2", r"5\text{ per hour}"]
ON_THE_POINTS = [  # (answer, gold): a term that vanished at every point the old checker sampled (p / (997 * 10^k))
    (r"x + x^{8}\sin(997000\pi x)", "x"), (r"x^2 + x^{8}(1 - \cos(1994000\pi x))", "x^2"),
    (r"\frac{1}{x} + x^{9}\sin(997000\pi x)", r"\frac{1}{x}")]


def test_verify_a_word_beside_the_answer_must_be_a_unit_and_points_alone_prove_nothing():
    """A word beside a number is dropped only when it is on the allow-list of units and formatting words: no
    phrasing of a denial passes (a deny-list missed "false" and "impossible"). And agreeing at the sample points
    is not equality: sympy must prove the difference zero."""
    verdicts = _verdicts([(a, "5", False) for a in DENIED] + [(a, "5", True) for a in UNITS]
                         + [(a, g, False) for a, g in ON_THE_POINTS])
    assert [a for a, ok in zip(DENIED, verdicts) if ok] == []
    assert [a for a, ok in zip(UNITS, verdicts[len(DENIED):]) if not ok] == []
    assert [pair for pair, ok in zip(ON_THE_POINTS, verdicts[len(DENIED) + len(UNITS):]) if ok] == []
    u, v = verify.to_sympy("x"), verify.to_sympy("x^2")
    firsts = [p[verify.to_sympy("x")] for p in verify._points(u, v)[4:12]]
    seconds = [p[verify.to_sympy("x")] for p in verify._points(u, v)[4:12]]
    assert firsts != seconds and len({abs(x).q for x in firsts}) == len(firsts)  # drawn afresh, no shared grid


LISTS = [  # (answer, gold, verdict): a gold that is a list ("2, 100": a comma and a space, or a variable before each
    # item) reads the answer's commas as a list too, compared as a set (roots in any order); else they may be thousands
    ("2100", "2, 100", False), ("2100", "x = 2, x = 100", False), ("-3125", "-3, 125", False),
    ("2,100", "2, 100", True), ("2, 100", "2, 100", True), ("100, 2", "2, 100", True), ("x=100, x=2", "x = 2, x = 100", True),
    ("125, -3", "-3, 125", True), ("2, 10", "2, 100", False), ("2,100", "2100", True), ("1, 000", "1000", True),
]


def test_verify_a_list_gold_is_never_read_as_thousands():
    """normalize dropped the spaces, then "2, 100" read as 2100: wrong answers scored True and the right "100, 2"
    False. The gold's form decides (verify._normalize_pair)."""
    assert _verdicts(LISTS) == [ok for _, _, ok in LISTS]


def test_verify_thinking_opened_by_the_prompt_must_close():
    """DeepSeek-R1 templates end the prompt with "<think>\\n": the completion holds no <think>, so it answers
    only after a </think>; a box inside thoughts it never closed is no answer (math and code alike)."""
    assert verify.prompt_opens_think("<|User|>Add 3 and 4.<|Assistant|><think>\n")
    assert not verify.prompt_opens_think(f"{data.INSTRUCTION}\nProblem: 3+4\nSolution: ")   # names, opens nothing
    assert not verify.prompt_opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")   # Qwen3, thinking off
    thoughts = "Let me add: 3 + 4 = 7, so \\boxed{7}. Let me check"
    answered = thoughts + "</think> The answer is \\boxed{7}."
    assert score(thoughts, "7") is True and score(thoughts, "7", think_open=True) is False
    assert score(answered, "7", think_open=True) is True
    assert score_batch([thoughts, answered], ["7", "7"], think_open=True) == [False, True]
    code = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    problems = [{"answer": "7"}, {"answer": "7"}, {"tests": SUM, "domain": "code"}, {"tests": SUM, "domain": "code"}]
    responses = [thoughts, thoughts, "Let me think.\n" + code, "Let me think.\n" + code]
    assert verify.score_problems(responses, problems, think_open=[True, False, False, True]) == [False, True, True, False]
    tok = AutoTokenizer.from_pretrained(toy.toy_model_dir())   # the wiring: score_samples reads the template
    samples = [gen.Sample(0, ids_of(tok, text) + [tok.eos_token_id], [], [], [], "eos") for text in (thoughts, answered)]
    problem = {"prompt": "Compute 3+4.", "answer": "7", "domain": "math"}
    assert data.score_samples(tok, samples, [problem] * 2)[1] == [True, True]
    tok.chat_template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|><think>\n"
    assert data.score_samples(tok, samples, [problem] * 2)[1] == [False, True]


# =============================================================================
# sandbox.py: code extraction and the sandboxed test runs

BWRAP = pytest.mark.skipif(not sandbox.bwrap_ready(), reason="bubblewrap (bwrap) or libseccomp is not installed, or "
                           "namespaces cannot be made here; .ci/run installs them")
RAN, RUN = "\n\ndef ran():\n    return 1", ["assert ran() == 1"]  # a program + RAN passes RUN when it runs to its end


def nproc_binds():
    """RLIMIT_NPROC binds every user except root; in bwrap root's program drops to nobody."""
    return sandbox.bwrap_ready() or os.geteuid() != 0 or sandbox._sandbox_uid() is not None


def sandbox_processes():
    """Live host processes still running a sandboxed program (the prelude's text is in their command line)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if b"_record" in open(f"/proc/{pid}/cmdline", "rb").read() and \
                    open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(pid)
    return found


def ps_line(pid):
    """A process's /proc stat line (its name, state and parent), or 'gone'."""
    with contextlib.suppress(OSError):
        return open(f"/proc/{pid}/stat").read()[:120]
    return "gone"


@pytest.fixture
def shared_dir():
    """A folder the unsafe path's program may write into. As root it runs as nobody (when nobody can start the
    interpreter), and nobody cannot reach pytest's tmp_path: /tmp/pytest-of-root is 0700. So: a 0777 temp dir."""
    folder = tempfile.mkdtemp(prefix="sandbox-test-")
    os.chmod(folder, 0o777)
    yield Path(folder)
    shutil.rmtree(folder, ignore_errors=True)

# -----------------------------------------------------------------------------
# code: extraction and the two test layouts


def test_code_extract_last_python_block():
    cases = {
        "```python\nprint(1)\n```\ntext\n```python\nprint(2)\n```": "print(2)",          # last wins
        "```\nprint(3)\n```": "print(3)", "```py\nx = 1\n```": "x = 1",
        "```python\nprint(1)\n```\n```cpp\nint main() {}\n```": "print(1)",              # not Python
        "<think>```python\nprint(1)\n```</think>\n```python\nprint(2)\n```": "print(2)",  # after think
        "<think>```python\nprint(1)\n```</think> no code": None,
        "<think>\n```python\nprint(1)\n```\nstill thinking": None,                      # interrupted
        "```python\nprint(1)\n": None, "no code": None, "```python\n\n```": None,
    }
    for response, code in cases.items():
        assert extract_code(response) == code, response
    assert extract_code(None) is None


def test_code_stdin_stdout_right_wrong_and_whitespace():
    right = fenced("a, b = map(int, input().split())\nprint(a + b)")
    spaced = fenced("a, b = map(int, input().split())\nprint('  ', a + b, '   ')\nprint()\nprint()")
    off_by_one = fenced("a, b = map(int, input().split())\nprint(a + b + 1)")
    crash_after = fenced("a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(3)")
    wrong_on_last = fenced("a, b = map(int, input().split())\nprint(a + b if a < 100 else 0)")
    lines = {"inputs": ["2\n"], "outputs": ["1 2\n3  4"]}
    assert score_code(right, SUM) is True and score_code(spaced, SUM) is True
    assert score_code(off_by_one, SUM) is False and score_code(crash_after, SUM) is False
    assert score_code(wrong_on_last, SUM) is False
    assert score_code(fenced("print('1  2 ')\nprint('3 4')"), lines) is True
    assert score_code(fenced("print('1 2 3 4')"), lines) is False                 # lines matter
    assert score_code("a, b = map(int, input().split())\nprint(a + b)", SUM) is False   # no block


def test_code_asserts_list_and_string():
    add = fenced("def add(a, b):\n    print('debug output is fine')\n    return a + b")
    assert score_code(add, ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]) is True
    assert score_code(add, "assert add(1, 2) == 3\nassert add(2, 2) == 4") is True
    assert score_code(add, ["assert add(1, 2) == 3", "assert add(2, 2) == 5"]) is False
    for cheat in ("import os\nos._exit(0)", "import sys\nsys.exit(0)", "exit()",
                  "def add(a, b):\n    raise SystemExit(0)"):
        assert score_code(fenced(cheat), ["assert add(1, 2) == 3"]) is False, cheat
    humaneval = "METADATA = {}\n\ndef check(candidate):\n    assert candidate(2, 3) == 5\n\ncheck(add)"
    assert score_code(add, humaneval) is True
    main_block = "def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    print(add(*map(int, input().split())))"
    assert score_code(fenced(main_block), ["assert add(1, 2) == 3"]) is True  # its stdin part runs only without asserts
    assert score_code(fenced("def add(a, b):\n    return a - b"), humaneval) is False


def test_code_malformed_tests_score_false():
    right = fenced("a, b = map(int, input().split())\nprint(a + b)")
    for tests in ({"inputs": [], "outputs": []}, {"inputs": ["1 2"], "outputs": ["3", "4"]},
                  {"inputs": [["1", "2"]], "outputs": [["3"]]}, {"inputs": "1 2", "outputs": "3"},
                  {"outputs": ["3"]}, [], "", "print('no assert here')", None, 5, [1, 2]):
        assert score_code(right, tests) is False, tests
    assert score_code(None, SUM) is False and score_code(b"```python\nprint(3)\n```", SUM) is False

# -----------------------------------------------------------------------------
# code: the sandbox


def test_code_infinite_loop_is_killed_on_time():
    for program in ("while True:\n    pass", "import time\ntime.sleep(60)", "input()"):
        start = time.perf_counter()
        assert score_code(fenced(program), {"inputs": [""], "outputs": ["x"]}, timeout=1.0) is False
        assert time.perf_counter() - start < 8.0, program        # 1 s + start-up, generous for CI
    start = time.perf_counter()
    assert score_code(fenced("while True:\n    pass" + RAN), RUN, timeout=1.0) is False
    assert 1.0 <= time.perf_counter() - start < 8.0


def test_code_memory_limit():
    alloc = "x = bytearray({})\nprint(len(x))"
    assert score_code(fenced(alloc.format(100 << 20)), {"inputs": [""], "outputs": [str(100 << 20)]})
    start = time.perf_counter()
    assert score_code(fenced(alloc.format(10 << 30)), {"inputs": [""], "outputs": [str(10 << 30)]}) is False
    grow = "x = []\nwhile True:\n    x.append(bytearray(50 << 20))"      # 50 MB at a time, forever
    assert score_code(fenced(grow + RAN), RUN) is False
    assert time.perf_counter() - start < 15.0
    assert score_code(fenced(alloc.format(600 << 20)), ["assert x"], memory=256 << 20) is False


PAST_THE_GUARD = "import sys\ndel sys.modules['ctypes'], sys.modules['_ctypes']\nimport ctypes\nlibc = ctypes.CDLL(None)\n"
HOARD = PAST_THE_GUARD + """import os, time
kids, reported, dead, (r, w) = {}, set(), set(), os.pipe()
for k in range(4):                          # 4 processes of 400 MiB, each within its own 1 GiB RLIMIT_AS
    pid = libc.fork()
    if pid == 0:
        try:
            hoard = b"\\x01" * (400 << 20)  # written: resident
            os.write(w, bytes([k]))
            time.sleep(60)
        finally:
            os._exit(0)
    kids[pid] = k
os.set_blocking(r, False)
end = time.time() + 6
while time.time() < end and len(reported | dead) < 4:
    time.sleep(0.05)
    try:
        reported.update(os.read(r, 16))
        while (pid := os.waitpid(-1, os.WNOHANG)[0]) > 0:    # a child the kernel killed
            dead.add(kids[pid])
    except (BlockingIOError, ChildProcessError):
        pass
print("holding", len(reported - dead), flush=True)
"""


@BWRAP
@pytest.mark.skipif(not sandbox.cgroup_plan()[0], reason="no cgroup can be made here (not root, no delegated "
                    "subtree): sandbox.cgroup_plan's line says why; the per-process limits are tested above")
def test_code_a_sample_cannot_hold_more_memory_than_its_cgroup_allows():
    """RLIMIT_AS binds each process alone: 4 forked processes of 400 MiB held 1.6 GiB against a 1 GiB limit. In a
    cgroup of its own the sample's processes together hold at most CODE_SAMPLE_MEMORY (the kernel kills past it)."""
    budget = sandbox.Budget(10.0, time.monotonic() + 30.0)
    code, out, _ = sandbox._run_program(HOARD, "", "", budget, sandbox.CODE_MEMORY, False)
    held = re.search(r"holding (\d+)", out)
    assert held or code != 0, out                            # the sample ran, or the kernel killed it whole
    assert held is None or int(held[1]) * (400 << 20) <= 5 << 28, out                 # 1.25 GiB, for all of it
    assert held is None or int(held[1]) * (400 << 20) <= sandbox.CODE_SAMPLE_MEMORY, out
    assert score_code(fenced("a, b = map(int, input().split())\nprint(a + b)"), SUM) is True


def seen_while_running(path):
    """{pid: (/proc/pid/<path>, /proc/pid/cgroup)} of this process's sandbox processes (not another test run's on
    this machine) seen while a 2 s sample runs."""
    def mine(pid):
        while pid > 1:
            pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            if pid == os.getpid():
                return True
        return False
    thread = threading.Thread(target=score_code, args=(fenced("import time\ntime.sleep(2)" + RAN), RUN))
    thread.start()
    seen, deadline = {}, time.monotonic() + 10
    while thread.is_alive() and time.monotonic() < deadline:  # each pid's last reading: bwrap's own process is
        for pid in sandbox_processes():                       # seen before the sandbox confines it
            with contextlib.suppress(OSError):
                if mine(int(pid)):
                    seen[pid] = (open(f"/proc/{pid}/{path}").read().strip(), open(f"/proc/{pid}/cgroup").read())
        time.sleep(0.05)
    thread.join()
    return seen


@BWRAP
def test_code_a_sample_is_the_oom_killers_first_pick_and_runs_without_a_cgroup(monkeypatch):
    """A sample's processes are the OOM killer's first pick (oom_score_adj 1000: one that fills the memory is
    killed, not the trainer). Where no cgroup can be made, the sandbox says so in one line and the sample runs
    with its per-process limits."""
    seen = seen_while_running("oom_score_adj")
    assert seen and all(adj == "1000" for adj, _ in seen.values()), seen
    monkeypatch.setattr(sandbox, "_own_cgroups", lambda: {})
    sandbox.cgroup_plan.cache_clear()
    try:
        plan, line = sandbox.cgroup_plan()
        assert plan == [] and line.startswith("code sandbox: no cgroup for the samples (no cgroup file system")
        seen = seen_while_running("oom_score_adj")
        assert seen and all(adj == "1000" and "scalerl-sandboxes" not in groups for adj, groups in seen.values())
        assert score_code(fenced("a, b = map(int, input().split())\nprint(a + b)"), SUM) is True
    finally:
        monkeypatch.undo()
        sandbox.cgroup_plan.cache_clear()


SPIN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {}:\n    pass\n"  # CPU seconds


@BWRAP
def test_code_one_time_budget_for_all_the_cases_of_a_sample(monkeypatch):
    """A correct but slow program costs its sample's budget once, not once per case (5 cases of 1 s each ran 5 s
    under a 3 s limit per run): the third run of 1 s of CPU each spends the last of 3 s (sooner where the budget
    is wall-clock time, on a busy machine), and the sample fails there, its last cases never run."""
    slow = fenced(SPIN.format(1.0) + "print(2 * int(input()))")
    assert score_code(slow, {"inputs": ["4"], "outputs": ["8"]}, timeout=3.0) is True
    runs, real = [], sandbox._run_program
    monkeypatch.setattr(sandbox, "_run_program", lambda *a: runs.append(a[2]) or real(*a))
    assert score_code(slow, {"inputs": [str(k) for k in range(5)], "outputs": [str(2 * k) for k in range(5)]},
                      timeout=3.0) is False
    assert runs == ["0", "1", "2"][:len(runs)] and len(runs) >= 2


CPU_COUNTED = pytest.mark.skipif(
    not sandbox.bwrap_ready() or sandbox._cgroup_cpu([p for p, _ in sandbox.cgroup_plan()[0]]) is None,
    reason="no cgroup here counts a sample's CPU time (cgroup v2's cpu.stat, v1's cpuacct): its budget is wall-clock")


@CPU_COUNTED
def test_code_time_budget_is_cpu_time_not_wall_clock():
    """The budget is CPU time: a program that needs 0.6 s of CPU passes a 1 s budget with a process spinning on its
    CPU beside it (it then takes ~1.2 s of wall-clock, and failed when the budget was wall-clock: a correct answer's
    reward depended on the machine's load); one that needs 1.5 s fails it on an idle CPU; one that sleeps 1.5 s
    passes (the wall-clock cap is CODE_WALL_FACTOR budgets), and one that sleeps past the cap fails."""
    answer = {"inputs": [""], "outputs": ["7"]}
    assert score_code(fenced(SPIN.format(1.5) + "print(7)"), answer, timeout=1.0) is False
    assert score_code(fenced("import time\ntime.sleep(1.5)\nprint(7)"), answer, timeout=1.0) is True
    start = time.monotonic()
    assert score_code(fenced("import time\ntime.sleep(60)\nprint(7)"), answer, timeout=1.0) is False
    assert sandbox.CODE_WALL_FACTOR == 3 and 3.0 <= time.monotonic() - start < 10.0
    cpu, mask = min(os.sched_getaffinity(0)), os.sched_getaffinity(0)
    hog = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True:\n"
                            "    pass"])
    try:
        os.sched_setaffinity(0, {cpu})  # this thread, and the sandboxes it starts: beside the hog
        time.sleep(0.2)
        start = time.monotonic()
        assert score_code(fenced(SPIN.format(0.6) + "print(7)"), answer, timeout=1.0) is True
        assert time.monotonic() - start > 1.0  # it shared its CPU: more wall-clock than budget
    finally:
        os.sched_setaffinity(0, mask)
        hog.kill()
        hog.wait()


@CPU_COUNTED
def test_code_cpu_time_of_a_child_never_waited_for_counts():
    """A program that hands its work to a forked child, which is still alive (asleep) when the program exits: wait4
    would count the program's CPU time, not the child's (and bwrap's outer process does not even wait for the
    program); the sample's cgroup counts both, so 0.5 s of it in the child is spent from the budget, and 2 s of it
    fails a 1 s budget (with a wall-clock cap of 30 s, which it would have passed uncounted)."""
    def offload(seconds):
        child = "".join("    " + line + "\n" for line in SPIN.format(seconds).splitlines())
        return (PAST_THE_GUARD + "import os, time\nr, w = os.pipe()\nif libc.fork() == 0:\n" + child +
                "    os.write(w, b'7')\n    time.sleep(60)\nprint(os.read(r, 1).decode())\n")
    budget = sandbox.Budget(10.0, time.monotonic() + 30.0)
    assert sandbox._run_program(offload(0.5), "", "", budget, sandbox.CODE_MEMORY, False)[:2] == (0, "7\n")
    assert 10.0 - budget.cpu >= 0.5, budget.cpu
    budget, start = sandbox.Budget(1.0, time.monotonic() + 30.0), time.monotonic()
    assert sandbox._run_program(offload(2.0), "", "", budget, sandbox.CODE_MEMORY, False)[0] is None
    assert time.monotonic() - start < 15.0 and budget.cpu < 0


def test_code_a_sample_runs_on_at_most_code_max_cases_cases(monkeypatch):
    runs = []
    monkeypatch.setattr(sandbox, "_run_program", lambda program, tests, stdin, *_: (runs.append(stdin), 0, stdin, b"")[1:])
    many = {"inputs": [str(k) for k in range(100)], "outputs": [str(k) for k in range(100)]}
    assert score_code(fenced("print(input())"), many) is True
    assert runs == [str(k) for k in range(32)] and sandbox.CODE_MAX_CASES == 32


def test_code_output_flood_is_cut():
    start = time.perf_counter()
    flood = fenced("while True:\n    print('x' * 100000)" + RAN)
    assert score_code(flood, {"inputs": [""], "outputs": ["x"]}) is False
    assert score_code(flood, RUN) is False
    assert time.perf_counter() - start < 15.0
    assert score_code(fenced("print('y' * 1000000)"), {"inputs": [""], "outputs": ["y" * 1000000]})


def test_code_naive_fork_bomb_fails_at_once_and_the_parent_is_fine():
    for bomb in ("import os\nwhile True:\n    os.fork()", "import os\nwhile True:\n    os.system('true')",
                 "import subprocess\nsubprocess.Popen(['sleep', '100'])",
                 "import multiprocessing\nmultiprocessing.Process(target=print).start()"):
        start = time.perf_counter()
        assert score_code(fenced(bomb + RAN), RUN, timeout=5.0) is False, bomb
        assert time.perf_counter() - start < 5.0, bomb              # removed: fails, no timeout
    assert score_code(fenced("a, b = map(int, input().split())\nprint(a + b)"), SUM) is True


THREADS = ("import threading, time\nn = 0\ntry:\n    for _ in range(200):\n"  # as many threads as it may
           "        threading.Thread(target=time.sleep, args=(3,), daemon=True).start()\n"
           "        n += 1\nexcept RuntimeError:\n    pass\n")
THREADS_BOUNDED = ["assert n > 5", f"assert n < {2 * sandbox.CODE_NPROC_MARGIN}"]


@pytest.mark.skipif(not nproc_binds(), reason="root that cannot drop to nobody (interpreter under a "
                    "0700 home): RLIMIT_NPROC does not bind root")
def test_code_nproc_limits_threads_and_processes():
    assert score_code(fenced(THREADS), THREADS_BOUNDED, memory=16 << 30) is True
    assert score_code(fenced(THREADS), ["assert n == 200"], memory=16 << 30) is False


OTHER_UID = 4321  # an unprivileged uid with no processes of its own, for the test below
AS_OTHER_USER = f"""
import subprocess, sys
import sandbox
sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(100)]  # the user's count outside: 100+
ok = sandbox.score_code({fenced(THREADS)!r}, {THREADS_BOUNDED!r}, memory=16 << 30)
for p in sleepers:
    p.kill()
sys.exit(0 if ok else 1)
"""


@BWRAP
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to run a process as another user")
def test_code_nproc_binds_in_a_user_namespace_whatever_the_user_runs_outside():
    """A non-root caller's sandbox is a user namespace of its own, where Linux >= 5.14 counts RLIMIT_NPROC
    apart from the user's tasks outside: the limit must then start from the tasks inside, not from the user's
    count (100 sleeping processes here), or a program gets that many more threads and processes. Run as
    another user, with an interpreter that user can start (a venv's under root's 0700 home is not)."""
    as_other = dict(cwd=ROOT, user=OTHER_UID, group=OTHER_UID, extra_groups=[], capture_output=True, text=True)
    for python in (os.path.realpath(sys.executable), "/usr/bin/python3"):
        with contextlib.suppress(OSError):
            if subprocess.run([python, "-c", "import sandbox; assert sandbox.bwrap_ready()"], **as_other).returncode == 0:
                break
    else:
        pytest.skip(f"no interpreter that uid {OTHER_UID} can start, import sandbox.py with and start bwrap")
    run = subprocess.run([python, "-c", AS_OTHER_USER], timeout=120, **as_other)
    assert run.returncode == 0, run.stderr[-2000:]


def cmdline(pid):
    """A process's command line (its first 200 bytes), or 'gone'."""
    with contextlib.suppress(OSError):
        return open(f"/proc/{pid}/cmdline", "rb").read()[:200].decode(errors="replace")
    return "gone"


def in_namespace(namespace):
    """Live processes (not zombies) in a PID namespace, as '/proc stat line | its parent's command line'."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/ns/pid") == namespace:
                stat = open(f"/proc/{pid}/stat").read()
                state, parent = stat.rsplit(")", 1)[1].split()[:2]
                if state != "Z":  # listed even when its parent is gone by the time it is described
                    found.append(stat[:120] + " | parent: " + ps_line(parent) + " " + cmdline(parent))
    return found


@BWRAP
def test_code_fork_bomb_past_the_guard_and_a_daemon_die_with_the_sandbox(monkeypatch):
    """Each sample's PID namespace (recorded as the sandbox starts, read from /proc here) is empty soon after
    score_code returns: nothing it forked, a setsid daemon included, outlives it. Watched by namespace, not by
    command line, so another test's or another run's sandboxes on the machine cannot be mistaken for its own."""
    bomb = ("import sys\ndel sys.modules['ctypes'], sys.modules['_ctypes']\nimport ctypes\n"
            "fork = ctypes.CDLL(None).fork\nwhile True:\n    fork()")
    daemon = ("import sys, time\ndel sys.modules['ctypes'], sys.modules['_ctypes']\nimport ctypes\n"
              "libc = ctypes.CDLL(None)\nif libc.fork() == 0:\n    libc.setsid()\n    if libc.fork() == 0:\n"
              "        time.sleep(60)\n")  # a double-forked setsid daemon; the program itself exits at once
    namespaces, read = [], sandbox._pid_namespace
    monkeypatch.setattr(sandbox, "_pid_namespace", lambda info: namespaces.append(read(info)) or namespaces[-1])
    for program, timeout in ((bomb, 3.0), (daemon, 6.0)):
        start, namespaces[:] = time.perf_counter(), []
        score_code(fenced(program + RAN), RUN, timeout=timeout)
        assert time.perf_counter() - start < 15.0
        assert len(namespaces) == 1 and namespaces[0] is not None, namespaces  # one sandbox, its namespace read
        # SIGKILLed with the namespace; on a busy machine they take a moment to exit (5 s was once too short in a
        # CI run beside the other worker); the daemon would sleep 60 s, so 20 s still tells killed from alive
        gone = time.monotonic() + 20
        while in_namespace(namespaces[0]) and time.monotonic() < gone:
            time.sleep(0.05)
        assert not in_namespace(namespaces[0]), (program, in_namespace(namespaces[0]))
    assert score_code(fenced("a, b = map(int, input().split())\nprint(a + b)"), SUM) is True


@BWRAP
def test_code_sandbox_sees_nothing_of_the_machine(tmp_path):
    """What a program can see and touch, asked from inside (each value goes back through the assert channel)."""
    secret = tmp_path / "expected.txt"
    secret.write_text("3\n")
    os.environ["SECRET_TOKEN"] = "hunter2"
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    try:
        probe = fenced("""import os, socket, sys
def reach(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return "connected"
    except OSError:
        return "refused"
def writable(path):
    try:
        open(path, "w").write("x")
        return True
    except OSError:
        return False
def fill():
    n = 0
    try:
        while n < 20:
            open(f"/tmp/f{n}", "wb").write(b"x" * (8 << 20))
            n += 1
    except OSError:
        pass
    return n
def ask(expression):  # the sandbox reports the value of a call of the program's own functions
    return eval(expression)
""")
        # every file it can read (outside /dev and its own /tmp) is a copy in its own root tmpfs: none is a
        # file of the machine, whose page cache another run could have warmed or left cold
        own_files = ("{os.stat(os.path.join(r, f)).st_dev for r, _, fs in os.walk('/') "
                     "if not r.startswith(('/dev', '/tmp')) for f in fs}")
        checks = ["assert ask('sorted(os.environ)') == ['HOME', 'LANG', 'LD_LIBRARY_PATH', 'PWD']",
                  f"assert ask({own_files!r}) == {{ask('os.stat(\"/\").st_dev')}}",
                  f"assert ask('os.stat(sys.executable).st_dev') != {os.stat(os.path.realpath(sys.executable)).st_dev}",
                  "assert not ask('os.path.exists(\"/usr\")') and not ask('os.path.exists(\"/etc\")')",
                  "assert ask('os.getcwd()') == '/tmp'", "assert ask('sys.flags.isolated') == 1",
                  "assert ask('os.getuid()') == 65534", "assert ask('os.getppid()') == 1",
                  "assert not ask('os.path.exists(\"/proc\")')",  # no /proc: its counters leak the page cache
                  "assert not ask('os.path.exists(\"/etc/shadow\")')",
                  f'assert not ask("os.path.exists({str(secret)!r})")',
                  f'assert not ask("os.path.exists({str(ROOT / "sandbox.py")!r})")',
                  f"assert reach({server.getsockname()[1]}) == 'refused'",
                  "assert not writable(sys.executable)", "assert writable('/tmp/x')",
                  f"assert fill() <= {sandbox.CODE_TMPFS // (8 << 20)}"]
        for check in checks:
            assert score_code(probe, [check]) is True, check
        assert score_code(probe, ["assert ask('os.getuid()') == 0"]) is False  # the channel really carries values
    finally:
        server.close()
        del os.environ["SECRET_TOKEN"]


@BWRAP
def test_code_wrong_solutions_cannot_forge_their_reward(tmp_path):
    """Each of these is wrong (add is missing or subtracts) and tries to score anyway."""
    data_file = tmp_path / "problems.jsonl"
    data_file.write_text(json.dumps({"tests": SUM}) + "\n")
    cheats = {
        "exit before the asserts": "import os\nprint('anything')\nos._exit(0)",
        "an always-equal object": "class Any:\n    def __eq__(self, other):\n        return True\n"
                                  "def add(a, b):\n    return Any()",
        "report values itself": "import os\nfor v in range(10):\n    os.write(4, f'0\\t{v}\\n'.encode())\nos._exit(0)",
        "replace the reporter": "def add(a, b):\n    return a - b\n_record = lambda k, v: None",
        "guess through the reporter": "def add(a, b):\n    return a - b\nfor v in range(10):\n    _record(0, v)",
    }
    for name, program in cheats.items():
        assert score_code(fenced(program), ["assert add(1, 2) == 3"]) is False, name
    near = ["assert abs(mean([1.0, 2.0, 3.0]) - 2.0) < 1e-6", "assert math.isclose(mean([2.0, 4.0]), 3.0)",
            "assert len(str(mean([1.0]))) < 5"]
    patched = {  # wrong means that change what the assert computes around their value
        "patch abs, isclose and len": "import builtins, math\nbuiltins.abs = builtins.len = lambda x: 0\n"
                                      "math.isclose = lambda *a, **k: True\ndef mean(xs):\n    return 999.0 ** 20",
        "patch them during the call": "import builtins, math\ndef mean(xs):\n    builtins.abs = builtins.len = "
                                      "lambda x: 0\n    math.isclose = lambda *a, **k: True\n    return 999.0 ** 20",
        "an object whose arithmetic lies": "class Z(float):\n    __sub__ = __abs__ = __lt__ = lambda *a: 0.0\n"
                                           "def mean(xs):\n    return Z(999.0 ** 20)",
    }
    for name, program in patched.items():
        assert score_code(fenced(program), near) is False, name
    assert score_code(fenced("def mean(xs):\n    return sum(xs) / len(xs)"), near) is True
    stdio_cheats = {
        "read the data set": f"print(open({str(data_file)!r}).read())",
        "read the parent's command line": "import os\nfor p in os.listdir('/proc'):\n"
                                          "    if p.isdigit():\n        print(open(f'/proc/{p}/cmdline').read())",
        "print nothing and exit 0": "pass",
    }
    for name, program in stdio_cheats.items():
        assert score_code(fenced(program), SUM) is False, name
    assert score_code(fenced("def add(a, b):\n    return a + b"), ["assert add(1, 2) == 3"]) is True


def passes(check, values):
    """One check on one report of its leaves' values, as the checker process judges it."""
    return sandbox._asserts_pass(f"0\t{values!r}\n", [check])


def test_code_split_asserts_keeps_expected_values_out():
    """The sandbox runs only the calls of the solution's functions; the parent evaluates the rest."""
    source, checks = sandbox.split_asserts("assert f(1) == [1, (2, 'x')]\nassert not g(2)\nassert h(3)\n"
                                           "def check(c):\n    assert c(4) in {4, 5}\ncheck(f)\n"
                                           "assert abs(f(5) - 2.0) < 1e-6 and math.isclose(g(6), 3.0)")
    assert all(text not in source for text in ("[1, (2, 'x')]", "{4, 5}", "abs", "isclose", "2.0", "3.0"))
    assert source.count("_record(") == 5 and "_record(4, (f(5), g(6)))" in source
    reports = [([1, (2, "x")],), (0,), (7,), (5,), (2.0, 3.0)]
    assert [passes(check, values) for check, values in zip(checks, reports)] == [True] * 5
    wrong = [([1, (2, "y")],), (1,), (0,), (6,), (2.0, 3.1)]
    assert [passes(check, values) for check, values in zip(checks, wrong)] == [False] * 5
    assert passes(sandbox.split_asserts("assert f(1) is None")[1][0], (None,)) is True
    assert passes(sandbox.split_asserts("assert 0 < f(1) < 2")[1][0], (1,)) is True
    for bad in ("x = 1", "expected = 3\nassert f(1) == expected", "def ref(a):\n    return a\nassert f(1) == ref(1)",
                "assert print(f(1)) is None", "assert [f(i) for i in range(3)] == [0, 1, 4]", "assert 2 ** f(1) == 4",
                "import numpy as np\nassert np.allclose(f(1), [1.0])", "def check(c):\n    assert c\ncheck(f)"):
        with pytest.raises(ValueError):
            sandbox.split_asserts(bad)


def test_code_asserts_that_never_call_the_solution_are_refused(tmp_path):
    """An assert that the parent alone evaluates (no call of the solution: `assert sum([1, 2, 3]) == 6` for a
    problem "write sum", `assert True` alone) would pass any program: refused by split_asserts, so scored
    False and refused at load time with file:line and the field. A constant assert beside real ones
    (HumanEval's `assert True, "..."`) decides nothing and is kept."""
    for tests in (["assert sum([1, 2, 3]) == 6"], ["assert True"], "assert True\nassert True, 'twice'",
                  ["assert add(1, 2) == 3", "assert sum([1, 2, 3]) == 6"],
                  "def check(c):\n    assert True\ncheck(add)"):
        with pytest.raises(ValueError, match="never calls the solution|no assert calls the solution"):
            sandbox.split_asserts(tests if isinstance(tests, str) else "\n".join(tests))
        assert score_code(fenced("pass"), tests) is False, tests
    add = fenced("def add(a, b):\n    return a + b")
    assert score_code(add, ["assert add(1, 2) == 3", "assert True, 'debugging aid'"]) is True
    assert score_code(fenced("def add(a, b):\n    return 0"), ["assert add(1, 2) == 3", "assert True"]) is False
    cases = {'{"prompt": "write sum", "tests": ["assert sum([1, 2, 3]) == 6"]}\n':
             ":1: field 'tests': line 1: 'assert sum([1, 2, 3]) == 6' never calls the solution",
             '{"prompt": "p", "answer": "1"}\n{"prompt": "q", "tests": "assert True"}\n':
             ":2: field 'tests': no assert calls the solution"}
    assert_load_errors(tmp_path, cases)


def test_code_the_parents_evaluation_of_asserts_is_bounded():
    """The checker, a process of its own, parses the reports and evaluates the asserts within CODE_CHECK_TIMEOUT
    and CODE_CHECK_MEMORY: a value that the assert turns into a long loop or a huge object, or a report over
    CODE_MAX_REPORT characters, scores False in bounded time and costs the caller no memory."""
    import resource
    _, checks = sandbox.split_asserts("assert len(f(1)) > 0")
    short, long = f"0\t({[1] * 10},)\n", f"0\t({[1] * sandbox.CODE_MAX_REPORT},)\n"
    assert sandbox._asserts_pass(short, checks) is True and sandbox._asserts_pass(long, checks) is False
    count = fenced("def count(n):\n    return 10 ** 18 if n == 3 else n\ndef text(n):\n    return 'x' * n")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for tests in (["assert max(range(count(3))) == 2"], ["assert sum(range(count(3))) == 3"],
                  ["assert len([0] * count(3)) == 3"], ["assert len(text(50000) * count(30000)) == 3"],
                  ["assert len(text(10 ** 7)) == 10 ** 7"]):
        start = time.perf_counter()
        assert score_code(count, tests) is False, tests
        assert time.perf_counter() - start < sandbox.CODE_CHECK_TIMEOUT + 5.0, tests
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 100 << 10  # KiB: not 100 MiB more
    assert score_code(count, ["assert max(range(count(2))) == 1", "assert len(text(5)) == 5"]) is True


def test_code_without_bwrap_refuses_unless_unsafe(toy_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sandbox, "bwrap_ready", lambda: False)
    add = fenced("def add(a, b):\n    return a + b")
    assert score_code(add, ["assert add(1, 2) == 3"]) is False  # never raises; the run refuses earlier
    assert score_code(add, ["assert add(1, 2) == 3"], unsafe=True) is True
    monkeypatch.setattr(checks, "bwrap_ready", lambda: False)
    code = str(FIXTURES / "code_toy.jsonl")
    with pytest.raises(SystemExit, match="apt-get install bubblewrap.*--unsafe_code_exec"):
        run_train(toy_dir, tmp_path / "a", "--data", code, "--val_size", "4")
    run_train(toy_dir, tmp_path / "b", "--data", code, "--val_size", "4", "--unsafe_code_exec")
    assert "--unsafe_code_exec: resource limits only" in capsys.readouterr().out


def test_eval_only_refuses_code_problems_without_a_sandbox_as_training_does(toy_dir, monkeypatch):
    """--eval_only on code problems without bwrap scored every program False (pass rate 0, no word): it refuses, or
    runs with --unsafe_code_exec, as training does."""
    monkeypatch.setattr(checks, "bwrap_ready", lambda: False)
    argv = ["--eval_only", "--model", toy_dir, "--val_data", str(FIXTURES / "code_toy.jsonl"), "--eval_samples", "1"]
    with pytest.raises(SystemExit, match="apt-get install bubblewrap.*--unsafe_code_exec"):
        train.eval_only(config.get_args(argv))


def test_code_unsafe_path_temp_dir_is_removed_even_when_locked(shared_dir):
    messy = (f"import os\nopen({str(shared_dir / 'cwd')!r}, 'w').write(os.getcwd())\n"
             "os.makedirs('a/b/c')\nopen('a/b/c/f.txt', 'w').write('x')\n"
             "os.symlink('/', 'a/root')\nos.chmod('a/b', 0)\nos.chmod('a', 0o500)")
    assert score_code(fenced(messy + RAN), RUN, unsafe=True) is True
    cwd = (shared_dir / "cwd").read_text()
    assert cwd and not os.path.exists(cwd) and os.path.exists("/")


def test_code_unsafe_path_files_outside_are_capped(shared_dir):
    big = f"f = open({str(shared_dir / 'big')!r}, 'wb')\nf.write(b'x' * (64 << 20))\nf.close()"
    assert score_code(fenced(big + RAN), RUN, unsafe=True) is False                           # RLIMIT_FSIZE
    assert (shared_dir / "big").stat().st_size <= sandbox.CODE_MAX_OUTPUT

# -----------------------------------------------------------------------------
# code: nothing outlives a sandbox for the next one to read (the system-call filter, a user namespace each)

ADD = {"inputs": ["20 22\n"], "outputs": ["42"]}  # 42 = 0b101010: 8 bits of answer to pass on
PAGE_CACHE = """import os
def pages():  # 8 pages of a read-only file every sandbox sees, read one at a time (no readahead)
    fd = os.open({path!r}, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd
"""
PAGE_SOLVER = """a, b = map(int, input().split())
try:  # bit i clear: page i evicted; set: cached
    fd = pages()
    for i in range(8):
        os.pread(fd, 1, 4096 * i)
        if not (a + b) >> i & 1:
            os.posix_fadvise(fd, 4096 * i, 4096, os.POSIX_FADV_DONTNEED)
except OSError:
    pass
print(a + b)
"""
PAGE_COPIER = """input()
def cached(fd, i):  # reads only a cached page
    try:
        return os.preadv(fd, [bytearray(1)], 4096 * i, os.RWF_NOWAIT) == 1
    except OSError:
        return False
fd = pages()
print(sum(1 << i for i in range(8) if cached(fd, i)))
"""


@BWRAP
def test_code_page_cache_carries_no_answer_between_samples():
    """A solver marks its answer in the page cache of a file under the interpreter's prefix (posix_fadvise evicts
    a page, a read caches it) and a copier with no solving logic reads it back with preadv(RWF_NOWAIT), which
    succeeds on cached pages alone: the copier would score True once a sibling has solved the same input."""
    path = os.path.realpath(os.path.join(os.path.dirname(os.__file__), "pydoc_data", "topics.py"))
    solver, copier = (fenced(PAGE_CACHE.format(path=path) + body) for body in (PAGE_SOLVER, PAGE_COPIER))
    with open(path, "rb") as f:
        f.read()  # every page cached: the copier alone reads 255
    assert score_code(copier, ADD) is False
    assert score_code(solver, ADD) is True
    assert score_code(copier, ADD) is False


KEYRING = """import sys
for name in ("ctypes", "_ctypes"):
    sys.modules.pop(name, None)
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
ADD_KEY, REQUEST_KEY, KEYCTL = {numbers}
def put(value):  # add_key("user", name, value, KEY_SPEC_USER_KEYRING)
    data = str(value).encode()
    libc.syscall(ADD_KEY, b"user", {name!r}, data, len(data), -4)
def get():  # request_key, then keyctl(KEYCTL_READ)
    key = libc.syscall(REQUEST_KEY, b"user", {name!r}, None, -4)
    buffer = ctypes.create_string_buffer(64)
    n = libc.syscall(KEYCTL, 11, ctypes.c_long(key), buffer, 64) if key >= 0 else -1
    return buffer.raw[:n].decode() if n >= 0 else ""
"""


@BWRAP
@pytest.mark.skipif(os.geteuid() != 0, reason="a non-root caller's sandboxes each have a user namespace (and user "
                    "keyring) of their own through bwrap alone; as root they were all uid 65534 of one namespace")
@pytest.mark.skipif(os.uname().machine not in ("x86_64", "aarch64"), reason="keyring call numbers of x86_64, arm64")
def test_code_kernel_keyring_carries_no_answer_between_samples():
    numbers = (248, 249, 250) if os.uname().machine == "x86_64" else (217, 218, 219)
    keyring = KEYRING.format(numbers=numbers, name=f"scalerl-test-{os.getpid()}-{time.time_ns()}".encode())
    solver = fenced(keyring + "a, b = map(int, input().split())\nput(a + b)\nprint(a + b)")
    copier = fenced(keyring + "input()\nprint(get())")
    assert score_code(copier, ADD) is False
    assert score_code(solver, ADD) is True
    assert score_code(copier, ADD) is False


@BWRAP
def test_code_the_system_call_filter_refuses_cross_sample_channels():
    """Asked from inside: what the filter refuses (EPERM) and what it leaves alone."""
    path = os.path.realpath(os.__file__)
    probe = fenced(f"""import errno, fcntl, os, resource, socket, threading
fd = os.open({path!r}, os.O_RDONLY)
def refused(expression):
    try:
        eval(expression)
    except OSError as err:
        return errno.errorcode.get(err.errno)
    return "allowed"
""")
    denied = ["os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)", "os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)",
              "fcntl.flock(fd, fcntl.LOCK_SH)", "resource.getrusage(resource.RUSAGE_SELF)",
              "socket.socket(socket.AF_NETLINK, socket.SOCK_RAW)", "socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)",
              "os.memfd_create('hoard')", "os.sched_setaffinity(0, {0})"]
    allowed = ["os.pread(fd, 1, 0)", "os.preadv(fd, [bytearray(1)], 0)", "socket.socket().close()",
               "socket.socketpair()", "threading.Thread(target=print).start()", "fcntl.fcntl(fd, fcntl.F_GETFL)"]
    checks = [f"assert refused({e!r}) == 'EPERM'" for e in denied]
    checks += [f"assert refused({e!r}) == 'allowed'" for e in allowed]
    for check in checks:
        assert score_code(probe, [check]) is True, check


@BWRAP
def test_code_each_sandbox_has_its_own_user_namespace():
    """Two samples at once, seen from outside: each program in a user namespace of its own (as root too, so that
    the keyring and the uid's other state are not shared), as the unprivileged uid (root's sandbox: uid 65534)."""
    sleeper = fenced("import time\ntime.sleep(3)" + RAN)
    done = threading.Event()
    both = [RUN, ["assert ran() >= 1"]]  # two problems: two samples of one problem never run at once
    thread = threading.Thread(target=lambda: (score_code_batch([sleeper] * 2, both, workers=2), done.set()))
    thread.start()
    uid = sandbox.SANDBOX_UID if os.geteuid() == 0 else os.getuid()  # the program's uid, seen from outside
    namespaces, deadline = {}, time.monotonic() + 10
    while len(namespaces) < 2 and not done.is_set() and time.monotonic() < deadline:
        for pid in sandbox_processes():
            with contextlib.suppress(OSError):
                if open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0] != b"bwrap" and \
                        f"\nUid:\t{uid}\t" in open(f"/proc/{pid}/status").read():
                    namespaces[pid] = os.readlink(f"/proc/{pid}/ns/user")
        time.sleep(0.05)
    thread.join()
    assert len(namespaces) >= 2 and len(set(namespaces.values())) == len(namespaces)
    assert os.readlink("/proc/self/ns/user") not in namespaces.values()


def test_code_without_libseccomp_refuses_unless_unsafe(monkeypatch):
    """No libseccomp, no system-call filter: code rewards refuse to run (one clear line) unless unsafe."""
    caches = (sandbox.bwrap_ready, sandbox.seccomp_filter)
    monkeypatch.setattr(sandbox, "LIBSECCOMP", "libseccomp-missing.so.0")
    for cache in caches:
        cache.cache_clear()
    try:
        assert sandbox.bwrap_ready() is False and "apt-get install libseccomp2" in sandbox.not_ready_reason()
        with pytest.raises(RuntimeError, match="need libseccomp.*--unsafe_code_exec"):
            sandbox._run_program("print(1)", "", "", sandbox.Budget(6.0, time.monotonic() + 18), 1 << 30, False)
        add = fenced("def add(a, b):\n    return a + b")
        assert score_code(add, ["assert add(1, 2) == 3"]) is False
        assert score_code(add, ["assert add(1, 2) == 3"], unsafe=True) is True
        with pytest.raises(SystemExit, match="^error: code rewards need libseccomp.*--unsafe_code_exec"):
            checks.check_code_rewards(types.SimpleNamespace(unsafe_code_exec=False), [{"domain": "code"}])
    finally:
        monkeypatch.undo()
        for cache in caches:
            cache.cache_clear()


def test_code_batch_equals_one_by_one_and_uses_workers(monkeypatch):
    rows = [json.loads(line) for line in open(FIXTURES / "code_toy.jsonl")][::3]  # all: test_data_code_toy_*
    responses = [r["solution"] for r in rows] + [r["solution"] for r in rows[:3]]
    tests = [r["tests"] for r in rows] + [r["tests"] for r in rows[1:4]]         # another's tests
    expected = [True] * len(rows) + [False] * 3
    assert [score_code(r, t) for r, t in zip(responses, tests)] == expected
    # real sandboxes side by side: one worker per CPU, so min(4, CPUs) samples run at once (read from when
    # each sample's scoring began and ended, not from a wall-clock bound, which a loaded machine breaks)
    spans, real = [], sandbox.score_code

    def timed(*args, **kwargs):
        start = time.monotonic()
        try:
            return real(*args, **kwargs)
        finally:
            spans.append((start, time.monotonic()))
    monkeypatch.setattr(sandbox, "score_code", timed)
    slow = [fenced("import time\ntime.sleep(1)\nprint(3)")] * 4
    four = [{"inputs": [str(k)], "outputs": ["3"]} for k in range(4)]        # four problems
    assert score_code_batch(slow, four, workers=4) == [True] * 4
    at_once = max(sum(a <= t < b for a, b in spans) for t, _ in spans)
    assert len(spans) == 4 and at_once == min(4, len(os.sched_getaffinity(0))), spans
    monkeypatch.setattr(sandbox, "score_code", real)
    assert score_code_batch(responses, tests, workers=2) == expected
    with pytest.raises(ValueError, match="2 responses but 1 tests"):
        score_code_batch(["a", "b"], [SUM])


def test_code_batch_never_runs_two_samples_of_one_problem_at_once(monkeypatch):
    """Samples of one problem take turns (no contention channel between a solver and a copier); samples of
    different problems still run side by side."""
    running, most_of_one, most_at_once, lock = collections.Counter(), [0], [0], threading.Lock()

    def fake_score(response, tests, **_):
        with lock:
            running[repr(tests)] += 1
            most_of_one[0] = max(most_of_one[0], running[repr(tests)])
            most_at_once[0] = max(most_at_once[0], sum(running.values()))
        time.sleep(0.05)
        with lock:
            running[repr(tests)] -= 1
        return response

    monkeypatch.setattr(sandbox, "score_code", fake_score)
    tests = [["assert a(1) == 1"], ["assert b(2) == 4"]] * 4
    assert score_code_batch(list(range(8)), tests, workers=4) == list(range(8))
    assert most_of_one == [1] and most_at_once == [2]


def test_code_batch_keeps_one_problem_apart_however_its_tests_are_written(monkeypatch):
    """"The same problem" is decided on the tests as the judge reads them: another spacing, order, subset of cases
    or name of the solution does not make another problem (two such samples ran side by side, and one could pass
    its answer to the other as CPU load). Different problems still run side by side."""
    same = {"stdin": ({"inputs": ["1 2\n", "5 5"], "outputs": ["3\n", "10"]}, {"inputs": ["5  5\n"], "outputs": ["10 \n"]}),
            "asserts": (["assert add(1, 2) == 3", "assert add(2, 2) == 4"],
                        "def check(candidate):\n    assert 3 == (candidate(1,2)), 'sums'\ncheck(add)")}
    running, worst, lock = collections.Counter(), collections.Counter(), threading.Lock()

    def fake_score(label, tests, **_):
        with lock:
            running[label] += 1
            worst[label], worst["all"] = max(worst[label], running[label]), max(worst["all"], sum(running.values()))
        time.sleep(0.05)
        with lock:
            running[label] -= 1
        return True

    monkeypatch.setattr(sandbox, "score_code", fake_score)
    labels = [label for label in same for _ in (0, 1)] * 2
    score_code_batch(labels, [tests for pair in same.values() for tests in pair] * 2, workers=2)
    assert (worst["stdin"], worst["asserts"], worst["all"]) == (1, 1, min(2, len(os.sched_getaffinity(0))))


SPINNERS = PAST_THE_GUARD + "for _ in range(30):\n    if libc.fork() == 0:\n        libc.setsid()\n        break\nwhile True:\n    pass\n"


@BWRAP
def test_code_a_neighbours_processes_cannot_starve_a_sample():
    """A sample of another problem that spins 31 processes, each in a session of its own, beside a correct sample
    that needs under a second of CPU: on 2 cores it got a 16th of one and failed its time limit. Each sandbox now
    has a CPU of its own (pinned, and kept there by the system-call filter; and a cgroup's one-CPU share)."""
    work = fenced("n = 0\nfor i in range(8_000_000):\n    n += i\nprint(n % 7)")
    spin_tests, work_tests = {"inputs": [""], "outputs": ["x"]}, {"inputs": [""], "outputs": [str(sum(range(8_000_000)) % 7)]}
    assert score_code_batch([fenced(SPINNERS), work], [spin_tests, work_tests], workers=2, timeout=6.0) == [False, True]


def test_load_problems_rejects_empty_and_non_finite_answers(tmp_path):
    path = tmp_path / "p.jsonl"
    cases = [('{"problem": "p", "answer": ""}', "field 'answer' is empty"),
             ('{"problem": "p", "answer": "   "}', "field 'answer' is empty"),
             ('{"question": "q", "answer": "work ####"}', "field 'answer' is empty after its last '####'"),
             ('{"question": "q", "answer": "work #### \\n"}', "field 'answer' is empty after its last '####'"),
             ('{"problem": "p", "answer": NaN}', "field 'answer' must be a finite number, got nan"),
             ('{"problem": "p", "answer": Infinity}', "field 'answer' must be a finite number, got inf")]
    for line, message in cases:
        path.write_text('{"problem": "ok", "answer": "1"}\n' + line + "\n")
        with pytest.raises(ValueError) as err:
            data.load_problems(str(path))
        assert str(err.value) == f"{path}:2: {message}"
    path.write_text('{"question": "q", "answer": "3 + 4 = 7 #### 7"}\n{"problem": "p", "answer": 0}\n')
    assert [p["answer"] for p in data.load_problems(str(path))] == ["7", "0"]


def test_data_build_toy_model_remakes_the_shipped_tokenizer_and_config_and_its_warm_up_learns(tmp_path):
    """`python toy.py --build toy` as the shipped toy_model/ was made, cut to 30 warm-up steps: the same tokenizer
    and architecture, a folder that loads, and a warm-up loss that falls (the tests train a copy of the shipped one)."""
    said = []
    out = toy.build_toy_model(str(tmp_path / "toy"), sft_steps=30, log=said.append)
    shipped = Path(toy.TOY_DIRS["toy"])
    assert json.loads((tmp_path / "toy" / "tokenizer.json").read_text()) == json.loads(
        (shipped / "tokenizer.json").read_text())
    for name in ("config.json", "generation_config.json"):  # byte for byte: a rebuild leaves git clean
        assert (tmp_path / "toy" / name).read_bytes() == (shipped / name).read_bytes(), name
    assert AutoModelForCausalLM.from_pretrained(out).num_parameters() == AutoModelForCausalLM.from_pretrained(
        shipped).num_parameters()
    losses = [float(re.search(r"loss ([\d.]+)", m)[1]) for m in said if "warm-up step" in m]
    assert len(losses) == 2 and losses[1] < losses[0] - 1, said  # steps 0 and 29
    assert not (tmp_path / "toy.tmp").exists() and said[-1].startswith("built toy base model")


def test_data_reads_regular_files_only_and_every_error_names_file_and_line(tmp_path, capsys):
    """--data naming a FIFO waited for a writer forever, /dev/zero was read into memory without end, and deeply
    nested JSON, a 5000-digit integer or an assert nested past the parser's depth gave a traceback or an error
    without file:line."""
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    said = {}
    reader = threading.Thread(target=lambda: said.update(exit=pytest.raises(SystemExit, train.load_data,
                                                                            config.get_args(["--data", str(fifo)]))),
                              daemon=True)
    reader.start()
    reader.join(10)
    assert str(said["exit"].value.code) == f"error: --data {fifo}: not a regular file (a FIFO): give a jsonl file"
    for path, kind in (("/dev/zero", "a device"), (tmp_path, "a directory")):
        with pytest.raises(OSError, match=rf"not a regular file \({kind}\)"):
            data.load_problems(str(path))
    ok = '{"problem": "ok", "answer": "1"}\n'
    cases = {ok + '{"problem": "p", "answer": ' + "[" * 100_000 + "]" * 100_000 + "}\n": ":2: invalid JSON (nested too deeply)",
             ok + '{"problem": "p", "answer": ' + "9" * 5000 + "}\n": ":2: invalid JSON (Exceeds the limit",
             ok + '{"prompt": "p", "tests": ["assert f(1)' + " + 1" * 100_000 + '"]}\n':
                 ":2: field 'tests': an expression nested too deeply to parse",
             ok + '{"problem": "' + "x" * runs.MAX_LINE_BYTES + '", "answer": "1"}\n': ":2: a line over 16 MiB"}
    assert_load_errors(tmp_path, cases)
    for i in range(len(cases)):
        with pytest.raises(SystemExit) as exit_:
            train.load_data(config.get_args(["--data", str(tmp_path / f"bad{i}.jsonl")]))
        assert re.fullmatch(rf"error: --data: \S*bad{i}.jsonl:2: [^\n]+", exit_.value.code), exit_.value.code


def test_data_counts_golds_no_response_can_match_and_cuts_tests_to_the_cases_a_sample_runs(tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    many = {"inputs": [str(k) for k in range(40)], "outputs": [str(k) for k in range(40)]}
    path.write_text("\n".join(json.dumps(r) for r in [
        {"problem": "a", "answer": "1"}, {"problem": "b", "answer": "2" * 1001}, {"problem": "c", "answer": "\\$"},
        {"problem": "d", "answer": "3" * 1001}, {"prompt": "e", "tests": many}]) + "\n")
    problems = data.load_problems(str(path))
    err = capsys.readouterr().err
    assert "2 gold answer(s) that no response can match (longer than 1000 characters): kept" in err and f"{path}:2)" in err
    assert "1 gold answer(s) that no response can match (nothing is left of it once normalized)" in err
    assert "1 code problem(s) with more than 32 test cases: each keeps its first 32" in err and f"{path}:5)" in err
    assert len(problems) == 5 and problems[4]["tests"] == {"inputs": many["inputs"][:32], "outputs": many["outputs"][:32]}
    assert not verify.score(r"\boxed{" + "2" * 1001 + "}", "2" * 1001)  # what the warning says


def test_curriculum_batch_across_epoch_boundary_never_repeats_or_serves_a_retired_prompt():
    for seed in range(40):
        c = data.Curriculum(5, seed=seed)
        first = c.next_batch(4)
        for i in first:
            c.record(i, 0.0)
        second = c.next_batch(4)  # one prompt from epoch 0, three from epoch 1
        assert len(set(second)) == 4 and c.epoch == 1
        tail = second[0]
        for i in second:
            c.record(i, 1.0 if i == tail else 0.0)  # the tail prompt is retired
        state = json.loads(json.dumps(c.state_dict()))
        later = [c.next_batch(3) for _ in range(6)]
        assert all(tail not in b and len(set(b)) == 3 for b in later)
        resumed = data.Curriculum(5, seed=seed)
        resumed.load_state_dict(state)
        assert [resumed.next_batch(3) for _ in range(6)] == later
    c = data.Curriculum(7, seed=3)  # no retirement: every run of 7 served prompts is one whole epoch
    stream = [i for _ in range(12) for i in c.next_batch(4)]
    for e in range(len(stream) // 7):
        assert sorted(stream[7 * e:7 * e + 7]) == list(range(7))
    assert all(len(set(stream[4 * b:4 * b + 4])) == 4 for b in range(12))

# =============================================================================
# data.py and hub.py: problem files, Hub ids, prompts, the curriculum, the toy task and the embedded toy model


def test_data_loads_the_published_layouts_of_gsm8k_and_math500():
    gsm, math500 = data.load_problems(FIXTURES / "gsm8k_test_sample.jsonl"), data.load_problems(FIXTURES / "math500.jsonl")
    assert (len(gsm), len(math500)) == (264, 500)
    assert gsm[0]["answer"] == "18" and gsm[0]["prompt"].startswith("Janet\u2019s ducks lay 16 eggs")
    assert [p["answer"] for p in gsm] == [_gsm8k_gold(r) for r in _jsonl(FIXTURES / "gsm8k_test_sample.jsonl")]
    rows = _jsonl(FIXTURES / "math500.jsonl")
    assert [p["answer"] for p in math500] == [r["answer"] for r in rows]
    assert [p["prompt"] for p in math500] == [r["problem"] for r in rows]
    assert all(isinstance(p["prompt"], str) and isinstance(p["answer"], str) for p in gsm + math500)


def test_data_layouts_and_clear_errors(tmp_path):
    f = tmp_path / "mixed.jsonl"
    f.write_text('{"problem": "p1", "solution": "so \\\\boxed{\\\\frac{1}{2}}."}\n\n'
                 '{"prompt": "p2", "answer": 72}\n{"question": "p3", "answer": "work\\n#### 1,000"}\n'
                 '{"problem": "p4", "answer": 0.5}\n')
    assert data.load_problems(f) == [{"prompt": "p1", "answer": "\\frac{1}{2}", "domain": "math"},
                                     {"prompt": "p2", "answer": "72", "domain": "math"},
                                     {"prompt": "p3", "answer": "1,000", "domain": "math"},
                                     {"prompt": "p4", "answer": "0.5", "domain": "math"}]
    cases = {'{"problem": "p"}\n': ":1: missing field 'answer'",
             '{"answer": "1"}\n': ":1: missing field 'prompt'",
             '{"problem": "p", "answer": "1"}\n{"problem": "q", "answer": [1, 2]}\n': ":2: field 'answer' must be",
             '{"problem": "p", "answer": "1"}\n{broken\n': ":2: invalid JSON",
             # a line cut short: the column where it ends, not column 1 of the next line
             '{"problem": "p", "answer": "1"}\n{"problem": "q", "answer": "2"\n':
                 ":2: invalid JSON (Expecting ',' delimiter at column 31)",
             '{"problem": "p\t", "answer": "1"}\n': ":1: invalid JSON (Invalid control character at column 15)",
             '': ": no problems"}
    assert_load_errors(tmp_path, cases)


def assert_load_errors(tmp_path, cases):
    """Each jsonl text in cases makes load_problems raise an error containing 'file' + the expected ':line: ...'."""
    for i, (text, msg) in enumerate(cases.items()):
        bad = tmp_path / f"bad{i}.jsonl"
        bad.write_text(text)
        with pytest.raises(ValueError) as e:
            data.load_problems(bad)
        assert f"bad{i}.jsonl{msg}" in str(e.value)  # file:line: field


def test_data_non_utf8_duplicates_and_a_clean_exit_from_train(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "ok", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not UTF-8 \(byte 0xe9 at column 16\)"):
        data.load_problems(bad)
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n{"prompt": "a", "answer": "3"}\n')
    assert [p["answer"] for p in data.load_problems(dup)] == ["1", "2"]
    assert "skipped 1 duplicate" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"error: .*bad.jsonl:2: not UTF-8"):
        train.load_data(config.get_args(["--data", str(bad)]))


# ---------------------------------------------------------------------------------------------
# the Hugging Face Hub (--model Qwen/Qwen3-0.6B, --data openai/gsm8k:main). Nothing here reaches the Hub: the tests
# build in tmp_path what a first online use leaves on disk, huggingface_hub's cache of a model repo (refs/main names
# the commit; snapshots/<commit>/ holds symlinks into blobs/) and datasets' cache of a loaded dataset
# (owner___name/config/0.0.0/<hash>/: the arrow files and dataset_info.json its real Parquet builder writes), then
# load offline (HF_HUB_OFFLINE=1, HF_DATASETS_OFFLINE=1) through the real code: snapshot_download, load_dataset.

HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_model_cache(hub, repo_id, folder):
    """huggingface_hub's cache layout of a model repo holding the files of `folder` -> its snapshot folder."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / HUB_COMMIT
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in sorted(Path(folder).iterdir()):
        blob = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, repo / "blobs" / blob)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", blob))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HUB_COMMIT)
    return snapshot


def hub_dataset_cache(cache, repo_id, config, splits):
    """What `datasets.load_dataset(repo_id, config)` online leaves in HF_DATASETS_CACHE, for splits {name: records}:
    prepared by datasets' own Parquet builder (as a Hub dataset of parquet files is), placed at owner___name/config."""
    import datasets
    from datasets.packaged_modules.parquet.parquet import Parquet
    owner, name = repo_id.split("/")
    src = cache.parent / "hub-src" / repo_id / config
    src.mkdir(parents=True)
    for split, records in splits.items():
        datasets.Dataset.from_list(records).to_parquet(str(src / f"{split}.parquet"))
    builder = Parquet(cache_dir=str(cache.parent / "staging"), dataset_name=name, config_name=config, hash="c0ffee",
                      data_files={split: str(src / f"{split}.parquet") for split in splits})
    builder.download_and_prepare()
    shutil.copytree(builder.cache_dir, cache / f"{owner}___{name}" / config / "0.0.0" / "c0ffee")


def gsm8k_record(i):
    return {"question": f"Tom has {i} apples and buys 2 more. How many apples does he have?",
            "answer": f"He has {i} + 2 = <<{i}+2={i + 2}>>{i + 2} apples.\n#### {i + 2}"}


def test_hub_model_id_resolves_through_the_cache_and_loads(tmp_path, monkeypatch, capsys):
    import huggingface_hub
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # read at its import:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # the env, as a fresh process reads it
    snapshot = hub_model_cache(tmp_path / "hub", "org/toy", ROOT / "toy_model")
    args = config.get_args(["--eval_only", "--model", "org/toy", "--val_size", "8", "--eval_samples", "1"])
    assert (args.model, args.model_dir) == ("org/toy", str(snapshot))  # as typed (--resume compares it); what loads
    assert train.main(args)["n"] == 8 and "eval org/toy on 8 held-out problems" in capsys.readouterr().out
    assert hub.resolve_model(str(ROOT / "toy_model")) == str(ROOT / "toy_model")  # a local folder: as is
    for argv, said in [(["--model", "org/none"], "train.py: error: --model org/none: not a local folder, and not in "
                         f"the Hugging Face cache (HF_HUB_CACHE={tmp_path / 'hub'}); the Hub could not be reached "
                         "(HF_HUB_OFFLINE is set): download it once with network access (hf download org/none) or "
                         "give a local folder"),
                       (["--model", "no/such/dir"], "train.py: error: --model no/such/dir: no such folder (and not a "
                        "Hugging Face Hub id, owner/name)")]:
        with pytest.raises(SystemExit):
            config.get_args(argv)
        assert capsys.readouterr().err.strip().splitlines() == [said + " (--help lists the flags)"]
    (snapshot / "model.safetensors").unlink()  # a snapshot cached without its weights: the folder checks still apply
    with pytest.raises(SystemExit):
        config.get_args(["--model", "org/toy"])
    assert f"--model org/toy ({snapshot}): no weights" in capsys.readouterr().err


def hub_settings(monkeypatch, hub, datasets_cache, offline):
    """huggingface_hub's and datasets' cache folders and offline mode, patched: both libraries read them from the
    environment at import (HF_HUB_CACHE, HF_DATASETS_CACHE, HF_HUB_OFFLINE, HF_DATASETS_OFFLINE), as a fresh
    process would."""
    import datasets
    import huggingface_hub
    for module, key, value in [(huggingface_hub.constants, "HF_HUB_CACHE", str(hub)),
                               (datasets.config, "HF_DATASETS_CACHE", datasets_cache),
                               (huggingface_hub.constants, "HF_HUB_OFFLINE", offline),
                               (datasets.config, "HF_HUB_OFFLINE", offline)]:
        monkeypatch.setattr(module, key, value)


def test_hub_dataset_ids_load_through_the_datasets_cache_offline(tmp_path, monkeypatch, capsys):
    hf = tmp_path / "hf"
    hub_settings(monkeypatch, hf / "hub", hf / "datasets", offline=True)
    hub_model_cache(hf / "hub", "org/toy", ROOT / "toy_model")
    math500 = _jsonl(FIXTURES / "math500.jsonl")[:5]  # its Hub layout: problem, solution, answer, subject, level, unique_id
    hub_dataset_cache(hf / "datasets", "org/gsm", "main", {"train": [gsm8k_record(i) for i in range(8)],
                                                           "test": [gsm8k_record(i) for i in range(8, 10)]})
    hub_dataset_cache(hf / "datasets", "org/math500", "default", {"test": math500})
    hub_dataset_cache(hf / "datasets", "org/bad", "default", {"train": [gsm8k_record(0), {"question": "q", "answer": "x ####"}]})
    train_set, val = train.load_data(config.get_args(["--data", "org/gsm:main", "--val_data", "org/gsm:main:test"]))
    assert [len(train_set), train_set[0], len(val), val[0]] == [
        8, {"prompt": gsm8k_record(0)["question"], "answer": "2", "domain": "math"},
        2, {"prompt": gsm8k_record(8)["question"], "answer": "10", "domain": "math"}]
    assert data.load_source_problems("org/math500", "test") == [
        {"prompt": r["problem"], "answer": r["answer"], "domain": "math"} for r in math500]
    errors = []
    for flag, spec in [("--data", "org/bad"), ("--data", "org/gsm:other"), ("--val_data", "org/gsm:main:validation"),
                       ("--val_data", "org/none"), ("--data", "fixtures/none.jsonl")]:
        with pytest.raises(SystemExit) as exit_:
            train.load_source(flag, spec, 0)
        errors.append(exit_.value.code)
    bad, bad_config, split, missing, no_file = errors
    assert bad == "error: --data: org/bad::train row 1: field 'answer' is empty after its last '####'"
    assert bad_config == ("error: --data org/gsm:other: not a file, and the Hugging Face dataset org/gsm has no config "
                          "other (configs found: main): name one, org/gsm:main")
    assert "Unknown split \"validation\"" in split and split.endswith("the syntax is owner/name[:config[:split]]")
    assert missing == ("error: --val_data org/none: not a file, and not in the Hugging Face datasets cache "
                       f"(HF_DATASETS_CACHE={hf / 'datasets'}); the Hub could not be reached (HF_HUB_OFFLINE is "
                       "set): run this once with network access (it is cached then) or give a jsonl file; if it "
                       "has several configs, name one: org/none:CONFIG (GSM8K's: openai/gsm8k:main)")
    assert no_file == "error: --data fixtures/none.jsonl: No such file or directory"  # a path, not a Hub id
    capsys.readouterr()
    # the first 4: the 5th's 730 tokens are more than the toy's 512-token context
    train.main(config.get_args(["--eval_only", "--model", "org/toy", "--data", "org/gsm:main", "--val_data",
                               "org/math500", "--val_size", "4", "--eval_samples", "1"]))
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("eval org/toy on org/math500: pass rate ") and "over 4 problems" in last, last


def test_hub_ids_without_network_fail_in_seconds_and_cached_ones_load(tmp_path, monkeypatch, capsys):
    """No HF_HUB_OFFLINE, and a Hub endpoint that takes connections and never answers (packets
    dropped): an id that is not cached fails within seconds (the libraries retried for minutes), one
    line naming the flag; cached ids load; a dataset of several configs says which to name."""
    import datasets
    import huggingface_hub
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)
    endpoint = f"http://127.0.0.1:{hole.getsockname()[1]}"
    hub_settings(monkeypatch, tmp_path / "hub", tmp_path / "datasets", offline=False)
    for module, key, value in [(huggingface_hub.constants, "ENDPOINT", endpoint),
                               (datasets.config, "HF_ENDPOINT", endpoint),
                               (hub, "HUB_PROBE_SECONDS", 1.0)]:  # 3 s in use
        monkeypatch.setattr(module, key, value)
    snapshot = hub_model_cache(tmp_path / "hub", "org/toy", ROOT / "toy_model")
    hub_dataset_cache(tmp_path / "datasets", "org/gsm", "main", {"train": [gsm8k_record(i) for i in range(4)]})
    hub_dataset_cache(tmp_path / "datasets", "org/gsm", "socratic", {"train": [gsm8k_record(9)]})
    capsys.readouterr()  # the cache builder's progress bars
    start = time.monotonic()
    with pytest.raises(SystemExit):
        config.get_args(["--model", "org/none"])
    with pytest.raises(SystemExit) as exit_:
        train.load_source("--data", "org/none", 0)
    assert time.monotonic() - start < 3 * hub.HUB_PROBE_SECONDS  # one probe, then nothing waits
    unreached = f"the Hub could not be reached ({endpoint} did not answer within 1 s)"
    assert capsys.readouterr().err.strip().splitlines() == [
        f"train.py: error: --model org/none: not a local folder, and not in the Hugging Face cache (HF_HUB_CACHE="
        f"{tmp_path / 'hub'}); {unreached}: download it once with network access (hf download org/none) or give "
        "a local folder (--help lists the flags)"]
    assert exit_.value.code == (
        f"error: --data org/none: not a file, and not in the Hugging Face datasets cache (HF_DATASETS_CACHE="
        f"{tmp_path / 'datasets'}); {unreached}: run this once with network access (it is cached then) or give a "
        "jsonl file; if it has several configs, name one: org/none:CONFIG (GSM8K's: openai/gsm8k:main)")
    assert hub.resolve_model("org/toy") == str(snapshot)
    assert [p["answer"] for p in train.load_source("--data", "org/gsm:main", 0)] == ["2", "3", "4", "5"]
    for spec, said in [("org/gsm", "has several configs (main, socratic): name one, org/gsm:main"),
                       ("org/gsm:other", "has no config other (configs found: main, socratic): name one, "
                                         "org/gsm:main")]:
        with pytest.raises(SystemExit) as exit_:
            train.load_source("--data", spec, 0)
        assert exit_.value.code == f"error: --data {spec}: not a file, and the Hugging Face dataset org/gsm {said}"
    hole.close()


def test_hub_dataset_id_without_the_datasets_package_says_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(SystemExit) as exit_:
        train.load_source("--val_data", "HuggingFaceH4/MATH-500", 0)
    assert exit_.value.code == ("error: --val_data HuggingFaceH4/MATH-500: a Hugging Face dataset id needs the "
                                "datasets package: pip install datasets (or give a jsonl file)")
    assert hub.hub_dataset_spec("openai/gsm8k:main:train[:100]") == ("openai/gsm8k", "main", "train[:100]")
    assert hub.hub_dataset_spec("HuggingFaceH4/MATH-500::test") == ("HuggingFaceH4/MATH-500", None, "test")
    assert [hub.hub_dataset_spec(s) for s in ("gsm8k.jsonl", "x/test.jsonl", "fixtures/none", "/abs/a")] == [None] * 4


def test_format_prompt_plain_and_chat_template(toy_dir):
    tok = AutoTokenizer.from_pretrained(toy_dir)
    plain = data.format_prompt(tok, "What is 2+2?")
    assert plain == f"{data.INSTRUCTION}\nProblem: What is 2+2?\nSolution: "
    tok.chat_template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
    chat = data.format_prompt(tok, "What is 2+2?")
    assert chat.startswith("<|user|>") and chat.endswith("<|assistant|>") and "What is 2+2?" in chat


def bos_tokenizer(template=True):
    """A word-level tokenizer that adds a BOS to whatever it tokenizes (as Llama-3's does), with a chat template
    that writes its own BOS first (as Llama-3's does)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    words = ["<s>", "</s>", "<unk>"] + sorted(set(re.findall(r"\w+|[^\w\s]", data.INSTRUCTION + " Problem Solution "
                                                                                "What is 2+2? <|user|> <|assistant|>")))
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(r"<\|\w+\|>|\w+|[^\w\s]", "isolated")
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    if template:
        tok.chat_template = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
                             "<|assistant|>")
    return tok


def test_prompt_ids_have_one_bos_whether_a_chat_template_writes_it_or_the_tokenizer_adds_it(toy_dir):
    for template in (True, False):
        tok = bos_tokenizer(template)
        ids = data.prompt_ids(tok, "What is 2+2?")
        assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1, template
        assert tok.decode(ids, skip_special_tokens=True).split() == \
            tok.decode(tok(data.format_prompt(tok, "What is 2+2?"))["input_ids"], skip_special_tokens=True).split()
    assert tok(data.format_prompt(bos_tokenizer(), "What is 2+2?"))["input_ids"][:2] == [0, 0]  # the old way: two
    toy_tok = AutoTokenizer.from_pretrained(toy_dir)  # the toy's prompts: exactly as before
    problems = toy.toy_problems(20, 3)
    for p in problems:
        assert data.prompt_ids(toy_tok, p["prompt"]) == toy_tok(data.format_prompt(toy_tok, p["prompt"]))["input_ids"]
    code = [{"prompt": "Write f.", "domain": "code"}]
    for tok in (toy_tok, bos_tokenizer(True), bos_tokenizer(False)):  # one batch: each prompt as alone
        assert train.tokenize_prompts(tok, problems + code) == [data.prompt_ids(tok, p["prompt"], p.get("domain"))
                                                               for p in problems + code]


LOOPING_TEMPLATE = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                    "{{ messages[0].content }}")


def test_a_chat_template_that_loops_stops_the_run_with_one_line(toy_dir, tmp_path, monkeypatch):
    """A model folder's chat template is code: one that loops (here 10^10 iterations) is rendered once, under a time
    limit, and stops the run with one line (it ran for minutes with no message)."""
    folder = tmp_path / "model"
    shutil.copytree(toy_dir, folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = LOOPING_TEMPLATE
    tok.save_pretrained(folder)
    monkeypatch.setattr(sandbox, "TEMPLATE_SECONDS", 1.0, raising=False)
    said, start = {}, time.monotonic()

    def evaluate():
        try:
            train.eval_only(config.get_args(["--eval_only", "--model", str(folder), "--val_size", "4"]))
        except SystemExit as err:
            said["exit"] = str(err.code)

    thread = threading.Thread(target=evaluate, daemon=True)
    thread.start()
    thread.join(30)
    assert said.get("exit", "").startswith(f"error: --model {folder}: its chat template took over 1 s to render")
    assert time.monotonic() - start < 15 and "\n" not in said["exit"]


def test_a_chat_template_computing_a_huge_power_stops_at_the_limit_with_one_line(toy_dir, monkeypatch):
    """10 ** (10 ** 8) is one C call holding the GIL: neither the trace deadline nor a thread's join acted, and
    start-up hung (~10 min). The template renders in a child killed at the limit; its errors come back as one line."""
    tok = AutoTokenizer.from_pretrained(toy_dir)
    monkeypatch.setattr(sandbox, "TEMPLATE_SECONDS", 1.0, raising=False)
    tok.chat_template = "{% for m in messages %}<u>{{ m.content }}{% endfor %}<a>"
    assert sandbox.render_chat_template(tok, "What is 2+2?") == "<u>What is 2+2?<a>"
    tok.chat_template = "{{ 10 ** (10 ** 8) }}{{ messages[0].content }}"
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"^its chat template took over 1 s to render one prompt \(a loop or a huge "):
        sandbox.render_chat_template(tok, "What is 2+2?")
    assert time.monotonic() - start < 5
    tok.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(ValueError, match=r"^its chat template fails: TemplateError: no system role$"):
        sandbox.render_chat_template(tok, "What is 2+2?")


CONTROL_CHARACTERS = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")  # a terminal acts on them (\n aside)


def test_a_chat_templates_error_message_reaches_the_terminal_with_its_control_characters_shown(toy_dir, tmp_path):
    """A model folder's template writes raise_exception's message: its escape sequences (clear the screen, retitle
    the window, a carriage return and a fake last line) reached stderr raw. They are shown as \\xNN in the one
    error line, and its non-ASCII text is kept."""
    folder = tmp_path / "model"
    shutil.copytree(toy_dir, folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = ("{{ raise_exception('\\x1b[2J\\x1b]0;pwned\\x07不支持 √2 ≤ π\\r\\ndone in 0.1 min | "
                         "pass rate 1.000\\x9b\\x7f') }}")
    tok.save_pretrained(folder)
    run = Forked(["--eval_only", "--model", str(folder), "--val_size", "4"], {}, tmp_path / "log")
    assert run.wait(timeout=60) == 2
    said = run.communicate()[0]
    assert said.strip().splitlines()[-1] == (
        f"train.py: error: --model {folder}: its chat template fails: TemplateError: \\x1b[2J\\x1b]0;pwned\\x07"
        "不支持 √2 ≤ π done in 0.1 min | pass rate 1.000\\x9b\\x7f")
    assert not CONTROL_CHARACTERS.search(said), said
    assert hub.one_line(ValueError("a\x1b[2J\tb\r\n\x00c 问题")) == "a\\x1b[2J b \\x00c 问题"


def test_a_chat_template_adding_a_megabyte_around_each_prompt_stops_with_one_line(toy_dir, tmp_path):
    """A template that adds 1 MB around each message rendered in time, and every prompt carried it (3 GB in 16 s, no
    line): the rendered text is capped (sandbox.TEMPLATE_CHARS), one line at load."""
    tok = AutoTokenizer.from_pretrained(toy_dir)
    tok.chat_template = "{{ 'x' * 1000000 }}{% for m in messages %}{{ m.content }}{% endfor %}"
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"^its chat template renders 1,000,0\d\d characters around one prompt, over "
                                         r"the 65,536 a template may add$"):
        sandbox.render_chat_template(tok, "What is 2+2?")
    folder = tmp_path / "model"
    shutil.copytree(toy_dir, folder)
    tok.save_pretrained(folder)
    said = one_line_exit(lambda: load_toy(str(folder)))
    assert said.startswith(f"error: --model {folder}: its chat template renders 1,000,0")
    assert time.monotonic() - start < 5


def test_a_prompt_longer_than_the_context_is_refused_by_file_and_line_before_tokenizing(toy_dir, tmp_path):
    """A dataset with 8 MB prompts was tokenized whole before the context check (4 GB in 33 s): each prompt, in its
    chat template, is measured in characters first (a token stands for at most as many characters as the longest
    token in the vocabulary), and one too long stops the run with one line naming its file and line."""
    path = tmp_path / "long.jsonl"
    rows = [{"prompt": "What is 1+1?", "answer": "2"}, {"prompt": "What is 2+2? " + "x" * 8_000_000, "answer": "4"},
            {"prompt": "What is 3+3?", "answer": "6"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    said = one_line_exit(lambda: train.eval_only(config.get_args(["--eval_only", "--model", toy_dir,
                                                                  "--val_data", str(path)])))
    assert re.fullmatch(rf"error: the prompt at {re.escape(str(path))}:2 \(8,000,\d+ characters with its template: "
                        r"at least \d+ tokens\) does not fit the model's context \(max_position_embeddings 512\) with "
                        r"the interruption phrase \(\d+\), whatever the budgets: shorten or drop that prompt",
                        said), said
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:1] + [{"prompt": "2 " * 450, "answer": "4"}]))
    said = one_line_exit(lambda: train.start(config.get_args(["--model", toy_dir, "--data", str(path), "--val_size",
                                                              "1", "--out", str(tmp_path / "run")])))
    runs.release_lock()
    assert re.fullmatch(rf"error: the prompt at {re.escape(str(path))}:2 \(\d+ tokens\) \+ --think_budget .*; "
                        r"lower the budgets to \d+ tokens together at most, or shorten that prompt", said), said


def long_prompt_file(path, long_at=2, ones=1500):
    """A jsonl of toy problems whose line `long_at` holds a prompt of about 2 x ones tokens (the toy tokenizer)."""
    rows = [{"prompt": f"Compute {i}+2.", "answer": str(i + 2)} for i in range(6)]
    rows[long_at - 1] = {"prompt": "Compute " + "+".join(["1"] * ones) + ".", "answer": str(ones)}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_every_entry_point_refuses_a_prompt_over_the_context_by_file_and_line(toy_dir, tmp_path, monkeypatch,
                                                                             capsys):
    """--eval_only scored a 3,024-token prompt on a 512-token model, which training refused in a line that said "lower
    the budgets" where only the prompt was too long: train, --eval_only and generate.py count the tokens of the prompts
    they use, a prompt that cannot fit whatever the budgets is named by file and line alone, and one that fits but not
    with the budgets names it and the budgets' room."""
    long = long_prompt_file(tmp_path / "long.jsonl")
    alone = (rf"error: the prompt at {re.escape(str(long))}:2 \(3024 tokens\) does not fit the model's context "
             r"\(max_position_embeddings 512\) with the interruption phrase \(19\), whatever the budgets: shorten or "
             r"drop that prompt")
    said = one_line_exit(lambda: train.eval_only(config.get_args(["--eval_only", "--model", toy_dir, "--val_data",
                                                                  str(long), "--eval_samples", "1"])))
    assert re.fullmatch(alone, said), said
    said = one_line_exit(lambda: train.start(config.get_args(["--model", toy_dir, "--data", str(long), "--val_size",
                                                              "1", "--out", str(tmp_path / "run")])))
    runs.release_lock()
    assert re.fullmatch(alone, said) and "lower the budgets" not in said, said
    fits = long_prompt_file(tmp_path / "fits.jsonl", long_at=3, ones=200)  # ~420 tokens: room for ~70 of 112
    n = len(data.prompt_ids(AutoTokenizer.from_pretrained(toy_dir), "Compute " + "+".join(["1"] * 200) + "."))
    said = one_line_exit(lambda: train.eval_only(config.get_args(["--eval_only", "--model", toy_dir, "--val_data",
                                                                  str(fits), "--eval_samples", "1"])))
    assert said == (f"error: the prompt at {fits}:3 ({n} tokens) + --think_budget 48 + --answer_budget 64 + the "
                    f"interruption phrase (19) = {n + 131} tokens: more than the model's context "
                    f"(max_position_embeddings 512); lower the budgets to {512 - n - 19} tokens together at most, or "
                    "shorten that prompt"), said
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", ["generate.py", "--model", toy_dir, "--prompt", "+".join(["1"] * 1500)])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(ROOT / "generate.py"), run_name="__main__")
    assert re.fullmatch(r"error: the prompt '1\+1\+.*' \(30\d\d tokens\) does not fit the model's context .*: "
                        r"shorten or drop that prompt", exit_.value.code), exit_.value.code


def test_every_entry_point_picks_torch_threads_and_hides_loading_bars_the_same_way(toy_dir, tmp_path, monkeypatch,
                                                                                   capsys):
    """--eval_only never capped torch's threads as training does (80 s against 8 s on a busy 2-core machine), and it
    and generate.py showed transformers' "Loading weights" bar that training hides: every entry point goes through
    faults.pick_threads (half the cores unless OMP_NUM_THREADS says) and hub.hide_progress_bars."""
    from transformers.utils import logging as hf_logging
    threads, picked = torch.get_num_threads(), []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (picked.append(n), real(n)))
    monkeypatch.setattr(os, "cpu_count", lambda: 2 * threads)  # half the cores: the threads now
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    rows = tmp_path / "val.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Compute {i}+1.", "answer": str(i + 1)}) + "\n" for i in range(2)))
    hf_logging.enable_progress_bar()  # as a fresh process has it
    train.eval_only(config.get_args(["--eval_only", "--model", toy_dir, "--val_data", str(rows), "--eval_samples",
                                     "1"]))
    out, err = capsys.readouterr()
    assert picked == [threads] and f"torch threads: {threads} of {2 * threads} cores" in out, (picked, out)
    assert "Loading weights" not in err, err
    hf_logging.enable_progress_bar()
    monkeypatch.setattr(sys, "argv", ["generate.py", "--model", toy_dir, "--n", "1", "--answer_budget", "8"])
    runpy.run_path(str(ROOT / "generate.py"), run_name="__main__")
    out, err = capsys.readouterr()
    assert picked == [threads] * 2 and out.count(" -> [") == 3 and "Loading weights" not in err, (picked, err)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # said: kept
    assert faults.pick_threads() == threads and picked == [threads] * 2
    assert faults.pick_threads(2) == threads and picked == [threads] * 3  # torchrun's 2 ranks: its OMP_NUM_THREADS=1


def test_split_is_seeded_and_disjoint():
    probs = [{"prompt": str(i), "answer": str(i)} for i in range(100)]
    tr, va = data.split_problems(probs, 20, seed=3)
    assert (tr, va) == data.split_problems(probs, 20, seed=3) and va != data.split_problems(probs, 20, seed=4)[1]
    assert len(va) == 20 and len(tr) == 80 and not {p["prompt"] for p in tr} & {p["prompt"] for p in va}


def test_curriculum_epochs_no_positive_resampling_and_resume():
    c = data.Curriculum(10, seed=1)
    first = c.next_batch(10)
    assert sorted(first) == list(range(10))
    for i in first:
        c.record(i, 1.0 if i < 3 else 0.5)  # prompts 0, 1, 2 reach pass rate >= 0.9
    second = c.next_batch(7)
    assert sorted(second) == list(range(3, 10)) and c.epoch == 1
    state = json.loads(json.dumps(c.state_dict()))  # survives a JSON round trip
    c2 = data.Curriculum(10, seed=1)
    c2.load_state_dict(state)
    assert [c.next_batch(4) for _ in range(5)] == [c2.next_batch(4) for _ in range(5)]
    assert c2.history[0] == [1.0] and c2.retired == {0, 1, 2}
    off = data.Curriculum(4, seed=0, npr=False)
    for i in off.next_batch(4):
        off.record(i, 1.0)
    assert sorted(off.next_batch(4)) == [0, 1, 2, 3]


def test_curriculum_retires_a_prompt_on_its_historical_pass_rate():
    """No-Positive-Resampling retires a prompt whose historical pass rate (paper 3.2: every group of it so far, each
    of G samples) reaches 0.9, not one group's: 0.5 then 1.0 is 0.75, kept; three more 1.0s make 4.5 / 5 = 0.9."""
    c = data.Curriculum(3, seed=0)
    for rate, retired in ((0.5, False), (1.0, False), (1.0, False), (1.0, False), (1.0, True)):
        c.record(0, rate)
        assert (0 in c.retired) == retired and (0 in c.retired) == (sum(c.history[0]) / len(c.history[0]) >= 0.9)
    c.record(1, 0.9)  # a first group at the threshold: its history is that group
    assert 1 in c.retired and 2 not in c.retired


def test_prompts_keep_a_resume_copy_per_batch_that_late_groups_of_earlier_batches_still_reach():
    """data.Prompts, generator 1 of 2 (prompts 1, 3, 5, 7, 9), batches of 2 groups: the copy of batch b is the
    curriculum before b's first pick; a pass rate of a group of batch b' < b that ends after b started goes into
    b's copy too (a resume at b has trained it), not into the copies of b' or earlier; forget_before drops the
    copies a resume can no longer need; the run's flag wins over a saved state's."""
    p = data.Prompts(10, 1, 2, batch=2, seed=0, npr=True)
    assert p.mine == [1, 3, 5, 7, 9]
    picks = [p.pick(gi) for gi in range(4)]  # batches 0 and 1 started
    assert p.at[0].pos == 0 and p.at[1].pos == 2 and p.state_at(5) is p.curriculum
    p.record(1, picks[1], 1.0)  # a group of batch 0, finished after batch 1 started: retired in its copy
    p.record(2, picks[2], 0.5)  # a group of batch 1: not in batch 1's copy
    assert p.at[1].history == {picks[1]: [1.0]} and p.at[1].retired == {picks[1]} and p.at[0].history == {}
    assert p.curriculum.history == {picks[1]: [1.0], picks[2]: [0.5]}
    p.forget_before(1)
    assert list(p.at) == [1]
    resumed = data.Prompts(10, 1, 2, batch=2, seed=0, npr=False, saved=p.state_at(1).state_dict())
    assert resumed.curriculum.retired == {picks[1]} and resumed.curriculum.npr is False

@pytest.mark.parametrize("preset, ops, top", [("toy", (1, 4), 20), ("toy-hard", (2, 6), 30)])
def test_toy_task_answers_are_right(preset, ops, top):
    problems = toy.toy_problems(300, 9, preset)
    for p in problems:
        expr = p["prompt"].removeprefix("Compute ").removesuffix(".")
        assert str(eval(expr)) == p["answer"]  # an independent evaluator
        assert ops[0] <= len(p["steps"]) <= ops[1] and all(0 <= s[3] <= top for s in p["steps"])
        trace = toy.toy_trace(p, random.Random(0))
        assert re.fullmatch(r"<think>.*</think> The answer is \\boxed\{-?\d+\}\.", trace)
    assert {len(p["steps"]) for p in problems} == set(range(ops[0], ops[1] + 1))
    args = config.get_args(["--data", preset, "--val_size", "50"])
    assert train.base_model_dir(args) == toy.toy_model_dir(preset=preset)
    assert os.path.basename(train.base_model_dir(args)) == {"toy": "toy_model", "toy-hard": "toy_model_hard"}[preset]
    assert all(p["prompt"].startswith("Compute ") for p in train.load_data(args)[1])


def test_toy_model_loads_like_any_hf_model(toy_dir):
    tok, model = AutoTokenizer.from_pretrained(toy_dir), AutoModelForCausalLM.from_pretrained(toy_dir)
    assert model.config.model_type == "llama" and 0.2e6 < sum(p.numel() for p in model.parameters()) < 1.5e6
    text = data.format_prompt(tok, "Compute 17+3-2.") + "<think>17+3=20,20-2=18.</think> The answer is \\boxed{18}."
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text  # lossless round trip, so verify.py sees exactly what was sampled
    assert "18" in tok.convert_ids_to_tokens(ids) and "</think>" in tok.convert_ids_to_tokens(ids)
    special = data.special_tokens(tok)  # the sampler's ids: the phrase and </think> round-trip too
    assert tok.decode(special["interrupt_ids"]) == data.INTERRUPT_PHRASE and special["eos_id"] == [tok.eos_token_id]
    assert tok.convert_ids_to_tokens(special["think_end"]) == ["</think>"]
    sample = gen.Sample(0, ids + [tok.eos_token_id], [], [], [], "eos")
    assert data.completion_text(tok, sample) == text  # the final eos is dropped, nothing else
    sample.tokens = ids
    assert data.completion_text(tok, sample) == text

# -----------------------------------------------------------------------------
# code problems (their tests run in sandbox.py)


def test_data_code_problems_and_domains(tmp_path):
    f = tmp_path / "mixed.jsonl"
    rows = [{"prompt": "sum", "tests": {"inputs": ["1 2"], "outputs": ["3"]}},
            {"problem": "add", "tests": ["assert add(1, 2) == 3"]},
            {"question": "add two", "tests": "assert add(1, 2) == 3", "domain": "code"},
            {"problem": "p", "answer": 5},
            {"problem": "q", "answer": "7", "domain": "math"}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert data.load_problems(f) == [
        {"prompt": "sum", "tests": {"inputs": ["1 2"], "outputs": ["3"]}, "domain": "code"},
        {"prompt": "add", "tests": ["assert add(1, 2) == 3"], "domain": "code"},
        {"prompt": "add two", "tests": "assert add(1, 2) == 3", "domain": "code"},
        {"prompt": "p", "answer": "5", "domain": "math"}, {"prompt": "q", "answer": "7", "domain": "math"}]
    cases = {'{"prompt": "p", "tests": {"inputs": ["1"], "outputs": []}}\n': ":1: field 'tests' must have",
             '{"prompt": "p", "tests": {"inputs": [1], "outputs": [2]}}\n': ":1: field 'tests' must have",
             '{"prompt": "p", "answer": "1"}\n{"prompt": "p", "tests": []}\n': ":2: field 'tests' must be",
             '{"prompt": "p", "tests": [5]}\n': ":1: field 'tests' must be",
             '{"prompt": "p", "answer": "1", "domain": "code"}\n': ":1: missing field 'tests'",
             '{"prompt": "p", "answer": "1", "domain": "chess"}\n': ":1: field 'domain' must be"}
    assert_load_errors(tmp_path, cases)


def test_data_code_toy_fixture_loads_and_its_solutions_pass():
    problems = data.load_problems(FIXTURES / "code_toy.jsonl")
    solutions = [json.loads(line)["solution"] for line in open(FIXTURES / "code_toy.jsonl")]
    assert len(problems) == 20 and {p["domain"] for p in problems} == {"code"}
    assert sum(isinstance(p["tests"], dict) for p in problems) >= 10
    assert score_code_batch(solutions, [p["tests"] for p in problems]) == [True] * 20
    wrong = [s.replace("print(", "print(1, ").replace("return ", "return 1 + ") for s in solutions]
    assert score_code_batch(wrong, [p["tests"] for p in problems]) == [False] * 20

# =============================================================================
# generate.py: the KV-cache sampler against uncached decoding (a full forward every step)


def tiny_model(kind="llama", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    common = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    cls, cfg = {"llama": (LlamaForCausalLM, LlamaConfig(**common)),
                "qwen2": (Qwen2ForCausalLM, Qwen2Config(**common)),
                "qwen3": (Qwen3ForCausalLM, Qwen3Config(head_dim=16, **common))}[kind]
    return cls(cfg).to(dtype).eval()


def tiny_prompts(n=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 40, (int(k),), generator=g).tolist() for k in torch.randint(2, 9, (n,), generator=g)]


GEN = dict(eos_id=0, think_end=[1], interrupt_ids=[5, 6, 7], think_budget=12, answer_budget=5)


def paged_reference(q, k, v, lengths, table, scale):
    """What the paged kernels compute, written out: q (R, H, D), each row over its first lengths[r] keys of the
    pools k, v (blocks, block, Hkv, D) in its block table's order, grouped query heads."""
    return torch.stack([torch.nn.functional.scaled_dot_product_attention(
        q[r, :, None], *(x[table[r].long()].flatten(0, 1)[:n].transpose(0, 1) for x in (k, v)), scale=scale,
        enable_gqa=True)[:, 0] for r, n in enumerate(lengths.tolist())])


def uncached_next(model, seq):
    """The slow path: a full forward over the whole sequence, float32 log-softmax of the last position."""
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0, -1].float().log_softmax(-1)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_generate_greedy_cached_equals_uncached(kind):
    model, prompts = tiny_model(kind), tiny_prompts(6)
    out = gen.generate(model, prompts, slots=2, temperature=0, **GEN)  # slots < prompts: slots get refilled
    n_checked = 0
    for p, s in zip(prompts, out):
        seq = list(p)
        for tok, lp, m in zip(s.tokens, s.logps, s.mask):
            if m:
                ref = uncached_next(model, seq)
                assert tok == int(ref.argmax()), f"{kind}: cached token differs at position {len(seq)}"
                assert abs(lp - ref[tok].item()) < 1e-4
                n_checked += 1
            seq.append(tok)
    assert n_checked > 30


def test_generate_budgets_and_interruption():
    model, prompts = tiny_model(), tiny_prompts(8)
    B, A, phrase = 18, 4, [5, 6, 7]
    out = gen.generate(model, prompts, eos_id=-1, think_end=[-2], interrupt_ids=phrase, think_budget=B,
                       answer_budget=A, slots=3, temperature=1.0, seed=3)
    for key, s in enumerate(out):  # no EOS and no </think> can be sampled: every sample is interrupted
        cut = gen.cut_point(3, key, B)
        assert B - B // 6 <= cut <= B
        assert s.tokens[cut:cut + 3] == phrase and s.mask[cut:cut + 3] == [0, 0, 0]
        assert all(s.mask[:cut]) and all(s.mask[cut + 3:])
        assert len(s.tokens) == cut + len(phrase) + A and s.finish == "truncated"
    plain = gen.generate(model, prompts, eos_id=-1, think_end=[-2], interrupt_ids=phrase, think_budget=B,
                         answer_budget=A, interrupt=False, slots=3, temperature=1.0)
    assert all(len(s.tokens) == B + A and all(s.mask) and s.finish == "truncated" for s in plain)


def test_generate_eos_and_think_end_finish_reasons():
    model, prompts = tiny_model(), tiny_prompts(30, seed=4)
    out = gen.generate(model, prompts, eos_id=3, think_end=[2], interrupt_ids=[5, 6, 7], think_budget=10,
                       answer_budget=3, slots=4, temperature=1.5, seed=1)
    for s in out:
        if s.finish == "eos":
            assert s.tokens[-1] == 3 and all(s.mask)
        if 2 in s.tokens and 0 not in s.mask:  # thought ended by itself: at most answer_budget tokens after it
            assert len(s.tokens) - (s.tokens.index(2) + 1) <= 3
    assert {s.finish for s in out} >= {"eos", "truncated"}


def test_generate_continuous_batching_equals_decoding_alone():
    model, prompts = tiny_model("qwen2", torch.float64), tiny_prompts(7)
    batched = gen.generate(model, prompts, slots=3, temperature=1.0, seed=11, **GEN)
    for key, p in enumerate(prompts):
        alone = gen.generate(model, [p], slots=1, temperature=1.0, seed=11, keys=[key], **GEN)[0]
        assert alone.tokens == batched[key].tokens and alone.finish == batched[key].finish
        assert np.allclose(alone.logps, batched[key].logps, atol=1e-9)


def test_sampler_tensor_core_head_gives_the_float32_heads_samples(monkeypatch):
    """On CUDA with bf16 weights the sampler's float32 head is a bf16 GEMM with float32 output (here a float32
    matmul stands in for CUDA's mm out_dtype), reading the model's own head weight: the same samples as the
    float32 copy's head, log-probs to float32 rounding, and a weight update reaches it without a copy."""
    model, prompts = tiny_model("qwen3", dtype=torch.bfloat16), tiny_prompts(6)
    monkeypatch.setattr(gen, "mm32", lambda a, b: a.float() @ b.float())
    out = {}
    for fast in (False, True):
        monkeypatch.setattr(gen, "tensor_core_head", lambda *a: fast)
        out[fast] = gen.generate(model, prompts, slots=3, temperature=1.0, seed=3, **GEN)
    for a, b in zip(out[True], out[False]):
        assert a.tokens == b.tokens and np.allclose(a.logps, b.logps, atol=1e-5)
    dec = gen.Decoder(model, 2, 32, 8, eos_id=0, think_end=[1], interrupt_ids=[5], think_budget=4,
                      answer_budget=4, interrupt=True, temperature=1.0, fp32_head=True, seed=0, version=0,
                      graphs=False)
    assert dec.w16.data_ptr() == dec.weight.data_ptr() == model.lm_head.weight.data_ptr()


def test_generate_chunked_prefill_gives_the_same_samples_and_stays_within_its_token_budget():
    """Admitting 12 prompts at once: prefill forwards of at most prefill_tokens padded tokens (one prompt each at
    a budget of 1) give exactly the samples of one forward for all (the sampler is deterministic given keys)."""
    model, prompts = tiny_model("qwen3"), tiny_prompts(12, seed=5) + [list(range(4, 30))]
    whole = gen.generate(model, prompts, slots=13, seed=2, prefill_tokens=10 ** 6, **GEN)
    for budget in (1, 40):
        chunked = gen.generate(model, prompts, slots=13, seed=2, prefill_tokens=budget, **GEN)
        assert [(s.tokens, s.logps, s.mask, s.finish) for s in chunked] == \
            [(s.tokens, s.logps, s.mask, s.finish) for s in whole]
    lens = [len(p) for p in prompts]
    groups = gen.prefill_groups(lens, 40, 64)
    assert [i for a, b, _ in groups for i in range(a, b)] == list(range(len(prompts)))
    for a, b, width in groups:
        assert width == -(-(max(lens[a:b]) - 1) // 16) * 16 and (b - a == 1 or (b - a) * width <= 40)
    assert len(gen.prefill_groups(lens, 10 ** 6, 64)) == 1 and len(gen.prefill_groups(lens, 1, 64)) == len(lens)


@pytest.mark.parametrize("dtype, fp32_head", [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)])
def test_decoder_bytes_equal_what_the_decoder_allocates(dtype, fp32_head):
    """The sampler's memory arithmetic (plan.decoder_bytes: the KV cache and bookkeeping per slot, what
    does not grow with the slots) against the bytes of every tensor a Decoder holds."""
    model = tiny_model("qwen3", dtype)
    for slots, max_len, max_new in ((3, 40, 20), (7, 64, 9)):
        dec = gen.Decoder(model, slots, max_len, max_new, eos_id=[0, 3], think_end=[1], interrupt_ids=[5, 6, 7],
                          think_budget=4, answer_budget=4, interrupt=True, temperature=1.0, fp32_head=fp32_head,
                          seed=0, version=0, graphs=False, block=16)
        params = {p.data_ptr() for p in model.parameters()}  # the head weight itself, where it needs no copy
        held = [t for t in vars(dec).values() if isinstance(t, torch.Tensor) and t.data_ptr() not in params]
        held += [t for kv in dec.cache for t in kv] + list(dec.rope)
        held += [t for wb in dec.qkv for t in wb if t is not None]
        per_slot, per_block, fixed = decoder_bytes(model.config, dtype, max_len, max_new, fp32_head, n_ids=6,
                                                   block=16)
        blocks = 1 + slots * -(-max_len // 16)  # every slot at max_len, and the scratch block
        assert sum(t.untyped_storage().nbytes() for t in held) == slots * per_slot + blocks * per_block + fixed
    kv = sum(k.nbytes + v.nbytes for k, v in dec.cache)
    assert kv == blocks * 16 * kv_bytes_per_token(model.config, dtype) == blocks * per_block
    p, b, f = decoder_bytes(model.config, dtype, 64, 40, fp32_head, block=16)  # rows at the mean length,
    room = 10 * (p + 3 * b) + b + f  # 64 - 40 / 2 = 44: 3 blocks; the rest of the room in blocks
    assert slots_in(room, model.config, dtype, 64, 40, fp32_head, block=16) == (10, 31, 10)
    assert slots_in(room, model.config, dtype, 64, 40, fp32_head, cap=4, block=16) == (4, 17, 10)  # 4 rows at 64
    assert slots_in(p + 4 * b + f, model.config, dtype, 64, 40, fp32_head, block=16) == (0, 0, 1)  # not one at 64
    assert fit_slots(model, max_len, max_new) == (gen.CPU_SLOTS, None, None)  # off CUDA: not sized by memory
    assert fit_slots(model, max_len, max_new, cap=5) == (5, None, None)


def test_generate_a_pool_too_small_for_every_row_preempts_and_gives_the_same_samples(monkeypatch):
    """A KV pool of 4-token blocks that holds one row at the full budget and little more: rows wait for blocks,
    the newest give theirs back and restart from their prompts (the same noise key), and every sample equals
    the one decoded with a block for every token of every slot; through the grouped attention and the paged
    kernels' inputs (lengths and block tables; the kernel stood in for by what it computes)."""
    model, prompts = tiny_model("qwen2", torch.float64), tiny_prompts(8, seed=6)
    cfg = dict(GEN, eos_id=3, slots=4, temperature=1.0, seed=2, block=4)
    whole = gen.generate(model, prompts, **cfg)
    assert any(0 in s.mask for s in whole) and {s.finish for s in whole} >= {"eos", "truncated"}
    admitted, admit = [], gen.Decoder.admit
    monkeypatch.setattr(gen.Decoder, "admit", lambda self, slots, *a: admitted.extend(slots) or admit(self, slots, *a))
    monkeypatch.setattr(pa, "paged_decode", paged_reference)
    for kernel in ("groups", "triton"):
        monkeypatch.setattr(gen, "decode_kernel", lambda *args, kernel=kernel: kernel)
        admitted.clear()
        small = gen.generate(model, prompts, blocks=1 + 7 + 2, **cfg)  # max_len 28: 7 blocks a row at most
        assert len(admitted) > len(prompts)  # some rows were preempted and admitted again
        for a, b in zip(small, whole):
            assert (a.key, a.tokens, a.mask, a.versions, a.finish) == (b.key, b.tokens, b.mask, b.versions, b.finish)
            assert np.allclose(a.logps, b.logps, atol=1e-9)


def test_sampler_admission_throws_away_no_decoding_when_the_pool_holds_rows_at_their_mean_length():
    """The real sampler loop over a model-free decoder (bench.LengthsDecoder: 16 slots, a 512-token budget that
    94.5% of samples reach, the KV pool sized at the mean length as plan.slots_in sizes it): decoded tokens
    thrown away by restarts stay within 5% of those kept (0.62 when rows were admitted while any block was
    free), and every sample has the length and finish reason it has with a block for every token of every
    slot (the stand-in samples nothing: its samples are their lengths)."""
    r = bench.efficiency_admission(slots=16, prompts=32, budget=512, block=16, sync_every=4, quiet=True)
    assert r["samples_equal_full_pool"] and r["discarded_full_pool"] == 0
    assert r["decode_tokens_discarded"] <= 0.05, r


def test_peak_blocks_equals_rows_grown_step_by_step():
    """Admission's projection against a step-by-step simulation: rows grow a token a step to their tops, then
    free their blocks; the most blocks held at once."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(1, 8))
        lengths = rng.integers(1, 40, n)
        tops = lengths + rng.integers(0, 40, n)
        most, t = 0, 0
        while True:
            now = np.minimum(lengths + t, tops)
            held = (-(-now // 8) * (lengths + t <= tops)).sum()
            most, t = max(most, held), t + 1
            if not (lengths + t <= tops).any():
                break
        assert gen.peak_blocks(lengths.tolist(), tops.tolist(), 8) == most


def test_decoder_blocks_are_taken_as_rows_grow_and_returned_when_they_finish():
    model = tiny_model("qwen2")
    dec = gen.Decoder(model, 3, 28, 20, eos_id=-1, think_end=[-2], interrupt_ids=[], think_budget=6, answer_budget=0,
                      interrupt=False, temperature=1.0, fp32_head=True, seed=0, version=0, graphs=False, blocks=10,
                      block=4)
    assert len(dec.free) == 9  # block 0 is the scratch block
    assert dec.reserve(0, 5) and dec.reserve(1, 8) and dec.reserve(0, 8) and len(dec.free) == 5
    assert not dec.reserve(2, 21) and len(dec.free) == 5 and not dec.tables[2].any()  # 6 blocks: none taken
    assert dec.reserve(0, 9) and len(dec.free) == 4
    taken = dec.tables[:2][dec.tables[:2] > 0].tolist()
    assert sorted(taken) == sorted(set(taken)) and len(taken) == 5 and 0 not in dec.free
    dec.admit([0, 1], [[4, 5, 6, 7, 8], [9, 10, 11]], [0, 1])
    for _ in range(6):  # the budget: 6 tokens
        dec.step(2, (dec.pos[:2] + 1).tolist())
    assert sorted(dec.collect(2)) == [0, 1] and sorted(dec.free) == list(range(1, 10))
    dec.step(2, [1, 1])  # the released rows write to the scratch block alone
    assert not dec.tables.any() and not dec.table.any()
    with pytest.raises(ValueError, match="cannot hold one row of 28 tokens"):
        gen.Decoder(model, 3, 28, 20, eos_id=-1, think_end=[-2], interrupt_ids=[], think_budget=6, answer_budget=0,
                    interrupt=False, temperature=1.0, fp32_head=True, seed=0, version=0, graphs=False, blocks=7,
                    block=4)


def test_generate_stops_on_every_eos_id_of_the_generation_config(toy_dir):
    """A model whose generation_config lists two eos ids (as Qwen2.5/3 instruct and Llama-3 do): special_tokens
    gives the tokenizer's and both, and each sample ends at its first token among them, exactly where the same
    sample drawn with no eos at all first meets one (the draws depend on the noise keys alone)."""
    tok, model = AutoTokenizer.from_pretrained(toy_dir), tiny_model()
    model.generation_config.eos_token_id = [9, 11]
    special = data.special_tokens(tok, model)
    assert special["eos_id"] == [tok.eos_token_id, 9, 11]
    prompts = tiny_prompts(16, seed=4)
    settings = dict(think_end=[1], interrupt_ids=[], think_budget=30, answer_budget=0, interrupt=False, seed=6)
    free = gen.generate(model, prompts, eos_id=-1, **settings)
    stopped = gen.generate(model, prompts, eos_id=[9, 11], **settings)
    ends = set()
    for a, b in zip(free, stopped):
        cut = next((i + 1 for i, t in enumerate(a.tokens) if t in (9, 11)), None)
        assert b.tokens == a.tokens[:cut] and b.finish == ("eos" if cut else "truncated")
        ends.add(b.tokens[-1] if cut else None)
    assert {9, 11} <= ends
    assert data.completion_text(tok, gen.Sample(0, [5, 9], [], [], [], "eos")) == tok.decode([5, 9])  # 9: not special
    special = tok.convert_tokens_to_ids("<think>")  # a special token that ended a sample on eos is dropped
    assert data.completion_text(tok, gen.Sample(0, [5, special], [], [], [], "eos")) == tok.decode([5])
    assert data.completion_text(tok, gen.Sample(0, [5, special], [], [], [], "truncated")) == tok.decode([5, special])


def test_sampler_draws_from_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]]).repeat(20000, 1)
    u = gen.uniform_noise(5, torch.arange(20000), torch.zeros(20000, dtype=torch.long))
    tokens, logps = gen.sample(logits, 0.8, u)
    probs = (logits[0] / 0.8).softmax(-1)
    freq = torch.bincount(tokens, minlength=5).float() / 20000
    assert (freq - probs).abs().max() < 0.015  # ~4 standard errors
    assert torch.allclose(logps, probs.log()[tokens], atol=1e-6)


@pytest.mark.parametrize("vocab", [1000, 1009, 151936])  # blocks of 250; a prime (one flat CDF); Qwen2's (128)
def test_sampler_two_level_cdf_equals_one_flat_float64_cdf(vocab):
    """The two-level draw against the textbook one (a single float64 cumsum over the whole vocab): the same
    token for every uniform, and the log-prob of log_softmax."""
    g = torch.Generator().manual_seed(vocab)
    rows = 64 if vocab > 10000 else 2000
    logits = torch.randn(rows, vocab, generator=g) * 4
    logits[:, vocab // 3] = -float("inf")  # a token that can never be drawn
    u = gen.uniform_noise(1, torch.arange(rows), torch.full((rows,), 3))
    for temperature in (1.0, 0.6):
        tokens, logps = gen.sample(logits, temperature, u)
        cdf = (logits / temperature).softmax(-1).double().cumsum(-1)
        expected = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None])[:, 0]
        assert torch.equal(tokens, expected)
        exact = (logits.double() / temperature).log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
        assert torch.allclose(logps.double(), exact, atol=1e-5)  # float32 log_softmax itself is off by ~1e-4 at 152k
        assert not (tokens == vocab // 3).any()
    greedy, lp = gen.sample(logits, 0, u)
    assert torch.equal(greedy, logits.argmax(-1))
    assert torch.allclose(lp.double(), logits.double().log_softmax(-1).max(-1).values, atol=1e-5)


def test_uniform_noise_is_uniform_with_no_special_inputs():
    """Small seeds, keys and positions (the common ones) give uniforms like any others: seed 0, key 0,
    position 0 used to map to 5.6e-17, so the first token of a default generate() was always token 0."""
    seed, key, pos = torch.meshgrid(torch.arange(4), torch.arange(64), torch.arange(64), indexing="ij")
    u = torch.stack([gen.uniform_noise(int(s), key[s].flatten(), pos[s].flatten()) for s in range(4)]).flatten()
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-3
    assert u.min() > 1e-7 and u.max() < 1 - 1e-7  # P(a fair draw of 16,384 fails this) = 0.3%
    pairs = torch.histc(gen.uniform_noise(0, torch.arange(4096), torch.zeros(4096, dtype=torch.long)) * 10 // 1 * 10
                        + gen.uniform_noise(0, torch.arange(4096), torch.ones(4096, dtype=torch.long)) * 10 // 1,
                        bins=100, min=0, max=100)  # neighbouring positions are independent: 10 x 10 cells
    assert stats.chisquare(pairs.numpy()).pvalue > 1e-3
    assert len(set(gen.uniform_noise(1, torch.tensor([0, 1000003]), torch.zeros(2, dtype=torch.long)).tolist())) == 2


def reference_sample(model, prompt, key, *, seed, temperature, eos_id, think_end, interrupt_ids, think_budget,
                     answer_budget, interrupt=True):
    """The slow path for one sample: a full forward over the whole sequence for every token, the same noise,
    one flat float64 inverse CDF, and the sampler's rules written out token by token."""
    seq, out, cut = list(prompt), gen.Sample(key, [], [], [], [], ""), gen.cut_point(seed, key, think_budget)
    forced, thinking, interrupted, limit = [], True, False, think_budget + answer_budget
    while True:
        n = len(out.tokens)
        with torch.no_grad():
            logp = (model(torch.tensor([seq])).logits[0, -1].double() / temperature).log_softmax(-1)
        u = gen.uniform_noise(seed, torch.tensor([key]), torch.tensor([n]))
        cdf = logp.exp().cumsum(-1)
        tok = int(torch.searchsorted(cdf, u * cdf[-1]))
        if interrupt and thinking and not interrupted and n == cut:
            forced, interrupted = list(interrupt_ids), True
        was_forced = bool(forced)
        tok, lp = (forced.pop(0), 0.0) if was_forced else (tok, logp[tok].item())
        seq.append(tok)
        out.tokens.append(tok), out.logps.append(lp), out.mask.append(int(not was_forced)), out.versions.append(0)
        if forced:
            continue
        if tok == eos_id:
            out.finish = "interrupted" if interrupted else "eos"
            return out
        if thinking and (was_forced or out.tokens[-len(think_end):] == think_end):
            thinking, limit = False, (n + 1 + answer_budget if interrupt else limit)
        if len(out.tokens) >= limit:
            out.finish = "truncated"
            return out


@pytest.mark.parametrize("cfg", [
    dict(eos_id=3, think_end=[1], interrupt_ids=[5, 3, 7], think_budget=12, answer_budget=5, temperature=1.3),
    dict(eos_id=3, think_end=[1, 2], interrupt_ids=[5, 6], think_budget=10, answer_budget=4, temperature=0.7,
         interrupt=False)])
def test_generate_static_step_equals_the_slow_reference(cfg):
    """The whole sampler (static decode step, device-side bookkeeping, continuous batching with 3 slots for
    12 prompts) against reference_sample: same tokens, masks, finish reasons; log-probs to float64 rounding.
    The first config puts eos inside the interruption phrase, where it must not end the sample."""
    model, prompts = tiny_model("qwen2", torch.float64), tiny_prompts(12, seed=9)
    keys = [50 + i for i in range(12)]
    out = gen.generate(model, prompts, keys=keys, slots=3, seed=4, **cfg)
    finishes = set()
    for p, key, s in zip(prompts, keys, out):
        ref = reference_sample(model, p, key, seed=4, **cfg)
        assert (s.key, s.tokens, s.mask, s.finish) == (ref.key, ref.tokens, ref.mask, ref.finish)
        assert np.allclose(s.logps, ref.logps, atol=1e-9)
        finishes.add(s.finish)
    assert finishes >= {"eos", "truncated"}
    if cfg.get("interrupt", True):
        assert any(s.mask.count(0) == 3 for s in out)  # the phrase, eos in it, and the sample went on
        assert any(1 in s.tokens and 0 not in s.mask for s in out)  # a thought that ended by itself


def sample_with_switch(model, prompt, switch, load, **cfg):
    """Drive gen.sampler through one prompt; before step `switch` (step 0 prefills and samples the first
    token) load() copies new weights into the model in place and version 1 is sent (what pipeline.py does)."""
    steps = gen.sampler(model, max_prompt_len=len(prompt), slots=1, **cfg)
    next(steps)
    new, version = [(prompt, 0, "only")], 0
    for n in range(1000):
        if n == switch:
            with torch.no_grad():
                load()
            version = 1
        finished, _ = steps.send((new, version))
        new = []
        if finished:
            return finished[0][1]
    raise AssertionError("the sample never finished")


def test_generate_in_flight_weight_update_keeps_cache_and_stamps_versions():
    model, other = tiny_model(seed=0), tiny_model(seed=1)
    prompts = tiny_prompts(1)
    old = gen.generate(tiny_model(seed=0), prompts, temperature=0, **GEN)[0]
    s = sample_with_switch(model, prompts[0], 4, lambda: [p.copy_(q) for p, q in zip(model.parameters(), other.parameters())],
                           temperature=0, **GEN)
    assert s.versions[:4] == [0] * 4 and set(s.versions[4:]) == {1}
    assert s.tokens[:4] == old.tokens[:4] and s.logps[4] != pytest.approx(old.logps[4])
    # the token after the update comes from the new weights on the old weights' cache:
    # not what either model alone computes from scratch
    fresh_new = uncached_next(other, prompts[0] + s.tokens[:4])
    assert abs(fresh_new[s.tokens[4]].item() - s.logps[4]) > 1e-6


def test_generate_streaming_sampler_equals_one_batch():
    model, prompts = tiny_model(), tiny_prompts(7)
    keys = [100 + i for i in range(7)]
    whole = gen.generate(model, prompts, keys=keys, slots=3, **GEN)
    queue, got = list(zip(prompts, keys, range(7))), {}
    steps = gen.sampler(model, slots=3, max_prompt_len=max(map(len, prompts)), **GEN)
    finished, n_free = next(steps)
    assert (finished, n_free) == ([], 3)
    while len(got) < 7:  # at most 2 prompts at a time and only into free slots, as a generator rank does
        new = queue[:min(max(n_free, 0), 2)]
        del queue[:len(new)]
        finished, n_free = steps.send((new, 0))
        got.update(finished)  # (tag, sample) pairs, in finishing order
    assert steps.send(([], 0)) == ([], 3)  # idle: no step runs
    for i, b in enumerate(whole):  # same keys -> same draws, whatever the batching (log-probs up to rounding)
        a = got[i]
        assert (a.key, a.tokens, a.finish) == (b.key, b.tokens, b.finish)
        assert np.allclose(a.logps, b.logps, atol=1e-5)
    for bad in ([5] * 9, []):  # an error ends the sampler: a new one for each
        steps = gen.sampler(model, slots=3, max_prompt_len=8, **GEN)
        next(steps)
        with pytest.raises(ValueError, match=f"prompt of {len(bad)} tokens: a prompt needs 1 to max_prompt_len = 8"):
            steps.send(([(bad, 0, "bad")], 0))


def test_generate_in_flight_update_uses_old_cache_and_new_weights():
    """Weights swapped mid-sequence: later tokens carry the new version, and their log-probs are those of
    the new weights reading a KV cache the old weights wrote (checked against transformers' own cache)."""
    model_a, model_b, prompt = tiny_model(seed=0), tiny_model(seed=1), tiny_prompts(1)[0]
    switch = 6
    model = tiny_model(seed=0)
    cfg = dict(GEN, eos_id=999, interrupt=False)
    s = sample_with_switch(model, prompt, switch, lambda: model.load_state_dict(model_b.state_dict()), **cfg)
    (plain,) = gen.generate(model_a, [prompt], **cfg)
    assert s.versions == [0] * switch + [1] * (len(s.tokens) - switch)
    assert s.tokens[:switch] == plain.tokens[:switch] and s.logps[:switch] == plain.logps[:switch]
    with torch.no_grad():  # reference: A encodes prompt + tokens[:switch-1], B continues with A's cache
        seq = torch.tensor([prompt + s.tokens])
        cut = len(prompt) + switch - 1
        cache = model_a(seq[:, :cut], use_cache=True).past_key_values
        # the keyword is `cache` from transformers 5 on (`past_key_values`, deprecated, goes in 5.40)
        name = "cache" if "cache" in inspect.signature(model_b.forward).parameters else "past_key_values"
        ref = model_b(seq[:, cut:-1], **{name: cache}).logits[0].float().log_softmax(-1)
        ref = ref.gather(-1, seq[0, cut + 1:, None]).squeeze(-1)
        pure_b = model_b(seq[:, :-1]).logits[0, cut:].float().log_softmax(-1).gather(-1, seq[0, cut + 1:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(s.logps[switch:]), ref, atol=1e-5)
    assert (torch.tensor(s.logps[switch:]) - pure_b).abs().max() > 1e-3  # the old cache really matters


def test_generate_decode_step_makes_no_host_sync(monkeypatch):
    """What a CUDA graph cannot capture, checked on the CPU: the decode step (forward, sampling, the rows'
    bookkeeping) never reads a tensor's value on the host."""
    model = tiny_model("qwen2")
    dec = gen.Decoder(model, 4, 40, 20, eos_id=3, think_end=[1, 2], interrupt_ids=[5, 6], think_budget=12,
                      answer_budget=5, interrupt=True, temperature=1.0, fp32_head=True, seed=0, version=0, graphs=False)
    dec.admit([0, 1, 2], [[4, 5, 6], [7, 8], [9]], [0, 1, 2])
    before = dec.n.clone()

    def host_sync(*args, **kwargs):
        raise AssertionError("the decode step read a tensor on the host")
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, host_sync)
    for _ in range(3):
        dec._step(4, dec.attention_plan([40] * 4), dec.live[:4])
    monkeypatch.undo()
    assert (dec.n - before).tolist() == [3, 3, 3, 0]  # three tokens in each live row, none in the free one


def test_generate_masked_off_warm_up_steps_change_nothing(monkeypatch):
    """Before capturing a new step size, the CUDA path runs the step once with every row masked off (lazy
    inits happen outside the graph). Checked on the CPU: with such a step before every real one, the
    samples are the same (interruptions, eos and budgets included), so a warm-up changes no state a later
    step reads."""
    model, prompts = tiny_model("qwen2"), tiny_prompts(9, seed=2)
    cfg = dict(GEN, eos_id=3, slots=4, temperature=1.0, seed=7)
    plain = gen.generate(model, prompts, **cfg)
    real_step = gen.Decoder._step

    def after_a_warm_up(self, R, plan, live):
        real_step(self, R, plan, self.off[:R])
        real_step(self, R, plan, live)
    monkeypatch.setattr(gen.Decoder, "_step", after_a_warm_up)
    warmed = gen.generate(model, prompts, **cfg)
    assert any(0 in s.mask for s in plain) and {s.finish for s in plain} >= {"eos", "truncated"}
    for a, b in zip(plain, warmed):
        assert (a.tokens, a.logps, a.mask, a.versions, a.finish) == (b.tokens, b.logps, b.mask, b.versions, b.finish)


def test_decode_attention_reads_each_rows_own_keys_and_equals_softmax_over_them(monkeypatch):
    """The decode step's attention (rows grouped by length bucket off CUDA; one group of every row over the
    longest row's length, the kernels' check's reference) against each row's softmax over its own keys written
    out, grouped query heads included; the groups read at most 1.25x the rows' keys where one bucket for all
    reads ~2x. The CUDA kernels (flash-attn's, torch's varlen_attn, the Triton one) are stood in for by what
    their docs say they compute; torch's varlen_attn, as its kernel, needs both cumulative lengths (queries and
    keys). The keys live in a pool of blocks of 50 tokens, each row's blocks scattered over it (its block
    table)."""
    g = torch.Generator().manual_seed(0)
    R, H, Hkv, D, max_len, B = 9, 4, 2, 8, 600, 50
    q = torch.randn(R, 1, H, D, generator=g, dtype=torch.float64)
    k_rows, v_rows = (torch.randn(R, max_len, Hkv, D, generator=g, dtype=torch.float64) for _ in range(2))
    where = torch.randperm(R * max_len // B, generator=g) + 1  # block 0: scratch
    table = where.view(R, -1).int()
    k, v = (torch.zeros(len(where) + 1, B, Hkv, D, dtype=torch.float64) for _ in range(2))
    k[where], v[where] = k_rows.reshape(-1, B, Hkv, D), v_rows.reshape(-1, B, Hkv, D)
    pos = torch.tensor([0, 599, 17, 130, 64, 299, 3, 450, 200])
    ref = torch.stack([torch.stack([((q[r, 0, h] @ k_rows[r, :p + 1, h // 2].T) * 0.3).softmax(-1)
                                    @ v_rows[r, :p + 1, h // 2] for h in range(H)])
                       for r, p in enumerate(pos.tolist())])
    lengths = (pos + 1).tolist()
    plan = tuple(g + (0,) for g in gen.row_groups(lengths, max_len))  # first block 0: keys gathered
    members = [(list(range(R)[a]) if isinstance(a, slice) else list(a), S) for a, S, _, _ in plan]
    assert sorted(r for rs, _ in members for r in rs) == list(range(R))  # every row in one group
    assert all(lengths[r] <= S for rs, S in members for r in rs) and len(plan) < R
    for how in (("groups", plan), ("groups", ((slice(0, R), 600, True, 0),))):
        assert torch.allclose(pa.decode_attention(q, k, v, 0.3, pa.attention_inputs(how, pos, q.dtype, table, B)), ref,
                              atol=1e-12), how

    def attend(q, k, v, scale):  # q (H, D) over k, v (n, Hkv, D), grouped heads
        return torch.stack([((q[h] @ k[:, h // 2].T) * scale).softmax(-1) @ v[:, h // 2] for h in range(H)])

    def keys(pool, blocks, n):  # a row's first n keys: its blocks in table order
        return pool[blocks.long()].flatten(0, 1)[:n]

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, enable_gqa, seqused_k, block_table):  # as documented
        assert max_q == 1 and max_k == block_table.size(1) * k.size(1) and enable_gqa
        # torch's kernel: "cumulative_sequence_length_q and ..._k must be both set"; the keys' with seqused_k
        assert cu_q is not None and cu_k is not None, "cu_seq_q and cu_seq_k must be both set"
        assert torch.equal(cu_q, torch.arange(len(q) + 1, dtype=torch.int32))
        assert cu_k.dtype == torch.int32 and cu_k.tolist() == [0, *itertools.accumulate(seqused_k.tolist())]
        return torch.stack([attend(q[i], keys(k, t, n), keys(v, t, n), scale)
                            for i, (t, n) in enumerate(zip(block_table, seqused_k.tolist()))])

    def flash(q, k, v, *, cache_seqlens, block_table, softmax_scale):  # flash_attn_with_kvcache: (R, 1, H, D) out
        return torch.stack([attend(q[i, 0], keys(k, t, n), keys(v, t, n), softmax_scale)[None]
                            for i, (t, n) in enumerate(zip(block_table, cache_seqlens.tolist()))])
    monkeypatch.setattr(pa, "varlen_attn", varlen)
    monkeypatch.setattr(pa, "flash_attn_with_kvcache", flash)
    monkeypatch.setattr(pa, "paged_decode", paged_reference)
    for kernel in pa.PAGED:  # the arguments the CUDA kernels are handed, read as their docs say
        assert torch.allclose(pa.decode_attention(q, k, v, 0.3, pa.attention_inputs((kernel,), pos, q.dtype, table, B)),
                              ref, atol=1e-12), kernel
    read = sum(len(rs) * S for rs, S in members)
    assert read <= 1.2 * sum(max(n, 256) for n in lengths) and 600 * R > 1.9 * sum(lengths)
    for seed in range(5):  # rows of 64..2048 keys: the groups read at most 1.25x, one bucket for all ~2x
        n = torch.randint(64, 2049, (64,), generator=torch.Generator().manual_seed(seed)).tolist()
        sizes = [(len(range(64)[a]) if isinstance(a, slice) else len(a), S) for a, S, _ in gen.row_groups(n, 2048)]
        assert sum(k * S for k, S in sizes) <= 1.25 * sum(n)
    for n in range(1, 5000):  # a group's keys: at most 1/8 more than its longest row's (or 16 under 128)
        assert n <= gen.len_bucket(n, 10 ** 6) <= max(n + 15, n * 9 / 8)


TRITON_CHECK = """
import json, sys, torch
import paged_attention as pa
g, worst = torch.Generator().manual_seed(0), {}
for block, H, Hkv, D, dtype in ((4, 4, 2, 8, torch.float32), (16, 14, 2, 64, torch.bfloat16),
                                (50, 6, 6, 16, torch.float32), (256, 8, 1, 32, torch.bfloat16)):
    R, W = 4, 3  # rows of 1 key, of all 3 blocks, and two ragged; blocks scattered over the pool
    lens = torch.cat([torch.tensor([1, W * block]), torch.randint(2, W * block, (R - 2,), generator=g)]).int()
    k, v = (torch.randn(1 + R * W, block, Hkv, D, generator=g).to(dtype) for _ in range(2))
    table = (torch.randperm(R * W, generator=g) + 1).view(R, W).int()
    q = torch.randn(R, 1, H, D, generator=g).to(dtype)
    out = pa.decode_attention(q, k, v, 0.3, pa.attention_inputs(("triton",), (lens - 1).long(), dtype, table, block))
    ref = [torch.nn.functional.scaled_dot_product_attention(  # SDPA over each row's own keys, in float32
        q[r, 0, :, None].float(), *(x[table[r].long()].flatten(0, 1)[:n].transpose(0, 1).float() for x in (k, v)),
        scale=0.3, enable_gqa=True)[:, 0] for r, n in enumerate(lens.tolist())]
    worst[f"{block} {H}/{Hkv} {dtype}"] = max((o.float() - x).abs().max().item() / (x.abs().max().item() if
                                                  dtype == torch.bfloat16 else 1) for o, x in zip(out, ref))
print(json.dumps({"worst": worst, "chosen": pa.exact_kernel(torch.device("cpu"), torch.bfloat16, 64, 16)}))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (requirements.txt "
                    "installs it on Linux; torch's CUDA build ships it)")
def test_paged_triton_kernel_equals_sdpa_over_each_rows_own_keys_under_the_interpreter():
    """The paged decode kernel of our own (Triton, the CUDA sampler's where flash-attn is absent) run through
    Triton's interpreter on CPU (TRITON_INTERPRET=1 before triton is imported: a fresh process) against SDPA
    over each row's own keys: rows of 1 key to a full table, ragged, blocks of 4 to 256 tokens scattered over the
    pool, grouped query heads (14 over 2, 8 over 1) and none, float32 (to rounding) and bf16 (to its output
    rounding); and the kernels' check chooses it where flash-attn is absent and torch's varlen_attn does not run."""
    run = subprocess.run([sys.executable, "-c", TRITON_CHECK], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).parent, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.splitlines()[-1])
    for case, err in out["worst"].items():
        assert err < (2 ** -7 if "bfloat16" in case else 1e-5), (case, err)
    assert out["chosen"][0] == "triton" and out["chosen"][1][0] == "flash-attn not installed", out["chosen"]


@pytest.mark.skipif(pa.triton is None, reason="triton is not installed (requirements.txt installs it on Linux; torch's "
                    "CUDA build ships it)")
def test_paged_triton_kernel_compiles_for_a100_and_h100_on_tensor_cores_in_bf16():
    """The paged decode kernel compiled, as a GPU would compile it, for an H100 (sm_90) in bf16 at the 0.5B's
    shape (7 query heads a KV head, head_dim 64, blocks of 256) and for an A100 (sm_80) in float32: Triton's
    compiler and ptxas run without a GPU. In bf16 its products are tensor-core mma instructions (tf32, exact for
    bf16 values), in float32 none (IEEE)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    for arch, dtype, mma in ((90, "bf16", True), (80, "fp32", False)):
        args = dict(q=f"*{dtype}", k=f"*{dtype}", v=f"*{dtype}", lengths="*i32", table="*i32", out=f"*{dtype}",
                    scale="fp32", q_row="i32", q_head="i32", table_row="i32")
        const = dict(BLOCK=256, HKV=2, G=7, D=64, GP=16, DP=64, N=64, PRECISION="tf32" if mma else "ieee")
        signature = {**args, **dict.fromkeys(const, "constexpr")}
        kernel = pa.triton.compile(ASTSource(pa._paged_decode, signature, {(list(signature).index(name),): value
                                                                           for name, value in const.items()}),
                                   target=GPUTarget("cuda", arch, 32))
        assert kernel.asm["cubin"] and bool(re.search(r"\bw?mma", kernel.asm["ptx"])) == mma, (arch, dtype)


def test_decode_kernel_is_the_first_paged_kernel_that_matches_sdpa_and_never_a_dense_fallback(monkeypatch):
    """Off CUDA the grouped path; on CUDA the first of flash-attn, torch's varlen_attn and the Triton kernel that
    runs and matches SDPA over each row's own keys (here on CPU, the kernels stood in for): torch's varlen_attn
    handed both cumulative lengths as its kernel requires, one that raises or differs passed over with its
    reason, and none at all a one-line error naming what to install (no dense fallback)."""
    assert pa.decode_kernel(torch.device("cpu"), torch.float32, 16, 16) == "groups"

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, enable_gqa, seqused_k, block_table):
        if cu_q is None or cu_k is None:  # torch's flash kernel's own check
            raise RuntimeError("cumulative_sequence_length_q and cumulative_sequence_length_k must be both set")
        assert cu_k.tolist() == [0, *itertools.accumulate(seqused_k.tolist())]
        return paged_reference(q, k, v, seqused_k, block_table, scale)
    monkeypatch.setattr(pa, "flash_attn_with_kvcache", None)
    monkeypatch.setattr(pa, "triton", None)
    monkeypatch.setattr(pa, "varlen_attn", varlen)
    assert pa.exact_kernel(torch.device("cpu"), torch.float32, 16, 16) == ("varlen", ["flash-attn not installed"])
    monkeypatch.setattr(pa, "varlen_attn", lambda q, *a, block_table, **kw: q)  # runs, computes something else
    assert pa.exact_kernel(torch.device("cpu"), torch.float32, 16, 16) == (
        None, ["flash-attn not installed", "varlen: differs from SDPA", "triton not installed"])
    monkeypatch.setattr(pa, "varlen_attn", lambda *a, block_table, **kw: 1 / 0)
    assert pa.exact_kernel(torch.device("cpu"), torch.float32, 16, 16)[1][1] == (
        "varlen: ZeroDivisionError: division by zero")
    monkeypatch.setattr(pa, "varlen_attn", lambda q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None: q)  # torch 2.11
    real = pa.exact_kernel
    monkeypatch.setattr(pa, "exact_kernel", lambda device, *a: real(torch.device("cpu"), *a))  # CUDA, checked on CPU
    with pytest.raises(RuntimeError) as err:
        pa.decode_kernel(torch.device("cuda"), torch.float32, 16, 16)
    assert str(err.value) == (f"paged_attention.py: no paged decode attention runs on cuda in torch.float32 (flash-attn "
                              f"not installed; torch {torch.__version__}'s varlen_attn takes no block_table; triton not "
                              f"installed): pip install triton (torch's CUDA build ships it) or flash-attn")
    assert not pa._KERNELS  # nothing kept: the next sampler checks again


def test_kernels_in_force_are_named_and_no_paged_decode_attention_on_cuda_is_a_one_line_error(monkeypatch,
                                                                                             capsys):
    """The start-up line (train.py, and bench.py's header) names the kernels in force, so a fallback shows:
    the sampler's decode attention, the trainer's packed attention (flash-attn, torch's varlen_attn on CUDA in
    16 bits, else SDPA per sample) and the head; on CUDA with no paged decode attention the run stops with
    paged_attention.decode_kernel's line, a user error."""
    model, args = tiny_model("qwen2"), types.SimpleNamespace(fp32_head=True)
    train.say_kernels(model, args)
    assert capsys.readouterr().out == ("kernels: decode attention SDPA per length group | trainer attention SDPA per "
                                       "sample | head float32\n")
    assert [trainer.attention_kernel(torch.device(d), t) for d, t in (("cuda", torch.bfloat16), ("cuda", torch.float32),
                                                                      ("cpu", torch.bfloat16))] == (
        ["flash" if trainer.flash_attn_varlen_func else "varlen" if trainer.varlen_attn else "sdpa", "sdpa", "sdpa"])
    monkeypatch.setattr(trainer, "decode_kernel", lambda *a: "triton")
    monkeypatch.setattr(trainer, "tensor_core_head", lambda *a: True)
    monkeypatch.setattr(trainer, "attention_kernel", lambda *a: "varlen")
    line = trainer.kernels_line(model.config, torch.device("cpu"), torch.bfloat16, True)
    assert line == ("kernels: decode attention Triton paged_decode (paged) | trainer attention torch varlen_attn | head "
                    "bf16 GEMM, float32 out (tensor cores)")
    monkeypatch.setattr(trainer, "tensor_core_head", lambda *a: False)
    assert trainer.kernels_line(model.config, torch.device("cpu"), torch.bfloat16, False).endswith("| head bfloat16")

    def none(*a):
        raise RuntimeError("paged_attention.py: no paged decode attention runs on cuda in torch.bfloat16 (...): "
                           "pip install triton (torch's CUDA build ships it) or flash-attn")
    monkeypatch.setattr(trainer, "decode_kernel", none)
    with pytest.raises(SystemExit, match=r"^error: paged_attention.py: no paged decode attention .*: pip install triton"):
        train.say_kernels(model, args)


def test_decode_kernels_per_step_counts_what_computes_once_a_call_and_grows_by_a_layers_worth_a_layer():
    """bench.py's decode_kernels_per_step (figure efficiency): torch.profiler's ops on CPU that would be kernels,
    a call's (after a warm-up): a GEMM, an in-place op and a reduction are 3, views and a cast to the same dtype
    none, a cast 1; a decode step of the same rows grows by the same count with each layer."""
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    assert bench.kernels_of(lambda: (x @ y).relu_().view(-1).t().sum(), "cpu") == 3
    assert bench.kernels_of(lambda: x.to(torch.float32).view(2, 32).reshape(64), "cpu") == 0
    assert bench.kernels_of(lambda: x.to(torch.float64), "cpu") == 1
    lens = torch.tensor([5, 17, 9, 30])
    counts = []
    for layers in (1, 2, 3):
        model = tiny_model("qwen2")
        model.model.layers = torch.nn.ModuleList([model.model.layers[0]] * layers)  # the same layer, repeated
        model.config.num_hidden_layers = layers
        dec = gen.Decoder(model, 4, 32, 4, eos_id=-1, think_end=[-2], interrupt_ids=[], think_budget=32,
                          answer_budget=0, interrupt=False, temperature=1.0, fp32_head=False, seed=0, version=0,
                          graphs=False, block=8)
        dec.pos.copy_(lens - 1)
        for r, n in enumerate(lens.tolist()):
            dec.reserve(r, n)
        dec._tables()
        plan = dec.attention_plan(lens.tolist())
        counts.append(bench.kernels_of(lambda: dec._step(4, plan, dec.off[:4]), "cpu"))
    assert counts[2] - counts[1] == counts[1] - counts[0] > 20, counts  # a layer: 7 projections, norms, attention


def test_decode_attention_reads_rows_in_consecutive_blocks_as_a_view_of_the_pool():
    """Off CUDA, rows of one block each, in consecutive blocks (what a pool that holds every row lends, the
    lowest free block first, also after rows finish and others take their slots), read their keys as a view
    of the pool, no gather, unmasked where every row has the group's length: the same attention as the
    gathered, masked read and each row's softmax over its own keys."""
    model = tiny_model("qwen2", torch.float64)
    dec = gen.Decoder(model, 4, 20, 8, eos_id=-1, think_end=[-2], interrupt_ids=[], think_budget=8, answer_budget=0,
                      interrupt=False, temperature=1.0, fp32_head=True, seed=0, version=0, graphs=False, block=32)
    for s in range(4):
        dec.reserve(s, 12)
    dec.release([1, 2])
    assert dec.reserve(1, 12) and dec.reserve(2, 12)  # refilled lowest slot first (the sampler's order)
    assert dec.tables[:, 0].tolist() == [1, 2, 3, 4] and dec.first_block(slice(0, 4), 12) == 1
    assert dec.first_block(slice(0, 4), 33) == 0 and dec.first_block((0, 2), 12) == 0
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 1, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(5, 32, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    table = torch.tensor(dec.tables)
    for pos in ([11] * 4, [11, 3, 7, 0]):
        pos = torch.tensor(pos)
        ref = torch.stack([torch.stack([((q[r, 0, h] @ k[1 + r, :p + 1, h // 2].T) * 0.3).softmax(-1)
                                        @ v[1 + r, :p + 1, h // 2] for h in range(4)])
                           for r, p in enumerate(pos.tolist())])
        ((rows, S, masked),) = gen.row_groups((pos + 1).tolist(), 20, slack=100)
        assert (rows, S, masked) == (slice(0, 4), 12, pos.min() < 11)
        view = pa.attention_inputs(("groups", ((rows, S, masked, 1),)), pos, q.dtype, table, 32)
        gather = pa.attention_inputs(("groups", ((rows, S, True, 0),)), pos, q.dtype, table, 32)
        assert isinstance(view[1][0][1], tuple) and torch.is_tensor(gather[1][0][1])
        assert k[view[1][0][1]].data_ptr() == k[1].data_ptr()  # a view: no copy
        for how in (view, gather):
            assert torch.allclose(pa.decode_attention(q, k, v, 0.3, how), ref, atol=1e-12)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_decoder_new_weights_refresh_the_fused_projections_in_their_storage(kind):
    """The fused q/k/v weights (and Qwen3's q/k norm weight) are copies: new_weights() refreshes them in place
    (a captured CUDA graph reads the same storage) to the model's new projections, concatenated."""
    model, other = tiny_model(kind), tiny_model(kind, seed=1)
    dec = gen.Decoder(model, 2, 16, 4, eos_id=0, think_end=[1], interrupt_ids=[], think_budget=4, answer_budget=0,
                      interrupt=False, temperature=1.0, fp32_head=True, seed=0, version=0, graphs=False)
    ptrs = [t.data_ptr() for wb in dec.qkv for t in wb if t is not None]
    with torch.no_grad():
        for p, q in zip(model.parameters(), other.parameters()):
            p.copy_(q)
    dec.new_weights(1)
    assert [t.data_ptr() for wb in dec.qkv for t in wb if t is not None] == ptrs
    for layer, (w, b, norm) in zip(other.model.layers, dec.qkv):
        a = layer.self_attn
        assert torch.equal(w, torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
        assert (b is None) == (kind == "qwen3") and (b is None or torch.equal(b, torch.cat([a.q_proj.bias, a.k_proj.bias,
                                                                                             a.v_proj.bias])))
        if kind == "qwen3":
            assert torch.equal(norm[0], a.q_norm.weight) and torch.equal(norm[-1], a.k_norm.weight)
            assert norm.size(0) == model.config.num_attention_heads + model.config.num_key_value_heads


def test_generate_paged_attention_gives_the_same_samples_as_grouped(monkeypatch):
    """The CUDA path (a paged kernel handed each row's length and block table; here the kernel stood in for by
    what it computes) and the grouped path give the same samples on a float64 model: same tokens, masks and
    finishes, log-probs to rounding."""
    model, prompts = tiny_model("qwen2", torch.float64), tiny_prompts(9, seed=3)
    cfg = dict(GEN, eos_id=3, slots=4, temperature=1.0, seed=5, block=4)
    grouped = gen.generate(model, prompts, **cfg)
    monkeypatch.setattr(gen, "decode_kernel", lambda *args: "triton")
    monkeypatch.setattr(pa, "paged_decode", paged_reference)
    paged = gen.generate(model, prompts, **cfg)
    for a, b in zip(grouped, paged):
        assert (a.tokens, a.mask, a.finish) == (b.tokens, b.mask, b.finish)
        assert np.allclose(a.logps, b.logps, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block, blocks", [(gen.BLOCK, 3), (8, 8)])
def test_generate_cuda_graph_replay_equals_eager_steps(dtype, block, blocks):
    """The captured decode step replays exactly what the eager step computes (same buckets, same kernels):
    continuous batching, interruptions, eos, and new weights copied in mid-sample (the graph reads them); a KV
    pool of 2 blocks for 4 slots (rows wait for blocks), or of 7 blocks of 8 tokens (rows are preempted)."""
    prompts = tiny_prompts(9, seed=2)
    runs = []
    for graphs in (True, False):
        model, other = tiny_model("qwen2", dtype).cuda(), tiny_model("qwen2", dtype, seed=1).cuda()
        steps = gen.sampler(model, max_prompt_len=max(map(len, prompts)), slots=4, graphs=graphs, sync_every=3,
                            temperature=1.0, seed=7, block=block, blocks=blocks, **dict(GEN, eos_id=3))
        next(steps)
        new, got = [(p, k, k) for k, p in enumerate(prompts)], {}
        for n in range(200):
            if n == 4:  # an in-flight update, as a generator rank receives it
                with torch.no_grad():
                    for p, q in zip(model.parameters(), other.parameters()):
                        p.copy_(q)
            finished, _ = steps.send((new, int(n >= 4)))
            new = []
            got.update(finished)
            if len(got) == len(prompts):
                break
        runs.append(got)
    graphed, eager = runs
    assert any(0 in s.mask for s in graphed.values()) and {s.finish for s in graphed.values()} >= {"eos", "truncated"}
    assert any(0 in s.versions and 1 in s.versions for s in graphed.values())
    for k in range(len(prompts)):
        a, b = graphed[k], eager[k]
        assert (a.tokens, a.logps, a.mask, a.versions, a.finish) == (b.tokens, b.logps, b.mask, b.versions, b.finish)


def test_sequence_logprobs_chunks_equal_full_logsoftmax_values_and_grads():
    model = tiny_model(dtype=torch.float64)
    ids = torch.tensor(tiny_prompts(3, seed=7)[0][:5] * 3).view(3, 5)
    attn = torch.ones_like(ids)
    lp = trainer.sequence_logprobs(model, ids, attn, fp32_head=False, chunk=2)
    lp.sum().backward()
    g_chunk = model.model.embed_tokens.weight.grad.clone()
    model.zero_grad()
    ref = model(ids, attention_mask=attn).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    ref.sum().backward()
    assert torch.allclose(lp, ref, atol=1e-10)
    assert torch.allclose(g_chunk, model.model.embed_tokens.weight.grad, atol=1e-10)


def right_padded(n=5, T=12, vocab=40, seed=3):
    """A right-padded batch of rows of 3..T real tokens -> ids (n, T), attention (n, T), lengths."""
    g = torch.Generator().manual_seed(seed)
    lens = [T] + torch.randint(3, T, (n - 1,), generator=g).tolist()
    ids = torch.zeros(n, T, dtype=torch.long)
    for i, L in enumerate(lens):
        ids[i, :L] = torch.randint(4, vocab, (L,), generator=g)
    return ids, (torch.arange(T) < torch.tensor(lens)[:, None]).long(), lens


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_sequence_logprobs_of_a_right_padded_batch_equal_each_row_alone_with_and_without_checkpoints(kind):
    """No mask, no KV cache: the positions the loss reads equal each row's unpadded forward (the model's own,
    full logits); the gradients are the same with the decoder layers checkpointed or not, and equal the rows'."""
    model = tiny_model(kind).train()
    ids, attn, lens = right_padded()
    weights = torch.randn(ids.size(0), ids.size(1) - 1, generator=torch.Generator().manual_seed(0)) * attn[:, 1:]
    grads = {}
    for ckpt in (False, True, "slow"):
        model.zero_grad()
        if ckpt == "slow":  # each row alone, unpadded, the model's own forward
            lp = torch.zeros(weights.shape)
            for i, L in enumerate(lens):
                lp[i, :L - 1] = model(ids[i:i + 1, :L]).logits[0, :-1].float().log_softmax(-1).gather(
                    -1, ids[i, 1:L, None])[:, 0]
        else:
            lp = trainer.sequence_logprobs(model, ids, attn, checkpoint_layers=ckpt, chunk=5)
        (lp * weights).sum().backward()
        grads[ckpt] = (lp.detach() * attn[:, 1:], [p.grad.clone() for p in model.parameters()])
    for ckpt in (True, "slow"):
        assert torch.allclose(grads[False][0], grads[ckpt][0], atol=1e-5), ckpt
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads[False][1], grads[ckpt][1])), ckpt
    with pytest.raises(ValueError, match="right-padded"):
        trainer.sequence_logprobs(model, ids, attn.flip(1))
    assert plan.checkpointing(plan.CHECKPOINT_ABOVE) is False and plan.checkpointing(plan.CHECKPOINT_ABOVE + 1) is True
    assert plan.checkpointing(28, "off") is False and plan.checkpointing(2, True) is True


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_packed_logprobs_equal_each_sample_alone_in_values_and_gradients(kind):
    """Samples of mixed lengths packed into one row (attention within each sample, rotary positions from 0 per
    sample): each sample's log-probs equal its own unpadded forward (the model's, full logits) to 1e-6 in float32,
    and the gradients of a weighted sum equal the samples' own, with the layers checkpointed or not."""
    model = tiny_model(kind).train()
    g = torch.Generator().manual_seed(5)
    lens = [9, 2, 17, 5, 30]
    rows = [torch.randint(4, 40, (L,), generator=g) for L in lens]
    weights = [torch.randn(L - 1, generator=g) for L in lens]
    model.zero_grad()
    alone = [model(r[None]).logits[0, :-1].log_softmax(-1).gather(-1, r[1:, None])[:, 0] for r in rows]
    sum((lp * w).sum() for lp, w in zip(alone, weights)).backward()
    want = [p.grad.clone() for p in model.parameters()]
    for ckpt in (False, True):
        model.zero_grad()
        lp = trainer.packed_logprobs(model, torch.cat(rows), lens, chunk=7, checkpoint_layers=ckpt)
        assert lp.shape == (5, 29)
        for i, L in enumerate(lens):
            assert torch.allclose(lp[i, :L - 1], alone[i], atol=1e-6) and not lp[i, L - 1:].any()
        sum((lp[i, :L - 1] * weights[i]).sum() for i, L in enumerate(lens)).backward()
        assert all(torch.allclose(p.grad, w, atol=1e-6, rtol=1e-5) for p, w in zip(model.parameters(), want))


def test_varlen_attention_kernels_are_called_as_the_exact_path_computes(monkeypatch):
    """torch's varlen_attn (CUDA only) as the installed torch names its keywords: both its signatures (torch 2.9:
    is_causal, one k/v head per query head, default scale; later: window_size, enable_gqa, scale) give what the
    exact per-sample path gives, here with a stand-in kernel that checks its arguments."""
    g = torch.Generator().manual_seed(0)
    lens = [3, 6, 1, 4]
    q, k, v = (torch.randn(14, h, 8, generator=g) for h in (4, 2, 2))
    cu = torch.tensor([0, 3, 9, 10, 14], dtype=torch.int32)
    want = trainer.varlen_attention(q, k, v, lens, cu, 0.3)

    def old(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False):
        assert is_causal and k.size(1) == q.size(1) and max_q == max_k == 6 and torch.equal(cu_q, cu)
        return trainer.varlen_attention(q, k, v, lens, cu, q.size(-1) ** -0.5)

    def new(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        assert window_size == (-1, 0) and enable_gqa and k.size(1) == 2
        return trainer.varlen_attention(q, k, v, lens, cu, scale)
    for fake in (old, new):
        monkeypatch.setattr(trainer, "varlen_attn", fake)
        assert torch.allclose(trainer._torch_varlen(q, k, v, cu, 6, 0.3), want, atol=1e-6)


def test_tensor_core_head_is_chosen_on_cuda_bf16_only_and_equals_the_float32_head(monkeypatch):
    """The float32 head as a bf16 GEMM with float32 output only on CUDA with bf16 weights and --fp32_head; its
    autograd (here with a float32 matmul standing in for CUDA's mm out_dtype) gives the float32 head's log-probs
    to float32 rounding and its gradients to bf16 rounding of the logits' gradient: about 0.5% of each gradient's
    norm (bf16 keeps 8 bits), one element at most 2.1% of the tensor's largest on a CPU whose bf16 GEMMs accumulate
    in bf16 blocks (an AMD EPYC here), hence the two bounds."""
    assert gen.tensor_core_head("cuda", torch.bfloat16, True) == hasattr(torch.ops.aten.mm, "dtype")
    assert not any(gen.tensor_core_head(*a) for a in (("cpu", torch.bfloat16, True), ("cuda", torch.float32, True),
                                                      ("cuda", torch.float16, True), ("cuda", torch.bfloat16, False)))
    model = tiny_model("qwen3", dtype=torch.bfloat16).train()
    ids, lens = torch.randint(4, 40, (40,), generator=torch.Generator().manual_seed(1)), [15, 25]
    out = {}
    for fast in (False, True):
        monkeypatch.setattr(trainer, "tensor_core_head", lambda *a: fast)
        monkeypatch.setattr(trainer, "mm32", lambda a, b: a.float() @ b.float())
        model.zero_grad()
        lp = trainer.packed_logprobs(model, ids, lens, chunk=9)
        lp.sum().backward()
        out[fast] = lp.detach(), [p.grad.float().clone() for p in model.parameters()]
    assert torch.allclose(out[True][0], out[False][0], atol=1e-5)
    for a, b in zip(out[True][1], out[False][1]):
        assert (a - b).norm() <= 0.02 * b.norm() + 1e-6
        assert (a - b).abs().max() <= 0.04 * b.abs().max() + 1e-6


def float32_head(h, w, targets, temperature):
    """The plain float32 head: F.linear in float32, log_softmax, gather."""
    logits = torch.nn.functional.linear(h.float(), w.float())
    return (logits / temperature).log_softmax(-1).gather(-1, targets[:, None])[:, 0]


@pytest.mark.parametrize("chunk", [1, 7, 16, 40, 64])
def test_trainer_head_equals_the_float32_head_in_values_and_gradients(monkeypatch, chunk):
    """trainer._Head (each target's log-prob under the LM head in chunks of vocabulary rows, the backward recomputing
    each chunk's logits and writing its rows of the weight's gradient once) against the plain float32 head, values
    and the gradients of the states and the weight, with chunks that divide the 40-row vocabulary, leave a ragged
    last one (7, 16) or exceed it: in float64 exactly; with bf16 weights as float32 GEMMs to float32 rounding of the
    values and bf16 rounding of the gradients; on tensor cores (a float32 matmul standing in for CUDA's mm out_dtype)
    the logits' gradient enters the GEMMs in bf16 (about 0.2% of each gradient's norm)."""
    monkeypatch.setattr(trainer, "mm32", lambda a, b: a.float() @ b.float())
    g = torch.Generator().manual_seed(chunk)
    h, w = torch.randn(23, 32, generator=g), torch.randn(40, 32, generator=g) / 3
    targets = torch.cat([torch.tensor([0, 39, 35]), torch.randint(0, 40, (20,), generator=g)])
    weights = torch.rand(23, generator=g)
    for dtype, gemm, tensor_core, close, grad_close in (
            (torch.float64, torch.float64, False, 1e-12, 1e-12), (torch.bfloat16, torch.float32, False, 1e-5, 0.005),
            (torch.bfloat16, torch.bfloat16, True, 1e-5, 0.01)):
        for temperature in (1.0, 0.7):
            a, b = h.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
            lp = trainer._Head.apply(a, b, targets, temperature, chunk, gemm, tensor_core)
            (lp * weights).sum().backward()
            ra, rb = (x.detach().to(torch.promote_types(dtype, torch.float32)).requires_grad_() for x in (a, b))
            want = float32_head(ra, rb, targets, temperature) if dtype != torch.float64 else (
                (ra @ rb.t() / temperature).log_softmax(-1).gather(-1, targets[:, None])[:, 0])
            (want * weights).sum().backward()
            assert lp.dtype == want.dtype and torch.allclose(lp, want, atol=close, rtol=0)
            for got, ref in ((a.grad, ra.grad), (b.grad, rb.grad)):
                assert got.dtype == dtype and (got - ref).norm() <= grad_close * ref.norm()


def test_trainer_head_peak_is_the_plans_and_makes_no_float32_copy_of_the_weight(monkeypatch):
    """packed_logprobs' head on bf16 weights with the tensor-core path (a float32 matmul standing in for CUDA's mm
    out_dtype) under a dispatch mode that follows every tensor the ops create: no float32 tensor the size of the
    head (vocab x hidden) is ever made, and the most bytes held at once, forward and backward, are within the memory
    plan: the head's saved bytes per token plus plan.head_peak (its gradient in bf16 and 4 chunks of logits). A
    float32 copy of the weight and per-chunk float32 gradients summed by autograd took about 3 x 4 V d bytes."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode

    class Held(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.held, self.peak, self.float32_head = {}, 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor)}
            self.held = {k: v for k, v in self.held.items() if not v[0].expired()}
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in ins:
                    s = t.untyped_storage()
                    self.held[s.data_ptr()] = StorageWeakRef(s), s.nbytes()
                    self.float32_head += t.dtype == torch.float32 and t.numel() >= V * d
            self.peak = max(self.peak, sum(n for _, n in self.held.values()))
            return out

    V, d, T = 4096, 64, 128
    config = Qwen2Config(vocab_size=V, hidden_size=d, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16).train()
    for p in model.parameters():
        p.requires_grad_(p is model.lm_head.weight or p is model.model.norm.weight)
    monkeypatch.setattr(trainer, "tensor_core_head", lambda *a: True)
    monkeypatch.setattr(trainer, "mm32", lambda a, b: a.float() @ b.float())
    monkeypatch.setattr(plan, "LOGITS_BYTES", (T - 1) * 500 * 4)  # chunks of 500 vocabulary rows (of positions before)
    ids = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(0))
    with Held() as held:
        trainer.packed_logprobs(model, ids, [T]).sum().backward()
    s = plan.plan_shape(config)
    assert model.lm_head.weight.grad.abs().sum() > 0 and held.float32_head == 0
    assert held.peak <= T * plan.plan_activations(s, 2)["head"] + plan.head_peak(s, 2)


def test_bench_gpu_figure_without_cuda_exits_with_one_line(monkeypatch, capsys):
    """`python bench.py --figures gpu` (and one of its parts) on a machine without CUDA: one line saying it needs a
    GPU, nothing else printed, a non-zero exit."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["--figures", "gpu"], ["--figures", "1,gpu"], ["--gpu_part", "trainer"]):
        with pytest.raises(SystemExit) as exit_:
            bench.main(bench.get_args(argv))
        said = str(exit_.value)
        assert said.startswith("bench.py --figures gpu: needs a CUDA GPU") and "\n" not in said, argv
        assert capsys.readouterr().out == ""


def test_bench_gpu_parts_a_hanging_part_is_timed_out_and_the_next_still_runs(capsys):
    """bench.run_parts (figure gpu's runner) on fake parts: one that hangs (and started a process of its own) is
    killed at its timeout with what it printed, one that fails is reported with its exit status, and the last still
    runs and hands back its JSON figures; the real parts' timeouts fit the figure's 8 minutes."""
    py = sys.executable
    hang = ("import subprocess, time; p = subprocess.Popen(['sleep', '60']); print('started', p.pid, flush=True); "
            "time.sleep(60)")
    t0 = time.monotonic()
    out = bench.run_parts([("hang", [py, "-c", hang], 2), ("fails", [py, "-c", "raise SystemExit(3)"], 30),
                           ("ok", [py, "-c", "print('fine'); print('{\"x\": 1}')"], 30)])
    printed = capsys.readouterr().out
    assert time.monotonic() - t0 < 15
    assert [r["status"] for r in out.values()] == ["TIMED OUT after 2 s", "FAILED (exit 3)", "ok"]
    assert out["ok"]["figures"] == {"x": 1} and out["hang"]["figures"] is None
    assert "gpu | hang | started" in printed and "gpu | ok | fine" in printed and '{"x"' not in printed
    grandchild = int(printed.split("gpu | hang | started ")[1].split()[0])
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{grandchild}") and time.monotonic() < deadline:  # killed with its part
        with open(f"/proc/{grandchild}/stat") as f:
            if f.read().split(") ")[1][0] == "Z":
                break
        time.sleep(0.05)
    else:
        assert not os.path.exists(f"/proc/{grandchild}")
    parts = bench.gpu_parts()
    assert [p[0] for p in parts] == ["tests", "kernels", "sampler", "trainer"] and sum(p[2] for p in parts) <= 480


def test_bench_gpu_attention_checks_each_decode_path_and_the_trainers_against_sdpa():
    """Figure gpu's kernel check, run on CPU: every decode path generate.py has is called on rows of 1 to 5 blocks
    over shuffled block tables (GQA), CPU's grouped path equals SDPA over each row's own keys, a path that cannot
    run here (flash-attn absent, varlen off CUDA) is reported, not raised; the trainer's attention equals SDPA per
    sample."""
    out = bench.gpu_attention("cpu", torch.float32)
    assert set(out) == {f"decode_{k}" for k in bench.DECODE_PATHS} | {"trainer_varlen"}
    assert out["decode_groups"] < 1e-5 and out["trainer_varlen"] < 1e-6
    assert pa.flash_attn_with_kvcache is not None or out["decode_flash"] is None


def test_plan_on_cpu_counts_the_kv_blocks_a_decoder_allocates():
    """Off CUDA a KV block is at most a row (generate.kv_block); the plan printed 256-token blocks for the toy's
    165-token rows. The plan's blocks, their size and their bytes are what a Decoder of those sizes allocates."""
    model = tiny_model()
    run = PlanRun(prompts=4, samples=4, prompt_len=20, think_budget=48, answer_budget=16, phrase_len=3,
                  micro_tokens=512, dtype=torch.float32, sized=False, slots=8)
    planned = memory_plan(model.config, run)
    dec = gen.Decoder(model, 8, planned["max_len"], planned["max_len"] - 20, eos_id=0, think_end=[1],
                      interrupt_ids=[5, 6, 7], think_budget=48, answer_budget=16, interrupt=True, temperature=1.0,
                      fp32_head=True, seed=0, version=0, graphs=False)
    assert (planned["block"], planned["blocks"]) == (dec.block, dec.cache[0][0].size(0)) == (87, 9)
    assert planned["roles"]["one process"]["parts"]["KV cache"] == sum(k.nbytes + v.nbytes for k, v in dec.cache)
    assert "KV cache 9 blocks of 87 tokens" in "\n".join(plan.plan_lines(planned, run))


def test_bench_two_layer_model_has_the_parameters_the_plan_counts():
    """The memory figure's 2-layer models, built under transformers' no_init_weights, left a tied shape's head
    untied: the 0.5B shape's per-parameter bytes read 11% above the plan. Tied where the shape ties, and the
    parameters plan_param_count counts."""
    for name, tied in (("Qwen2.5-0.5B", True), ("Qwen2.5-7B", False)):
        model = bench.two_layer_model(name, vocab_size=64, bos_token_id=None, eos_token_id=None,
                                      **({} if tied else {"hidden_size": 256, "intermediate_size": 512,
                                                          "num_attention_heads": 4, "num_key_value_heads": 2}))
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied, name
        assert sum(p.numel() for p in model.parameters()) == plan_param_count(plan_shape(model.config)), name


def test_sequence_logprobs_saves_2_kb_per_token_per_layer_at_the_qwen3_0_6b_shape():
    """The trainer's forward at Qwen3-0.6B's width (1024, 16 heads, 8 kv heads, head dim 128, MLP 3072, vocab
    151,936, bf16) with its layers checkpointed (the default above CHECKPOINT_ABOVE layers; forced here on 2):
    saved-tensor hooks count what each layer keeps for the backward (its input: 2 KB per token; 72 KB without
    checkpointing) and what the head keeps (no logits: the final norm's input and output and ~0.5 KB more, 4.6 KB per
    token, whatever the vocab)."""
    model = bench.two_layer_model("Qwen3-0.6B")
    part = bench.saved_by_part(model, lengths=(16, 32), checkpoint_layers=True)
    plan = plan_activations(plan_shape(bench.shape_config("Qwen3-0.6B")), 2)
    assert part["layer"] <= 4096 and part["layer"] == plan["checkpointed"] == 2048
    assert part["rest"] == plan["head"] < 8192  # one float32 logit per vocab entry would be 608 KB


@pytest.mark.parametrize("kind, dtype, changes", [("llama", torch.float32, dict(attention_bias=True, mlp_bias=True)),
                                                  ("qwen2", torch.bfloat16, {}),
                                                  ("qwen3", torch.bfloat16, dict(tie_word_embeddings=True))])
def test_memory_plan_per_token_figures_equal_measurements_on_a_tiny_model(kind, dtype, changes):
    """memory_plan's figures against what a tiny model holds: the bytes its forward saves per token per
    layer, checkpointed and not, and outside the layers (saved-tensor hooks), its parameters, and an FSDP2
    trainer's shares."""
    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, **changes)
    cls, cfg = {"llama": (LlamaForCausalLM, LlamaConfig(**common)), "qwen2": (Qwen2ForCausalLM, Qwen2Config(**common)),
                "qwen3": (Qwen3ForCausalLM, Qwen3Config(head_dim=16, **common))}[kind]
    model = cls(cfg).to(dtype).train()
    s = plan_shape(model.config)
    plan = plan_activations(s, dtype.itemsize)
    on, off = (bench.saved_by_part(model, checkpoint_layers=c) for c in (True, False))
    assert (on["layer"], off["layer"]) == (plan["checkpointed"], plan["layer"])
    assert on["rest"] == plan["head"] and 0 <= plan["head"] - off["rest"] <= 8  # unused there: the position ids
    assert plan_param_count(s) == sum(p.numel() for p in model.parameters())
    one, two = (plan_trainer(s, dtype.itemsize, 1000, True, fsdp, n) for fsdp, n in ((False, 1), (True, 2)))
    assert two["AdamW state"] == one["AdamW state"] / 2 == 4 * plan_param_count(s)


def test_bench_stability_row_tells_a_fall_from_a_slower_climb():
    """bench.py --figures stability's row: a run fell when its held-out pass rate dropped more than
    metrics.HELD_OUT_DROP_ALARM below its best so far; it held when it ended within 0.03 of its one-process
    counterpart with no eval after step 30 under 0.6, so one that climbs more slowly did not fall and did not
    hold. The lag columns count the steps that trained."""
    def records(rates, lags=(0,)):
        out = [{"kind": "eval", "step": 10 * i, "pass_rate": r} for i, r in enumerate(rates)]
        return out + [{"kind": "train", "step": i + 1, "kept_prompts": 1, "lag": lag, "lag_max": 8,
                       "trunc": 0.01 * i, "forget": 0.0} for i, lag in enumerate(lags)]
    one = records([0.2, 0.6, 0.97])
    slow = bench.stability_row(0, one, records([0.2, 0.4, 0.6, 0.75, 0.74], (8, 8, 6, 8)), [])
    assert not slow["fell"] and not slow["held"] and math.isclose(slow["fall"], 0.01) and slow["final"] == 0.74
    assert (slow["lag_mean"], slow["at_max_lag"], slow["max_trunc"]) == (7.5, 0.75, 0.03)
    fell = bench.stability_row(1, one, records([0.2, 0.8, 0.5, 0.9, 0.95], (8,)), [50])
    assert fell["fell"] and fell["held"] and math.isclose(fell["fall"], 0.3) and fell["lowest_after_30"] == 0.95
    close = bench.stability_row(2, one, records([0.2, 0.5, 0.7, 0.9, 0.94], (8,)), [])
    assert close["held"] and not close["fell"]  # 0.94 >= 0.97 - 0.03


def test_memory_plan_says_the_readme_command_and_a_7b_node_run_fit():
    """The plan of bench.py --figures memory: Qwen2.5-7B at 16 x 16 x 8k on 8 x 80 GB (6 generators, 2 FSDP2
    trainers) fits at 8,192 tokens per micro-batch and not at 32,768; below the longest row (8,724 tokens, which
    goes alone) the trainer is planned for that row; the README's real-model commands fit
    (Qwen3-0.6B --recipe one_gpu on one GPU, Qwen2.5-7B's paper recipe on 8); a sampler that cannot hold one
    group does not fit."""
    plans = {mt: memory_plan(bench.shape_config("Qwen2.5-7B"), PlanRun(**{**bench.NODE_RUN,
                                                                                           "micro_tokens": mt}))
             for mt in (1024, 8192, 32768)}
    assert all(r["fits"] for r in plans[8192]["roles"].values()) and not plans[32768]["roles"]["trainer"]["fits"]
    assert plans[1024]["max_len"] == 8724 and plans[1024]["roles"]["trainer"] == plans[8192]["roles"]["trainer"]
    assert plans[8192]["sequences"] * 6 >= 256
    readme = memory_plan(bench.shape_config("Qwen3-0.6B"), PlanRun(**bench.README_RUN))
    assert readme["roles"]["one process"]["fits"] and readme["sequences"] >= 16
    node = memory_plan(bench.shape_config("Qwen2.5-7B"), PlanRun(**bench.README_NODE_RUN))
    assert all(r["fits"] for r in node["roles"].values()) and node["sequences"] >= 16
    small = memory_plan(bench.shape_config("Qwen3-0.6B"),
                        PlanRun(**{**bench.README_RUN, "device_bytes": 12e9}))
    assert small["sequences"] < 8 and not small["roles"]["one process"]["fits"]  # not one group of 8


def test_memory_plan_caps_the_kv_cache_at_what_a_generator_can_have_in_flight():
    """On CUDA the sampler's slots are what --gen_memory holds, at most the sequences the lag rule lets a
    generator have in flight: one process, one batch (8 x 16 = 128 at Qwen2.5-0.5B and 8k budgets, where 80 GB
    would hold about 650); a generator of 6 under PipelineRL-8, its share of 9 batches of 16 x 16 (every 6th
    of 144 groups: 24 x 16 = 384, about 620 fit). Where memory holds fewer (Qwen2.5-7B), memory decides."""
    one = {**bench.recipe_run("paper"), "think_budget": 7168, "answer_budget": 1024, "prompts": 8, "samples": 16}
    plan = memory_plan(bench.shape_config("Qwen2.5-0.5B"), PlanRun(**one))
    assert plan["sequences"] == 8 * 16
    width = -(-plan["max_len"] // gen.BLOCK)  # at the bound: a pool of every row at the full budget, and scratch
    assert plan["blocks"] == 1 + 128 * width and plan["per_block"] == gen.BLOCK * 12 * 1024
    assert plan["roles"]["one process"]["parts"]["KV cache"] == plan["blocks"] * plan["per_block"]
    room = memory_plan(bench.shape_config("Qwen2.5-0.5B"), PlanRun(**one, slots=10 ** 6))
    assert room["sequences"] == 128  # --slots above the bound changes nothing
    node = dict(bench.NODE_RUN)
    assert (node["prompts"], node["samples"], node["generators"]) == (16, 16, 6)
    small = memory_plan(bench.shape_config("Qwen2.5-0.5B"), PlanRun(**node))
    assert small["sequences"] == math.ceil(9 * 16 / 6) * 16 == 384
    big = memory_plan(bench.shape_config("Qwen2.5-7B"), PlanRun(**node))
    assert big["sequences"] < 384 and big["sequences"] == memory_plan(
        bench.shape_config("Qwen2.5-7B"), PlanRun(**node, lag=10 ** 3))["sequences"]
    mean, width = (-(-n // gen.BLOCK) for n in (big["mean_len"], big["max_len"]))  # memory decides: its rows at
    assert big["sequences"] * mean <= big["blocks"] - 1 < big["sequences"] * width   # the mean length, in blocks
    assert in_flight(types.SimpleNamespace(prompts=16, samples=16), 6, 8) == 384


def qwen2_folder(toy_dir, folder):
    """A real model's shape in miniature: a random Qwen2 (no scalerl_task: the paper's recipe) with the toy's
    tokenizer, its context long enough for the paper's budgets."""
    tok = AutoTokenizer.from_pretrained(toy_dir)
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
                                 tie_word_embeddings=True)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_memory_plan_is_the_slots_every_sampler_takes_on_cpu(toy_dir, tmp_path, monkeypatch, capsys):
    """The paper's recipe on CPU: the held-out eval's sampler (step 0, and --eval_only, which prints its plan too)
    and the training sampler take the slots the printed plan says. (The eval took one slot per sample: 16 per
    held-out prompt, 8,000 at 500 prompts, and the kernel killed the run.)"""
    folder = qwen2_folder(toy_dir, tmp_path / "qwen2")
    taken = []

    class Enough(Exception):
        pass

    def sampler(model, *, slots, **kw):  # each sampler's slots; its items end at once (empty samples)
        taken.append(slots)
        if len(taken) == 3:
            raise Enough  # the training sampler: far enough
        new, _ = yield [], slots
        while True:
            new, _ = yield [(tag, gen.Sample(key, [], [], [], [], "truncated")) for _, key, tag in new], slots

    monkeypatch.setattr(pipeline, "sampler", sampler)
    flags = ["--model", str(folder), "--val_size", "10", "--save_every", "0"]  # 160 held-out samples
    train.eval_only(config.get_args(["--eval_only", *flags]))
    with pytest.raises(Enough):
        train.main(config.get_args(["--out", str(tmp_path / "run"), *flags]))
    out = capsys.readouterr().out
    assert "recipe paper" in out and "mean@16 over 10 problems, 160 samples" in out
    planned = [int(n) for n in re.findall(r"sampler: (\d+) sequences of up to 14\d\d\d tokens", out)]
    assert len(planned) == 2 and taken == [planned[0]] + [planned[1]] * 2 == [gen.CPU_SLOTS] * 3, (taken, out)
    qwen3 = bench.shape_config("Qwen3-0.6B")  # --eval_only on an 80 GB GPU: only the weights are held
    plan = memory_plan(qwen3, PlanRun(**bench.recipe_run("paper"), evaluate=16000))
    weights = plan_param_count(plan_shape(qwen3)) * 2
    assert plan["sequences"] == slots_in(0.85 * (80e9 - weights), qwen3, torch.bfloat16,
                                         *gen.cache_length(512, 12288, 2048, [0] * 20))[0] > 16


def test_busy_metrics_keep_the_last_rates_while_no_generator_has_published():
    """Generators publish their counters at most every 0.1 s; steps can be faster (50 ms on a GPU). A step
    with nothing new keeps the last busy fraction and tokens/s (it read 0.00 on every other step), and the
    next difference spans both steps."""
    class Store(dict):
        def check(self, keys):
            return all(k in self for k in keys)

    store = Store()
    ctx = ranks.Context(rank=0, world=2, n_trainers=1, n_gens=1, device="cpu", timeout=1, mode="pipeline", k=8,
                        prompts=1, samples=1, store=store, weights=None, trainers=None, rollouts=None)
    rstats = {"wait_s": 0.0}
    store["genstats/1"] = json.dumps({"wall": 1.0, "idle": 0.5, "sync": 0.0, "tokens": 100})
    first = ranks.busy_metrics(ctx, 0.05, rstats, 0.01, 0.0, 0)
    assert math.isclose(first["gen_busy"], 0.5) and math.isclose(first["gen_tok_s"], 100)
    again = ranks.busy_metrics(ctx, 0.05, rstats, 0.01, 0.0, 0)  # nothing published since
    assert math.isclose(again["gen_busy"], 0.5) and math.isclose(again["gen_tok_s"], 100)
    store["genstats/1"] = json.dumps({"wall": 2.0, "idle": 0.5, "sync": 0.25, "tokens": 500})
    later = ranks.busy_metrics(ctx, 0.05, rstats, 0.01, 0.0, 0)
    assert math.isclose(later["gen_busy"], 0.75) and math.isclose(later["gen_tok_s"], 400)


def test_generate_rejects_unsupported_architecture():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=20))
    with pytest.raises(ValueError, match="not supported.*llama, qwen2, qwen3"):
        gen.generate(gpt2, [[1, 2]], **GEN)
    dynamic = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                                   "rope_theta": 10000.0}))
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported"):
        gen.generate(dynamic, [[1, 2]], **GEN)


def test_generate_a_config_with_nonsense_rope_sizes_or_ids_is_one_line_at_load(toy_dir, tmp_path, monkeypatch):
    """rope_theta 0 loaded, made the rotary tables NaN and the sampler died with an IndexError at its first decode
    step: a rope parameter, a size or a token id out of range is one line naming the field, at --model's check
    and at load. A tokenizer's PanicException (a BaseException from Rust) is one line too."""
    base = json.loads((Path(toy_dir) / "config.json").read_text())
    for k, (edit, field) in enumerate([(("rope_parameters", "rope_theta", 0), "rope_parameters.rope_theta is 0, not a finite"),
                        ((None, "rope_theta", -1.0), "rope_theta is -1.0, not a finite"),
                        (("rope_parameters", "factor", float("nan")), "rope_parameters.factor is nan"),
                        ((None, "hidden_size", 0), "hidden_size is 0, not a whole number >= 1"),
                        ((None, "num_hidden_layers", -2), "num_hidden_layers is -2"),
                        ((None, "num_key_value_heads", 3), "num_key_value_heads 3 does not divide"),
                        ((None, "eos_token_id", [0, 378]), "eos_token_id is [0, 378], not an id below vocab_size 378")]):
        edited = json.loads(json.dumps(base))
        (edited[edit[0]] if edit[0] else edited)[edit[1]] = edit[2]
        folder = tmp_path / f"model{k}"
        shutil.copytree(toy_dir, folder)
        (folder / "config.json").write_text(json.dumps(edited))
        errors = []
        checks.check_model_dir(str(folder), errors.append)
        assert len(errors) == 1 and errors[0].startswith(f"--model {folder}: config.json: {field}"), errors
    with pytest.raises(SystemExit, match=r"^error: --model .*: config\.json: rope_parameters\.rope_theta is 0"):
        train.load_model(str(tmp_path / "model0"), config.get_args([]), torch.device("cpu"))

    class PanicException(BaseException):  # what pyo3 raises for a panic in the tokenizers library
        pass

    def panic(*a, **k):
        raise PanicException("called `Option::unwrap()` on a `None` value")
    monkeypatch.setattr(train.AutoTokenizer, "from_pretrained", panic)
    with pytest.raises(SystemExit, match=r"^error: --model .*: its tokenizer fails: called `Option::unwrap\(\)`"):
        train.load_model(str(toy_dir), config.get_args([]), torch.device("cpu"))


def edited_toy(toy_dir, folder, config=None, generation=None):
    """A copy of the toy model folder with fields of config.json / generation_config.json replaced."""
    shutil.copytree(toy_dir, folder)
    for name, edits in (("config.json", config), ("generation_config.json", generation)):
        path = Path(folder) / name
        path.write_text(json.dumps({**json.loads(path.read_text()), **(edits or {})}))
    return str(folder)


def one_line_exit(call, seconds=5):
    """call() -> the one line it exits with, within a few seconds."""
    start = time.monotonic()
    with pytest.raises(SystemExit) as exit_:
        call()
    said = str(exit_.value.code)
    assert time.monotonic() - start < seconds and "\n" not in said, said
    return said


def load_toy(folder):
    return train.load_model(folder, config.get_args([]), torch.device("cpu"))


def test_a_config_claiming_20000_layers_is_refused_before_a_layer_is_built(toy_dir, tmp_path, monkeypatch):
    """A 1.4 MB folder whose config.json claims 20,000 layers built them for minutes with no line (the loading line
    looked only at the weight files' size): the parameters its sizes make are counted before any layer is built,
    against the weight files and the device's memory."""
    folder = edited_toy(toy_dir, tmp_path / "deep", config={"num_hidden_layers": 20000})
    said = one_line_exit(lambda: load_toy(folder))
    assert said == (f"error: --model {folder}: config.json's sizes make 2,954,288,512 parameters (20000 layers of "
                    "147,712, vocab_size 378 x hidden_size 128); the weight files hold 343,936: a config.json for "
                    "another model, or weights missing?")
    folder = edited_toy(toy_dir, tmp_path / "biased", config={"mlp_bias": True})  # biases it would make up
    assert one_line_exit(lambda: load_toy(folder)).endswith("parameters (2 layers of 148,352, vocab_size 378 x "
                                                            "hidden_size 128); the weight files hold 343,936: a "
                                                            "config.json for another model, or weights missing?")
    monkeypatch.setattr(plan, "device_bytes", lambda device: 1e6)  # the toy's own weights: 1.4 MB in float32
    said = one_line_exit(lambda: load_toy(toy_dir))
    assert said == (f"error: --model {toy_dir}: its 343,936 parameters take 0.0014 GB in float32, more than the "
                    "device's 0.001 GB")


def test_half_a_safetensors_file_is_one_line_before_loading(toy_dir, tmp_path):
    """Half a model.safetensors (an interrupted copy) ended in a SafetensorError traceback: its header is read and its
    tensors' offsets checked against the file's size before loading, one line naming the file."""
    for cut, why in [(0.5, "holds 686,820 bytes of tensor data where its header lists 1,375,744: cut short (an "
                           "interrupted download?); copy it again"),
                     (100, "its header is cut short (100 bytes in all): an interrupted download?; copy it again")]:
        folder = edited_toy(toy_dir, tmp_path / f"cut{cut}")
        weights = Path(folder) / "model.safetensors"
        whole = weights.read_bytes()
        weights.write_bytes(whole[:int(len(whole) * cut) if cut < 1 else cut])
        assert one_line_exit(lambda: load_toy(folder)) == f"error: --model {folder}: model.safetensors: {why}"


def test_a_sliding_window_the_sampler_does_not_run_is_refused_before_loading(toy_dir, tmp_path):
    """Mistral with sliding_window 8 was accepted while the sampler and trainer attend to every earlier token (17.1
    nats off the model's own forward): a window shorter than the context, for any supported model_type and however
    the config asks for it, is one line at --model's check and at load; a window that covers the context is full
    attention, and runs."""
    refused = [({"model_type": "mistral", "sliding_window": 8}, "sliding_window 8 is below max_position_embeddings "
                "512: the sampler and trainer attend to every earlier token (full attention); set "
                "max_position_embeddings to at most 8 to run it"),
               ({"model_type": "mistral", "max_position_embeddings": 8192}, "sliding_window 4096 is below "
                "max_position_embeddings 8192"),  # MistralConfig's default window
               ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
                "sliding_window 8 is below max_position_embeddings 512"),
               ({"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 8,
                 "layer_types": ["full_attention", "sliding_attention"]}, "sliding_window 8 is below"),
               ({"model_type": "qwen2", "layer_types": ["full_attention", "chunked_attention"]},
                "layer_types[1] is 'chunked_attention': the sampler and trainer run full_attention"),
               ({"model_type": "qwen2", "layer_types": ["full_attention"]},
                "layer_types has 1 entries, not num_hidden_layers 2")]
    for k, (edits, why) in enumerate(refused):
        folder, errors = edited_toy(toy_dir, tmp_path / f"window{k}", config=edits), []
        checks.check_model_dir(folder, errors.append)
        assert len(errors) == 1 and errors[0].startswith(f"--model {folder}: config.json: {why}"), errors
    assert one_line_exit(lambda: load_toy(str(tmp_path / "window0"))).startswith(
        f"error: --model {tmp_path / 'window0'}: config.json: sliding_window 8 is below")
    for k, edits in enumerate([{"model_type": "mistral", "sliding_window": 512},
                               {"model_type": "mistral", "sliding_window": None},
                               {"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 8},
                               {"model_type": "llama", "sliding_window": 8}]):  # Llama has no window
        folder, errors = edited_toy(toy_dir, tmp_path / f"full{k}", config=edits), []
        checks.check_model_dir(folder, errors.append)
        assert errors == [], edits
    _, model = load_toy(str(tmp_path / "full0"))
    assert model.config.model_type == "mistral" and model.config.sliding_window == 512


def test_a_config_nested_100000_lists_deep_is_one_line(toy_dir, tmp_path, capsys):
    """config.json nested 100,000 lists deep ended in a RecursionError traceback: one line naming the file, at
    --model's check and at load."""
    for name in ("config.json", "generation_config.json"):
        folder = edited_toy(toy_dir, tmp_path / name)
        text = json.loads((Path(folder) / name).read_text())
        (Path(folder) / name).write_text(json.dumps(text)[:-1] + ', "x": ' + "[" * 100000 + "]" * 100000 + "}")
        errors = []
        checks.check_model_dir(folder, errors.append)
        assert errors == [f"--model {folder}: {name}: not JSON a model folder holds (nested too deeply)"]
        with pytest.raises(SystemExit):
            config.get_args(["--model", folder])
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"train.py: error: --model {folder}: {name}: not JSON a model folder holds (nested too deeply) "
            "(--help lists the flags)")
        assert one_line_exit(lambda: load_toy(folder)) == \
            f"error: --model {folder}: {name}: not JSON a model folder holds (nested too deeply)"


def test_an_eos_token_id_that_is_no_id_in_generation_config_is_one_line(toy_dir, tmp_path):
    """eos_token_id "abc" in generation_config.json loaded and ended in a TypeError at the sampler's first step: every
    token id there is checked against the vocabulary, and anything transformers refuses in it is one line."""
    for k, (edits, why) in enumerate([({"eos_token_id": "abc"}, "eos_token_id is 'abc', not an id below vocab_size "
                                                                 "378"),
                                      ({"eos_token_id": [0, 1e300]}, "eos_token_id is [0, 1e+300], not an id"),
                                      ({"pad_token_id": "abc"}, "pad_token_id is 'abc': '<' not supported"),
                                      ({"max_new_tokens": "abc"}, "")]):
        folder, errors = edited_toy(toy_dir, tmp_path / f"gen{k}", generation=edits), []
        checks.check_model_dir(folder, errors.append)
        assert len(errors) == 1 and errors[0].startswith(f"--model {folder}: generation_config.json: {why}"), errors
        assert one_line_exit(lambda: load_toy(folder)) == f"error: {errors[0]}"


def test_an_unknown_hidden_act_or_a_field_of_the_wrong_type_is_one_line(toy_dir, tmp_path):
    """hidden_act "nope" loaded until building the MLP raised a KeyError, and transformers' own checks of a field's
    type (rms_norm_eps "abc", a head count past any size) raised multi-line tracebacks: one line naming config.json
    and the field, at --model's check and at load."""
    for k, (edits, why) in enumerate([({"hidden_act": "nope"}, "hidden_act is 'nope', not an activation transformers "
                                                                "has (gelu, "),
                                      ({"rms_norm_eps": "abc"}, "Validation error for field 'rms_norm_eps': TypeError"),
                                      ({"tie_word_embeddings": "abc"}, "Validation error for field 'tie_word_emb"),
                                      ({"dtype": "abc"}, "dtype is 'abc', not a torch dtype"),
                                      ({"num_attention_heads": 2 ** 70}, "Class validation error")]):
        folder, errors = edited_toy(toy_dir, tmp_path / f"cfg{k}", config=edits), []
        checks.check_model_dir(folder, errors.append)
        assert len(errors) == 1 and errors[0].startswith(f"--model {folder}: config.json: {why}"), errors
        assert "\n" not in errors[0]
        assert one_line_exit(lambda: load_toy(folder)) == f"error: {errors[0]}"


@pytest.mark.parametrize("kind,dtype", [("llama", torch.float32), ("qwen3", torch.bfloat16)])
def test_generate_rope_tables_equal_the_models_rotary_module_per_position(kind, dtype):
    """The decode step looks positions up in tables made once; they are the model's own rotary values
    for those positions, bit for bit (so the sampler's forward stays the model's arithmetic)."""
    model = tiny_model(kind, dtype)
    cos, sin = gen.rope_tables(model, 200)
    pos = torch.tensor([[0, 1, 7, 63, 64, 150, 199]])
    ref_cos, ref_sin = model.model.rotary_emb(torch.zeros(1, dtype=dtype), pos)
    half = cos.size(-1) // 2
    assert cos.dtype == sin.dtype == dtype
    assert torch.equal(cos[pos[0]], ref_cos[0])
    assert torch.equal(sin[pos[0], :half], -ref_sin[0, :, :half]) and torch.equal(sin[pos[0], half:], ref_sin[0, :, half:])

# =============================================================================
# fit.py: the sigmoid fit of pass rate against compute, its extrapolation and the command line

# ScaleRL fits as the paper reports them: C_mid (GB200 GPU-hours), B, A
PUBLISHED = {
    "8B batch 768": (2542, 1.92, 0.610),
    "8 generations": (2542, 2.44, 0.585),
    "MoE 17Bx16": (4242, 1.65, 0.710),
    "batch 2048": (10909, 1.70, 0.645),
}
R0 = 0.38


def fit_curve(C_mid, B, A, seed=0, noise=0.003, n=61, span=4.0):
    """Eval points of a published curve: C from 0 to span * C_mid (N,), R with seeded noise."""
    C = np.linspace(0.0, span * C_mid, n)
    R = fit.sigmoid(C, A, B, C_mid, R0) + np.random.default_rng(seed).normal(0, noise, n)
    R[0] = R0
    return C, R


def write_run(run_dir, C, R, lines=None, se=None, train=None, steps=None, config=None):
    """A metrics.jsonl like train.py's: a config line, train lines, eval lines (compute in s; se: the evals'
    standard error, pass_rate_se; train: step -> more fields of that step's train line; steps: each line's step,
    else 0, 1, ...; config: more fields of the config line)."""
    os.makedirs(run_dir, exist_ok=True)
    recs = [{"kind": "config", "loss": "cispo", "batch": 8, "prompts": 16, "samples": 8, **(config or {})}]
    for step, c, r in zip(range(len(C)) if steps is None else steps, C, R):
        recs.append({"kind": "train", "step": step, "compute_s": c, "flops": c * 1e9,
                     "reward": 2 * r - 1, "pass_rate": r, **(train(step) if train else {})})
        recs.append({"kind": "eval", "step": step, "compute_s": c, "flops": c * 1e9,
                     "pass_rate": r, "pass_rate/math": r, "n": 800, **({} if se is None else {"pass_rate_se": se})})
    text = lines if lines is not None else [json.dumps(x) for x in recs]
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.write("\n".join(text) + "\n")


def test_fit_recovers_published_curves_and_extrapolates_from_half():
    for k, (C_mid, B, A) in enumerate(PUBLISHED.values()):
        C, R = fit_curve(C_mid, B, A, seed=k)
        f = fit.fit_sigmoid(C, R)
        assert abs(f["A"] - A) < 0.01, (A, f)
        assert f["R0"] == R0 and abs(f["B"] - B) < 0.25 and abs(np.log(f["C_mid"] / C_mid)) < 0.1
        half = C <= C[-1] / 2
        h = fit.fit_sigmoid(C[half], R[half])
        pred = fit.sigmoid(C[-1], h["A"], h["B"], h["C_mid"], h["R0"])
        assert abs(pred - fit.sigmoid(C[-1], A, B, C_mid, R0)) < 0.02, (A, h)


def test_fit_noiseless_curve_is_exact():
    C_mid, B, A = PUBLISHED["8B batch 768"]
    C, R = fit_curve(C_mid, B, A, noise=0.0)
    f = fit.fit_sigmoid(C, R)
    np.testing.assert_allclose([f["A"], f["B"], f["C_mid"]], [A, B, C_mid], rtol=1e-4)


def test_fit_drops_the_first_tenth_of_the_compute_by_default():
    """A transient in the first 10% of the compute (here: early pass rates far off the curve) moves a fit
    of every point; the default fit, which starts at 10% of the compute as the paper's fits do, is exact."""
    C_mid, B, A = PUBLISHED["8B batch 768"]
    C, R = fit_curve(C_mid, B, A, noise=0.0)
    early = (C > 0) & (C < 0.1 * C[-1])
    R = np.where(early, R + 0.15, R)
    assert fit.fit_start(C) == pytest.approx(0.1 * C[-1])
    f = fit.fit_sigmoid(C, R)
    np.testing.assert_allclose([f["A"], f["B"], f["C_mid"]], [A, B, C_mid], rtol=1e-4)
    every = fit.fit_sigmoid(C, R, fit_from=0)
    assert abs(every["B"] - B) > 0.05


def test_fit_extrapolation_check_and_the_shared_A_rule_over_several_runs():
    C_mid, B, A = PUBLISHED["8B batch 768"]
    C, R = fit_curve(C_mid, B, A, noise=0.0)
    x = fit.extrapolation_check(C, R)
    assert x["n"] == 31 and x["measured"] == pytest.approx(R[-1]) and abs(x["error"]) < 1e-3
    assert fit.extrapolation_check(C[:5], R[:5]) is None  # 2 points in the first half: no fit
    runs = []
    for b in (1.2, 1.6, 2.0):  # same ceiling, different efficiency
        Cb, Rb = fit_curve(C_mid, b, A, noise=0.0)
        runs.append({"fit": fit.fit_sigmoid(Cb, Rb), "data": (Cb, Rb)})
    shared, refits = fit.shared_A_refit(runs)
    assert shared == pytest.approx(A, abs=1e-3)
    np.testing.assert_allclose([f["B"] for f in refits], [1.2, 1.6, 2.0], rtol=1e-2)


def test_fit_units_do_not_matter():
    C, R = fit_curve(*PUBLISHED["MoE 17Bx16"], seed=3)
    base = fit.fit_sigmoid(C, R)
    for scale in (1e3, 1e15):                       # GPU-hours -> "seconds", -> "FLOPs"
        f = fit.fit_sigmoid(C * scale, R)
        assert abs(f["A"] - base["A"]) < 1e-3 and abs(f["B"] - base["B"]) < 1e-2
        assert abs(f["C_mid"] / (base["C_mid"] * scale) - 1) < 1e-2


def test_fit_power_law_overpredicts_sigmoid_data():
    # What is true on sigmoid data (checked on every published row): fitted on the first half,
    # the power law's ceiling A lands far above the sigmoid's (often on the 1.0 cap) and its
    # SSE is >10x worse; with the early transient dropped (fit_from = 1.5k GPU-hours, as the
    # paper) it over-predicts the final pass rate, by more than the sigmoid misses it (where
    # 1.5k is a small part of the rise, batch 2048 with C_mid 10.9k, it shrinks to ~0.001).
    for k, name in enumerate(["8B batch 768", "8 generations"]):
        C_mid, B, A = PUBLISHED[name]
        C, R = fit_curve(C_mid, B, A, seed=k)
        half = C <= C[-1] / 2
        sig, pow_ = fit.fit_sigmoid(C[half], R[half]), fit.fit_power_law(C[half], R[half])
        assert pow_["sse"] > 10 * sig["sse"] and pow_["A"] > sig["A"] + 0.2
        sig = fit.fit_sigmoid(C[half], R[half], fit_from=1500)
        pow_ = fit.fit_power_law(C[half], R[half], fit_from=1500)
        true_end = fit.sigmoid(C[-1], A, B, C_mid, R0)
        err_sig = fit.sigmoid(C[-1], sig["A"], sig["B"], sig["C_mid"], sig["R0"]) - true_end
        err_pow = fit.power_law(C[-1], pow_["A"], pow_["B"], pow_["D"]) - true_end
        assert err_pow > 0.01 and err_pow > abs(err_sig), (name, err_pow, err_sig)


def test_fit_linear_view_has_slope_B():
    C, R = fit_curve(*PUBLISHED["batch 2048"], seed=1)
    f = fit.fit_sigmoid(C, R)
    Cs = np.geomspace(C[1], C[-1], 30)
    logF = fit.linear_view(fit.sigmoid(Cs, f["A"], f["B"], f["C_mid"], f["R0"]),
                           f["A"], f["B"], f["C_mid"], f["R0"])
    slope, intercept = np.polyfit(np.log(Cs), logF, 1)
    assert abs(slope - f["B"]) < 1e-6 and abs(intercept) < 1e-4
    above_A = fit.linear_view(np.array([f["A"] + 0.01]), f["A"], f["B"], f["C_mid"], f["R0"])
    assert np.isnan(above_A[0])


def test_fit_compare_noise_and_different():
    C, Ra = fit_curve(3000, 1.6, 0.600, seed=1)
    _, Rb = fit_curve(3000, 2.0, 0.610, seed=2)
    _, Rc = fit_curve(3000, 1.6, 0.650, seed=3)
    fa, fb, fc = (fit.fit_sigmoid(C, R) for R in (Ra, Rb, Rc))
    v = fit.compare(fa, fb, (C, Ra), (C, Rb))
    assert v["branch"] == "noise" and v["better"] == "b"
    assert abs(v["A_shared"] - (fa["A"] + fb["A"]) / 2) < 1e-12 and v["B_b"] > v["B_a"]
    v = fit.compare(fa, fc, (C, Ra), (C, Rc))
    assert v["branch"] == "different" and v["better"] == "b" and abs(v["dA"] - 0.05) < 0.015


def test_fit_bootstrap_and_predict_final():
    C, R = fit_curve(*PUBLISHED["8 generations"], seed=4)
    spread = fit.bootstrap_A(C, R, n=8, seed=0)
    assert 0 < spread["std"] < 0.01 and spread["lo"] <= spread["mean"] <= spread["hi"]
    assert abs(spread["mean"] - 0.585) < 0.01
    assert fit.predict_final(C[:4], R[:4], C[-1]) is None       # R0 + 3 points: too few
    p = fit.predict_final(C[:31], R[:31], C[-1])
    assert abs(p["R_end"] - fit.sigmoid(C[-1], 0.585, 2.44, 2542, R0)) < 0.02


def test_fit_cli_table_and_pngs(tmp_path, capsys):
    C = np.linspace(0, 1200, 25)                        # CPU-seconds
    write_run(tmp_path / "cispo", C, fit.sigmoid(C, 0.60, 1.8, 300, 0.30))
    write_run(tmp_path / "grpo", C, fit.sigmoid(C, 0.61, 1.4, 400, 0.30))
    png = tmp_path / "out" / "curve.png"
    os.makedirs(png.parent)
    fit.main([str(tmp_path / "cispo"), str(tmp_path / "grpo"), "--fit_until", "600",
              "--extrapolate_to", "5000", "--png", str(png)])
    out = capsys.readouterr().out
    assert "cispo" in out and "grpo" in out and "C_mid" in out and "R power" in out
    assert "0.600" in out and "A within noise" in out and "a is more efficient" in out
    for p in (png, tmp_path / "out" / "curve_linear.png"):
        data = p.read_bytes()
        assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"
    fit.main([str(tmp_path / "cispo"), "--compute", "flops", "--metric", "pass_rate/math"])
    assert "1.2e+12" in capsys.readouterr().out
    fit.main([str(tmp_path / "cispo")])  # the same run in device-seconds: figures of its own
    assert sorted(p.name for p in (tmp_path / "cispo").glob("fit*.png")) == [
        "fit_device_s.png", "fit_device_s_linear.png", "fit_flops_pass_rate_math.png",
        "fit_flops_pass_rate_math_linear.png"]


def test_fit_curves_png_and_its_series(tmp_path, capsys):
    train = []
    for s in range(1, 21):
        rec = {"kind": "train", "step": s, "compute_s": 2.0 * s, "reward": 0.05 * s - 0.5,
               "pass_rate": 0.025 * s + 0.25, "trunc": 0.01 * (s % 7), "intr": 0.2 / s, "prompts": 16,
               "kept_prompts": s % 9, "drift": 0.001 * s}
        if s % 4 == 0:
            del rec["drift"]                            # a step that trained nothing logs no drift
        if s == 5:
            del rec["trunc"], rec["prompts"]            # no kept fraction either
        if s == 6:
            rec.update(reward=None, intr=float("nan"))  # not numbers: skipped as well
        train.append(rec)
    evals = [{"kind": "eval", "step": s, "compute_s": 2.0 * s, "pass_rate": r}
             for s, r in ((0, 0.3), (10, 0.5), (20, 0.62))]
    write_eval_lines(tmp_path / "run", evals[:1] + train[:10] + evals[1:2] + train[10:] + evals[2:])
    c = fit.train_curves(str(tmp_path / "run"))
    every = list(range(1, 21))
    assert c["kept"][0].tolist() == [s for s in every if s != 5]
    assert c["kept"][1].tolist() == [(s % 9) / 16 for s in every if s != 5]
    assert c["drift"][0].tolist() == [s for s in every if s % 4]
    assert c["drift"][1].tolist() == [0.001 * s for s in every if s % 4]
    assert c["trunc"][1].tolist() == [0.01 * (s % 7) for s in every if s != 5]
    assert c["reward"][0].tolist() == c["intr"][0].tolist() == [s for s in every if s != 6]
    assert c["pass_rate"][1].tolist() == [0.025 * s + 0.25 for s in every]
    assert c["eval_pass_rate"][0].tolist() == [0, 10, 20] and c["eval_pass_rate"][1].tolist() == [0.3, 0.5, 0.62]
    assert np.allclose(plots.moving_average([1.0, 2, 3, 10], 1), [1.5, 2, 5, 6.5])
    with pytest.raises(ValueError, match="need at least 4"):    # 3 evals are too few to fit: the curves still come
        fit.main([str(tmp_path / "run")])
    png = tmp_path / "run" / "curves.png"
    assert f"wrote {png}; the fit failed" in capsys.readouterr().err
    data = png.read_bytes()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"
    C = np.linspace(0, 1200, 25)                        # a run that fits: the path is printed with the others
    write_run(tmp_path / "a", C, fit.sigmoid(C, 0.60, 1.8, 300, 0.30))
    write_run(tmp_path / "b", C, fit.sigmoid(C, 0.61, 1.4, 400, 0.30))
    fit.main([str(tmp_path / "a"), str(tmp_path / "b")])
    a, b = tmp_path / "a", tmp_path / "b"
    wrote = f"wrote {a / 'fit_device_s.png'}, {a / 'fit_device_s_linear.png'} and the training curves "
    wrote += f"{a / 'curves.png'}, "
    wrote += str(b / "curves.png")
    assert wrote in capsys.readouterr().out
    write_eval_lines(tmp_path / "one", train[:1])       # 1 step, no eval line
    write_eval_lines(tmp_path / "bare", [{"kind": "train", "step": 1}, {"kind": "eval"}])  # nothing to draw
    for run in ("one", "bare"):
        assert fit.plot_curves(str(tmp_path / run)) == str(tmp_path / run / "curves.png")
        assert (tmp_path / run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fit_steep_rise_fits_with_ceiling_at_one():
    # a live fit from train.py that once failed: the grid's best A sat a rounding error above 1.0
    C = np.array([0.0, 4.07, 7.23, 9.64, 13.8, 17.38, 20.31, 23.77])
    R = np.array([0.25, 0.52, 0.561, 0.638, 0.673, 0.754, 0.791, 0.838])
    f = fit.fit_sigmoid(C, R)
    assert R.max() - 0.02 <= f["A"] <= 1.0 and f["sse"] < 0.01
    assert fit.predict_final(C, R, 100.0)["R_end"] <= 1.0


def test_fit_errors(tmp_path):
    write_run(tmp_path / "short", [0.0, 10.0, 20.0, 30.0], [0.3, 0.31, 0.33, 0.36])
    with pytest.raises(ValueError, match=r"short.*metrics.jsonl.*need at least 4 .* got 3"):
        fit.main([str(tmp_path / "short"), "--png", str(tmp_path / "x.png")])
    for run in ("short", "missing"):  # the command line (fit.py as __main__, forked): one error line, no traceback
        cli = Forked([str(tmp_path / run)], {}, tmp_path / f"{run}.log", script="fit.py")
        out = cli.communicate(timeout=60)[0]
        assert cli.returncode == 1 and "Traceback" not in out, out
        assert out.strip().splitlines()[-1].startswith(f"error: {tmp_path / run}"), out
    good = json.dumps({"kind": "eval", "step": 0, "compute_s": 0.0, "pass_rate": 0.2})
    lines = [good, good.replace("0.0", "1.0"), '{"kind": "eval",']
    write_run(tmp_path / "bad", [], [], lines=lines)
    with pytest.raises(ValueError, match=r"bad.metrics\.jsonl:3: invalid JSON"):
        fit.load_run(tmp_path / "bad")
    write_run(tmp_path / "nofield", [], [], lines=[good, json.dumps({"kind": "eval", "step": 1, "compute_s": 1.0})])
    with pytest.raises(ValueError, match=r"nofield.metrics\.jsonl:2: eval line: missing field 'pass_rate'"):
        fit.load_run(tmp_path / "nofield")
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        fit.load_run(tmp_path / "missing")
    C, R = fit_curve(3000, 1.6, 0.6)
    with pytest.raises(ValueError, match="NaN"):
        fit.fit_sigmoid(C, np.where(C > 5000, np.nan, R))
    with pytest.raises(ValueError, match="strictly increase"):
        fit.fit_sigmoid(C[::-1], R)
    with pytest.raises(ValueError, match="no point at C = 0"):
        fit.fit_sigmoid(C[1:], R[1:])


def test_fit_refuses_a_flat_series_in_one_line(tmp_path):
    C = np.linspace(0, 1200, 25)
    write_run(tmp_path / "code", C, np.zeros(25))  # pass_rate/code of a run that never solved one
    with pytest.raises(ValueError) as err:  # the command line prints it as one line (test_fit_errors)
        fit.fit_run(str(tmp_path / "code"), types.SimpleNamespace(compute="compute_s", metric="pass_rate/math",
                                                                 fit_until=None, fit_from=None))
    assert str(err.value) == (
        f"{tmp_path / 'code' / 'metrics.jsonl'}: a flat series: the 22 points fitted never rise 0.02 above "
        "R0 = 0.000 (their highest is 0.000), so there is no curve to fit (A, B and C_mid would be arbitrary)")
    R = np.full(25, 0.3)
    R[-1] = 0.315  # within the noise of R0
    assert fit.flat_series(C, R).startswith("a flat series: the 22 points fitted never rise 0.02 above R0 = 0.300")
    assert fit.predict_final(C, R, 2400.0) is None  # train.py's live fit: no prediction, no error
    R[-1] = 0.33
    assert fit.flat_series(C, R) is None and fit.predict_final(C, R, 2400.0)  # a rise past the noise


def test_fit_warns_when_device_seconds_bend_against_flops(tmp_path, capsys):
    F = np.linspace(0, 24e12, 25)  # FLOPs per eval; each 1e12 took 10 s, or 50 s while the machine was loaded
    R = fit.sigmoid(F, 0.8, 2.0, 6e12, 0.2)
    busy = np.r_[10.0 * np.ones(2), 50.0 * np.ones(6), 10.0 * np.ones(16)]  # s per 1e12 FLOPs of steps 1-24
    C = np.cumsum(np.r_[0, busy])
    even = np.cumsum(np.r_[0, 10.0 * (1 + 0.3 * np.sin(np.arange(24)))])  # uneven steps, even on average
    for name, seconds in (("busy", C), ("even", even)):
        write_eval_lines(tmp_path / name, [{"kind": "eval", "step": i, "compute_s": c, "flops": f, "pass_rate": r}
                                           for i, (c, f, r) in enumerate(zip(seconds, F, R))])
    fit.main([str(tmp_path / "busy"), "--png", str(tmp_path / "b.png")])
    ratio = (C[1:] / F[1:])[C[1:] >= C[-1] / 10]  # the points fitted: from 10% of the compute
    warp = ratio.max() / ratio.min()  # 2.0: at eval 8, 40 s per 1e12 FLOPs so far; at the end, 20 s
    assert f"warning: busy: its device-seconds per FLOP vary {warp:.2f}x over the points fitted (over 1.5x" in \
        capsys.readouterr().out and warp == 2.0
    args = types.SimpleNamespace(compute="compute_s", metric="pass_rate", fit_until=None, fit_from=None)
    assert fit.fit_run(str(tmp_path / "even"), args)["warp"] < 1.2  # 1.18: no warning
    args.compute = "flops"  # FLOPs do not move with the machine: nothing to check
    assert fit.fit_run(str(tmp_path / "busy"), args)["warp"] is None


def write_eval_lines(run_dir, recs):
    """A metrics.jsonl of the given records, one per line (line 1 is a config line)."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"kind": "config"}) + "\n")
        for rec in recs:
            f.write(json.dumps(rec) + "\n")
    return os.path.join(run_dir, "metrics.jsonl")


def test_fit_load_run_rejects_a_wrong_typed_value_naming_file_line_and_field(tmp_path):
    good = [{"kind": "eval", "step": i, "compute_s": 10.0 * i, "pass_rate": 0.3 + 0.05 * i} for i in range(6)]
    for field, bad in [("pass_rate", None), ("pass_rate", "0.5"), ("pass_rate", True), ("pass_rate", [0.5]),
                       ("compute_s", {"x": 1}), ("compute_s", False), ("pass_rate", "n/a")]:
        recs = [dict(r) for r in good]
        recs[3][field] = bad
        path = write_eval_lines(tmp_path / "run", recs)
        with pytest.raises(ValueError) as err:
            fit.load_run(str(tmp_path / "run"))
        assert str(err.value) == f"{path}:5: field '{field}' must be a finite number, got {bad!r}"
    recs = [dict(r) for r in good]
    recs[4]["compute_s"] = 25.0  # below line 5's 30.0
    path = write_eval_lines(tmp_path / "run", recs)
    with pytest.raises(ValueError) as err:
        fit.load_run(str(tmp_path / "run"))
    assert str(err.value) == f"{path}: compute must strictly increase: C=30.0 at line 5, then C=25.0 at line 6"


def test_fit_and_study_a_400_digit_number_is_one_line_naming_file_line_and_field(tmp_path):
    """A 400-digit integer (JSON admits it) raised OverflowError from math.isfinite, outside fit.py's except: an
    eval line's is a ValueError naming file:line and field, a train line's is skipped like any non-number, and
    study's run_logs names the file and line of any field it reads that is not a finite number."""
    huge = 10 ** 400
    recs = [{"kind": "eval", "step": i, "compute_s": 10.0 * i + 1, "pass_rate": 0.3 + 0.05 * i} for i in range(6)]
    recs[3]["compute_s"] = huge
    path = write_eval_lines(tmp_path / "run", recs)
    with pytest.raises(ValueError, match=rf"^{re.escape(path)}:5: field 'compute_s' must be a finite number, got "
                                         r"10000000000000000000\.\.\. \(401 characters\)$"):
        fit.load_run(str(tmp_path / "run"))
    recs[3]["compute_s"] = 31.0
    train_lines = [{"kind": "train", "step": 1, "reward": huge, "len": 12}, {"kind": "train", "step": 2, "reward": 0.5,
                                                                              "len": huge}]
    write_eval_lines(tmp_path / "run", recs + train_lines)
    assert fit.train_curves(str(tmp_path / "run"))["reward"][1].tolist() == [0.5]
    with pytest.raises(ValueError, match=rf"^{re.escape(path)}:9: field 'len' must be a finite number"):
        study.run_logs(str(tmp_path / "run"))
    (tmp_path / "run" / "study_minutes.json").write_text(str(huge))
    assert study.run_minutes(str(tmp_path / "run")) == 0.0


def test_fit_pass_rates_on_a_0_to_100_scale_are_named_as_such(tmp_path):
    C, R = np.arange(8.0), np.array([30, 40, 45, 50, 55, 57, 58, 59.0])
    with pytest.raises(ValueError) as err:
        fit.fit_sigmoid(C, R)
    assert str(err.value) == "pass rates must lie in [0, 1], got R0 = 30 and max R = 59"
    path = write_eval_lines(tmp_path / "pct", [{"kind": "eval", "compute_s": c, "pass_rate": r} for c, r in zip(C, R)])
    with pytest.raises(ValueError) as err:
        fit.load_run(str(tmp_path / "pct"))
    assert str(err.value) == f"{path}:2: field 'pass_rate' must be a pass rate in [0, 1], got 30.0"
    with pytest.raises(ValueError, match="R0 = 0.999 leaves no room"):  # a pass rate near 1 still blames R0
        fit.fit_sigmoid(C, np.full(8, 0.999))


def test_fit_bootstrap_A_refits_on_the_callers_fit_from():
    C = np.array([0.0, 1, 2, 4, 8, 100])  # the default 10% cut (C >= 10) would leave one point
    R = fit.sigmoid(C, 0.6, 1.5, 3.0, 0.3)  # on the curve: every refit finds the same A
    spread = fit.bootstrap_A(C, R, fit_from=0, n=4)
    assert abs(spread["mean"] - 0.6) < 0.01 and spread["std"] < 0.005
    assert spread["lo"] <= spread["mean"] <= spread["hi"]


def test_fit_predict_final_is_none_while_the_cut_leaves_too_few_points():
    C, R = np.array([0.0, 1, 2, 3, 100]), np.array([0.3, 0.35, 0.4, 0.45, 0.6])
    assert fit.predict_final(C, R, 200.0) is None  # 4 points with C > 0, but only C = 100 is past 10
    C = np.linspace(0, 100, 11)
    p = fit.predict_final(C, fit.sigmoid(C, 0.7, 2.0, 40.0, 0.3), 200.0)
    assert abs(p["R_end"] - fit.sigmoid(200.0, 0.7, 2.0, 40.0, 0.3)) < 0.01

# =============================================================================
# study.py: the report over variants and seeds, and a quick study end to end


def paired_p_by_hand(d, shift):
    """A one-sided paired t-test's p-value written out: t = (mean(d) - shift) / (sd(d, ddof 1) / sqrt(n)) on n - 1
    degrees of freedom, testing mean(d) > shift."""
    d = np.asarray(d, dtype=float)
    t = (d.mean() - shift) / (math.sqrt(((d - d.mean()) ** 2).sum() / (len(d) - 1)) / math.sqrt(len(d)))
    return stats.t.sf(t, len(d) - 1)


def test_study_tests_holm_and_the_words_each_test_allows_by_hand():
    """Superiority tests X - Y > 0, non-inferiority X - Y > -0.02, each one-sided; Holm's step-down by hand; a
    verdict says only what its test allows: superiority shown or not, a loss beyond the margin excluded or not,
    never "reproduced"; fewer than 5 pairs decides nothing."""
    assert (study.ALPHA, study.MIN_PAIRS, study.NI_MARGIN) == (0.05, 5, 0.02)
    d = np.array([0.012, -0.004, 0.02, 0.007, 0.001])
    assert study.one_sided_p(d, 0.0) == pytest.approx(paired_p_by_hand(d, 0.0), rel=1e-9)
    assert study.one_sided_p(d, -0.02) == pytest.approx(paired_p_by_hand(d, -0.02), rel=1e-9)
    assert study.one_sided_p([0.01] * 5, 0.0) == 0.0 and study.one_sided_p([0.0] * 5, 0.0) == 1.0  # no spread
    assert math.isnan(study.one_sided_p([0.3], 0.0))
    # sorted 0.01 (x4), 0.03 (x3), 0.04 (x2), 0.5 (x1), each at least the one before it
    assert study.holm([0.04, 0.01, 0.5, 0.03]) == pytest.approx([0.09, 0.04, 0.5, 0.09])
    assert study.holm([0.2, float("nan"), 0.01])[::2] == pytest.approx([0.2, 0.02])
    assert study.holm([0.6, 0.7]) == pytest.approx([1.0, 1.0])  # capped at 1, never below the one before
    words = {(k, p <= 0.05): study.verdict(k, p, 5) for k in ("superiority", "non-inferiority") for p in (0.01, 0.2)}
    assert words == {("superiority", True): "superiority shown", ("superiority", False): "superiority not shown",
                     ("non-inferiority", True): "a loss larger than 0.02 excluded",
                     ("non-inferiority", False): "a loss larger than 0.02 not excluded"}
    assert study.verdict("superiority", 0.001, 4).startswith("not decided")


def test_study_protocol_is_frozen_and_says_what_the_code_does():
    """docs/protocol.md is the file whose hash study.py holds (an edit shows as a changed protocol, and fails here),
    and it names the code's seeds, variants and flags, findings with their kinds, and the numbers of its rules."""
    text = (ROOT / study.PROTOCOL).read_text()
    assert hashlib.sha256(text.encode()).hexdigest() == study.PROTOCOL_CHAIN[-1][1] and study.protocol_record()["frozen"]
    assert f"Seeds {', '.join(map(str, study.SEEDS))}" in text and f"--budget {study.BUDGET:g}" in text
    for name, flags in study.VARIANTS.items():
        assert f"| {name} | " in text and all(f in text for f in flags), name
    for finding, _, X, Y, kind in study.FINDINGS:
        assert f"| {finding} | {X} | {Y} | {kind} |" in text
    for phrase in (f"step {int(study.EARLY * study.STEPS)} of {study.STEPS}", f"margin {study.NI_MARGIN}",
                   f"half the run's samples (step {int(study.CUT * study.STEPS)})", "40%, 60% and 75%",
                   "Holm", "final_mean3", " ".join(study.TASK[:-2])):
        assert phrase in " ".join(text.split()), phrase
    assert study.CUTS == (0.4, 0.5, 0.6, 0.75) and study.EARLY == 0.1 and study.CUT == 0.5


def study_curve(steps, A, B, mid, R0, seed):
    """A pass-rate curve over eval steps with a little seed-dependent wobble."""
    return fit.sigmoid(steps, A, B, mid, R0) + 0.006 * np.sin(steps * (seed + 1)) * (steps > 0)


def write_synthetic_study(folder, seeds=(10, 11, 12, 13, 14)):
    """ScaleRL, no_npr (0.03 under it), norm_prompt (within 0.005 of it) and batch32 (32 prompts a step), 5 seeds,
    evals every 10 steps to 200; norm_prompt's seed 14 collapses at the end -> the variants."""
    steps = np.arange(0, 201, 10.0)
    for name, A, prompts in (("scalerl", 0.8, 16), ("no_npr", 0.77, 16), ("norm_prompt", 0.798, 16),
                             ("batch32", 0.82, 32)):
        for seed in seeds:
            spread = 0.004 * (seed % 2) if name != "scalerl" else 0.0  # pairs differ from seed to seed
            R = study_curve(steps, A + 0.002 * (seed - 12) + spread, 2.0, 60.0, 0.3, seed)
            if name == "norm_prompt" and seed == 14:
                R[-1] = R.max() - 0.06
            write_run(folder / f"{name}-s{seed}", steps * 2.0, R, se=0.009, steps=steps,
                      config={"prompts": prompts, "samples": 8},
                      train=(lambda step: {"intr": 0.01, "dropped_zero_var": 4, "prompts": 16}) if name == "scalerl"
                      else None)
    return ["scalerl", "no_npr", "batch32", "norm_prompt"]


def test_study_report_recomputes_from_its_own_series(tmp_path):
    """Synthetic runs, 5 seeds: each run's series in study_report.json is its evals; every final_mean3, paired test,
    Holm-adjusted p, verdict and prediction is recomputed here from those series by formulas written out."""
    names, seeds = write_synthetic_study(tmp_path), study.SEEDS
    text = study.write_report(str(tmp_path), names, seeds, 200)
    rep = json.loads((tmp_path / "study_report.json").read_text())
    assert rep["protocol"]["path"] == "docs/protocol.md" and rep["protocol"]["frozen"]
    assert [c["commit"] for c in rep["protocol"]["chain"]] == [c for c, _, _ in study.PROTOCOL_CHAIN]
    assert rep["seeds"] == list(seeds)
    run = {(r["variant"], r["seed"]): r for r in rep["runs"]}
    assert len(run) == 20
    for (v, s), r in run.items():
        recs = [json.loads(ln) for ln in open(tmp_path / f"{v}-s{s}" / "metrics.jsonl")]
        per_step = 8 * (32 if v == "batch32" else 16)
        assert r["series"] == [{"step": e["step"], "samples": e["step"] * per_step, "flops": e["flops"],
                                "compute_s": e["compute_s"], "pass_rate": e["pass_rate"]}
                               for e in recs if e["kind"] == "eval"]
        R = [e["pass_rate"] for e in r["series"]]
        assert r["final_mean3"] == pytest.approx(sum(R[-3:]) / 3)
    found = {f["finding"]: f for f in rep["findings"]}
    assert list(found) == ["No-Positive-Resampling", "batch size", "advantage normalization"]
    ps = []
    for f in rep["findings"]:
        d = np.array([run[(f["X"], s)]["final_mean3"] - run[(f["Y"], s)]["final_mean3"] for s in seeds])
        shift = 0.0 if f["kind"] == "superiority" else -0.02
        assert f["p"] == pytest.approx(paired_p_by_hand(d, shift), rel=1e-6, abs=1e-12) and f["pairs"] == 5
        half = stats.t.ppf(0.975, 4) * d.std(ddof=1) / math.sqrt(5)
        assert f["ci95"] == pytest.approx([d.mean() - half, d.mean() + half]) and f["endpoint"] == "final_mean3"
        ps.append(f["p"])
    order = np.argsort(ps)  # Holm written out for three
    adjusted = np.maximum.accumulate([min(1, (3 - k) * ps[i]) for k, i in enumerate(order)])
    for k, i in enumerate(order):
        assert rep["findings"][i]["p_holm"] == pytest.approx(adjusted[k])
    assert found["No-Positive-Resampling"]["verdict"] == "superiority shown"  # 0.03 ahead on every seed
    assert found["batch size"]["kind"] == "superiority"
    ni = found["advantage normalization"]
    assert ni["kind"] == "non-inferiority" and ni["verdict"].startswith("a loss larger than 0.02")
    assert all("reproduced" not in f["verdict"] for f in rep["findings"])
    assert f"**{ni['verdict']}**" in text and "## Predictability, the paper's method" in text
    # predictions: the fit from step 20 to the cut (samples), R0 the step-0 eval, redone by hand
    for (v, s), r in run.items():
        C = np.array([e["samples"] for e in r["series"]])
        R = np.array([e["pass_rate"] for e in r["series"]])
        preds = {p["cut"]: p for p in r["predictions"] if p}
        if r["collapsed"]:
            assert (v, s) == ("norm_prompt", 14) and not preds
            continue
        for cut, p in preds.items():
            keep = (C > 0) & (C >= 0.1 * C[-1]) & (C <= cut * C[-1])
            f = fit.fit_sigmoid(C[keep], R[keep], R0=R[0], fit_from=0)
            assert p["points"] == keep.sum() and p["persistence"] == pytest.approx(R[C <= cut * C[-1]][-3:].mean())
            assert p["predicted"] == pytest.approx(np.mean(fit.sigmoid(C[-3:], f["A"], f["B"], f["C_mid"], R[0])))
    by_cut = {p["cut"]: p for p in rep["predictability"]["by_cut"]}
    assert set(by_cut) == {0.4, 0.5, 0.6, 0.75} and rep["predictability"]["cut"] == 0.5
    finals = {k: r["final_mean3"] for k, r in run.items()}
    for cut, block in by_cut.items():
        rows = [(next(p for p in r["predictions"] if p and p["cut"] == cut), finals[k]) for k, r in run.items()
                if not r["collapsed"]]
        const = [(sum(finals.values()) - m) / 19 for _, m in rows]
        rmse = lambda guess: math.sqrt(sum((g - m) ** 2 for g, (_, m) in zip(guess, rows)) / len(rows))  # noqa
        assert block["n"] == 19 and block["rmse_fit"] == pytest.approx(rmse([p["predicted"] for p, _ in rows]))
        assert block["rmse_persistence"] == pytest.approx(rmse([p["persistence"] for p, _ in rows]))
        assert block["rmse_constant"] == pytest.approx(rmse(const))
        assert block["skill"] == (block["rmse_fit"] < min(block["rmse_persistence"], block["rmse_constant"]))
    assert rep["predictability"]["skill"] == by_cut[0.5]["skill"]
    assert ("the fit has skill" in text) == by_cut[0.5]["skill"]
    assert "| scalerl | 1.0% | - | 25% |" in text  # what the knobs did: seed means of the train lines
    for png in ("study.png", "study_extrap.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


def study_runs_as(monkeypatch, make):
    """study.py's runs started by make(cmd, **kw) instead of subprocess.Popen; git's answers (the code's commit)
    stay real."""
    real = subprocess.Popen
    monkeypatch.setattr(study.subprocess, "Popen", lambda cmd, **kw: real(cmd, **kw) if cmd[0] == "git" else
                        make(cmd, **kw))


def test_study_quick_trains_and_reports(tmp_path, capsys, monkeypatch):
    """The quick study end to end. Its commands run as study.py makes them, with its arguments and environment,
    in processes forked from the preloaded server (fork_command: ~5 CPU-s less a process)."""
    study_runs_as(monkeypatch, lambda cmd, stdout, env, **kw: ForkedRun(fork_command(cmd, stdout.name, env=env)))
    out = tmp_path / "study"
    study.main([str(out), "--quick", "--assets", str(tmp_path / "assets")])
    first = capsys.readouterr().out
    assert first.count("study: [") == 2 and "## The paper's findings" in first
    assert (out / "report.md").read_text().splitlines()[0] == study.QUICK_NOTE
    rep = json.loads((tmp_path / "assets" / "study_report.json").read_text())
    assert rep["note"] == study.QUICK_NOTE and rep["protocol"]["frozen"]
    assert {r["variant"] for r in rep["runs"]} == {"scalerl", "batch32"}
    (batch,) = rep["findings"]  # one seed: one pair, under the 5 a verdict needs
    assert batch["finding"] == "batch size" and batch["verdict"].startswith("not decided") and batch["pairs"] == 1
    assert all(len(r["series"]) == 7 and r["series"][-1]["step"] == 6 for r in rep["runs"])
    assert rep["minutes"] > 0 and (tmp_path / "assets" / "study.png").exists()
    cfg = {n: json.loads(open(out / f"{n}-s0" / "metrics.jsonl").readline()) for n in ("scalerl", "batch32")}
    assert cfg["scalerl"]["world"] == 1 and cfg["batch32"]["prompts"] == 32
    # the study's task, on train.py's own loss defaults (no pins)
    assert cfg["scalerl"]["think_budget"] == 64 and cfg["scalerl"]["neg_trust"] == config.get_args([]).neg_trust
    recs = [json.loads(ln) for ln in open(out / "scalerl-s0" / "metrics.jsonl")]
    assert recs[0]["val_data"] == str(out / "problems" / "val.jsonl")  # every run scored on the same prompts
    evals = [r for r in recs if r["kind"] == "eval"]
    assert all(r["n"] == 8 and 0 <= r["pass_rate_se"] < 0.2 for r in evals)
    assert sum(r["kept_prompts"] for r in recs if r["kind"] == "train") > 0  # it trained: not every group dropped
    study.main([str(out), "--quick"])  # finished runs are kept, not trained again
    assert "study: [" not in capsys.readouterr().out


def test_study_figure2_quick_runs_the_recipes_and_reports_the_protocols_tests(tmp_path, capsys, monkeypatch):
    """--figure2 --quick: two of the second study's recipes (--method scalerl, --method dapo) x 1 seed x 6 tiny
    steps, then its report: the protocol chain, the power table, per-recipe A with intervals, the skill, ranking and
    A tests, each run's series and starts; the figure. The two-rank recipes run under torchrun on both cores."""
    commands = []
    study_runs_as(monkeypatch, lambda cmd, stdout, env, **kw: (
        commands.append(cmd), ForkedRun(fork_command(cmd, stdout.name, env=env)))[1])
    out = tmp_path / "fig2"
    study.main([str(out), "--figure2", "--quick"])
    assert [c[c.index("--method") + 1] for c in commands] == ["scalerl", "dapo"]
    cfg = {n: json.loads(open(out / f"{n}-s0" / "metrics.jsonl").readline()) for n in ("scalerl", "dapo")}
    assert (cfg["dapo"]["loss"], cfg["dapo"]["agg"], cfg["scalerl"]["loss"]) == ("dapo", "token", "cispo")
    rep = json.loads((out / "figure2_report.json").read_text())
    assert rep["note"] == study.QUICK_NOTE and rep["protocol"]["path"] == study.PROTOCOL2
    assert rep["power"] == [dict(p) for p in study.POWER] and {r["recipe"] for r in rep["runs"]} == {"scalerl", "dapo"}
    assert all(len(r["series"]) == 7 and len(r["starts"]) == 1 for r in rep["runs"])
    # 6 steps leave too few points before the cut to predict: nothing to rank, no skill test
    assert rep["ranking"]["methods"] == [] and rep["ranking"]["verdict"].startswith("not decided")
    assert rep["skill"]["n"] == 0 and not rep["skill"]["skill"]
    assert rep["a_rule"] == [dict(X="dapo", Y="scalerl", pairs=1, diff_A=pytest.approx(
        rep["recipes"][1]["A"] - rep["recipes"][0]["A"]), ci95=[None, None], verdict=rep["a_rule"][0]["verdict"])]
    for row in rep["recipes"]:
        run = next(r for r in rep["runs"] if r["recipe"] == row["recipe"])
        assert row["A"] == pytest.approx(run["A"])  # one seed: its own fit
    assert (out / "figure2.md").read_text().splitlines()[2].startswith("# The quick study")
    assert (out / "figure2.png").read_bytes()[:4] == b"\x89PNG"
    two = study.run_command("pipeline8", study.FIGURE2["pipeline8"], str(out / "p"), 20, 400, ("t", "v"), [])
    assert two[1:5] == ["-m", "torch.distributed.run", "--nproc_per_node", "2"] and study.ranks_of(
        study.FIGURE2["ppo8"]) == 2 and study.ranks_of(study.FIGURE2["grpo"]) == 1
    # each launch a rendezvous file of its own, not there yet (without one torchrun warns of master_addr)
    again = study.run_command("pipeline8", study.FIGURE2["pipeline8"], str(out / "p"), 20, 400, ("t", "v"), [])
    ends = [c[c.index("--rdzv-endpoint") + 1] for c in (two, again)]
    assert ends[0] != ends[1] and not any(os.path.exists(e) for e in ends), ends


def test_study_figure2_protocol_is_frozen_and_says_what_the_code_does():
    """docs/protocol-figure2.md is the file whose chain study.py holds (each commit's file hashed by git's own copy),
    and it names the code's seeds, steps, eval interval, budget, recipes with their flags, the power table the code
    records, and the length chosen: the shortest simulated with 80% power."""
    text = " ".join((ROOT / study.PROTOCOL2).read_text().split())
    rec = study.protocol_record(study.PROTOCOL2, study.PROTOCOL2_CHAIN)
    assert rec["frozen"] and rec["sha256"] == hashlib.sha256((ROOT / study.PROTOCOL2).read_bytes()).hexdigest()
    for link in rec["chain"]:
        held = subprocess.run(["git", "-C", str(ROOT), "show", f"{link['commit']}:{study.PROTOCOL2}"],
                              capture_output=True, check=True).stdout
        assert hashlib.sha256(held).hexdigest() == link["sha256"]
    assert f"Seeds {', '.join(map(str, study.SEEDS2))}" in text and f"{study.STEPS2} optimizer steps" in text
    assert f"--eval_every {study.EVAL_EVERY2}" in text and f"{study.BUDGET2:g} machine-minutes" in text
    for name, flags in study.FIGURE2.items():
        assert f"| {name} | `{' '.join(flags)}" in text, name
    for row in study.POWER:
        assert (f"| {row['steps']} | {row['evals']} | {row['power']:.2f} | {row['rmse_fit']:.4f} | "
                f"{row['rmse_constant']:.4f} | {row['rmse_persistence']:.4f} |") in text, row
    assert study.STEPS2 == min(r["steps"] for r in study.POWER if r["power"] >= 0.8)
    for phrase in ("both p <= 0.05", "Spearman", "120 orders", "+-0.02", "(step 300)", "steps 560, 580, 600"):
        assert phrase in text, phrase


def test_study_figure2_report_recomputes_from_its_own_series(tmp_path):
    """Synthetic second study (3 recipes x 3 seeds, 600 steps, an eval every 20): every final_mean3, the skill
    test's p-values, the ranking's rho and p and each A comparison recomputed here from figure2_report.json's runs
    by formulas written out."""
    steps = np.arange(0, 601, 20.0)
    for name, A in (("scalerl", 0.80), ("grpo", 0.70), ("dapo", 0.76)):
        for seed in (20, 21, 22):
            R = study_curve(steps * 128, A + 0.003 * (seed - 21), 2.0, 40 * 128.0, 0.25, seed)
            write_run(tmp_path / f"{name}-s{seed}", steps * 2.0, R, steps=steps, config={"prompts": 16, "samples": 8})
    study.write_figure2_report(str(tmp_path), ["scalerl", "grpo", "dapo"], (20, 21, 22), 600)
    rep = json.loads((tmp_path / "figure2_report.json").read_text())
    recompute_figure2_report(rep)
    assert rep["ranking"]["methods"] == ["scalerl", "grpo", "dapo"] and rep["skill"]["n"] == 9
    assert {a["X"]: a["verdict"] for a in rep["a_rule"]}["grpo"] == "lower by more than 0.02"
    assert (tmp_path / "figure2.png").read_bytes()[:4] == b"\x89PNG"
    # the words: the skill verdict beside the power the protocol simulated for this length, the runs' code
    text = (tmp_path / "figure2.md").read_text()
    power = next(r["power"] for r in study.POWER if r["steps"] == 600)
    assert f"(its power at 600 steps, by the protocol's simulation: {power:.2f})." in text
    assert "The runs' code: unknown (9 runs)." in text and "3 recipes x 3 seeds" in text
    assert "each ran synchronous and on-policy" in text  # --method grpo's PPO-off-policy needs torchrun
    for row in rep["recipes"]:  # every interval in the table, as the report holds it
        assert (f"| {row['recipe']} | 3 | " + " | ".join(f"{row[k]:{f}} ({row[k + '_ci95'][0]:{f}} to "
                                                         f"{row[k + '_ci95'][1]:{f}})" for k, f in (
            ("final_mean3", ".3f"), ("A", ".3f"), ("B", ".2f"), ("C_mid", ".3g"))) + " |") in text, row


def test_study_figure2_committed_report_recomputes_and_readme_says_what_its_tests_allow():
    """assets/figure2_report.json, the second study as it ran: every (recipe, seed) of its frozen protocol, each
    number recomputed from the runs' own series (recompute_figure2_report), and README's words on it the verdicts
    the report holds, each with its numbers as the report rounds them."""
    rep = json.loads((ROOT / "assets" / "figure2_report.json").read_text())
    recompute_figure2_report(rep)
    assert not rep["quick"] and rep["protocol"] == study.protocol_record(study.PROTOCOL2, study.PROTOCOL2_CHAIN)
    assert sorted((r["recipe"], r["seed"]) for r in rep["runs"]) == sorted(
        itertools.product(study.FIGURE2, study.SEEDS2)) and rep["steps"] == study.STEPS2
    assert all(len(r["series"]) == study.STEPS2 // study.EVAL_EVERY2 + 1 for r in rep["runs"])
    assert (ROOT / "assets" / "figure2.png").read_bytes()[:4] == b"\x89PNG"
    text = " ".join((ROOT / "README.md").read_text().split())
    sk, rk = rep["skill"], rep["ranking"]
    power = next(r["power"] for r in study.POWER if r["steps"] == rep["steps"])
    assert (f"{'skill shown' if sk['skill'] else 'no skill shown'}: at half the compute the fit misses the runs' "
            f"ends by RMSE {sk['rmse_fit']:.4f}, against {sk['rmse_constant']:.4f} for the constant") in text
    assert (f"and {sk['rmse_persistence']:.4f} for persistence (one-sided paired p {study.show(sk['p_constant'])} "
            f"and {study.show(sk['p_persistence'])}") in text and f"a power of {power:.2f}" in text
    assert f"Spearman {rk['rho']:.2f} (exact p {study.show(rk['p'])}): {rk['verdict']}" in text
    for a in rep["a_rule"]:
        lo, hi = a["ci95"]
        assert f"{a['X']} {a['diff_A']:+.3f} ({lo:+.3f} to {hi:+.3f}): {a['verdict']}" in text, a
    # the descriptive numbers beside them: the half-compute fits' mean error and A against the whole runs'
    cut = [(q, r) for r in rep["runs"] if not r["collapsed"] for q in r["predictions"] if q and q["cut"] == 0.5]
    under = -np.mean([q["predicted"] - r["final_mean3"] for q, r in cut])
    assert (f"fall under the ends by {under:.3f} on average (their A {np.mean([q['A'] for q, _ in cut]):.3f} "
            f"against {np.mean([r['A'] for _, r in cut]):.3f} fitted on whole runs)") in text
    best = max(rep["recipes"], key=lambda row: row["final_mean3"])
    assert best["recipe"] == "scalerl" == max(rep["recipes"], key=lambda row: row["A"])["recipe"]
    assert f"(final_mean3 {best['final_mean3']:.3f}; A {best['A']:.3f}, 95% interval {best['A_ci95'][0]:.3f}" in text


def recompute_figure2_report(rep):
    """A second study's report (figure2_report.json) against formulas written out from its own runs: every
    final_mean3 from its series, the skill test's p-values (paired, one-sided, fit against the constant and
    persistence at the cut, collapsed runs left out), the ranking's rho and exact p, each A comparison."""
    runs_, seeds = rep["runs"], rep["seeds"]
    finals = {(r["recipe"], r["seed"]): np.mean([e["pass_rate"] for e in r["series"]][-3:]) for r in runs_}
    assert all(r["final_mean3"] == pytest.approx(finals[(r["recipe"], r["seed"])]) for r in runs_)
    rows = [(next(p for p in r["predictions"] if p and p["cut"] == 0.5), r["final_mean3"]) for r in runs_
            if not r["collapsed"]]
    const = [(sum(finals.values()) - m) / (len(finals) - 1) for _, m in rows]
    fit_sq = [(p["predicted"] - m) ** 2 for p, m in rows]
    assert rep["skill"]["n"] == len(rows)
    assert rep["skill"]["p_constant"] == pytest.approx(
        paired_p_by_hand(np.subtract([(c - m) ** 2 for c, (_, m) in zip(const, rows)], fit_sq), 0.0))
    assert rep["skill"]["p_persistence"] == pytest.approx(
        paired_p_by_hand(np.subtract([(p["persistence"] - m) ** 2 for p, m in rows], fit_sq), 0.0))
    mean = lambda name, get: np.mean([get(r) for r in runs_ if r["recipe"] == name])  # noqa: E731
    methods = rep["ranking"]["methods"]
    predicted = [mean(n, lambda r: next(p for p in r["predictions"] if p and p["cut"] == 0.5)["predicted"])
                 for n in methods]
    measured = [mean(n, lambda r: r["final_mean3"]) for n in methods]
    rho = stats.spearmanr(predicted, measured).statistic
    assert rep["ranking"]["rho"] == pytest.approx(rho) and rep["ranking"]["p"] == pytest.approx(
        np.mean([stats.spearmanr(predicted, o).statistic >= rho - 1e-12 for o in itertools.permutations(measured)]))
    for row in rep["recipes"]:  # seed means and their 95% t intervals
        for key in ("final_mean3", "A", "B", "C_mid"):
            v = [r[key] for r in runs_ if r["recipe"] == row["recipe"]]
            half = stats.t.ppf(0.975, len(v) - 1) * np.std(v, ddof=1) / math.sqrt(len(v))
            assert row[key] == pytest.approx(np.mean(v)) and row[f"{key}_ci95"] == pytest.approx(
                [np.mean(v) - half, np.mean(v) + half]), (row["recipe"], key)
    for a in rep["a_rule"]:
        d = [next(r["A"] for r in runs_ if (r["recipe"], r["seed"]) == (a["X"], s)) -
             next(r["A"] for r in runs_ if (r["recipe"], r["seed"]) == (a["Y"], s)) for s in seeds]
        assert a["diff_A"] == pytest.approx(np.mean(d))
        assert a["verdict"] == ("higher by more than 0.02" if np.mean(d) > 0.02 else "lower by more than 0.02"
                                if np.mean(d) < -0.02 else "within +-0.02")


def test_study_figure2_ranking_and_a_rule_by_hand():
    """Spearman's rho with its exact one-sided p over every order, and the +-0.02 rule on A, written out."""
    rho, p = study.spearman_test([0.1, 0.4, 0.3, 0.2, 0.5], [0.6, 0.9, 0.8, 0.7, 1.0])
    assert rho == pytest.approx(1.0) and p == pytest.approx(1 / 120)
    x, y = [0.3, 0.1, 0.2, 0.5, 0.4], [0.2, 0.1, 0.3, 0.5, 0.4]
    rho, p = study.spearman_test(x, y)
    assert rho == pytest.approx(stats.spearmanr(x, y).statistic)
    assert p == pytest.approx(np.mean([stats.spearmanr(x, o).statistic >= rho - 1e-12
                                       for o in itertools.permutations(y)]))
    runs = lambda As: {"runs": [{"seed": s, "fit": {"A": a}} for s, a in zip((20, 21, 22), As)]}  # noqa: E731
    table = {"dapo": runs([0.70, 0.72, 0.71]), "scalerl": runs([0.75, 0.74, 0.76]), "grpo": runs([0.74, 0.75, 0.75])}
    assert study.a_rule(table, "dapo", "scalerl")["verdict"] == "lower by more than 0.02"
    got = study.a_rule(table, "grpo", "scalerl")
    assert got["verdict"] == "within +-0.02" and got["diff_A"] == pytest.approx(-0.0033333333) and got["pairs"] == 3


def test_study_ctrl_c_stops_runs_as_interrupted_and_the_same_command_continues_them(tmp_path, capsys, monkeypatch):
    """Ctrl-C on the study (a KeyboardInterrupt in its wait, once the run has logged step 2): the run gets SIGINT,
    saves its step and stops; the study names it "interrupted" (not "failed"), prints the command to continue
    and exits 130. Run again, it continues from that checkpoint (--resume): steps 1-6 each logged once."""
    commands, real_sleep = [], time.sleep
    study_runs_as(monkeypatch, lambda cmd, stdout, env, **kw: (
        commands.append(cmd), ForkedRun(fork_command(cmd, stdout.name, env=env)))[1])
    out, run = tmp_path / "study", tmp_path / "study" / "scalerl-s0"
    quick = ["--prompts", "4", "--samples", "4", "--eval_every", "1", "--eval_samples", "1", "--save_every", "0"]

    def ctrl_c(seconds):  # the terminal's Ctrl-C, once, with the run under way
        if not commands[1:] and study.last_step(run) >= 2:
            commands.append("ctrl-c")
            raise KeyboardInterrupt
        real_sleep(seconds)
    monkeypatch.setattr(study.time, "sleep", ctrl_c)
    with pytest.raises(SystemExit) as stopped:
        study.train_all(str(out), {"scalerl": []}, (0,), 6, 1000, quick, held_out=8, again="python study.py X")
    said = capsys.readouterr().out
    saved = runs.checkpoints(run)
    assert stopped.value.code == 130 and "failed" not in said and len(saved) == 1, said
    step = runs.step_of(saved[0])
    assert 2 <= step < 6 and not study.finished(run, 6)
    assert f"study: scalerl seed 0 interrupted at step {step}/6; saved: {saved[0]}" in said
    assert "study: interrupted; continue with: python study.py X" in said
    assert "--overwrite" in commands[0] and "--resume" not in commands[0]
    assert study.train_all(str(out), {"scalerl": []}, (0,), 6, 1000, quick, held_out=8) == []
    assert "--resume" in commands[-1] and "--overwrite" not in commands[-1]
    assert "(continued from its last checkpoint)" in capsys.readouterr().out and study.finished(run, 6)
    assert [r["step"] for r in map(json.loads, open(run / "metrics.jsonl")) if r["kind"] == "train"] == [1, 2, 3, 4,
                                                                                                        5, 6]
    assert study.run_minutes(run) > 0


def test_study_ctrl_c_leaves_no_traceback_in_a_runs_log_and_ends_it_with_one_line(tmp_path, capsys, monkeypatch):
    """A run still starting (no signal handler yet, as train.py importing torch) took the terminal's and the study's
    SIGINT as a KeyboardInterrupt: its log ended in a traceback. Runs start in their own session (the terminal's
    Ctrl-C reaches the study alone), are stopped by SIGTERM, and their log ends with the study's one line."""
    popen, kwargs = subprocess.Popen, []
    # Python's own start-up SIGINT (a shell's background job starts with it ignored)
    start = "import signal, time\nsignal.signal(signal.SIGINT, signal.default_int_handler)\nprint('starting', " \
            "flush=True)\ntime.sleep(60)"
    monkeypatch.setattr(study, "run_command", lambda *a: [sys.executable, "-c", start])
    monkeypatch.setattr(study.subprocess, "Popen", lambda cmd, **kw: (kwargs.append(kw) if cmd[0] != "git" else None,
                                                                      popen(cmd, **kw))[1])
    out, real_sleep, pressed = tmp_path / "study", time.sleep, []

    def ctrl_c(seconds):  # the terminal's Ctrl-C, once, in the study's wait (0.2 s) when the run has started
        if not pressed and seconds >= 0.1 and "starting" in (out / "scalerl-s0.log").read_text():
            pressed.append(time.time())
            raise KeyboardInterrupt
        real_sleep(seconds)
    monkeypatch.setattr(study.time, "sleep", ctrl_c)
    with pytest.raises(SystemExit) as stopped:
        study.train_all(str(out), {"scalerl": []}, (0,), 6, 1000, held_out=8, again="python study.py X")
    assert stopped.value.code == 130 and kwargs[0].get("start_new_session") is True
    assert time.time() - pressed[0] < 30  # ended by the study's signal, not killed after its 120 s wait
    log = (out / "scalerl-s0.log").read_text()
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
    assert log.splitlines() == ["starting", "study: scalerl seed 0 stopped by the study's Ctrl-C at step 0/6; saved: "
                                "nothing yet; the same study command continues it"], log


def test_study_a_failed_run_is_named_when_the_other_has_no_folder_yet(tmp_path, capsys):
    """A run that fails at once stops the study with its own message and log, even when the run beside it has
    not made its folder yet (nothing to save there)."""
    ended = types.SimpleNamespace(poll=lambda: 0, send_signal=lambda s: None, kill=lambda: None)
    other = dict(name="batch32", seed=0, path=str(tmp_path / "batch32-s0"), proc=ended, start=time.time(),
                 before=0.0)
    with pytest.raises(SystemExit) as stopped:
        study.stop_study([other], lambda r: 0.1, 6, None, "scalerl seed 0 failed (exit 1; its log: x.log)", 1)
    said = capsys.readouterr().out
    assert stopped.value.code == 1 and "study: scalerl seed 0 failed (exit 1; its log: x.log)" in said
    assert "batch32 seed 0 interrupted at step 0/6; saved: nothing yet" in said
    assert not (tmp_path / "batch32-s0").exists()


def test_study_reads_only_regular_files_and_names_the_one_that_is_not(tmp_path):
    """A run's study_minutes.json linked to /dev/zero was read without end, and as a FIFO hung the study (its
    report, and a continued run's start, read it); its metrics.jsonl as a FIFO read as "not finished". Each stops
    the study in one line naming the file, before a byte of it is read."""
    for name in ("scalerl", "batch32"):  # --quick's runs, finished
        steps = np.arange(7.0)
        write_run(tmp_path / f"{name}-s0", steps, 0.3 + 0.05 * steps, steps=steps)
    run = tmp_path / "scalerl-s0"
    for name, kind in (("study_minutes.json", "a device"), ("study_minutes.json", "a FIFO"),
                       ("metrics.jsonl", "a FIFO")):
        kept = (run / name).read_bytes() if (run / name).is_file() else b"1.5"
        special_file(run / name, kind)
        code, said = run_capped([tmp_path, "--quick", "--report"], tmp_path / "study.log", script="study.py")
        # a link to /dev/zero is refused as a link (a study's own file), before its target is looked at
        why = runs.NOT_THROUGH_A_LINK if (run / name).is_symlink() else f"not a regular file ({kind})"
        assert code == 1 and said.strip().splitlines()[-1].startswith(f"study: error: {run / name}: {why}"), said[-600:]
        os.remove(run / name)
        (run / name).write_bytes(kept)


def test_study_report_names_the_file_line_and_field_of_a_missing_number(tmp_path):
    """An eval line without "flops", or a config line without "prompts", ended the report in a KeyError traceback:
    each is one line naming file:line and the field."""
    names = write_synthetic_study(tmp_path)
    path = tmp_path / "scalerl-s10" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    first_eval = next(i for i, ln in enumerate(lines) if json.loads(ln)["kind"] == "eval")
    for i, field in ((0, "prompts"), (first_eval, "flops"), (first_eval, "step")):
        rec = json.loads(lines[i])
        del rec[field]
        path.write_text("\n".join(lines[:i] + [json.dumps(rec)] + lines[i + 1:]) + "\n")
        with pytest.raises(ValueError) as err:
            study.write_report(str(tmp_path), names, study.SEEDS, 200)
        assert str(err.value) == f"{path}:{i + 1}: missing field '{field}'"



def test_study_quick_takes_steps(tmp_path, monkeypatch):
    """--quick --steps N trains N steps a run (it once kept its 6 whatever --steps said)."""
    seen = []
    monkeypatch.setattr(study, "train_all", lambda out, variants, seeds, steps, *a, **k: seen.append(steps) or [])
    for argv, steps in ((["--quick", "--steps", "3"], 3), (["--quick"], 6)):
        with pytest.raises(SystemExit, match="no variant"):
            study.main([str(tmp_path / str(steps)), *argv])
        assert seen.pop() == steps
        assert json.loads((tmp_path / str(steps) / "settings.json").read_text())["steps"] == steps


def test_study_started_with_sigint_ignored_still_stops_on_it(tmp_path, monkeypatch):
    """A study started in the background (`nohup python study.py ... &`) inherits SIGINT ignored: `kill -INT` did
    nothing (SIGTERM did). SIGINT, SIGTERM and SIGHUP each stop it as Ctrl-C does, the runs saving their step."""
    handlers = []
    monkeypatch.setattr(study, "train_all", lambda *a, **k: handlers.append(
        [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)]) or [])
    before = [signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)]
    try:
        with pytest.raises(SystemExit, match="no variant"):
            study.main([str(tmp_path / "s"), "--quick"])
    finally:
        for s, h in zip((signal.SIGINT, signal.SIGTERM, signal.SIGHUP), before):
            signal.signal(s, h)
    assert handlers == [[signal.default_int_handler] * 3]


def test_study_folder_keeps_its_settings_and_refuses_another_command(tmp_path, monkeypatch):
    """A study folder records the settings it was made with (settings.json, through runs.py's writer); another
    command on it (the full study on the quick study's folder, which silently ran on its 8 held-out problems) is
    refused in one line naming the folder, what differs and the command for another folder. The README's two
    study commands use separate folders."""
    monkeypatch.setattr(study, "train_all", lambda *a, **k: [])  # nothing runs: the settings alone
    out = tmp_path / "study"
    with pytest.raises(SystemExit, match="no variant"):
        study.main([str(out), "--quick"])
    made = json.loads((out / "settings.json").read_text())
    assert made["quick"] is True and made["held_out"] == 8 and made["seeds"] == [0] and made["steps"] == 6
    with pytest.raises(SystemExit, match="no variant"):  # the same command again: accepted
        study.main([str(out), "--quick"])
    for argv, differs in (([str(out)], "quick (True there, False here)"), ([str(out), "--report"], "held_out (8 there, "
                          "2000 here)")):
        with pytest.raises(SystemExit) as refused:
            study.main(argv)
        line = str(refused.value.code)
        assert "\n" not in line and line.startswith(f"study: error: {out} holds a study made with other settings")
        assert differs in line and "another folder: python study.py " in line, line
    assert json.loads((out / "settings.json").read_text()) == made  # never overwritten by the refused command
    readme = (ROOT / "README.md").read_text()
    folders = re.findall(r"^python study\.py (\S+)", readme, re.M)
    assert len(folders) >= 2 and len(set(folders)) == len(folders), folders


def test_study_quick_refuses_to_replace_a_full_studys_assets(tmp_path):
    (tmp_path / "assets").mkdir()
    shutil.copyfile(ROOT / "assets" / "study_report.json", tmp_path / "assets" / "study_report.json")
    with pytest.raises(SystemExit, match="--quick would replace the full study's report"):
        study.main([str(tmp_path / "study"), "--quick", "--assets", str(tmp_path / "assets")])
    assert not (tmp_path / "study").exists()  # refused before anything ran


def test_study_assets_copies_the_report_it_wrote_never_a_file_swapped_in_since(tmp_path, monkeypatch):
    """--assets re-opened study_report.json by path after plotting: a link swapped in meanwhile copied a private key
    stand-in into assets/study_report.json. What is copied is the file the study wrote, or one line naming it."""
    folder, assets, secret = tmp_path / "study", tmp_path / "assets", tmp_path / "id_rsa"
    secret.write_text("PRIVATE KEY")
    monkeypatch.setattr(study, "finished", lambda path, steps: True)
    monkeypatch.setattr(study, "run_minutes", lambda path: 1.0)
    swaps = [False, True]

    def write_report(out, *args):  # the report's files, then (the first time) the swap, as while it plotted
        for name in ("report.md", "study_report.json", "study.png", "study_extrap.png"):
            runs.replace_file(os.path.join(out, name), lambda f: f.write(f"{name} as written"))
        if swaps.pop():
            os.rename(folder / "study_report.json", folder / "moved.json")
            (folder / "study_report.json").symlink_to(secret)
        return "report"
    monkeypatch.setattr(study, "write_report", write_report)
    with pytest.raises(SystemExit, match=rf"^error: {folder}/study_report.json was replaced since it was written"
                                         r"[^\n]*$"):
        study.main([str(folder), "--report", "--assets", str(assets)])
    assert "PRIVATE KEY" not in "".join(p.read_text() for p in assets.iterdir())
    study.main([str(folder), "--report", "--assets", str(assets)])
    assert {p.name: p.read_text() for p in assets.iterdir()} == {
        name: f"{name} as written" for name in ("study_report.json", "study.png", "study_extrap.png")}


def fake_study_runs(monkeypatch, minutes, log_steps=False):
    """study.subprocess.Popen replaced by runs that take `minutes` of a fake clock (advanced by each sleep)
    and then write their last eval (log_steps: a train line per step as they go, at an even pace) -> (the clock,
    the started runs as (command, start, end), live count)."""
    clock, started = [0.0], []

    class FakeRun:
        def __init__(self, cmd, **_):
            self.cmd, self.start, self.end, self.done = cmd, clock[0], clock[0] + 60 * minutes, False
            started.append([cmd, clock[0], None])
            live = sum(r[2] is None for r in started)
            assert live <= 2  # two cores

        def poll(self):
            if clock[0] < self.end:
                if log_steps:
                    out, steps = self.cmd[self.cmd.index("--out") + 1], int(self.cmd[self.cmd.index("--steps") + 1])
                    done = int(steps * (clock[0] - self.start) / (self.end - self.start))
                    write_eval_lines(out, [{"kind": "train", "step": k} for k in range(1, done + 1)])
                return None
            if not self.done:
                out, steps = self.cmd[self.cmd.index("--out") + 1], int(self.cmd[self.cmd.index("--steps") + 1])
                write_eval_lines(out, [{"kind": "eval", "step": steps, "compute_s": 1.0, "flops": 1.0,
                                        "pass_rate": 0.5}])
                next(r for r in started if r[0] is self.cmd)[2], self.done = clock[0], True
            return 0

    study_runs_as(monkeypatch, FakeRun)
    monkeypatch.setattr(study.time, "time", lambda: clock[0])
    # the study's waits (0.2 s) a minute each; subprocess's own polls (git's, at most 0.05 s) none
    monkeypatch.setattr(study.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + 60 * (s >= 0.1)))
    return clock, started


def test_study_budget_leaves_out_the_variants_that_would_not_fit(tmp_path, monkeypatch):
    """Variants run in priority order, one-process runs two at a time; one starts only if its seeds fit in
    what is left at the pace so far (a run's machine-minutes: its wall-clock x its share of the 2 cores)."""
    clock, started = fake_study_runs(monkeypatch, 20)  # 20 min on one core: 10 machine-minutes
    variants = {"scalerl": [], "batch8": ["--prompts", "8"], "no_npr": ["--no-no_positive_resampling"]}
    assert study.train_all(str(tmp_path), variants, (0, 1, 2), 5, budget_min=65, held_out=16) == ["no_npr"]
    assert [c[c.index("--seed") + 1] for c, _, _ in started] == ["0", "1", "2"] * 2
    assert [start for _, start, _ in started] == [0, 0, 1200, 1200, 2400, 2400]  # two at a time
    assert clock[0] == 3600 and study.run_minutes(tmp_path / "scalerl-s0") == 10
    assert study.train_all(str(tmp_path), variants, (0, 1, 2), 5, budget_min=65, held_out=16) == ["no_npr"]
    assert len(started) == 6  # finished runs cost nothing and are not run again; no_npr would end at 90 > 65


def test_study_overall_eta_is_within_2x_of_the_time_it_took(tmp_path, monkeypatch, capsys):
    """Each run's start line says the minutes so far and an overall ETA: from the first run's end on, so far + ETA
    is within 2x of the whole study's time (fake runs of 20 min on one core, two at a time)."""
    clock, started = fake_study_runs(monkeypatch, 20)
    variants = {"scalerl": [], "batch8": ["--prompts", "8"], "no_npr": []}
    study.train_all(str(tmp_path), variants, (0, 1, 2), 5, budget_min=1000, held_out=16)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("study: [")]
    assert len(lines) == 9 and "an ETA once a run has logged a step" in lines[0]
    total = clock[0] / 60
    guesses = [float(a) + float(b) for a, b in
               (re.search(r"\| ([\d.]+) min so far, .* about (\d+) min left", ln).groups() for ln in lines[2:])]
    assert len(guesses) == 7 and all(total / 2 <= g <= total * 2 for g in guesses), (guesses, total)


def test_study_overall_eta_comes_from_the_first_runs_pace_before_any_run_ends(tmp_path, monkeypatch, capsys):
    """Before any run has ended, the overall ETA comes from the running runs' pace (steps logged against their
    machine-minutes): every progress line from the first step on says "about N min left", with so far + ETA within
    2x of the whole study's time; the quick study's shape (every run started at once) said "about 0 min left"."""
    for variants, seeds in (({"scalerl": [], "batch8": ["--prompts", "8"], "no_npr": []}, (0, 1, 2)),
                            ({"scalerl": [], "batch32": ["--prompts", "32"]}, (0,))):
        clock, _ = fake_study_runs(monkeypatch, 20, log_steps=True)
        study.train_all(str(tmp_path / str(len(seeds))), variants, seeds, 20, budget_min=1000, held_out=16)
        said, total = capsys.readouterr().out.splitlines(), clock[0] / 60
        first_end = next(i for i, ln in enumerate(said) if " done in " in ln)
        progress = [ln for ln in said[:first_end] if re.match(r"study: [\d.]+ min \|", ln)]
        assert len(progress) >= 10 and all("min left" in ln for ln in progress), said[:first_end]
        guesses = [float(a) + float(b) for a, b in
                   (re.search(r"^study: ([\d.]+) min \|.* about (\d+) min left", ln).groups() for ln in progress)]
        assert all(total / 2 <= g <= total * 2 for g in guesses), (guesses, total)


def test_study_runs_carry_their_start_time_and_code_commit_into_the_report(tmp_path, monkeypatch):
    """Each run records when it started and the code's commit (study_run.json, a continued run adds its start);
    the report's runs carry them. The commit is git's own answer for this checkout."""
    clock, _ = fake_study_runs(monkeypatch, 20)
    clock[0] = 1.8e9
    study.train_all(str(tmp_path), {"scalerl": []}, (10,), 200, budget_min=1000, held_out=16)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (start,) = json.loads((tmp_path / "scalerl-s10" / "study_run.json").read_text())
    assert start["started"] == "2027-01-15T08:00:00Z" and start["commit"] == head and isinstance(start["dirty"], bool)
    names = write_synthetic_study(tmp_path)
    study.write_report(str(tmp_path), names, study.SEEDS, 200)
    runs_ = {(r["variant"], r["seed"]): r for r in json.loads((tmp_path / "study_report.json").read_text())["runs"]}
    assert runs_[("scalerl", 10)]["starts"] == [start] and runs_[("no_npr", 10)]["starts"] == []


def test_study_report_records_every_protocol_commit_with_its_files_hash():
    """The report recorded the first protocol commit beside the SHA-256 of the amended file: now the chain, each
    commit with the SHA-256 of the file as that commit holds it (git's own copy), the last one today's file."""
    rec = study.protocol_record()
    assert [c["commit"][:7] for c in rec["chain"]] == ["1b3775d", "8a32913"] and rec["frozen"]
    for link in rec["chain"]:
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{link['commit']}:{study.PROTOCOL}"],
                              capture_output=True, check=True).stdout
        assert hashlib.sha256(text).hexdigest() == link["sha256"] and link["what"]
    assert rec["sha256"] == rec["chain"][-1]["sha256"] == hashlib.sha256((ROOT / study.PROTOCOL).read_bytes()).hexdigest()


def test_study_words_on_predictability_are_what_the_paired_test_allows():
    """README's "only 75% gives it skill" and docs/reference.md's "skill at 75% alone" rested on RMSE 0.0129 against
    0.0147: a paired t-test of the squared errors (fit against the constant) recomputed from the committed report
    shows skill at no cut (p 0.52 at 75%), and the words say so."""
    rep = json.loads((ROOT / "assets" / "study_report.json").read_text())
    finals = np.array([r["final_mean3"] for r in rep["runs"]])
    p = {}
    for cut in (0.4, 0.5, 0.6, 0.75):
        rows = [(q["predicted"], r["final_mean3"]) for r in rep["runs"] for q in r["predictions"] if q and q["cut"] == cut]
        fit_sq = np.array([(g - m) ** 2 for g, m in rows])
        const_sq = np.array([((finals.sum() - m) / (len(finals) - 1) - m) ** 2 for _, m in rows])
        p[cut] = stats.ttest_rel(fit_sq, const_sq).pvalue
        assert not (p[cut] <= 0.05 and fit_sq.mean() < const_sq.mean())  # no cut shows skill
    assert f"{p[0.75]:.2f}" == "0.52"
    for doc in ("README.md", "docs/reference.md"):
        text = " ".join((ROOT / doc).read_text().split())
        assert "no skill shown at any cut" in text and "p 0.52" in text, doc
        assert "gives it skill" not in text and "skill at 75% alone" not in text, doc


def test_study_power_by_simulation_shows_skill_where_recipes_differ_and_noise_is_small():
    """simulate_power: truth curves (sigmoids on samples) evaluated with binomial noise, each fitted at the cut;
    recipes that end far apart (A 0.5 to 0.9) with almost no noise: the fit beats the constant (the other runs'
    mean end) in every simulated study; the same seed gives the same answer; the skill test is the one-sided paired
    t-test of squared errors written out, against both baselines."""
    truth = [dict(A=a, B=2.0, C_mid=30 * 128.0, R0=0.2) for a in (0.5, 0.6, 0.7, 0.8, 0.9, 0.55, 0.75)]
    got = study.simulate_power(truth, 400, n_eval=10 ** 8, reps=2)
    assert got["power"] == 1.0 and got["rmse_fit"] < 0.002 < 0.1 < got["rmse_constant"], got
    assert study.simulate_power(truth, 400, n_eval=10 ** 8, reps=2) == got and got["runs"] == 7
    fit_sq, const_sq, pers_sq = [0.1, 0.2, 0.05, 0.3], [0.5, 0.4, 0.6, 0.9], [0.2, 0.25, 0.1, 0.2]
    t = study.skill_test(fit_sq, const_sq, pers_sq)
    assert t["p_constant"] == pytest.approx(paired_p_by_hand(np.subtract(const_sq, fit_sq), 0.0))
    assert t["p_persistence"] == pytest.approx(paired_p_by_hand(np.subtract(pers_sq, fit_sq), 0.0))
    assert t["skill"] == (t["p_constant"] <= 0.05 and t["p_persistence"] <= 0.05) and t["p_constant"] < 0.05


def test_plots_extrapolation_draws_the_fit_solid_to_the_cut_and_dashed_beyond(tmp_path):
    """Figure 2's form on synthetic recipes: the fitted curve solid from the first fitted point to the cut, dashed
    from the cut to the run's end, each on the curve it was given; a PNG."""
    C = np.arange(0, 401, 20) * 128.0
    recipes = [dict(name=n, C=C, R=fit.sigmoid(C, a, 2.0, 4000.0, 0.2), fit_from=0.1 * C[-1],
                    curve=lambda x, a=a: fit.sigmoid(x, a, 2.0, 4000.0, 0.2)) for n, a in (("scalerl", 0.8),
                                                                                        ("grpo", 0.6))]
    drawn = plots.draw_extrapolation(recipes, str(tmp_path / "f.png"), 0.5, "samples", "pass rate", "t")
    for name, (solid, dashed) in drawn.items():
        assert solid[0] == pytest.approx(0.1 * C[-1]) and solid[-1] == pytest.approx(0.5 * C[-1])
        assert dashed[0] == pytest.approx(0.5 * C[-1]) and dashed[-1] == pytest.approx(C[-1])
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"


def test_study_quick_report_says_quick_and_names_its_command(tmp_path):
    """The quick study's report called itself "The confirmatory ... study" and named the command without --quick."""
    names = write_synthetic_study(tmp_path, seeds=(0,))[:1]
    quick = study.write_report(str(tmp_path), names, (0,), 200, quick=True).splitlines()
    assert quick[0] == study.QUICK_NOTE and quick[2].startswith("# The quick study") and "confirmatory" not in quick[2]
    assert f"Written by `python study.py {tmp_path} --quick`" in quick[4]
    full = study.write_report(str(tmp_path), names, (0,), 200).splitlines()
    assert full[0].startswith("# The confirmatory") and f"Written by `python study.py {tmp_path}`" in full[2]


def test_study_one_seed_decides_nothing_and_no_prediction_without_points_before_the_cut(tmp_path):
    steps = np.array([0.0, 30, 60, 140, 160, 180, 200])  # up to the cut (100): one point from step 20 on
    for name, A in (("scalerl", 0.8), ("agg_sample", 0.7)):
        write_run(tmp_path / f"{name}-s10", steps, fit.sigmoid(steps, A, 2.0, 30, 0.3), steps=steps)
    text = study.write_report(str(tmp_path), ["scalerl", "agg_sample"], (10,), 200)
    rep = json.loads((tmp_path / "study_report.json").read_text())
    (agg,) = rep["findings"]
    # X ahead by about 0.1 at the end, but one pair: not decided, and no p without a spread
    assert agg["finding"] == "loss aggregation" and agg["verdict"].startswith("not decided")
    assert agg["pairs"] == 1 and agg["p"] is None and agg["p_holm"] is None
    assert agg["x"][0] - agg["y"][0] == pytest.approx(np.mean(fit.sigmoid(steps[-3:], 0.8, 2.0, 30, 0.3) -
                                                              fit.sigmoid(steps[-3:], 0.7, 2.0, 30, 0.3)))
    main = next(p for p in rep["predictability"]["by_cut"] if p["cut"] == 0.5)
    assert main["n"] == 0 and main["rmse_fit"] is None and not rep["predictability"]["skill"]
    assert "No run could be checked" in text

# =============================================================================
# pipeline.py: generator and trainer ranks (gloo, spawned processes)


def test_pipeline_pack_unpack_round_trip():
    s = [gen.Sample(0, [5, 7, 0], [-0.5, -1.25, -2.0], [1, 1, 0], [3, 4, 4], "eos"),
         gen.Sample(1, [150000, 9], [-0.375, 0.0], [1, 0], [4, 4], "truncated")]
    group = {"gi": 41, "index": 17, "prompt": [1, 2, 3], "samples": s, "correct": [True, False],
             "rewards": [0.75, -1.0]}
    rows = ranks.pack_group(3, group, length=8)
    assert rows.shape == (2, ranks.HEADER + 4 * 8) and rows.dtype == torch.float32
    g = ranks.unpack_group(rows)
    assert (g["gen_rank"], g["gi"], g["index"], g["prompt"], g["correct"], g["rewards"]) == \
        (3, 41, 17, [1, 2, 3], [True, False], [0.75, -1.0])
    for a, b in zip(s, g["samples"]):
        assert (a.tokens, a.logps, a.mask, a.versions, a.finish) == (b.tokens, b.logps, b.mask, b.versions, b.finish)
    with pytest.raises(ValueError, match="cannot pack"):
        ranks.pack_group(0, dict(group, prompt=[1] * 7), length=8)


def rank_facts(hosts, devices, gpus=None, cuda=True, gens=1):
    """ranks.local_facts as each rank would report it: its host, device index and GPU identity (by
    default a GPU per (host, device))."""
    gpus = gpus or [f"{h}/{d}" for h, d in zip(hosts, devices)]
    return [{"host": h, "cuda": cuda, "gens": gens, "device": d if cuda else None, "gpu": g if cuda else None}
            for h, d, g in zip(hosts, devices, gpus)]


def test_pipeline_device_plan_round_robin_and_gloo_where_ranks_share_a_gpu():
    """(Its plan now comes from every rank's facts, gathered by rank 0: host, LOCAL_RANK's device, GPU UUID.)"""
    plan = ranks.device_plan
    one = plan(rank_facts(["a", "a"], [0, 0]), [0], [1])  # one GPU, two ranks: both on it; the weights group must avoid nccl
    assert one["name"] == ["cuda:0", "cuda:0"] and (one["weights"], one["trainers"]) == ("gloo", "nccl")
    assert "share a GPU" in one["line"] and "weight broadcast over gloo" in one["line"]
    eight = plan(rank_facts(["a"] * 8, range(8)), [0, 1, 2, 3, 4, 5], [6, 7])  # a full node: one GPU each, nccl everywhere
    assert eight["devices"] == list(range(8)) and {eight["weights"], eight["trainers"]} == {"nccl"}
    four = plan(rank_facts(["a"] * 4, [0, 1, 0, 1]), [0, 1], [2, 3])  # 4 ranks on 2 GPUs: 0,1,0,1
    assert four["devices"] == [0, 1, 0, 1]
    assert (four["trainers"], four["weights"]) == ("nccl", "gloo")  # 0 and 2 share GPU 0
    nodes = plan(rank_facts(["a", "a", "b", "b"], [0, 0, 0, 0]), [0, 2], [1, 3])  # 2 nodes x 1 GPU: 0 and 2 on different machines
    assert nodes["devices"] == [0, 0, 0, 0] and nodes["trainers"] == "nccl" and nodes["weights"] == "gloo"
    cpu = plan(rank_facts(["a"] * 3, [0] * 3, cuda=False), [0], [1, 2])
    assert cpu["name"] == ["cpu"] * 3 and {cpu["weights"], cpu["trainers"]} == {"gloo"}


def test_ranks_device_from_local_rank_and_slurm_one_gpu_per_task_keeps_nccl(monkeypatch):
    """A rank's GPU is its LOCAL_RANK's (it was (RANK % LOCAL_WORLD_SIZE) % GPUs: wrong where nodes run different
    numbers of ranks); under SLURM's one GPU per task every rank sees one GPU, cuda:0, and the plan told that
    apart from ranks sharing one by nothing: it sent the weights and gradients over gloo. The GPU's UUID tells."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(uuid=f"GPU-{d}"))
    monkeypatch.setenv("RANK", "9")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # RANK % LOCAL_WORLD_SIZE is 1
    mine = ranks.local_facts(types.SimpleNamespace(device="auto"), 2)
    assert (mine["device"], mine["gpu"], mine["cuda"], mine["host"]) == (3, "GPU-3", True, socket.gethostname())
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # SLURM's binding: one GPU visible to each rank
    assert ranks.local_facts(types.SimpleNamespace(device="auto"), 2)["device"] == 0
    bound = ranks.device_plan(rank_facts(["a"] * 4, [0] * 4, gpus=["GPU-a", "GPU-b", "GPU-c", "GPU-d"]), [0, 1], [2, 3])
    assert bound["name"] == ["cuda:0"] * 4 and (bound["weights"], bound["trainers"]) == ("nccl", "nccl")
    assert "one GPU per rank" in bound["line"] and "4 GPU(s) over 1 node(s)" in bound["line"]
    shared = ranks.device_plan(rank_facts(["a"] * 4, [0] * 4, gpus=["GPU-a"] * 4), [0, 1], [2, 3])
    assert (shared["weights"], shared["trainers"]) == ("gloo", "gloo") and "share a GPU" in shared["line"]


def test_ranks_srun_without_torchrun_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """`srun python train.py` (SLURM's tasks, no torchrun: no RANK) started that many one-process runs, each
    training alone; now each task stops at once, in one line saying to run torchrun under srun, before --out."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "2")
    with pytest.raises(SystemExit) as stop:
        run_train(toy.toy_model_dir(), tmp_path / "run", "--steps", "1")
    assert re.fullmatch(r"error: started by srun as task 2 of 4 without torchrun: [^\n]*`srun --ntasks-per-node 1 "
                        r"torchrun \.\.\. train\.py \.\.\.`[^\n]*", str(stop.value)), stop.value
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")  # `srun -n 1 python train.py`, and torchrun's ranks: as before
    ranks.check_launcher()
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    monkeypatch.setenv("RANK", "0")
    ranks.check_launcher()


def test_ranks_role_sizing_reaches_the_papers_64_plus_16_and_the_role_map_has_a_line_per_node():
    assert ranks.n_generators(0, 80) == 60  # the default split: 60 + 20
    assert config.get_args(["--gen_ranks", "0.8"]).gen_ranks == 0.8
    assert [ranks.n_generators(0.8, w) for w in (80, 8, 4, 2)] == [64, 6, 3, 1]  # at least one trainer
    assert ranks.n_generators(0.01, 8) == 1 and ranks.n_generators(64, 80) == 64
    with pytest.raises(SystemExit):
        config.get_args(["--gen_ranks", "2.5"])
    hosts = [f"node{r // 8:02d}" for r in range(80)]  # ten 8-GPU nodes, the paper's 80 GPUs
    lines = ranks.role_map(hosts, 80 - ranks.n_generators(0.8, 80))
    assert len(lines) == 10 and lines[0] == "node node00: 8 trainer(s) (ranks 0-7)"
    assert lines[1] == "node node01: 8 trainer(s) (ranks 8-15)"
    assert lines[2] == "node node02: 8 generator(s) (ranks 16-23)" and lines[9].endswith("(ranks 72-79)")
    assert ranks.role_map(["a", "b", "a", "b"], 2) == ["node a: 1 trainer(s) (ranks 0), 1 generator(s) (ranks 2)",
                                                       "node b: 1 trainer(s) (ranks 1), 1 generator(s) (ranks 3)"]
    assert ranks.device_plan(rank_facts(hosts, [r % 8 for r in range(80)]), list(range(16)), list(range(16, 80)))[
        "roles"] == lines


def test_ranks_a_rank_whose_answers_differ_is_named_in_one_line():
    """Each rank decided for itself whether it ran on GPUs and how many generators there were: one that differed
    built other groups than the rest, and they all hung in new_group. Rank 0 decides from every rank's facts."""
    first = rank_facts(["a", "b"], [0, 0])
    assert ranks.disagreement(first[1], first[0]) is None
    gens = ranks.disagreement(dict(first[1], gens=2), first[0])
    assert gens == "--gen_ranks gives 2 generators here, 1 on rank 0 (a): start every node with the same flags"
    cpu = ranks.disagreement(rank_facts(["b"], [0], cuda=False)[0], first[0])
    assert cpu.startswith("this rank runs on the CPU, rank 0 (a) on GPUs: every rank must")


def _faked_gpu_rank(rank, world, port, out):
    """A rank of setup where rank 1 sees a GPU (faked) and rank 0 none: -> out/rank{r}.txt, how it ended."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_ERROR_FILE=str(Path(out, f"error{rank}.json")))
    if rank == 1:
        torch.cuda.is_available, torch.cuda.device_count = (lambda: True), (lambda: 1)
        torch.cuda.get_device_properties = lambda d: types.SimpleNamespace(uuid="GPU-x")
    args = types.SimpleNamespace(gen_ranks=1, prompts=1, samples=1, device="auto", timeout=20, mode="pipeline",
                                 max_lag=8, heartbeat_timeout=30)
    try:
        ranks.setup(args)
        ended = "joined"
    except SystemExit as err:
        ended = f"exit {err.code}"
    except BaseException as err:
        ended = f"raised {type(err).__name__}: {err}"
    Path(out, f"rank{rank}.txt").write_text(ended)


def two_ranks_end(rank_fn, tmp_path):
    """Two forked ranks of rank_fn(rank, world, port, out) -> how each ended (its rank{r}.txt)."""
    torch.multiprocessing.start_processes(rank_fn, args=(2, bench.free_port(), str(tmp_path)), nprocs=2,
                                          start_method="forkserver")
    return [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]


def test_ranks_a_rank_that_differs_stops_every_rank_at_once_instead_of_hanging(tmp_path):
    """Every rank stops at once, exit 2; torchrun's root cause is the rank that differs, saying why in its error
    file (it once said "the same error as rank 0", whose own file held nothing); the other points to it."""
    in_fork(int)  # the fork server started (it imports this file), then the clock
    t0 = time.time()
    ended = two_ranks_end(_faked_gpu_rank, tmp_path)
    assert ended == ["exit 2", "exit 2"], ended
    assert time.time() - t0 < 15  # not the 20 s --timeout of a hang
    said = [json.loads((tmp_path / f"error{r}.json").read_text())["message"] for r in range(2)]
    host = socket.gethostname()
    assert said[1]["message"] == (f"train.py: error: rank 1 on {host}: this rank runs on GPUs, rank 0 ({host}) on "
                                  "the CPU: every rank must (the same GPUs on every node, or --device cpu everywhere)")
    assert said[0]["message"] == "stopped with rank 1, whose start-up check failed (the root cause)"
    assert int(said[0]["extraInfo"]["timestamp"]) > int(said[1]["extraInfo"]["timestamp"])  # torchrun: the earliest


def test_ranks_loopback_master_addr_pins_lo_on_one_machine_only(monkeypatch):
    """The run's store pinned GLOO/NCCL_SOCKET_IFNAME=lo whenever MASTER_ADDR resolved to a loopback address, as the
    head node's name does under Debian's /etc/hosts (127.0.1.1): a run over several nodes then failed to connect.
    Now lo only where the whole run is on one machine; on several nodes one line, unless the interface is set."""
    monkeypatch.setenv("MASTER_ADDR", "head")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # the launcher's store: nothing is bound here
    monkeypatch.setattr(ranks.socket, "getaddrinfo",
                        lambda *a, **k: [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", 29500))])
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as stop:
        ranks.store_address(2, 16, 8)
    assert str(stop.value).startswith(f"error: rank 2 on {socket.gethostname()}: MASTER_ADDR head resolves to "
                                      "127.0.1.1, a loopback address, in a run over several nodes (16 ranks, 8 here)")
    assert "GLOO_SOCKET_IFNAME" not in os.environ and "\n" not in str(stop.value)
    assert ranks.store_address(0, 8, 8) and os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")  # the launcher's store listens everywhere; gloo, nccl on ib0
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    assert ranks.store_address(2, 16, 8) and os.environ["NCCL_SOCKET_IFNAME"] == "ib0"
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")  # but rank 0's own store would listen on 127.0.1.1
    with pytest.raises(SystemExit, match="MASTER_ADDR head resolves to 127.0.1.1, a loopback address"):
        ranks.store_address(2, 16, 8)


def test_runs_a_filesystem_without_locks_is_one_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    """Lustre without -o flock answers flock with ENOSYS (others: EOPNOTSUPP, ENOLCK): the run stopped in a
    traceback. It goes on, saying in one line what that means and what to do."""
    for code in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK):
        def flock(f, how, code=code):
            raise OSError(code, os.strerror(code))
        monkeypatch.setattr(runs.fcntl, "flock", flock)
        out = tmp_path / errno.errorcode[code]
        if code == errno.ENOSYS:  # a whole run, to its end
            assert run_train(toy.toy_model_dir(), out, "--steps", "1", "--eval_every", "1")[-1]["kind"] == "eval"
        else:
            runs.prepare_out_dir(config.get_args(["--out", str(out)]))
        said = [ln for ln in capsys.readouterr().out.splitlines() if "--out" in ln and "lock" in ln]
        assert said == [f"warning: --out {out}: its filesystem cannot lock files ({errno.errorcode[code]}), so "
                        "nothing stops a second run from writing the same --out: start one run per --out (or "
                        "mount the disk with locks, Lustre: -o flock)"], said
    runs.release_lock()


def _layout_rank(rank, world, port, out):
    """setup and meet where the generator's model is bfloat16 and trainer 0's float32 -> out/rank{r}.txt (and what
    it told torchrun: out/error{r}.json)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_ERROR_FILE=str(Path(out, f"error{rank}.json")))
    args = types.SimpleNamespace(gen_ranks=1, prompts=1, samples=1, device="cpu", timeout=20, mode="pipeline",
                                 max_lag=8, heartbeat_timeout=30)
    ctx = ranks.setup(args)
    model = tiny_model(dtype=torch.bfloat16 if rank else torch.float32)
    try:
        ranks.meet(ctx, 0, 8, pipeline.weight_layout(model, 256))
        ended = "met"
    except SystemExit as err:
        ended = f"exit {err.code}"
    Path(out, f"rank{rank}.txt").write_text(ended)
    os._exit(0)  # the heartbeat thread, the group: gone with the process


def test_ranks_weight_broadcast_layout_is_checked_once_at_start(tmp_path):
    """The generator's side of the weight broadcast buckets by its own dtypes with no size check: another model or
    --dtype on a node was garbage weights (or a hang on nccl). Trainer 0's layout goes through the store once."""
    model = tiny_model()
    sent = pipeline.weight_layout(model, 256)
    assert [n for n, _, _ in sent["params"]] == [n for n, _ in model.named_parameters()]
    assert sent["params"][0] == ["model.embed_tokens.weight", [40, 32], "float32"]
    assert ranks.layout_mismatch(sent, pipeline.weight_layout(tiny_model(seed=1), 256)) is None
    assert ranks.layout_mismatch(sent, dict(sent, bucket_mb=64)).startswith("--bucket_mb 64 here, 256 on trainer 0")
    shorter = dict(sent, params=sent["params"][:-1])
    assert f"parameter {len(shorter['params'])} is lm_head.weight (40, 32) float32 on trainer 0 but nothing here" \
        in ranks.layout_mismatch(sent, shorter)
    in_fork(int)  # the fork server started (it imports this file), then the clock
    t0 = time.time()
    ended = two_ranks_end(_layout_rank, tmp_path)
    assert ended == ["exit 2", "exit 2"], ended
    assert time.time() - t0 < 15
    said = [json.loads((tmp_path / f"error{r}.json").read_text())["message"]["message"] for r in range(2)]
    assert said == ["stopped with rank 1, whose start-up check failed (the root cause)",
                    f"train.py: error: rank 1 on {socket.gethostname()}: the weight broadcast does not match: "
                    "parameter 0 is model.embed_tokens.weight (40, 32) float32 on trainer 0 but "
                    "model.embed_tokens.weight (40, 32) bfloat16 here; every rank must load the same --model with "
                    "the same --dtype"], said


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("slots", [1, 16])  # generators slower than the trainer / far faster
def test_pipeline_admission_rule_bounds_the_lag_by_k_and_reaches_it(k, slots):
    """PipelineRL-k run by hand: 2 generators start groups by admit_ok with the weights they hold, a group
    takes 1-12 ticks (one token a tick, stamped with the version of that tick, so long groups finish out of
    order), the trainer takes batch s (groups s*B..s*B+B-1, waiting for late ones) as soon as it is
    complete. The lags read off the stamps never exceed k; with fast generators they reach k exactly
    (the old rule, admitting about k/2 batches ahead, never did)."""
    rng, B, n_gens = random.Random(k * 100 + slots), 4, 2
    version, done, lags, admitted = 0, {}, [], [0] * n_gens
    running = [[] for _ in range(n_gens)]  # per generator: [gi, stamps, length]
    for _ in range(600):
        for g in range(n_gens):
            while len(running[g]) < slots and pipeline.admit_ok(admitted[g] * n_gens + g, version, k, B):
                running[g].append([admitted[g] * n_gens + g, [], rng.randint(1, 12)])
                admitted[g] += 1
            for item in running[g]:
                item[1].append(version)
            for item in [x for x in running[g] if len(x[1]) == x[2]]:
                running[g].remove(item)
                done[item[0]] = item[1]
        batch = range(version * B, version * B + B)
        if all(gi in done for gi in batch):  # one trainer step a tick at most
            lags += [version - min(done.pop(gi)) for gi in batch]
            version += 1
    assert version > 40 and max(lags) <= k
    if slots == 16:
        assert max(lags) == k


def _broadcast_rank(rank, world, port, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    args = types.SimpleNamespace(gen_ranks=world - 1, prompts=1, samples=1, device="cpu", timeout=60,
                                 mode="pipeline", max_lag=8, heartbeat_timeout=30, fsdp=False)
    ctx = ranks.setup(args)
    model = tiny_model(seed=rank)  # every rank starts from different weights
    for bucket_mb in (0, 256):  # one bucket per parameter; everything in one bucket
        if rank == 0:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p))
        if rank == 0:
            pipeline.send_weights(ctx, model, bucket_mb, torch.float32)
        else:
            pipeline.receive_weights(ctx, model, bucket_mb)
        torch.save(model.state_dict(), os.path.join(out, f"rank{rank}-{bucket_mb}.pt"))
    ranks.part(ctx)


def test_pipeline_broadcast_makes_generators_bit_identical(tmp_path):
    torch.multiprocessing.start_processes(_broadcast_rank, args=(3, bench.free_port(), str(tmp_path)), nprocs=3,
                                       start_method="forkserver")  # FORKS' server, with everything imported
    for bucket_mb in (0, 256):
        sent = torch.load(tmp_path / f"rank0-{bucket_mb}.pt")
        assert not torch.equal(sent["lm_head.weight"], tiny_model(seed=0).state_dict()["lm_head.weight"])
        for r in (1, 2):
            got = torch.load(tmp_path / f"rank{r}-{bucket_mb}.pt")
            assert all(torch.equal(sent[k], got[k]) for k in sent)


PIPE_FLAGS = ["--prompts", "4", "--samples", "4", "--val_size", "4", "--eval_samples", "1", "--eval_every", "100",
              "--save_every", "0", "--heartbeat_timeout", "20",
              "--timeout", "120"]


def launch(world, out, *flags, torchrun=False, slow=None, record=None, root=ROOT, env=None):
    """Start `world` ranks of train.py as torchrun would (or with torchrun itself) -> a list of Popen, or of
    Forked (same interface) where no torchrun is asked for; slow: see slow_down, record: see record_groups,
    root: see run_train_py, env: see fork_ranks (forked ranks only)."""
    argv = ["--out", str(out), *PIPE_FLAGS, *flags]
    if torchrun:  # torchrun itself (its flags, agent, store, error files and report) in a process forked from the
        # preloaded server; with --run-path --start-method fork its ranks fork from it and run train.py as __main__
        return [Forked(["--run-path", "--start-method", "fork", "--nproc_per_node", str(world), "--master_port",
                        str(bench.free_port()), str(ROOT / "train.py"), *argv], {},
                       f"{out}-torchrun-{time.time_ns()}.log", script=torch.distributed.run.__file__)]
    return fork_ranks(world, argv, out.parent / out.name, slow, record, root, env)


def fork_ranks(world, argv, logs, slow=None, record=None, root=ROOT, env=None):
    """`world` Forked ranks of `train.py *argv` (argv: a list, or rank -> list), with `env` (a dict, or rank -> dict)
    and the environment torchrun gives them (a free port on the loopback interface); their logs:
    `logs`-rank{r}-{time}.log."""
    port = bench.free_port()
    rank_env = lambda r: dict((env(r) if callable(env) else env) or {}, RANK=str(r), WORLD_SIZE=str(world),
                              LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(port))
    return [Forked(argv(r) if callable(argv) else argv, rank_env(r), f"{logs}-rank{r}-{time.time_ns()}.log", slow,
                   record, root) for r in range(world)]


class ForkedRun:
    """Forked processes (a command's: fork_command) as the one process that study.py polls and kills."""

    def __init__(self, procs):
        self.procs = procs

    def poll(self):  # as torchrun's: the first failure's code once all have ended
        codes = [p.poll() for p in self.procs]
        return None if None in codes else next((c for c in codes if c), 0)

    def kill(self):
        for p in self.procs:
            p.kill()

    def send_signal(self, sig):
        for p in self.procs:
            p.send_signal(sig)


def fork_command(words, log, root=None, env=None):
    """A command's words, `python X.py ...` or torchrun's (`torchrun ...` or `python -m torch.distributed.run
    ...`) with `X.py ...`, run as Forked processes of X.py in root (else X.py's folder, else ROOT), with
    `env` added: one process, its output in `log`, or torchrun's ranks (fork_ranks) -> the list of them."""
    script = next(w for w in words if w.endswith(".py"))
    argv, root = words[words.index(script) + 1:], root or Path(os.path.dirname(script) or ROOT)
    if "torchrun" in words[0] or "torch.distributed.run" in words:
        return fork_ranks(int(words[words.index("--nproc_per_node") + 1]), argv, log, root=root, env=env)
    return [Forked(argv, env or {}, log, root=root, script=os.path.basename(script))]


def finish_all(procs, timeout=240):
    """Wait for every process -> (exit codes, outputs); past the timeout, kill them all and fail."""
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise
    return [p.returncode for p in procs], outs


def train_records(out):
    return [r for r in map(json.loads, open(out / "metrics.jsonl")) if r["kind"] == "train"]


def wait_for_train_records(out, n, procs, timeout=180):
    t0 = time.time()
    while not (out / "metrics.jsonl").exists() or len(train_records(out)) < n:
        assert time.time() - t0 < timeout and all(p.poll() is None for p in procs), "the run stopped or stalled"
        time.sleep(0.2)


def test_pipeline_two_ranks_train_exit_cleanly_and_bound_the_lag_under_a_slow_trainer(tmp_path):
    """(Under torchrun, launcher and ranks fresh interpreters, to a clean exit: the README's first torchrun
    command, test_every_readme_command_runs_in_order_in_a_fresh_clone.)"""
    procs = launch(2, tmp_path, "--steps", "6", "--max_lag", "2", slow=("trainer", 0.6))
    rcs, (out, _) = finish_all(procs)
    assert rcs == [0, 0], out
    recs = train_records(tmp_path)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    assert all(0 <= r["gen_busy"] <= 1 and 0 <= r["train_busy"] <= 1 for r in recs)
    assert recs[-1]["sync_MBps"] > 0 or recs[-2]["sync_MBps"] > 0  # weights moved after the steps
    assert (tmp_path / "ckpt-000006" / "model.safetensors").exists()
    assert "1 trainer + 1 generator ranks, pipeline, max lag 2" in out
    lags = [r["lag_max"] for r in recs]
    assert max(lags) <= 2
    assert max(lags) >= 1  # the generator really ran ahead of the slow trainer


def test_one_process_and_torchrun_sync_are_the_same_experiment(tmp_path, monkeypatch):
    """`python train.py` is generator 0 of 1 under `--mode sync`: one process and two ranks (1 trainer,
    1 generator) sample every step's groups from the same prompts in the same order with the same noise
    keys, and where the arithmetic is the same (one thread each, one trainer) they log the same metrics."""
    flags = ["--steps", "3", "--seed", "5", "--eval_every", "3", "--log_every", "1"]
    rcs, outs = finish_all(launch(2, tmp_path / "ranks", "--mode", "sync", *flags, record=tmp_path / "ranks.jsonl"))
    assert rcs == [0, 0], outs
    monkeypatch.setattr(pipeline, "group_items", record_groups(tmp_path / "one.jsonl"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train.main(config.get_args(["--out", str(tmp_path / "one"), *PIPE_FLAGS, *flags]))
    finally:
        torch.set_num_threads(threads)
    one, ranks = ([json.loads(x) for x in open(tmp_path / f"{name}.jsonl")] for name in ("one", "ranks"))
    assert len(one) == 3 * 4 * 4 and sorted(ranks) == sorted(one)  # 3 steps x 4 prompts x 4 samples
    assert len({tuple(p) for _, _, p in one}) > 1 and len({k for _, k, _ in one}) == len(one)
    keys = ("pass_rate", "reward", "len", "trunc", "intr", "kept_prompts", "loss", "grad_norm")
    logged = [[{k: r[k] for k in ("step", *keys) if k in r} | {"eval": r["kind"] == "eval"}
               for r in map(json.loads, open(path)) if r["kind"] != "config"]
              for path in (tmp_path / "one" / "metrics.jsonl", tmp_path / "ranks" / "metrics.jsonl")]
    assert [r["step"] for r in logged[0] if not r["eval"]] == [1, 2, 3] and len(logged[0]) == len(logged[1])
    for a, b in zip(*logged):  # the same samples; the loss's sum runs in another order (float rounding)
        assert a == pytest.approx(b, rel=1e-5, abs=1e-9)


# partial credit for the toy's intermediate steps, the change a researcher would make for a graded reward:
# verify.reward is the only function it touches
GRADED_REWARD = (
    "    return 1.0 if correct else -1.0\n",
    "    import re\n"
    "    steps = re.findall(r'(\\d+)([+-])(\\d+)=(\\d+)', response)\n"
    "    right = sum(int(c) == int(a) + (int(b) if op == '+' else -int(b)) for a, op, b, c in steps)\n"
    "    return (1.0 if correct else -1.0) + 0.5 * right / max(len(steps), 1)\n")


def test_a_graded_reward_is_one_function_from_the_verifier_to_the_loss(tmp_path):
    """A copy of the project with verify.reward giving partial credit (its one-file diff) trains in one process
    and as a generator and a trainer rank: the logged batch rewards are the graded ones (not 2 x pass@1 - 1, as
    +1 / -1 give), and the pass rates stay the verdicts'."""
    copy = tmp_path / "repo"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", ".venv", "runs", "__pycache__", "assets",
                                                             "toy_model_hard", "fixtures"))
    source = (copy / "verify.py").read_text()
    assert source.count(GRADED_REWARD[0]) == 1
    (copy / "verify.py").write_text(source.replace(*GRADED_REWARD))
    for name, world in (("one", 1), ("ranks", 2)):  # the copy's own modules, in ranks as torchrun starts them
        rcs, outs = finish_all(launch(world, tmp_path / name, "--steps", "2", root=copy))
        assert rcs == [0] * world, outs
        assert f"{copy}{os.sep}toy_model" in outs[0]  # it ran the copy
        steps = [r for r in map(json.loads, open(tmp_path / name / "metrics.jsonl")) if r["kind"] == "train"]
        assert len(steps) == 2
        for r in steps:  # each sample's reward: +-1 plus half its share of right steps (at most 0.5)
            assert 2 * r["pass_rate"] - 1 < r["reward"] <= 2 * r["pass_rate"] - 1 + 0.5 + 1e-6


def test_pipeline_held_out_evals_run_on_the_generators_with_the_weights_of_their_step(tmp_path):
    """Under PipelineRL the generator ranks (two, each its share of the prompts) run the held-out evals, asked by
    trainer 0 and logged when their results are in: each eval is of the weights of its step, what one process
    gives evaluating that step's checkpoint, sample for sample (the same noise keys). Trainer 0's waits while
    they evaluate are not compute (as the frozen modes' evals on trainer 0 are not)."""
    flags = ["--steps", "4", "--eval_every", "2", "--save_every", "2", "--keep", "3", "--val_size", "12",
             "--eval_samples", "2", "--gen_ranks", "2"]
    rcs, outs = finish_all(launch(3, tmp_path, *flags))
    assert rcs == [0, 0, 0], outs
    records = list(map(json.loads, open(tmp_path / "metrics.jsonl")))
    evals = {r["step"]: r for r in records if r["kind"] == "eval"}
    assert sorted(evals) == [0, 2, 4]
    # compute: every step's time on the 3 devices, less trainer 0's waits while the generators evaluated
    steps = [r for r in records if r["kind"] == "train"]
    assert all(0 <= r["eval_wait_ms"] <= r["dt_ms"] for r in steps)
    assert math.isclose(steps[-1]["compute_s"], sum(r["dt_ms"] - r["eval_wait_ms"] for r in steps) / 1000 * 3)
    args = config.get_args(["--out", str(tmp_path), *PIPE_FLAGS, *flags])
    _, val = train.load_data(args)
    for step in (2, 4):
        tok, model = train.load_model(str(tmp_path / f"ckpt-{step:06d}"), args, torch.device("cpu"))
        here = train.evaluate(model, tok, train.tokenize_prompts(tok, val), val, args)
        assert {k: here[k] for k in ("pass_rate", "trunc", "len", "n")} == \
            {k: evals[step][k] for k in ("pass_rate", "trunc", "len", "n")}, step


def test_pipeline_a_held_out_eval_longer_than_the_timeout_does_not_stall_the_trainer(tmp_path):
    """The generator runs the step-0 eval (4,000 samples: about 12 s, past --timeout) beside the training groups,
    in at most EVAL_SHARE of its slots: the trainer takes its steps while it runs (it was queued ahead of them:
    "rank 0 (trainer) waited 5.0 s for rollouts for step 1 (groups 0..3) (--timeout)"). Stopped by a signal after
    step 2, long before the eval ends: a signal skips the evals, and trainer 0 says which it cut short (that one
    is lost: the weights of step 0 are gone from the generators)."""
    procs = launch(2, tmp_path, "--steps", "1000", "--val_size", "500", "--eval_samples", "8", "--timeout", "5")
    wait_for_train_records(tmp_path, 2, procs)
    procs[0].send_signal(signal.SIGINT)
    rcs, outs = finish_all(procs)
    assert rcs == [128 + signal.SIGINT] * 2, outs
    lines = [(r["kind"], r["step"]) for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if "step" in r]
    assert lines[0] == ("train", 1) and ("train", 2) in lines, lines  # step 1 before the eval's line, if any
    if ("eval", 0) not in lines:
        done = len([k for k, _ in lines if k == "train"])
        assert (f"held-out eval of step 0: cut short by the signal; lost (training went on to step {done}, and the "
                "generators no longer hold the weights of step 0)") in outs[0], outs[0]


def test_pipeline_a_held_out_prompt_longer_than_every_training_prompt_is_sampled_on_the_generators(tmp_path):
    """The generator's sampler, which samples the held-out prompts too, is sized by the longest of every prompt
    (it was sized by the training prompts', and the eval stopped every generator with "ValueError: prompt of N
    tokens: a prompt needs 1 to max_prompt_len")."""
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"problem": f"Compute {'+'.join(['1'] * n)}.", "answer": str(n)}) + "\n"
                           for n in (2, 12)))  # the toy's prompts have 1 to 4 operations
    rcs, (out, _) = finish_all(launch(2, tmp_path / "run", "--steps", "1", "--val_data", str(val), "--val_size", "2"))
    assert rcs == [0, 0], out
    evals = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if r["kind"] == "eval"]
    assert [(r["step"], r["n"]) for r in evals] == [(0, 2), (1, 2)]


def test_pipeline_lag_bound_holds_under_a_slow_generator(tmp_path):
    """A straggler generator (the last one) decodes slowly while the other runs ahead: the trainer waits
    for the straggler's groups of each batch (nothing is dropped) and the fast one stops k batches ahead."""
    procs = launch(3, tmp_path, "--steps", "5", "--max_lag", "1", "--gen_ranks", "2", slow=("generator", 0.02))
    rcs, outs = finish_all(procs)
    assert rcs == [0, 0, 0], outs
    recs = train_records(tmp_path)
    assert len(recs) == 5 and max(r["lag_max"] for r in recs) <= 1
    assert all(r["too_old"] == 0 and r["prompts"] == 4 for r in recs)


def test_pipeline_ppo_offpolicy_freezes_generator_weights_for_k_steps(tmp_path):
    procs = launch(3, tmp_path, "--steps", "6", "--mode", "ppo_offpolicy", "--max_lag", "3", "--gen_ranks", "2",
                   "--no-zero_var_filter", "--keep_truncated")  # every sample trains: each step's lag is defined
    rcs, outs = finish_all(procs)
    assert rcs == [0, 0, 0], outs
    recs = train_records(tmp_path)
    # every token of steps 1..3 was sampled by version 0, of steps 4..6 by version 3
    assert [(r["lag"], r["lag_max"]) for r in recs] == [(0, 0), (1, 1), (2, 2), (0, 0), (1, 1), (2, 2)]
    assert [r["sync_MBps"] > 0 for r in recs] == [False, False, True, False, False, False]


def test_pipeline_a_dead_or_stalled_rank_stops_the_other(tmp_path):
    """A killed or stopped generator: the trainer's heartbeat check names it. A stopped trainer 0 hosts the store
    here (no launcher, as under the README's one-machine torchrun), so the generator's store calls hang: the
    heartbeat's own deadline stops it (before it, the generator waited as long as the trainer stayed stopped). The
    three runs side by side, so that their 4 s waits overlap. (A killed trainer:
    test_pipeline_sigkill_then_resume_restores_every_rank; a stopped one under torchrun's own store:
    test_pipeline_stalled_trainer_under_torchrun_stops_the_run_and_leaves_no_process.)"""
    cases = [("generator", signal.SIGKILL), ("generator", signal.SIGSTOP), ("trainer", signal.SIGSTOP)]
    runs = [launch(2, tmp_path / f"{who}-{sig}", "--steps", "1000", "--heartbeat_timeout", "4") for who, sig in cases]
    try:
        for (who, sig), (trains, generator) in zip(cases, runs):
            wait_for_train_records(tmp_path / f"{who}-{sig}", 1, [trains, generator])
            os.kill((generator if who == "generator" else trains).pid, sig)
        t_kill = time.time()
        for (who, sig), (trains, generator) in zip(cases, runs):
            other = trains if who == "generator" else generator
            out = other.communicate(timeout=120)[0]
            assert other.returncode != 0 and time.time() - t_kill < 60, (who, sig, out)
            said = "rank 1 (generator)" if who == "generator" else "the rendezvous store did not answer for 4 s"
            assert said in out and "ERROR" in out, (who, sig, out)
    finally:  # the victims (a stopped one would stay stopped), and every rank should a check fail
        for rank in itertools.chain(*runs):
            rank.kill()
            rank.proc.join(30)


def test_pipeline_waits_keep_no_deadline_while_trainer_0_evaluates():
    """A held-out eval may take longer than --timeout: the other ranks wait on the store meanwhile."""
    store = torch.distributed.HashStore()
    trainer0, trainer1, generator = (types.SimpleNamespace(store=store, rank=r, n_trainers=2, timeout=0.2,
                                                           live=ranks.Live()) for r in range(3))
    faults.set_status(trainer0, "training step 3")
    with pytest.raises(TimeoutError, match=r"rank 2 \(generator\) waited 0.2 s for weights"):
        faults.wait_until(generator, lambda: False, "weights")
    faults.set_status(trainer0, "evaluating step 3")
    done = threading.Timer(0.7, ranks.done_evaluating, (trainer0, 3))  # 3 deadlines later
    done.start()
    t0 = time.time()
    ranks.wait_for_eval(trainer1, 3)
    assert 0.6 < time.time() - t0 < 5 and store.get("status/0") == b"evaluated step 3"
    with pytest.raises(TimeoutError, match="rank 2 .generator. waited 0.2 s for weights"):  # the deadline is back
        faults.wait_until(generator, lambda: False, "weights")


def test_pipeline_a_generators_held_out_eval_says_its_count_and_eta(capsys, monkeypatch):
    """Under torchrun the first generator prints its share of a long eval: done/total and an ETA
    at the pace so far (here 30 of 120 in 12 s: 36 s left); other generators stay quiet."""
    args = types.SimpleNamespace(eval_samples=2)
    gen = types.SimpleNamespace(index=0, evals=evals.EvalShare(val_ids=[[1]] * 60), n_gens=1, args=args)
    other = types.SimpleNamespace(index=1, evals=evals.EvalShare(val_ids=[[1]] * 60), n_gens=2, args=args)
    monkeypatch.setattr(evals.time, "time", lambda: 1000.0)
    gen.evals.start(4, args.eval_samples, gen.index, gen.n_gens)
    other.evals.start(4, args.eval_samples, other.index, other.n_gens)
    assert gen.evals.want == 120 and other.evals.progress is None  # the other generators stay quiet
    gen.evals.progress.update(10)  # under 10 s since the start: nothing yet
    monkeypatch.setattr(evals.time, "time", lambda: 1012.0)
    assert capsys.readouterr().out == ""
    gen.evals.progress.update(30)
    assert capsys.readouterr().out == ("generator 0: held-out eval of step 4: 30/120 samples in 12 s, "
                                       "ETA 36 s\n")
    gen.evals.progress.update(31)  # at most one line every 10 s
    assert capsys.readouterr().out == ""


def test_pipeline_waits_keep_no_deadline_while_the_generators_eval_makes_progress():
    """The generators' held-out eval shares their time with training groups: a trainer's wait for rollouts runs
    out only after --timeout without the eval's progress (its counter in the store), not while it goes on."""
    store = torch.distributed.HashStore()
    trainer = types.SimpleNamespace(store=store, rank=0, n_trainers=1, timeout=0.5, live=ranks.Live())
    stop = time.time() + 1.5  # 3 deadlines
    bumps = threading.Thread(target=lambda: [(store.add("eval_progress", 1), time.sleep(0.05))
                                             for _ in range(32)])
    bumps.start()
    t0 = time.time()
    faults.wait_until(trainer, lambda: time.time() > stop, "rollouts for step 1")
    assert time.time() - t0 > 1.4
    bumps.join()
    with pytest.raises(TimeoutError, match=r"rank 0 \(trainer\) waited 0.5 s for rollouts"):  # no progress
        faults.wait_until(trainer, lambda: False, "rollouts for step 1")


def test_pipeline_sigkill_then_resume_restores_every_rank(tmp_path):
    flags = ["--steps", "6", "--save_every", "2", "--max_lag", "2"]
    procs = launch(2, tmp_path, *flags)
    wait_for_train_records(tmp_path, 3, procs)
    procs[0].send_signal(signal.SIGKILL)  # the trainer dies; the generator notices, says so and exits
    t_kill = time.time()
    rcs, outs = finish_all(procs)
    assert rcs[0] != 0 and rcs[1] != 0 and time.time() - t_kill < 60
    assert "rank 0" in outs[1] and "ERROR" in outs[1], outs[1]
    assert (tmp_path / "ckpt-000002").exists()
    for ckpt in runs.checkpoints(str(tmp_path)):  # each holds the generator's curriculum at its step
        saved = torch.load(Path(ckpt) / "state.pt", weights_only=True)["curricula"]["1"]
        assert saved["epoch"] == 0 and saved["pos"] == runs.step_of(ckpt) * 4  # exactly its batches served (not k
        assert sum(map(len, saved["history"].values())) == saved["pos"]  # more), with every one of their pass rates
    procs = launch(2, tmp_path, *flags, "--resume")
    rcs, outs = finish_all(procs)
    assert rcs == [0, 0], outs
    recs = train_records(tmp_path)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    assert all(r["lag_max"] <= 2 for r in recs)  # the bound holds right after resume too
    assert "resumed from" in outs[0]


def test_pipeline_every_checkpoint_holds_each_generators_curriculum_and_an_older_one_resumes_exactly(tmp_path):
    """Trainer 0 saves every generator's curriculum (and No-Positive-Resampling history) at the checkpoint's step
    into the checkpoint, sent through the store: a generator wrote its own file into --out when it took new
    weights (so not during a held-out eval, nor on a node without the shared disk) and only the newest, so a
    resume from an older checkpoint took a curriculum of later steps. Here each checkpoint holds the state of
    exactly its batches, and a resume from ckpt-000002 (the newer one damaged) takes steps 3 and 4 as the straight
    run did."""
    flags = ["--steps", "4", "--save_every", "2", "--mode", "sync"]
    rcs, outs = finish_all(launch(2, tmp_path, *flags))
    assert rcs == [0, 0], outs
    straight = train_records(tmp_path)
    for step in (2, 4):
        saved = torch.load(tmp_path / f"ckpt-{step:06d}" / "state.pt", weights_only=True)["curricula"]["1"]
        assert saved["epoch"] == 0 and saved["pos"] == step * 4  # 4 prompts a step, all this generator's
        assert sum(map(len, saved["history"].values())) == step * 4  # and each one's pass rate
    assert sorted(os.listdir(tmp_path)) == [".lock", ".train-run.json", "ckpt-000002", "ckpt-000004", "metrics.jsonl"]
    (tmp_path / "ckpt-000004" / "state.pt").unlink()
    rcs, outs = finish_all(launch(2, tmp_path, *flags, "--resume"))
    assert rcs == [0, 0] and f"resumed from {tmp_path / 'ckpt-000002'} at step 2" in outs[0], outs
    again = train_records(tmp_path)
    assert [r["step"] for r in again] == [1, 2, 3, 4]
    for a, b in zip(straight, again):
        assert (a["reward"], a["kept_prompts"], a["loss"]) == (b["reward"], b["kept_prompts"], b["loss"]), a["step"]


def worker_pids(launcher_pid):
    """The pids of the processes a launcher started (its children, read from /proc), in the order it started them
    (torchrun forks local rank 0 first)."""
    kids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            if int(fields[1]) == launcher_pid:
                kids.append((int(fields[19]), int(pid)))  # field 22: its start time
    return [pid for _, pid in sorted(kids)]


def test_pipeline_stalled_trainer_under_torchrun_stops_the_run_and_leaves_no_process(tmp_path):
    """torchrun's own agent, store and report (torch.distributed.run, in a process forked from the preloaded
    server, its ranks forked from it: --run-path --start-method fork; the README test starts torchrun and its
    ranks as fresh interpreters). A stopped trainer 0: the generator names it, the launcher stops the run, kills
    the stopped rank and reports the generator's line as the root cause."""
    (p,) = launch(2, tmp_path, "--steps", "1000", "--heartbeat_timeout", "4", torchrun=True)
    wait_for_train_records(tmp_path, 2, [p])
    workers = worker_pids(p.pid)
    assert len(workers) == 2, workers
    os.kill(workers[0], signal.SIGSTOP)  # the trainer freezes; torchrun's agent (the store) stays up
    t0 = time.time()
    # wait until the launcher has taken the generator's exit as the failure and signals the stopped rank: woken
    # earlier, the trainer's own store watchdog (stopped past its limit) could exit first and be reported instead
    while f"process {workers[0]} via signal" not in Path(p.log).read_text():  # torch.multiprocessing's words
        assert time.time() - t0 < 120, Path(p.log).read_text()[-3000:]
        time.sleep(0.5)
    assert "rank 0 (trainer) sent no heartbeat" in Path(p.log).read_text()
    os.kill(workers[0], signal.SIGCONT)  # only so that torchrun's SIGTERM acts now, not after its 30 s grace
    assert p.wait(timeout=60) != 0
    report = Path(p.log).read_text().split("Failures:")[-1]  # torchrun's: the line each rank wrote to its error file
    assert "traceback : rank 0 (trainer) sent no heartbeat for 4 s" in report, report
    for pid in workers:  # no worker left behind (a stopped one is killed by the launcher)
        assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1][:3]


# Two nodes simulated on one machine: two torchrun agents (torch.distributed.run forked from the preloaded server,
# --run-path --start-method fork: their ranks fork from them), 2 ranks each, gloo on the CPU, each agent in its own
# working folder (nothing on disk is shared unless --out is one absolute path). Under xdist they run one after
# another: four ranks and two agents each on two cores.
NODES = pytest.mark.xdist_group("nodes")


def launch_nodes(tmp_path, out, *flags, rdzv=None, env=None):
    """Two agents -> [node 0's, node 1's] (Forked); their working folders tmp_path/node0 and node1, their logs
    tmp_path/node{n}.log. rdzv: the rendezvous flags (default: static, node 0 at a free port on 127.0.0.1)."""
    port = bench.free_port()
    agents = []
    for n in range(2):
        (tmp_path / f"node{n}").mkdir(exist_ok=True)
        how = rdzv or ["--node_rank", str(n), "--master_addr", "127.0.0.1", "--master_port", str(port)]
        agents.append(Forked(["--run-path", "--start-method", "fork", "--nnodes", "2", "--nproc_per_node", "2",
                              *how, str(ROOT / "train.py"), "--out", str(out), *PIPE_FLAGS, *flags],
                             # nodes simulated on one machine: gloo on lo, as the README's note says
                             {"GLOO_SOCKET_IFNAME": "lo", **(env or {})}, tmp_path / f"node{n}.log",
                             script=torch.distributed.run.__file__, cwd=tmp_path / f"node{n}"))
    return agents


@NODES
def test_nodes_a_run_folder_that_a_node_cannot_see_stops_every_rank_before_step_1_in_one_line(tmp_path):
    """`--out run` from two working folders is two folders: rank 0 writes a nonce into its --out, node 1's first
    rank does not find it in its own: every rank on both nodes stops before step 1, and the one line naming that
    host and rank is said once (node 0's ranks name who failed)."""
    t0 = time.time()
    rcs, outs = finish_all(launch_nodes(tmp_path, "run", "--steps", "2"), timeout=120)
    host, both = socket.gethostname(), "".join(outs)
    assert rcs[0] != 0 and rcs[1] != 0, outs
    assert both.count("is not the run folder that rank 0 writes") == 1, both
    line = next(ln for ln in outs[1].splitlines() if "is not the run folder that rank 0 writes" in ln)
    assert line.endswith(f"(rank 2 (generator) on {host})") and str(tmp_path / "node0" / "run") in line, line
    assert f"rank 2 (generator) on {host} failed" in outs[0], outs[0]
    assert "step 1/" not in both and not (tmp_path / "node1" / "run").exists()
    assert time.time() - t0 < 60


@NODES
def test_nodes_a_rank_failing_on_node_1_says_its_line_with_its_host_and_node_0_stops_within_seconds(tmp_path):
    """A --data file that only node 0's working folder holds: node 1's ranks fail, and the first failure is said
    once, with its rank and host, as node 1's root cause in torchrun's report (the other rank's error file points to
    it); node 0's ranks stop within seconds, naming the rank and host that failed, not after --timeout (120 s)."""
    (tmp_path / "node0").mkdir()
    (tmp_path / "node0" / "problems.jsonl").write_text("".join(json.dumps({"prompt": p["prompt"], "answer": p["answer"]})
                                                             + "\n" for p in toy.toy_task(0)[:40]))
    agents = launch_nodes(tmp_path, tmp_path / "run", "--data", "problems.jsonl", "--steps", "2")
    assert agents[1].wait(timeout=60) != 0
    t0 = time.time()
    assert agents[0].wait(timeout=15) != 0 and time.time() - t0 < 15
    host, (out0, out1) = socket.gethostname(), (Path(a.log).read_text() for a in agents)
    assert out1.count("problems.jsonl: No such file or directory") == 1, out1
    line = next(ln for ln in out1.splitlines() if "problems.jsonl: No such file" in ln)
    rank = re.search(rf"\(rank ([23]) \(generator\) on {host}\)$", line)  # whichever failed first
    assert rank and out1.split("Root Cause")[1].count(line) == 1, out1  # torchrun's root cause
    assert f"rank {rank[1]} (generator) on {host} failed" in out0, out0


@NODES
def test_nodes_resume_from_the_first_launch_starts_fresh_and_a_restart_resumes_to_the_end(tmp_path):
    """The same command with --resume on a first launch starts fresh (one line says so), and under c10d rendezvous
    with torch's shared store (its default) and --max-restarts 1, a SIGKILLed generator rank is restarted with
    every other rank, they resume from the last checkpoint and the run finishes (before: the restarted ranks met
    stale store keys, `Gloo connectFullMesh failed ... Connection refused`)."""
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{bench.free_port()}", "--rdzv-id", "job",
            "--max-restarts", "1", "--monitor-interval", "0.2"]
    out = tmp_path / "run"
    agents = launch_nodes(tmp_path, out, "--steps", "20", "--save_every", "2", "--resume", "--heartbeat_timeout",
                          "5", rdzv=rdzv)
    wait_for_train_records(out, 3, agents, timeout=90)
    log = "".join(Path(a.log).read_text() for a in agents)
    assert log.count(f"--resume: no intact checkpoint in {out}, starting from scratch") == 1, log
    victim = next(pid for a in agents for pid in worker_pids(a.pid)[1:])  # a generator (rank 0 trains)
    os.kill(victim, signal.SIGKILL)
    rcs, outs = finish_all(agents, timeout=150)
    assert rcs == [0, 0], outs
    assert "resumed from" in "".join(outs) and "done in" in "".join(outs)
    assert [r["step"] for r in train_records(out)][-1] == 20


@NODES
def test_nodes_ctrl_c_under_torchrun_saves_and_gives_the_resume_line_with_the_rendezvous_flags(tmp_path):
    """Ctrl-C under torchrun (SIGINT to the launcher and its ranks, as a terminal sends it): the ranks save the
    last step and rank 0's resume line repeats the launcher's flags, its rendezvous among them (before: `torchrun
    --nproc_per_node 2 train.py ... --resume`, which run as printed listened on every interface)."""
    agents = launch_nodes(tmp_path, tmp_path / "run", "--steps", "1000", "--save_every", "0")
    wait_for_train_records(tmp_path / "run", 2, agents)
    for a in agents:
        for pid in [a.pid, *worker_pids(a.pid)]:
            os.kill(pid, signal.SIGINT)
    rcs, outs = finish_all(agents, timeout=60)
    done = len(train_records(tmp_path / "run"))
    port = re.search(r"--master_port (\d+)", outs[0])
    assert port, outs[0]
    assert f"saved {tmp_path / 'run' / f'ckpt-{done:06d}'}; continue with: torchrun --nnodes 2 --nproc_per_node 2 " \
           f"--master_addr 127.0.0.1 --master_port {port[1]} --node_rank 0 {ROOT / 'train.py'} --out " in outs[0], outs[0]
    assert (tmp_path / "run" / f"ckpt-{done:06d}").is_dir() and "KeyboardInterrupt" not in "".join(outs)


def test_nodes_max_restarts_without_resume_is_refused_in_one_line(tmp_path):
    """torchrun --max-restarts restarts the ranks with the same command: without --resume the restarted ranks met
    their own run in --out and stopped ("already holds a run"); refused at once, before anything is made."""
    rcs, outs = finish_all(launch(2, tmp_path / "run", "--steps", "2", env={"TORCHELASTIC_MAX_RESTARTS": "1"}))
    assert rcs == [2, 2] and outs[0].strip().splitlines()[-1] == (
        "train.py: error: torchrun --max-restarts restarts the ranks with this same command, which would then find "
        "this run in --out and stop: add --resume (with nothing to resume yet, a run starts fresh)"), outs
    assert outs[1].strip() == "" and not (tmp_path / "run").exists()


def test_nodes_the_resume_command_repeats_the_launchers_own_flags(monkeypatch):
    """Under torchrun the resume line's launcher flags are the ones torchrun was started with, read from its command
    line (the ranks' parent), words with spaces quoted; a parent that is no torchrun: rebuilt from the environment
    torchrun gives its ranks."""
    words = ["--nnodes", "2", "--nproc_per_node", "8", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.1.2.3:29500",
             "--rdzv-id", "job 7", "--max-restarts", "1"]
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "/venv/bin/torchrun", *words,
                               "train.py", "--out", "runs/x"])
    try:
        monkeypatch.setattr(sys, "argv", ["train.py", "--out", "runs/x"])
        monkeypatch.setattr(os, "getppid", lambda: parent.pid)
        for k, v in dict(WORLD_SIZE="16", LOCAL_WORLD_SIZE="8", TORCHELASTIC_RUN_ID="job 7", GROUP_RANK="1",
                         TORCHELASTIC_USE_AGENT_STORE="True", MASTER_ADDR="10.1.2.3", MASTER_PORT="29500",
                         TORCHELASTIC_MAX_RESTARTS="1").items():
            monkeypatch.setenv(k, v)
        t0 = time.time()
        while "torchrun" not in open(f"/proc/{parent.pid}/cmdline").read():  # until the child has exec'd
            assert time.time() - t0 < 10
            time.sleep(0.01)
        said = runs.resume_command()
        assert said == "torchrun " + " ".join(map(shlex.quote, words)) + " train.py --out runs/x --resume", said
    finally:
        parent.kill()
        parent.wait()
    monkeypatch.setattr(os, "getppid", lambda: 1)
    assert runs.resume_command() == ("torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint "
                                     "10.1.2.3:29500 --rdzv-id 'job 7' --max-restarts 1 train.py --out runs/x --resume")


def test_nodes_the_resume_command_names_a_fresh_rendezvous_file_for_the_one_machine_launcher(monkeypatch):
    """The README's one-machine launcher (torchrun_local) gives torchrun a file rendezvous, which refuses a second
    run once used: the resume line asks the shell for a new file name where the used one was."""
    words = ["--rdzv-backend", "c10d", "--rdzv-conf", "store_type=file", "--rdzv-endpoint", "/tmp/tmp.used",
             "--local-addr", "127.0.0.1", "--nproc_per_node", "2"]
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "torchrun", *words, "train.py"])
    try:
        monkeypatch.setattr(sys, "argv", ["train.py"])
        monkeypatch.setattr(os, "getppid", lambda: parent.pid)
        monkeypatch.setenv("WORLD_SIZE", "2")
        t0 = time.time()
        while "torchrun" not in open(f"/proc/{parent.pid}/cmdline").read():
            assert time.time() - t0 < 10
            time.sleep(0.01)
        said = runs.resume_command()
    finally:
        parent.kill()
        parent.wait()
    assert said == ("torchrun --rdzv-backend c10d --rdzv-conf store_type=file --rdzv-endpoint \"$(mktemp -u)\" "
                    "--local-addr 127.0.0.1 --nproc_per_node 2 train.py --resume"), said
    echoed = subprocess.run(["bash", "-c", "echo " + said], capture_output=True, text=True).stdout.split()
    assert echoed[6].startswith("/tmp/") and echoed[6] != "/tmp/tmp.used", echoed


def test_pipeline_fsdp2_trainers_equal_data_parallel_trainers_and_resume(tmp_path):
    """Two trainers with the model sharded (FSDP2), stopped after step 3 and resumed, take the same steps
    as two full replicas that run 5 steps straight (the sharded AdamW state comes back on resume: step 5's
    update depends on it)."""
    flags = ["--gen_ranks", "1", "--mode", "sync", "--save_every", "3"]
    rcs, outs = finish_all(launch(3, tmp_path / "dp", "--steps", "5", *flags))
    assert rcs == [0, 0, 0], outs
    runs = {"dp": (train_records(tmp_path / "dp"), outs[0], AutoModelForCausalLM.from_pretrained(tmp_path / "dp" / "ckpt-000003"))}
    for r in runs["dp"][0]:  # the console's step line under torchrun carries the roles' fields, as metrics.jsonl
        line = next(l for l in outs[0].splitlines() if l.startswith(f"step {r['step']}/5 "))
        assert f"| busy gen {r['gen_busy']:.2f} train {r['train_busy']:.2f} | sync {r['sync_ms']:.0f} ms" in line
    out = tmp_path / "fsdp"
    rcs, outs = finish_all(launch(3, out, "--steps", "3", *flags, "--fsdp"))
    assert rcs == [0, 0, 0], outs
    weights = AutoModelForCausalLM.from_pretrained(out / "ckpt-000003")
    rcs, resumed = finish_all(launch(3, out, "--steps", "5", "--resume", *flags, "--fsdp"))  # from ckpt-000003
    assert rcs == [0, 0, 0] and "resumed from" in resumed[0], resumed
    runs["fsdp"] = (train_records(out), outs[0], weights)
    held = re.search(r"FSDP2: trainer 0 holds (\d+) of (\d+) parameters", runs["fsdp"][1])
    assert held and int(held[1]) <= int(held[2]) // 2 + 1000  # half the weights (+ padding of odd dims)
    assert [r["step"] for r in runs["fsdp"][0]] == [1, 2, 3, 4, 5]
    for a, b in zip(runs["dp"][0], runs["fsdp"][0]):
        assert (a["step"], a["reward"], a["kept_prompts"]) == (b["step"], b["reward"], b["kept_prompts"])
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5, abs_tol=1e-7)
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4)
    dp, fs = runs["dp"][2], runs["fsdp"][2]
    for (name, p), q in zip(dp.named_parameters(), fs.parameters()):
        assert torch.allclose(p, q, atol=1e-5), name  # rank 0's gathered copy is a from_pretrained folder

def test_pipeline_fsdp_a_shard_written_into_another_trainers_out_is_not_saved(tmp_path):
    """Two --fsdp trainers whose --out differ (each node's own disk: a second line of defence behind the start-up
    check of a shared --out): trainer 1's shard landed in its own folder, rank 0 wrote .metadata and renamed, and the
    run printed `saved .../ckpt-000002` and exited 0 with a checkpoint that never loads. Now rank 0 names the shard,
    the trainer and host that wrote it, and saves nothing."""
    mine, other = tmp_path / "run", tmp_path / "node1"
    (other / "ckpt-000002.tmp").mkdir(parents=True)  # as found on the other node: trainer 1 writes into it
    (other / runs.RUN_MARK).write_text('{"tb": false}')
    flags = ["--steps", "2", "--save_every", "2", "--gen_ranks", "1", "--mode", "sync", "--fsdp", "--overwrite",
             "--heartbeat_timeout", "4"]
    procs = fork_ranks(3, lambda r: ["--out", str(other if r == 1 else mine), *PIPE_FLAGS, *flags], tmp_path / "log")
    rcs, outs = finish_all(procs, timeout=120)
    assert rcs[0] == 2 and all(rcs), (rcs, outs)
    assert re.search(rf"train.py: error: {mine}/ckpt-000002\.tmp/shards/\.metadata lists __1_0\.distcp, which trainer "
                     rf"rank 1 on host {re.escape(socket.gethostname())} wrote, but rank 0 does not find it there "
                     r"[^\n]*one shared --out[^\n]*not saved", outs[0]), outs[0]
    assert "saved " not in outs[0] and not (mine / "ckpt-000002").exists()
    assert (other / "ckpt-000002.tmp" / "shards" / "__1_0.distcp").exists()


def test_a_step_is_the_same_whatever_splits_its_groups_one_process_data_parallel_or_fsdp(tmp_path):
    """The first step of one process taking its whole batch at once, and of 2 data-parallel trainers and 2
    FSDP2 trainers taking theirs one row at a time (--micro_tokens 1: every group split across micro-batches):
    the same samples, the same loss and gradient norm (float32 sums in other orders)."""
    flags = ["--steps", "1", "--mode", "sync", "--eval_every", "100"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train.main(config.get_args(["--out", str(tmp_path / "one"), *PIPE_FLAGS, *flags, "--micro_tokens", "0"]))
    finally:
        torch.set_num_threads(threads)
    steps = {"one": train_records(tmp_path / "one")[0]}
    for name, extra in (("dp", []), ("fsdp", ["--fsdp"])):
        rcs, outs = finish_all(launch(3, tmp_path / name, *flags, "--gen_ranks", "1", "--micro_tokens", "1",
                                      *extra))
        assert rcs == [0, 0, 0], outs
        steps[name] = train_records(tmp_path / name)[0]
    for name in ("dp", "fsdp"):
        a, b = steps["one"], steps[name]
        assert (a["reward"], a["kept_prompts"], a["len"]) == (b["reward"], b["kept_prompts"], b["len"]), name
        assert a["kept_prompts"] > 0  # a step that trained
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5, abs_tol=1e-8), (name, a["loss"], b["loss"])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5), (name, a["grad_norm"], b["grad_norm"])


def _fsdp_checkpoint_rank(rank, world, port, out):
    """One of 2 FSDP2 trainers (trainer.shard_trainer) of a tiny Qwen3 whose decoder layers are checkpointed (as
    a 0.5B-8B model's are by default): the forward and backward of its own rows, packed."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    plan.CHECKPOINT_ABOVE, calls, real = 0, [], trainer.checkpoint
    name = lambda fn: getattr(fn, "__name__", type(fn).__name__)  # a module (the final norm) has none
    trainer.checkpoint = lambda fn, *a, **k: (calls.append(name(fn)), real(fn, *a, **k))[1]
    model = tiny_model("qwen3").train()
    forward = trainer.shard_trainer(model, torch.distributed.group.WORLD, "cpu")
    ids, attn, lens = right_padded(seed=rank)
    packed = torch.cat([row[:L] for row, L in zip(ids, lens)])
    (forward(packed, lens, True, 1.0) * attn[:, 1:]).sum().backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    if rank == 0:
        torch.save((grads, calls), out)
    torch.distributed.destroy_process_group()


def test_pipeline_fsdp2_trainers_with_checkpointed_layers_sum_the_unsharded_gradient(tmp_path):
    """Activation checkpointing (non-reentrant) inside FSDP2's per-layer units: the gathered gradient of 2 sharded
    trainers equals one unsharded model's over both trainers' rows, computed without checkpointing."""
    torch.multiprocessing.start_processes(_fsdp_checkpoint_rank, args=(2, bench.free_port(), str(tmp_path / "g.pt")),
                                          nprocs=2, start_method="forkserver")
    grads, calls = torch.load(tmp_path / "g.pt")
    assert calls.count("_layer") == 2  # both layers went through the checkpoint
    model = tiny_model("qwen3").train()
    for rank in range(2):
        ids, attn, _ = right_padded(seed=rank)
        (trainer.sequence_logprobs(model, ids, attn, checkpoint_layers=False) * attn[:, 1:]).sum().backward()
    assert all(torch.allclose(g, p.grad, atol=1e-5) for g, p in zip(grads, model.parameters()))


def _grads_of_rank(rank):
    """A trainer's gradients for test_pipeline_all_reduce_grads: float32 and bf16 ones, one missing on rank 1."""
    g = torch.Generator().manual_seed(rank)
    grads = [torch.randn(n, generator=g).to(dtype) for n, dtype in ((30, torch.float32), (7, torch.bfloat16),
                                                                    (50, torch.bfloat16), (3, torch.float32))]
    return [None if (rank, i) == (1, 2) else x for i, x in enumerate(grads)]


def _all_reduce_rank(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    params = [torch.nn.Parameter(torch.zeros(len(x), dtype=x.dtype)) for x in _grads_of_rank(0)]
    for p, x in zip(params, _grads_of_rank(rank)):
        p.grad = x
    ranks.all_reduce_grads(types.SimpleNamespace(trainers=torch.distributed.group.WORLD), params,
                           bucket_mb=100 / 2 ** 20)  # 100-byte buckets: several
    if rank == 0:
        torch.save([p.grad for p in params], out)
    torch.distributed.destroy_process_group()


def test_pipeline_all_reduce_grads_sums_in_float32_bucket_by_bucket(tmp_path):
    """Replicated trainers sum their gradients once a step in buckets: on 2 gloo ranks each gradient is the two
    ranks' sum taken in float32 and rounded once to its dtype (a missing one counts as zero)."""
    torch.multiprocessing.start_processes(_all_reduce_rank, args=(2, bench.free_port(), str(tmp_path / "g.pt")),
                                          nprocs=2, start_method="forkserver")
    got = torch.load(tmp_path / "g.pt")
    for i, (a, b) in enumerate(zip(_grads_of_rank(0), _grads_of_rank(1))):
        want = (a.float() + (b.float() if b is not None else 0)).to(a.dtype)
        assert got[i].dtype == a.dtype and torch.equal(got[i], want), i


def test_pipeline_fsdp2_bf16_keeps_float32_shards_like_replicated_bf16_trainers(tmp_path):
    """--fsdp --dtype bfloat16: FSDP2 keeps float32 shards (AdamW's master weights), computes with the
    weights gathered in bf16 and broadcasts bf16 to the generator. Against two bf16 replicas with float32
    master copies: the same steps, and after a resume from step 2 the same float32 weights up to the
    bf16 arithmetic's reduction order. At lr 1e-5 the steps move a weight by about 1e-6 each, under bf16's
    spacing: masters rounded to bf16 on resume would lose the first two steps' moves on almost every
    weight, half the total, which the mean difference catches."""
    flags = ["--gen_ranks", "1", "--mode", "sync", "--save_every", "1", "--dtype", "bfloat16", "--lr", "1e-5"]
    rcs, outs = finish_all(launch(3, tmp_path / "dp", "--steps", "3", *flags))
    assert rcs == [0, 0, 0], outs
    out = tmp_path / "fsdp"
    rcs, outs = finish_all(launch(3, out, "--steps", "2", *flags, "--fsdp"))
    assert rcs == [0, 0, 0], outs
    rcs, resumed = finish_all(launch(3, out, "--steps", "3", "--resume", *flags, "--fsdp"))
    assert rcs == [0, 0, 0] and "resumed from" in resumed[0], resumed
    for a, b in zip(train_records(tmp_path / "dp"), train_records(out)):
        assert (a["step"], a["reward"], a["kept_prompts"]) == (b["step"], b["reward"], b["kept_prompts"])
        assert math.isclose(a["loss"], b["loss"], rel_tol=2e-2, abs_tol=1e-4)
    dp = torch.load(tmp_path / "dp" / "ckpt-000003" / "state.pt", weights_only=True)["master"]
    whole = tmp_path / "fsdp.pt"  # the trainers' shards (torch.distributed.checkpoint), made whole
    dcp_to_torch_save(out / "ckpt-000003" / trainer.SHARDS, whole)
    fs = torch.load(whole, weights_only=True)["model"]
    start = AutoModelForCausalLM.from_pretrained(toy.toy_model_dir(), dtype=torch.bfloat16)
    names = [name for name, _ in start.named_parameters()]
    assert len(dp) == len(names) and set(names) <= set(fs), (len(dp), names, list(fs))
    for a, b, w0 in zip(dp, [fs[name] for name in names], start.parameters()):
        assert a.dtype == b.dtype == torch.float32
        moved = (a - w0.float()).abs().mean()
        assert moved > 1e-6 and (a - b).abs().mean() < 0.1 * moved, ((a - b).abs().mean(), moved)


# =============================================================================
# train.py: end to end on the embedded toy model: every loss and ablation, resume, checks, logging


def test_imports_between_the_files_have_no_cycle():
    """Each file imports only files below it (anywhere in it, __main__ blocks included): a depth-first walk
    of the import graph from every file never comes back to a file on its own path."""
    files = {p.stem for p in ROOT.glob("*.py")} - {"test_all"}
    imports = {}
    for name in files:
        tree = ast.parse((ROOT / f"{name}.py").read_text())
        found = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        found |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imports[name] = (found & files) - {name}
    assert "generate" in imports["pipeline"] and "data" in imports["generate"]  # the graph is really read

    def walk(name, path):
        assert name not in path, f"import cycle: {' -> '.join(path + [name])}"
        for dep in imports[name]:
            walk(dep, path + [name])
    for name in files:
        walk(name, [])


@pytest.mark.parametrize("flags", [[], ["--loss", "dapo"], ["--loss", "gspo"], ["--loss", "grpo"],
                                   ["--agg", "sample", "--adv_norm", "prompt"], ["--agg", "token", "--adv_norm", "none"],
                                   ["--no-fp32_head", "--no-zero_var_filter", "--no-no_positive_resampling"],
                                   ["--length_control", "penalty"], ["--length_control", "none"],
                                   ["--micro_tokens", "1"]])
def test_train_runs_every_loss_and_ablation(toy_dir, tmp_path, flags):
    lines = run_train(toy_dir, tmp_path, *flags)
    assert lines[0]["kind"] == "config"
    assert [m["step"] for m in lines if m["kind"] == "train"] == [1, 2]
    assert [m["step"] for m in lines if m["kind"] == "eval"] == [0, 2]
    for m in lines[1:]:
        assert 0 <= m["pass_rate"] <= 1 and m["compute_s"] >= 0 and math.isfinite(m.get("loss", 0.0))
    assert lines[-2]["flops"] > lines[-3]["flops"] > 0


def test_config_methods_are_the_compared_recipes_built_from_flags_alone_over_any_size_recipe():
    """--method NAME: the recipes the paper's Figure 2 compares (GRPO, DAPO, Magistral, MiniMax-M1, ScaleRL), each
    a set of existing flags; it combines with a size --recipe, and a flag given wins over it. The paper's GRPO is
    sample aggregation with prompt normalization (--loss grpo alone changes only the objective, as --help says);
    every method is in the README with its source."""
    dests = {a.dest: a for a in config.make_parser()._actions}
    assert set(config.METHODS) == {"scalerl", "grpo", "dapo", "magistral", "minimax"}
    for name, flags in config.METHODS.items():
        assert set(flags) <= set(dests), name  # existing flags only
        for key, value in flags.items():
            assert dests[key].choices is None or value in dests[key].choices, (name, key)
    defaults = config.get_args([])
    assert config.get_args(["--method", "scalerl"]).__dict__ == {**defaults.__dict__, "method": "scalerl"}
    grpo = config.get_args(["--method", "grpo"])
    assert (grpo.loss, grpo.agg, grpo.adv_norm, grpo.mode) == ("grpo", "sample", "prompt", "ppo_offpolicy")
    assert (grpo.prompts, grpo.lr) == (defaults.prompts, defaults.lr)  # the toy's sizes kept
    dapo = config.get_args(["--method", "dapo", "--agg", "prompt", "--recipe", "one_gpu"])
    assert (dapo.loss, dapo.agg, dapo.zero_var_filter, dapo.length_control) == ("dapo", "prompt", True, "penalty")
    assert (dapo.prompts, dapo.think_budget) == (16, 4096)  # one_gpu's sizes under DAPO's flags
    assert config.get_args(["--method", "minimax", "--no-fp32_head"]).fp32_head is False
    assert config.get_args(["--method", "grpo", "--zero_var_filter"]).zero_var_filter is True
    help_text = " ".join(config.make_parser().format_help().split())
    assert "--loss grpo alone" in help_text and "--method grpo" in help_text
    readme = (ROOT / "README.md").read_text()
    for name in config.METHODS:
        row = next((ln for ln in readme.splitlines() if ln.startswith(f"| `--method {name}`")), "")
        assert "arXiv" in row or "section" in row, name


def test_train_live_fit_failure_is_logged_not_fatal(toy_dir, tmp_path, monkeypatch, capsys):
    def failing_fit(C, R, C_end, R0=None):
        assert len(C) == len(R) and C_end >= 0
        raise ValueError("cannot fit")
    monkeypatch.setattr(fit, "predict_final", failing_fit)
    lines = run_train(toy_dir, tmp_path)
    assert [m["step"] for m in lines if m["kind"] == "eval"] == [0, 2]
    assert "no live fit (cannot fit)" in capsys.readouterr().out


def step_gradients(model, batch, args, logprobs):
    """train.train_step on a Trainer of `model` whose AdamW step does nothing -> the gradients it would step on
    (summed over the micro-batches of --micro_tokens)."""
    t, grads = trainer.Trainer(args, model, None, {}), []
    t.logprobs, t.opt.step, t.sched.step = logprobs, lambda: None, lambda: None
    t.reduce_grads = lambda: grads.extend(p.grad.clone() for p in model.parameters())
    train.train_step(t, batch, args)
    return grads


def test_train_micro_batches_give_the_full_batch_gradient(toy_dir):
    """Rows packed into micro-batches of any token budget (down to one row each: every group split across
    them) give the gradient of the unsplit batch's loss computed the independent way, the model's own forward
    of the right-padded batch and the slow reference loss (CISPO and the aggregation by hand) over all rows at
    once, for every aggregation."""
    model = AutoModelForCausalLM.from_pretrained(toy_dir, dtype=torch.float64)
    prompts, samples = [[3, 4, 5], [6, 7], [8, 9, 10, 11]] * 2, []
    for i, p in enumerate(prompts):
        n = 3 + i % 4
        samples.append(gen.Sample(i, list(range(12, 12 + n)), [-1.0 - 0.1 * j for j in range(n)],
                                  [1] * (n - 1) + [0], [0] * n, "eos"))
    ids, attn, mask, gen_logp, lag = trainer.collate(prompts, samples, 0, "cpu")
    assert mask[0, 2:2 + 3].tolist() == [1, 1, 0] and gen_logp[0, 2].item() == -1.0  # aligned with targets
    group = torch.tensor([0, 1, 2, 0, 1, 2])
    adv = torch.tensor([1.0, -1.0, 0.5, -1.0, 1.0, -0.5], dtype=torch.float64)
    lengths = [len(p) + len(s.tokens) for p, s in zip(prompts, samples)]
    assert len(trainer.micro_batches(lengths, 1)) == 6 and len(trainer.micro_batches(lengths, 0)) == 1
    for agg in ("prompt", "sample", "token"):
        model.zero_grad()
        logp = model(ids, attention_mask=attn).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        slow_policy_loss(logp, gen_logp, adv, mask, group, "cispo", agg,  # the default mask
                         neg_trust=config.get_args([]).neg_trust).backward()
        want = [p.grad.clone() for p in model.parameters()]
        batch = loss.Batch(prompts, samples, [True] * 6, None, group, None, None, list(range(6)), adv,
                           loss.agg_counts(group, mask))
        args = config.get_args(["--agg", agg])
        for budget in (0, 1, 12, 20):
            model.zero_grad()
            args.micro_tokens = budget
            logprobs = lambda ids, lens: trainer.packed_logprobs(model, ids, lens, True, 1.0)
            grads = step_gradients(model, batch, args, logprobs)
            worst = max((g - w).abs().max().item() for g, w in zip(grads, want))
            assert worst < 1e-12, (agg, budget, worst)


def test_train_micro_batches_pack_rows_up_to_the_budget_and_a_longer_row_alone():
    """trainer.micro_batches packs rows into micro-batches of at most the budget (first fit, longest first): each row
    once, no micro-batch over the budget unless it is one row longer than it, and no two that would fit in one;
    trainer.pack concatenates a micro-batch's rows with their lengths."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 60, (200,), generator=g).tolist() + [130, 75]
    parts = trainer.micro_batches(lengths, 100)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    sizes = [sum(lengths[i] for i in p) for p in parts]
    assert all(s <= 100 or len(p) == 1 for p, s in zip(parts, sizes)) and [130] in [[lengths[i] for i in p] for p in parts]
    assert all(a + min(lengths[i] for i in q) > 100 for a, q in zip(sizes, parts[1:]))  # first fit: a later row did not fit
    assert len(parts) <= sum(lengths) // 100 + 3
    samples = [gen.Sample(0, [7, 8], [0.0] * 2, [1] * 2, [0] * 2, "eos"), gen.Sample(1, [9], [0.0], [1], [0], "eos")]
    ids, lens = trainer.pack([[1, 2, 3], [4]], samples, "cpu")
    assert ids.tolist() == [1, 2, 3, 7, 8, 4, 9] and lens == [5, 2]


def test_train_peak_saved_bytes_follow_micro_tokens_not_the_group_or_the_sample_length():
    """The trainer's activations are sized by --micro_tokens: the same tiny model trains a group of 16 samples
    of 2k tokens and one of 16 x 256 with --micro_tokens 4096, and the most that one micro-batch's forward saves
    for its backward (saved-tensor hooks) is within 10% for both, and far below what one forward of the whole
    long group saves."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=4096)).train()
    args = config.get_args(["--micro_tokens", "4096"])
    peaks = {}
    for length in (2048, 256):
        prompts = [[4 + i % 30] * 8 for i in range(16)]
        samples = [gen.Sample(i, torch.randint(4, 40, (length - 8,)).tolist(), [-1.0] * (length - 8),
                              [1] * (length - 8), [0] * (length - 8), "eos") for i in range(16)]
        mask = torch.ones(16 * (length - 8))
        group, adv = torch.zeros(16, dtype=torch.long), torch.tensor([1.0, -1.0] * 8)
        batch = loss.Batch(prompts, samples, [True] * 16, None, group, None, None, list(range(16)), adv,
                           loss.agg_counts(group, mask))
        saved = []

        def logprobs(ids, lens):
            size, out = bench.saved_bytes(lambda: trainer.packed_logprobs(model, ids, lens), model)
            saved.append(size)
            return out
        step_gradients(model, batch, args, logprobs)
        peaks[length] = max(saved)
        if length == 2048:
            ids, attn, *_ = trainer.collate(prompts, samples, 0, "cpu")
            whole = bench.saved_bytes(lambda: trainer.sequence_logprobs(model, ids, attn), model)[0]
    assert len(trainer.micro_batches([2048] * 16, 4096)) == 8 and len(trainer.micro_batches([256] * 16, 4096)) == 1
    assert abs(peaks[2048] / peaks[256] - 1) < 0.1, peaks
    assert whole > 6 * peaks[2048], (whole, peaks)


def test_train_bf16_steps_float32_master_weights_and_resumes_them_exactly(toy_dir, tmp_path):
    """--dtype bfloat16: AdamW steps float32 copies. Its first step, by hand: bias-corrected Adam with eps
    1e-15 moves each weight by exactly lr_1 = lr / warmup against its gradient's sign (0 where the gradient
    is 0), after the decoupled decay w (1 - lr_1 wd). At lr 1e-5 that is far under bf16's spacing, so the
    bf16 weights keep almost all of it only through the master copy; the resumed run continues from the
    saved float32 copies, not from their bf16 rounding."""
    lr, base = 1e-5, toy.toy_model_dir()  # the embedded model: it passes some prompts, so steps train
    flags = ["--model", base, "--dtype", "bfloat16", "--lr", "1e-5", "--eval_every", "2", "--save_every", "1"]
    first = run_train(toy_dir, tmp_path / "cut", *flags, "--steps", "1")
    assert [m["kept_prompts"] > 0 for m in first if m["kind"] == "train"] == [True]
    state = torch.load(tmp_path / "cut" / "ckpt-000001" / "state.pt", weights_only=False)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "cut" / "ckpt-000001", dtype=torch.bfloat16)
    start = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    lr_1, wd = lr / 10, 0.01  # --warmup 10, --weight_decay 0.01
    moved = kept = total = 0
    for (name, w), w0, m in zip(saved.named_parameters(), start.parameters(), state["master"]):
        assert m.dtype == torch.float32 and torch.equal(w, m.to(torch.bfloat16)), name
        step = (m - w0.float() * (1 - lr_1 * wd)).abs()
        ulps = 4 * torch.finfo(torch.float32).eps * w0.float().abs() + 1e-12  # float32 rounding of m
        assert ((step - lr_1).abs().minimum(step) <= ulps).all(), name
        moved += int((step > 0.5 * lr_1).sum())
        kept += int((w == w0).sum())
        total += w.numel()
    assert moved > 0.5 * total and kept > 0.95 * total, (moved, kept, total)
    full = run_train(toy_dir, tmp_path / "full", *flags, "--steps", "2")
    resumed = run_train(toy_dir, tmp_path / "cut", *flags, "--steps", "2", "--resume")
    assert strip_timing(resumed) == strip_timing(full)
    masters = [torch.load(tmp_path / d / "ckpt-000002" / "state.pt", weights_only=False)["master"]
               for d in ("full", "cut")]
    assert all(torch.equal(a, b) for a, b in zip(*masters))


def strip_timing(records):
    """Train records without the fields that measure time (they differ between any two runs)."""
    timing = ("compute_s", "dt_ms", "tok_s", "gen_busy", "train_busy", "sync_ms", "generate_ms", "verify_ms", "train_ms")
    return [{k: v for k, v in m.items() if k not in timing} for m in records if m["kind"] == "train"]


def test_train_sigkill_then_resume_equals_an_uninterrupted_run(toy_dir, tmp_path):
    flags = ["--model", toy_dir, "--steps", "6", "--save_every", "2", "--eval_every", "3"]
    (full,) = launch(1, tmp_path / "full", *flags)  # side by side with the run that is cut
    cut = tmp_path / "cut"
    (p,) = launch(1, cut, *flags)
    wait_for_train_records(cut, 3, [p])  # past the step-2 checkpoint, at an arbitrary point of step 4+
    p.send_signal(signal.SIGKILL)
    p.wait()
    (p,) = launch(1, cut, *flags, "--resume")
    (rc, rc_full), (out, out_full) = finish_all([p, full])
    assert rc == 0 and "resumed from" in out, out
    assert rc_full == 0, out_full
    records = [json.loads(ln) for ln in open(cut / "metrics.jsonl")]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
    assert strip_timing(records) == strip_timing([json.loads(ln) for ln in open(tmp_path / "full" / "metrics.jsonl")])


def test_train_an_eval_a_signal_cut_short_is_redone_on_resume_and_step_0s_is_kept(toy_dir, tmp_path, monkeypatch):
    """Ctrl-C while a held-out eval samples (faults.stop_on_signals' flag, raised from inside the eval): the eval
    logged nothing, the resume went on to the next step and that step's eval never came (evals 0, 2 of 0, 1, 2);
    during step 0's eval nothing was saved at all. Now the step is saved (step 0 too), its resume evaluates it first,
    and the evals and steps equal an uninterrupted run's."""
    evals_of = lambda out: [{k: r[k] for k in ("step", "pass_rate", "n", "trunc", "len")}  # noqa: E731
                            for r in map(json.loads, open(out / "metrics.jsonl")) if r["kind"] == "eval"]
    flags = ["--steps", "2", "--eval_every", "1"]
    run_train(toy_dir, tmp_path / "straight", *flags)
    assert [e["step"] for e in evals_of(tmp_path / "straight")] == [0, 1, 2]
    real, out = train.evaluate, tmp_path / "cut"
    for cut, resume in ((1, ()), (2, ("--resume",))):  # step 0's eval; then, resumed, step 1's (after 0's again)
        calls = []

        def cut_short(*a, **k):
            calls.append(1)
            if len(calls) == cut:  # the signal's flag, set while this eval samples
                faults.STOP.update(name="SIGINT", at=time.time())
            return real(*a, **k)
        monkeypatch.setattr(train, "evaluate", cut_short)
        try:
            run_train(toy_dir, out, *flags, *resume)
        finally:
            faults.STOP.clear()
        assert [e["step"] for e in evals_of(out)] == [0] * (cut - 1) and (out / f"ckpt-{cut - 1:06d}").is_dir()
    monkeypatch.setattr(train, "evaluate", real)
    run_train(toy_dir, out, *flags, "--resume")
    assert evals_of(out) == evals_of(tmp_path / "straight")
    assert strip_timing(map(json.loads, open(out / "metrics.jsonl"))) == \
        strip_timing(map(json.loads, open(tmp_path / "straight" / "metrics.jsonl")))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_train_a_signal_saves_the_last_step_says_how_to_resume_and_resume_continues_exactly(toy_dir, tmp_path, sig):
    """Ctrl-C (SIGINT) or SIGTERM mid-run: the step under way is abandoned, the last finished one saved, one
    line gives the exact command that resumes, the exit status is 128 + the signal; the command it gives
    repeats the uninterrupted run's steps exactly."""
    flags = ["--model", toy_dir, "--steps", "6", "--save_every", "0", "--eval_every", "3"]
    # side by side with the run that is stopped; the resume is checked once (SIGINT), the signals' handling
    # is one code path
    full = launch(1, tmp_path / "full", *flags)[0] if sig == signal.SIGINT else None
    cut = tmp_path / "cut"
    (p,) = launch(1, cut, *flags)
    wait_for_train_records(cut, 2, [p])
    p.send_signal(sig)
    assert p.wait(timeout=30) == 128 + sig  # seconds on an idle machine (README); CI machines are slower
    done = len(train_records(cut))
    ckpt = cut / f"ckpt-{done:06d}"
    argv = ["--out", str(cut), *PIPE_FLAGS, *flags, "--resume"]
    line = f"stopped by a signal after step {done}/6; saved {ckpt}; continue with: python {ROOT / 'train.py'} "
    said = Path(p.log).read_text().splitlines()
    assert line + " ".join(map(shlex.quote, argv)) in said and ckpt.is_dir() and done < 6
    # what it says on the signal is true whether the step under way was sampling (dropped) or training (saved)
    assert f"{sig.name}: stopping; the last step to finish will be saved ({sig.name} again, 3 s from now or " \
           "later: exit at once without saving)" in said
    if full is None:
        return
    (p,) = launch(1, cut, *flags, "--resume")
    (rc, rc_full), (out, out_full) = finish_all([p, full])
    assert rc == 0 and rc_full == 0, out + out_full
    records = [json.loads(ln) for ln in open(cut / "metrics.jsonl")]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
    assert strip_timing(records) == strip_timing([json.loads(ln) for ln in open(tmp_path / "full" / "metrics.jsonl")])


def test_pipeline_a_signal_to_one_rank_stops_every_rank_with_the_last_step_saved(tmp_path):
    """Under torchrun a SIGTERM may reach one rank only (a scheduler, a kill): here the generator. It passes the
    request on; the trainer stops after its step, saves it, says how to resume, and every rank exits with
    128 + SIGTERM; the resumed run goes on from that step."""
    procs = launch(2, tmp_path, "--steps", "40", "--save_every", "0")
    wait_for_train_records(tmp_path, 2, procs)
    procs[1].send_signal(signal.SIGTERM)
    rcs, (out, _) = finish_all(procs, timeout=60)
    assert rcs == [128 + signal.SIGTERM] * 2, out
    done = len(train_records(tmp_path))
    assert f"stopped by a signal after step {done}/40; saved {tmp_path / f'ckpt-{done:06d}'}; continue with: " \
           "torchrun --nproc_per_node 2 " in out
    saved = torch.load(tmp_path / f"ckpt-{done:06d}" / "state.pt", weights_only=True)["curricula"]["1"]
    assert saved["pos"] == done * 4  # the generator's curriculum at the step saved
    rcs, (out, _) = finish_all(launch(2, tmp_path, "--steps", str(done + 2), "--save_every", "0", "--resume"))
    assert rcs == [0, 0] and f"resumed from {tmp_path / f'ckpt-{done:06d}'} at step {done}" in out, out
    assert [r["step"] for r in train_records(tmp_path)] == list(range(1, done + 3))


def test_train_mixed_math_and_code_logs_a_pass_rate_per_domain(toy_dir, tmp_path):
    recs = run_train(toy_dir, tmp_path, "--data", f"toy,{FIXTURES / 'code_toy.jsonl'}", "--val_size", "30",
                     "--steps", "1", "--eval_every", "1", "--prompts", "8")
    ev = [r for r in recs if r.get("kind") == "eval"]
    assert all({"pass_rate/math", "pass_rate/code"} <= set(r) for r in ev)
    assert all(0 <= r["pass_rate/code"] <= 1 for r in ev)
    tr = [r for r in recs if r.get("kind") == "train"]
    assert tr and "pass_rate/math" in tr[0]


def test_train_note_on_the_toy_model_names_the_part_of_a_mix_it_does_not_know(capsys):
    toy = types.SimpleNamespace(model="")
    for data_, said in [("toy,fixtures/code_toy.jsonl", "which knows the toy task but not fixtures/code_toy.jsonl: "
                                                        "expect a pass rate near 0 on that part; give --model"),
                        ("fixtures/code_toy.jsonl", "which only knows the toy arithmetic task: expect a pass rate "
                                                    "near 0; give --model")]:
        train.note_toy_model(toy, data_, "--data", "trains")
        assert capsys.readouterr().out == f"note: --data without --model trains the embedded toy model, {said} a " \
                                          "real checkpoint\n"
    for args, data_ in [(toy, "toy"), (toy, None), (types.SimpleNamespace(model="m"), "fixtures/code_toy.jsonl")]:
        train.note_toy_model(args, data_, "--data", "trains")
    assert capsys.readouterr().out == ""


def nan_gradients_at(monkeypatch, steps):
    """Make the gradients of these optimizer steps (1-based) NaN, just before train.py clips them."""
    clip, calls = torch.nn.utils.clip_grad_norm_, [0]

    def poisoned(params, *a, **k):
        params = list(params)
        calls[0] += 1
        if calls[0] in steps:
            for p in params:
                p.grad.fill_(float("nan"))
        return clip(params, *a, **k)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", poisoned)


def test_train_skips_a_nan_step_and_stops_after_too_many(toy_dir, tmp_path, monkeypatch):
    nan_gradients_at(monkeypatch, {2})
    recs = run_train(toy_dir, tmp_path / "one", "--steps", "3", "--eval_every", "3", "--no-zero_var_filter")
    tr = [r for r in recs if r.get("kind") == "train"]
    assert [r["skipped_bad"] for r in tr] == [False, True, False]
    assert tr[2]["lr"] == tr[1]["lr"] == 2 * tr[0]["lr"]  # the skipped step did not advance the schedule
    assert [r["lr"] for r in tr] == pytest.approx(warmed_up(recs, 2e-4))
    nan_gradients_at(monkeypatch, {2, 3, 4})
    with pytest.raises(SystemExit, match="3 consecutive steps with a non-finite"):
        run_train(toy_dir, tmp_path / "many", "--steps", "5", "--max_bad_steps", "3", "--no-zero_var_filter")


def chain_model(tokenizer, successors):
    """A Llama whose next token depends only on the current one: successors maps a token id to the ids that
    may follow it (equally likely; a token not in the map is followed by eos). Attention and MLP outputs are
    zero, the embeddings one-hot, so the LM head reads the current token alone: a sampler's output is a walk
    on this graph, known in advance."""
    V = len(tokenizer)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=V, intermediate_size=8, num_hidden_layers=1,
                                         num_attention_heads=1, num_key_value_heads=1, head_dim=V,
                                         max_position_embeddings=512, tie_word_embeddings=False,
                                         eos_token_id=tokenizer.eos_token_id))  # the sampler stops on it
    with torch.no_grad():
        for p in model.model.layers[0].parameters():
            p.zero_()
        model.model.layers[0].input_layernorm.weight.fill_(1)
        model.model.layers[0].post_attention_layernorm.weight.fill_(1)
        model.model.embed_tokens.weight.copy_(torch.eye(V))
        head = torch.zeros(V, V)
        for t in range(V):
            for nxt in successors.get(t, [tokenizer.eos_token_id]):
                head[nxt, t] = 1.0  # after the final norm the one-hot is sqrt(V) ~ 19: a logit gap of ~19
        model.lm_head.weight.copy_(head)
    return model.eval()


def ids_of(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def chain(tokenizer, *texts):
    """{token: [next]} for the token sequences of texts, each a chain; the first token of each text follows
    the last of the one before (the prompt's last token starts the first)."""
    successors, prev = {}, None
    for text in texts:
        for t in ids_of(tokenizer, text):
            if prev is not None:
                successors.setdefault(prev, []).append(t)
            prev = t
    return successors


def test_rethinking_after_the_answer_tag_is_scored_under_the_default_budgets_not_truncated():
    """The collapse shape (more thinking after </think>, issue: truncation blind spot): a policy that after
    </think> either answers (11 tokens) or writes 20 more tokens of arithmetic and no answer. Under the old
    16-token answer budget the long answers are all truncated and leave the loss: every group is then
    all-correct, zero-variance filtering drops it, nothing is trained, the format is never penalized. Under
    the default budgets they end, score -1 and keep a gradient against that format."""
    tok = AutoTokenizer.from_pretrained(toy.toy_model_dir())
    succ = chain(tok, "?", "<think>", "5", "</think>", " The answer is \\boxed{8}.")
    succ[ids_of(tok, "</think>")[0]].append(ids_of(tok, "10")[0])  # or: 20 tokens of numbers, then eos
    succ.update(chain(tok, *map(str, range(10, 30))))  # one token per number
    model = chain_model(tok, succ)
    prompt = ids_of(tok, "?")
    problems = [{"prompt": "?", "answer": "8", "domain": "math"}] * 16
    kept = {}
    for budget in ("16", str(config.get_args([]).answer_budget)):
        args = config.get_args(["--answer_budget", budget])
        steps = pipeline.make_sampler(model, tok, args, len(prompt))
        done = gen.drive(steps, [(prompt, i, i) for i in range(16)])
        samples = [done[i] for i in range(16)]
        texts, correct, rewards = data.score_samples(tok, samples, problems)
        assert {t.split("</think>")[1][:4] for t in texts} == {" The", "1011"}  # both branches were sampled
        assert correct == [t.endswith("\\boxed{8}.") for t in texts]
        groups = [{"index": 0, "prompt": prompt, "samples": samples, "correct": correct, "rewards": rewards}]
        batch = loss.make_batch(groups, length=loss.LengthControl.from_args(args),
                                keep_truncated=args.keep_truncated, zero_var_filter=args.zero_var_filter,
                                adv_norm=args.adv_norm)
        kept[budget] = (sum(s.finish == "truncated" for s in samples), len(batch.rows), batch.adv)
    old, new = kept["16"], kept[str(config.get_args([]).answer_budget)]
    assert old[0] > 0 and old[1] == 0  # the long answers truncated; the group, all correct, dropped
    assert new[0] == 0 and new[1] == 16 and (new[2] < 0).sum() == old[0]  # every long answer pushed down


def test_a_truncated_sample_is_never_correct_in_rewards_npr_and_evals():
    """A truncated sample whose text already holds the right box (it wrote the answer, then ran on) did not
    answer: it is incorrect for the reward, for No-Positive-Resampling's pass-rate history and for the
    held-out pass rate; the same text ended by eos is correct."""
    tok = AutoTokenizer.from_pretrained(toy.toy_model_dir())
    text = "<think>5+2=7.</think>5+2=7.</think> The answer is \\boxed{7}"
    done = gen.Sample(0, ids_of(tok, text) + [tok.eos_token_id], [0.0] * 30, [1] * 30, [0] * 30, "eos")
    cut = gen.Sample(0, ids_of(tok, text), [0.0] * 30, [1] * 30, [0] * 30, "truncated")
    problem = {"prompt": "?", "answer": "7", "domain": "math"}
    assert data.score_samples(tok, [done, cut], [problem] * 2)[1] == [True, False]
    # a policy that writes the right box and never stops: every sample truncated, none correct
    model = chain_model(tok, chain(tok, "?", "<think>5</think> The answer is \\boxed{7}.", *map(str, range(10, 18))))
    succ_loop = ids_of(tok, "17")[0]
    model.lm_head.weight.data[:, succ_loop] = 0
    model.lm_head.weight.data[ids_of(tok, "10")[0], succ_loop] = 1.0  # ... 17 -> 10: a loop, no eos
    args = config.get_args(["--prompts", "2", "--samples", "4"])
    train_set = [dict(problem, prompt=f"?{i}") for i in range(2)]
    source = pipeline.LocalRollouts(args, model, tok, train_set, [ids_of(tok, "?")] * 2, 0)
    groups, _ = source.get(0)
    assert all(s.finish == "truncated" for g in groups for s in g["samples"])
    assert "\\boxed{7}" in data.completion_text(tok, groups[0]["samples"][0])
    assert [c for g in groups for c in g["correct"]] == [False] * 8
    assert [r for g in groups for r in g["rewards"]] == [-1.0] * 8
    curriculum = source.gen.prompts.curriculum
    assert curriculum.history == {0: [0.0], 1: [0.0]} and not curriculum.retired
    result = train.evaluate(model, tok, [ids_of(tok, "?")], [problem], args)
    assert result["pass_rate"] == 0.0 and result["trunc"] == 1.0


def test_train_forget_alarm_reads_a_window_of_steps_and_a_solved_batch_is_no_alarm(capsys):
    """The forget alarm averages the last FORGET_WINDOW steps that trained: a one-step spike (healthy pinned
    runs showed them up to 0.069) says nothing; a sustained loss above FORGET_ALARM (the lr-3e-4 collapse:
    from step 20, its fall at 40) warns once, at the step its window passes the threshold. A step that keeps no
    prompt warns, unless every sample was right (a solved batch)."""
    rec = metrics.Record(config.get_args([]), log=None, world=1, n_params=1, domains=["math"])
    def step(i, forget, kept=4):
        metrics.alarms(rec, {"step": i, "trunc": 0.0, "forget": forget, "kept_prompts": kept, "lag_max": 8,
                           "pass_rate": 0.5})
        return capsys.readouterr().out
    assert metrics.FORGET_WINDOW == 5 and metrics.FORGET_ALARM == 0.01
    spike = 5 * metrics.FORGET_ALARM - 1e-3
    assert [step(i, f) for i, f in enumerate([spike, 0.0, 0.0, 0.0, 0.0], 1)] == [""] * 5
    assert "forget" not in step(6, 1.0, kept=0)  # a step that trained nothing is not in the window
    outs = [step(i, 0.011) for i in range(7, 13)]
    assert outs[:4] == [""] * 4 and outs[4].startswith("warning: step 11: forget 0.011 (mean of the last 5")
    assert outs[5] == ""  # once
    rec = metrics.Record(config.get_args([]), log=None, world=1, n_params=1, domains=["math"])
    empty = {"trunc": 0.0, "forget": None, "kept_prompts": 0, "lag_max": 8}
    metrics.alarms(rec, {**empty, "step": 1, "pass_rate": 1.0})  # every group all right: solved, no alarm
    assert capsys.readouterr().out == "" and rec.empty_steps == 1
    metrics.alarms(rec, {**empty, "step": 2, "pass_rate": 0.4})
    assert capsys.readouterr().out.startswith("warning: step 2: no prompt kept") and rec.empty_steps == 2


def test_train_resume_gives_the_forget_alarm_its_window_back(tmp_path, capsys):
    """On --resume the window holds the forget of the last FORGET_WINDOW steps that trained before the
    checkpoint (not those logged after it): a fall that began before a restart still warns at once."""
    lines = [{"kind": "config"}] + [{"kind": "train", "step": i, "forget": 0.02 if i > 6 else 0.0,
                                     "kept_prompts": 0 if i == 9 else 4} for i in range(1, 12)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    args = config.get_args(["--out", str(tmp_path)])
    env = types.SimpleNamespace(args=args, state={}, ctx=None, train=[{}], log=None, rank0=True, ckpt="ckpt-10")
    rec = metrics.new_record(env, types.SimpleNamespace(n_params=1, version=10))
    assert rec.forgets == [0.0, 0.0, 0.02, 0.02, 0.02]  # steps 5-8 and 10 (9 kept nothing; 11 was dropped)
    metrics.alarms(rec, {"step": 11, "trunc": 0.0, "forget": 0.02, "kept_prompts": 4, "lag_max": 8, "pass_rate": 0.5})
    assert capsys.readouterr().out.split("\n")[-2].startswith("warning: step 11: forget 0.016")  # alone: 0.004


def test_train_held_out_interruption_rise_warns_once_and_survives_resume(tmp_path, capsys):
    """The toy-hard collapse at lr 1.4e-4 (BENCHMARKS.md section 6): its held-out interruption went 0.3% -> 14.8%
    between two evals, with truncation at 0 (the truncation alarms saw nothing). A rise of more than
    HELD_OUT_INTR_RISE since the eval before warns once, naming the cause; the falling interruption of a healthy
    run says nothing. On --resume the evals before the checkpoint give the alarm its last reading back."""
    rec = metrics.Record(config.get_args([]), log=None, world=2, n_params=1, domains=["math"])
    def ev(step, rate, intr):
        rec.evals.append((step, rate))
        rec.eval_intr.append(intr)
        metrics.eval_alarms(rec, step, {"trunc": 0.0, "pass_rate": rate, "intr": intr})
        return capsys.readouterr().out
    assert metrics.HELD_OUT_INTR_RISE == 0.05
    assert [ev(s, r, i) for s, r, i in [(0, 0.24, 0.137), (10, 0.30, 0.09), (150, 0.931, 0.003),
                                        (152, 0.93, 0.05)]] == [""] * 4  # falling, then a rise of 0.047
    out = ev(160, 0.784, 0.1485).splitlines()
    assert out[0].startswith("warning: step 160: the held-out pass rate fell from 0.930 to 0.784")
    assert out[0].endswith("the stale samples': a lower --max_lag, or --mode sync" + metrics.SEE)  # staleness, not the lr
    assert out[1].startswith("warning: step 160: 14.8% of the held-out samples were interrupted (5.0% at the eval "
                             "before)") and out[1].endswith(": --mode sync" + metrics.SEE)
    assert ev(170, 0.605, 0.326) == ""  # once
    lines = [{"kind": "config"}] + [{"kind": "eval", "step": s, "compute_s": s, "pass_rate": 0.9, "intr": i}
                                    for s, i in [(0, 0.1), (10, 0.004), (20, 0.3)]]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    env = types.SimpleNamespace(args=config.get_args(["--out", str(tmp_path)]), state={}, ctx=None, train=[{}],
                                log=None, rank0=True, ckpt="ckpt-10")
    rec = metrics.new_record(env, types.SimpleNamespace(n_params=1, version=10))
    capsys.readouterr()
    assert rec.eval_intr == [0.1, 0.004]  # step 20's eval came after the checkpoint: dropped
    assert ev(20, 0.9, 0.2).startswith("warning: step 20: 20.0% of the held-out samples were interrupted (0.4%")


def test_train_held_out_truncation_warning_names_the_flags_of_its_mode(capsys):
    """Held-out truncation after step 0: under PipelineRL-k the advice is the lag (a lower lr did worse on
    toy-hard, BENCHMARKS.md section 6); on-policy (one process, or --mode sync) it is the lr."""
    def warned(world, *flags):
        rec = metrics.Record(config.get_args(list(flags)), log=None, world=world, n_params=1, domains=["math"])
        metrics.eval_alarms(rec, 10, {"trunc": metrics.HELD_OUT_TRUNC_ALARM + 0.01, "pass_rate": 0.5, "intr": 0.0})
        return capsys.readouterr().out
    stale = warned(2)
    assert "(its training batches are older). Raise --answer_budget, or train nearer on-policy: a lower " \
           "--max_lag, or --mode sync, or train on truncated samples with --keep_truncated" in stale
    assert "--lr" not in stale
    for on_policy in (warned(1), warned(2, "--mode", "sync")):
        assert "writes past its budgets. Raise --answer_budget or lower --lr, or train on truncated" in on_policy
        assert "--max_lag" not in on_policy and "older" not in on_policy
    assert warned(2, "--keep_truncated").rstrip().endswith("a lower --max_lag, or --mode sync" + metrics.SEE)


def test_train_warns_on_truncation_and_stops_after_steps_that_keep_nothing(tmp_path, capsys):
    """A budget too small for any answer: every sample truncated, every step keeps no prompt. The log warns
    once about the truncation rate and once about the empty step, and after --max_empty_steps in a row the
    run stops, naming the cause and the flags, with its last step saved and evaluated."""
    recs = run_train(toy.toy_model_dir(), tmp_path, "--steps", "20", "--think_budget", "2", "--answer_budget", "1",
                     "--max_empty_steps", "3", "--eval_every", "50")
    out = capsys.readouterr().out
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2, 3]
    assert all(r["trunc"] == 1.0 and r["kept_prompts"] == 0 for r in recs if r["kind"] == "train")
    assert out.count("warning: step 1: 100% of the batch was truncated") == 1
    assert out.count("warning: step 1: no prompt kept") == 1
    assert out.count("warning: step 0: 100.0% of the held-out samples ran out of budget: the base model writes "
                     "past its budgets. Raise --answer_budget or --think_budget, or train on truncated") == 1
    assert out.count("warning:") == 3
    assert "stopping at step 3: 3 steps in a row kept no prompt" in out
    assert "Raise --answer_budget, or train on them with --keep_truncated" in out
    assert [r["step"] for r in recs if r["kind"] == "eval"] == [0, 3] and (tmp_path / "ckpt-000003").exists()
    stopped = [r for r in recs if r["kind"] == "stopped"]  # the run says it ended itself: study.py counts it done
    assert stopped == [{"kind": "stopped", "step": 3, "reason": stopped[0]["reason"]}]
    assert stopped[0]["reason"].startswith("stopping at step 3: 3 steps in a row kept no prompt")
    assert study.finished(str(tmp_path), 20)  # no eval at step 20, but over
    runs.truncate_metrics(str(tmp_path / "metrics.jsonl"), 3)  # resumed, it goes on: no longer stopped
    assert not study.finished(str(tmp_path), 20)
    # given --keep_truncated, no message suggests it; the batch's says the samples stay in the loss
    run_train(toy.toy_model_dir(), tmp_path / "kept", "--steps", "1", "--think_budget", "2", "--answer_budget",
              "1", "--max_empty_steps", "1", "--keep_truncated")
    out = capsys.readouterr().out
    assert out.count("warning:") == 3 and "--keep_truncated keeps them in the loss, as wrong answers" in out
    assert "Raise --answer_budget or --think_budget" + metrics.SEE + "\n" in out and "stopping at step 1" in out
    assert "train on truncated samples" not in out and "train on them" not in out


def test_train_resume_keeps_the_count_of_steps_that_kept_nothing(tmp_path, capsys):
    """Two steps that keep no prompt, saved, then --resume: the third in a row stops the run with
    --max_empty_steps 3, as it does uninterrupted (the count restarted at 0 stopped it at step 5)."""
    flags = ("--think_budget", "2", "--answer_budget", "1", "--max_empty_steps", "3", "--eval_every", "50")
    run_train(toy.toy_model_dir(), tmp_path, "--steps", "2", "--save_every", "2", *flags)
    recs = run_train(toy.toy_model_dir(), tmp_path, "--steps", "20", "--resume", *flags)
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2, 3]
    assert "stopping at step 3: 3 steps in a row kept no prompt" in capsys.readouterr().out


def test_train_tok_s_of_a_step_that_trains_nothing_is_no_rate():
    sums = {"len": 300, "train_tokens": 0}  # a torchrun step that kept no prompt: nothing trained
    assert metrics.tokens_per_s(sums, {"gen_s": 2.0}, 3.0) == 150  # one process: the sampler's rate, as ever
    assert metrics.tokens_per_s(dict(sums, train_tokens=600), {}, 3.0) == 200  # torchrun: trained tokens / s
    assert metrics.tokens_per_s(sums, {}, 3.0) is None
    m = dict(step=4, reward=-1.0, pass_rate=0.0, len=9.0, entropy=0.1, trunc=1.0, intr=0.0, lag=0.0, lag_max=0,
             kept_prompts=0, prompts=8, loss=0.0, dt_ms=30.0, tok_s=None)
    assert metrics.log_line(m, 10).endswith("| kept 0/8 | loss +0.0000 | dt 30 ms | tok/s n/a")


def test_drift_by_lag_is_the_mean_abs_log_ratio_per_lag():
    logp = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.0, -1.0, -3.0, -2.0]])
    gen_logp = torch.tensor([[-1.5, -2.0, -0.1, 9.0], [-1.0, -2.0, -1.0, -2.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    lag = torch.tensor([[0, 2, 2, 5], [1, 1, 2, 0]])
    parts = [drift_by_lag(logp[:1], gen_logp[:1], mask[:1], lag[:1]), drift_by_lag(logp[1:], gen_logp[1:], mask[1:], lag[1:])]
    by_lag = metrics.lag_drift(parts)
    # lag 0: |0.5| and |0|; lag 1: |0| and |1|; lag 2: |0|, |0.4|, |2|; the masked lag-5 token is not counted
    assert by_lag["log_rho_by_lag"] == pytest.approx([0.25, 0.5, 0.8])
    assert by_lag["drift"] == pytest.approx(0.8)


# a fresh interpreter running a script whose import of torch ends it, saying so: what it printed before is all
STOP_AT_TORCH = """import runpy, sys
class StopAtTorch:
    def find_spec(self, name, path=None, target=None):
        if name in ("torch", "transformers"):
            print("<" + name + " imported>", flush=True)
            raise SystemExit(0)
sys.meta_path.insert(0, StopAtTorch())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_flags_and_their_errors_come_before_torch_is_imported():
    """Every flag error and --help took 13-24 s on a busy machine (torch and transformers imported first), and a normal
    start was silent for 15 s: train.py, generate.py and bench.py parse their flags before those imports, and a start says so
    first. (config.py imports neither.)"""
    def run(*argv):
        done = subprocess.run([sys.executable, "-c", STOP_AT_TORCH, *argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=60)
        return done.returncode, done.stdout, done.stderr
    code, out, err = run("train.py", "--help")
    assert code == 0 and "--think_budget" in out and "imported>" not in out, (out, err)
    code, out, err = run("train.py", "--temprature", "0.5")
    assert code == 2 and "imported>" not in out and err.strip().splitlines() == [
        "train.py: error: unrecognized arguments: --temprature 0.5 (--temprature: did you mean --temperature?) (--help "
        "lists the flags)"], (out, err)
    code, out, err = run("generate.py", "--help")
    assert code == 0 and "--think_budget" in out and "imported>" not in out, (out, err)
    code, out, err = run("generate.py", "--nn", "2")  # one line, as train.py's
    assert code == 2 and "imported>" not in out and err.strip().splitlines() == [
        "generate.py: error: unrecognized arguments: --nn 2 (--nn: did you mean --n?) (--help lists the flags)"], err
    code, out, err = run("bench.py", "--help")
    assert code == 0 and "--figures" in out and "imported>" not in out, (out, err)
    code, out, err = run("bench.py", "--figures", "9")
    assert code == 2 and "imported>" not in out and "--figures: no figure 9" in err, (out, err)
    for script in ("train.py", "generate.py"):  # a start: its first line before the heavy imports
        code, out, err = run(script)
        assert out.splitlines()[:2] == ["starting: importing torch and transformers ...", "<torch imported>"], out
    assert (config.LOSS_KINDS, config.AGGS, config.NORMS) == (tuple(loss.LOSSES), loss.AGGS, loss.NORMS)


def test_val_size_takes_the_first_of_val_data_and_resume_compares_what_the_run_used(tmp_path, capsys):
    """--val_size was silently ignored with --val_data (yet listed among the flags that differ), and a resume that
    dropped it, or changed the recipe, was refused for a value the run never used (--val_size was 8, now 500): it
    takes the first N held-out problems, the recipe's sizes only a split of --data, and resume compares those used."""
    rows = tmp_path / "val.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Compute {i}+1.", "answer": str(i + 1)}) + "\n" for i in range(5)))
    every = train.load_data(config.get_args(["--val_data", str(rows)]))[1]
    first = train.load_data(config.get_args(["--val_data", str(rows), "--val_size", "3"]))[1]
    assert [p["prompt"] for p in every] == [f"Compute {i}+1." for i in range(5)] and first == every[:3]
    with pytest.raises(SystemExit) as exit_:
        train.load_data(config.get_args(["--val_data", str(rows), "--val_size", "6"]))
    assert exit_.value.code == (f"error: --val_size 6: --val_data {rows} has 5 problems: give at most 5, or no "
                                "--val_size for all")
    budgets = ["--val_data", str(rows), "--think_budget", "48", "--answer_budget", "64"]
    one_gpu = config.get_args([*budgets, "--recipe", "one_gpu"])
    assert one_gpu.val_size is None and "--val_size" not in config.recipe_lines(one_gpu, 5)[1]
    runs.check_resume(vars(one_gpu), config.get_args([*budgets, "--recipe", "paper"]))  # neither used a --val_size
    assert "--resume: changed since the run started" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:  # one that was used, dropped: another held-out set
        runs.check_resume(vars(config.get_args([*budgets, "--val_size", "3"])), config.get_args(budgets))
    assert exit_.value.code == ("error: --resume: --val_size was 3, now None (start another --out for another run)")


def test_default_out_tells_recipes_and_models_apart_and_tracker_errors_leave_no_folder(toy_dir, tmp_path,
                                                                                      monkeypatch):
    """The default --out named only the data (a second recipe on it was refused as the same run), and --tensorboard
    without its package left --out/.lock behind: the default names the model, data and recipe (but the toy's), and a
    missing tracker library is said before anything is made in --out."""
    outs = [config.get_args(argv).out for argv in
            ([], ["--recipe", "one_gpu", "--think_budget", "48", "--answer_budget", "64"], ["--model", toy_dir],
             ["--model", toy_dir, "--recipe", "paper", "--think_budget", "48", "--answer_budget", "64", "--data",
              "fixtures/gsm8k_test_sample.jsonl"])]
    assert outs == ["runs/toy", "runs/toy-one_gpu", "runs/model-toy", "runs/model-gsm8k_test_sample-paper"], outs
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # not installed
    out = tmp_path / "tb"
    with pytest.raises(SystemExit, match="--tensorboard needs a package that is not installed"):
        train.start(config.get_args(["--model", toy_dir, "--tensorboard", "--out", str(out)]))
    assert not out.exists()


def test_train_rejects_bad_flags_and_folders_before_any_work(toy_dir, tmp_path, capsys):
    for argv, msg in [(["--loss", "ppo"], "invalid choice"), (["--think_budget", "-4"], "must be positive"),
                      (["--model", str(tmp_path)], "no config.json"),
                      (["--warmup", "0"], "must be positive"), (["--grad_clip", "-1"], "must be >= 0"),
                      (["--micro_tokens", "-1"], "must be >= 0")]:
        with pytest.raises(SystemExit):
            config.get_args(argv)
        assert msg in capsys.readouterr().err, argv
    empty = tmp_path / "noweights"
    empty.mkdir()
    (empty / "config.json").write_text('{"model_type": "llama"}')
    bad_arch = tmp_path / "gpt2"
    bad_arch.mkdir()
    (bad_arch / "config.json").write_text('{"model_type": "gpt2"}')
    (bad_arch / "model.safetensors").write_bytes(b"")
    errors = []
    for path in (empty, bad_arch):
        checks.check_model_dir(str(path), errors.append)
    assert "no weights" in errors[0] and "'gpt2' is not supported" in errors[-1]
    short = tmp_path / "short"  # a 112-token context (Qwen2.5-Math's is 4096)
    short.mkdir()
    (short / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": 112}')
    (short / "model.safetensors").write_bytes(b"")
    with pytest.raises(SystemExit):
        config.get_args(["--model", str(short), "--think_budget", "100", "--answer_budget", "13"])
    assert capsys.readouterr().err.strip().splitlines() == [
        "train.py: error: --think_budget 100 + --answer_budget 13 = 113 tokens: more than the model's context "
        "(max_position_embeddings 112); lower the budgets (--help lists the flags)"]
    args = config.get_args(["--model", str(short), "--think_budget", "48", "--answer_budget", "64"])
    assert checks.context_error(args, 112) is None
    assert checks.context_error(args, 112, 30, 8) == (
        "the longest prompt (30 tokens) + --think_budget 48 + --answer_budget 64 + the interruption phrase (8) = "
        "150 tokens: more than the model's context (max_position_embeddings 112); lower the budgets to 74 tokens "
        "together at most, or shorten that prompt")
    assert checks.context_error(args, 112, 103, 8) == (  # one token left: not one of each budget
        "the longest prompt (103 tokens) does not fit the model's context (max_position_embeddings 112) with the "
        "interruption phrase (8), whatever the budgets: shorten or drop that prompt")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if os.geteuid() != 0:  # root writes anywhere: the check cannot fail there
        with pytest.raises(SystemExit, match="not writable"):
            runs.prepare_out_dir(config.get_args(["--out", str(locked / "run")]))
    with pytest.raises(SystemExit, match="not writable"):
        (tmp_path / "file.txt").write_text("x")
        runs.prepare_out_dir(config.get_args(["--out", str(tmp_path / "file.txt" / "run")]))
    with pytest.raises(SystemExit):
        config.get_args(["--resume", "--overwrite"])


def test_train_model_folder_files_are_regular_and_bounded_before_transformers_reads_them(toy_dir, tmp_path, capsys):
    """transformers reads a model folder's files by name: its tokenizer_config.json or weights as a FIFO hung the
    load, a generation_config.json linked to /dev/zero was read without end (train.py and generate.py). Every file
    it may read (hub's MODEL_FILES) is checked first, before any is read: a regular file, within its cap
    (weights: any size)."""
    for name, kind in (("tokenizer_config.json", "a FIFO"), ("model.safetensors", "a FIFO"),
                       ("generation_config.json", "a device"), ("tokenizer.json", "over")):
        model = tmp_path / name / "model"
        shutil.copytree(toy_dir, model)
        if kind == "over":  # sparse: no byte written
            os.truncate(model / name, runs.MODEL_FILE_BYTES + 1)
        else:
            special_file(model / name, kind)
        with pytest.raises(SystemExit):
            config.get_args(["--model", str(model), "--out", str(tmp_path / "run")])
        why = (f"{runs.MODEL_FILE_BYTES + 1:,} bytes, over the {runs.MODEL_FILE_BYTES:,} such a file may hold"
               if kind == "over" else f"not a regular file ({kind})")
        assert capsys.readouterr().err.strip().splitlines() == [
            f"train.py: error: --model {model}: {model / name}: {why} (--help lists the flags)"], name
        code, said = run_capped(["--model", model], tmp_path / "generate.log", script="generate.py")
        assert code == 1 and said.strip().splitlines()[-1] == f"error: --model {model / name}: {why}", said[-600:]
    assert not (tmp_path / "run").exists()


def test_train_number_flags_must_be_finite_and_in_range_before_anything_is_made(tmp_path, capsys):
    """nan, inf and negative values went through (`--temperature -1` trained silently to 0.000): each is one line
    naming the flag, at parsing, before --out exists."""
    out = tmp_path / "run"
    for flag in ("lr", "temperature", "adam_eps", "weight_decay", "grad_clip", "eps_high", "eps_low", "timeout",
                 "heartbeat_timeout"):
        for value in ("nan", "inf", "-1"):
            with pytest.raises(SystemExit):
                config.get_args(["--out", str(out), f"--{flag}", value])
            said = capsys.readouterr().err.strip().splitlines()
            assert len(said) == 1 and said[0].startswith(f"train.py: error: --{flag} must be "), (flag, value, said)
    for argv in (["--timeout", "1e300"], ["--seed", "-1"], ["--keep", "0"], ["--l_cache", "-3"], ["--eps_low", "5"],
                 ["--loss", "grpo", "--eps_low", "1.5"]):
        with pytest.raises(SystemExit):
            config.get_args(["--out", str(out), *argv])
        assert capsys.readouterr().err.count("\n") == 1, argv
    assert not out.exists()
    assert config.get_args(["--eps_low", "0", "--grad_clip", "0", "--weight_decay", "0"]).grad_clip == 0  # 0: off


def test_user_errors_are_one_line_naming_the_flag_and_leave_no_folder(toy_dir, tmp_path, capsys):
    for argv, line in [(["--prompt", "8"], "train.py: error: unrecognized arguments: --prompt 8 (--prompt: did you "
                                           "mean --prompts?) (--help lists the flags)"),
                       (["--lr_rate", "1e-5", "--temp", "1"], "train.py: error: unrecognized arguments: --lr_rate 1e-5 "
                        "--temp 1 (--lr_rate: did you mean --lr?) (--temp: did you mean --temperature?) (--help"),
                       (["--device", "cuda"], "train.py: error: --device cuda: this PyTorch build has no CUDA")]:
        if argv[0] == "--device" and torch.cuda.is_available():
            continue
        with pytest.raises(SystemExit):
            config.get_args(argv)
        said = capsys.readouterr().err.strip().splitlines()
        assert len(said) == 1 and said[0].startswith(line), said
    for flags, message in [(["--data", "no_such.jsonl"], "error: --data no_such.jsonl: No such file or directory"),
                           (["--val_data", "none.jsonl"], "error: --val_data none.jsonl: No such file or directory")]:
        with pytest.raises(SystemExit) as exit_:
            run_train(toy_dir, tmp_path / "out", *flags)
        assert exit_.value.code == message and not (tmp_path / "out").exists()
    train_set, val = train.load_data(config.get_args(["--data", str(FIXTURES / "code_toy.jsonl")]))
    assert (len(train_set), len(val)) == (18, 2)  # the default split of a small data set: a tenth held out
    help_ = Forked(["--help"], {}, tmp_path / "help.log", script="toy.py")
    assert help_.wait(timeout=60) == 0 and "--build" in help_.communicate()[0]


def test_error_lines_and_notes_show_the_control_characters_of_paths_and_fields_escaped(toy_dir, tmp_path, capsys):
    """A folder's name is an input too: with \\x1b]0;...\\x07 in it (it retitles the window) or a carriage return,
    train.py's, fit.py's, study.py's and data.py's error lines and data.py's loading notes printed it raw; now as
    \\xNN, in one line, with the field values and non-ASCII text as they were."""
    odd = tmp_path / "问题\x1b]0;pwned\x07\r"
    shown = str(tmp_path / "问题\\x1b]0;pwned\\x07 ")
    odd.mkdir()
    (odd / "p.jsonl").write_text(json.dumps({"prompt": "x", "answer": "1", "domain": "\x1b[2J"}) + "\n")
    (odd / "dup.jsonl").write_text(json.dumps({"prompt": "√2 ≤ π?", "answer": "1"}) + "\n" +
                                   json.dumps({"prompt": "√2 ≤ π?", "answer": "1"}) + "\n")
    data.load_problems(str(odd / "dup.jsonl"))
    assert capsys.readouterr().err == (f"{shown}/dup.jsonl: skipped 1 duplicate prompt(s); each is kept where it first "
                                       f"occurs (the first at {shown}/dup.jsonl:2)\n")
    ckpt = odd / "ckpt-000001"  # a checkpoint's state.pt names its shards' folder
    ckpt.mkdir()
    torch.save({"shards": "\x1b]0;pwned\x07"}, ckpt / "state.pt")
    (ckpt / "config.json").write_text("{}")
    shutil.copy(Path(toy_dir) / "model.safetensors", ckpt)
    assert runs.intact_checkpoint(str(odd)) == (None, {})
    said = capsys.readouterr().out
    assert "pwned" in said and not CONTROL_CHARACTERS.search(said.rstrip("\n")), said
    shutil.rmtree(ckpt)
    with pytest.raises(SystemExit):  # argparse's message, and did_you_mean's
        config.get_args(["--temp\x1b]0;pwned\x07", "1"])
    said = capsys.readouterr().err
    assert "--temp\\x1b]0;pwned\\x07 1 (--temp" in said and not CONTROL_CHARACTERS.search(said), said
    (odd / "run").mkdir()
    (odd / "run" / "metrics.jsonl").write_text('{"kind": "eval", "step": 1, "compute_s": 1, "pass_rate": 2}\n')
    cases = {"data": (["--data", str(odd / "p.jsonl"), "--out", str(tmp_path / "out")], "train.py",
                      f"train.py: error: --data: {shown}/p.jsonl:1: field 'domain' must be 'math' or 'code', "
                      "got '\\x1b[2J'"),
             "out": (["--out", str(odd / "run")], "train.py",
                     f"train.py: error: --out {shown}/run holds metrics.jsonl but is not a run of train.py"),
             "fit": ([str(odd / "run")], "fit.py",
                     f"error: {shown}/run/metrics.jsonl:1: field 'pass_rate' must be a pass rate in [0, 1], got 2"),
             "study": (["--report", "--quick", str(odd)], "study.py",
                       f"study: no variant has all 1 seeds finished in {shown}"),
             "loader": ([str(odd / "p.jsonl")], "data.py", f"error: {shown}/p.jsonl:1: field 'domain' must be")}
    started = {name: Forked(argv, {}, tmp_path / f"{name}.log", script=script)
               for name, (argv, script, _) in cases.items()}
    for name, run in started.items():
        assert run.wait(timeout=60) in (1, 2), name
        said = run.communicate()[0]
        assert said.rstrip("\n").splitlines()[-1].startswith(cases[name][2]), (name, said)
        assert not CONTROL_CHARACTERS.search(said), (name, said)


def test_pipeline_a_user_error_is_one_line_from_rank_0_alone(toy_dir, tmp_path):
    """Rank 0 alone judges --out, once the ranks have met: its error is its last line, with its rank and host; the
    other rank stops with the same exit code and says nothing (without torchrun's error files: its node's first
    rank would name the failed one)."""
    run_train(toy_dir, tmp_path, "--steps", "1")
    rcs, outs = finish_all(launch(2, tmp_path, "--steps", "1"))
    assert rcs == [2, 2]  # as argparse's errors: one prefix, one exit code
    assert outs[0].strip().splitlines()[-1] == (
        f"train.py: error: --out {tmp_path} already holds a run (ckpt-000001, metrics.jsonl): pass --resume to continue "
        f"it, --overwrite to start over, or another --out (rank 0 (trainer) on {socket.gethostname()})")
    assert "".join(outs).count("already holds a run") == 1 and outs[1].strip() == ""


def test_a_real_model_gets_the_papers_recipe_and_the_toy_its_own(tmp_path, capsys):
    """Any model but the embedded ones (a random-weight Qwen2 folder here) starts from the paper's recipe
    (appendix A.3), the flags given override it and the start-up line names them; the embedded default
    keeps the toy's values."""
    folder = str(tmp_path / "qwen2")
    bench.write_model(bench.get_args(["--write_model", folder]))
    paper = config.get_args(["--model", folder])
    assert (paper.recipe, paper.lr, paper.warmup, paper.prompts, paper.samples, paper.think_budget,
            paper.answer_budget, paper.eval_every, paper.eval_samples, paper.val_size, paper.dtype) == \
        ("paper", 5e-7, 100, 48, 16, 12288, 2048, 100, 16, 1000, "bfloat16")
    toy = config.get_args([])
    assert (toy.recipe, toy.lr, toy.warmup, toy.prompts, toy.samples, toy.think_budget, toy.answer_budget,
            toy.steps, toy.eval_every, toy.eval_samples, toy.dtype) == \
        ("toy", 2e-4, 10, 16, 8, 48, 64, 150, 10, 4, "float32")
    assert config.get_args(["--model", str(ROOT / "toy_model_hard")]).recipe == "toy"
    train.main(config.get_args(["--model", folder, "--out", str(tmp_path / "run"), "--prompts", "2", "--samples",
                               "2", "--think_budget", "6", "--answer_budget", "4", "--steps", "1", "--val_size",
                               "2", "--eval_samples", "1", "--save_every", "0", "--dtype", "float32"]))
    cfg = json.loads(open(tmp_path / "run" / "metrics.jsonl").readline())
    assert (cfg["recipe"], cfg["lr"], cfg["warmup"], cfg["prompts"], cfg["think_budget"]) == \
        ("paper", 5e-7, 100, 2, 6)
    assert cfg["neg_trust"] == 0 and cfg["grad_clip"] == 0  # the paper's CISPO: no mask, no clipping
    out = capsys.readouterr().out
    size = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors")) / 1e9  # loading says so: seconds on a GPU
    assert f"loading {folder} ({size:.1f} GB of weights) onto cpu ...\n" in out and size > 0.1
    assert "recipe paper: 2 prompts x 2 samples | think 6 + answer 4 tokens | 1 steps, lr 5e-07, warm-up 100, " \
        "no grad clip, no CISPO mask | eval every 100 on 2 held-out x 1 | save every 0 | float32" in out
    assert f"flags that differ from it and the defaults: --model {folder} --val_size 2 --dtype float32 --prompts 2 " \
        "--samples 2 --think_budget 6 --answer_budget 4 --steps 1 --eval_samples 1 --save_every 0\n" in out
    for argv, recipe in (([], "toy"), (["--model", folder, "--recipe", "one_gpu"], "one_gpu"),
                         (["--model", folder, "--recipe", "paper"], "paper"), (["--recipe", "paper"], "paper")):
        a = config.get_args(argv)  # the toy's CISPO mask and clipping are the toy's alone (README, "Recipes")
        assert (a.recipe, a.neg_trust, a.grad_clip) == ((recipe, 0.5, 1.0) if recipe == "toy" else (recipe, 0, 0))
    assert config.get_args(["--model", folder, "--neg_trust", "0.8"]).neg_trust == 0.8  # a flag given wins
    help_ = " ".join(config.make_parser().format_help().split())
    assert "(recipe: toy 0.5, paper 0, one_gpu 0)" in help_ and "(recipe: toy 16, paper 48, one_gpu 16)" in help_
    assert "default: None" not in help_


def test_pipeline_torchrun_reports_a_user_error_once_last_as_its_root_cause(tmp_path, monkeypatch, capsys):
    """torchrun's failure report (torch's own ChildFailedError, from the error file each rank writes:
    TORCHELASTIC_ERROR_FILE) shows a user error's one line once, last, on a line of its own, as its root cause;
    the other ranks' files point to it, and no rank prints it besides (torchrun reading the files: the
    stalled trainer under torchrun)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    files = [tmp_path / f"error-{r}.json" for r in range(2)]
    procs = launch(2, tmp_path / "run", "--gen_ranks", "5", env=lambda r: {"TORCHELASTIC_ERROR_FILE": str(files[r])})
    rcs, outs = finish_all(procs, timeout=120)
    line = "train.py: error: --gen_ranks 5 with 2 ranks: need at least one generator and one trainer"
    assert rcs == [2, 2] and "error" not in outs[0] + outs[1], outs
    report = ChildFailedError("train.py", {r: ProcessFailure(r, p.pid, 2, str(f))
                                           for r, (p, f) in enumerate(zip(procs, files))}).format_msg()
    lines = report.strip().splitlines()
    assert report.count("error: --gen_ranks") == 1 and lines[-2] == "  " + line, report
    assert "the same error as rank 0 (the root cause, below)" in report
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))  # a bad flag: every rank, rank 0 here
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_:
        config.get_args(["--lr_rate", "1"])
    assert exit_.value.code == 2 and capsys.readouterr().err == ""  # torchrun's report says it
    said = json.loads((tmp_path / "error.json").read_text())["message"]
    assert said["message"] == said["extraInfo"]["py_callstack"].strip() == (
        "train.py: error: unrecognized arguments: --lr_rate 1 (--lr_rate: did you mean --lr?) (--help lists the flags)")


def test_nodes_a_user_error_before_the_ranks_meet_exits_after_its_nodes_first_rank_said_it(tmp_path, monkeypatch):
    """A flag error meets every rank before they meet: a rank other than its node's first writes its pointer and
    exits only once that rank's error file exists (torchrun's attempt_N/<local rank>/error.json), so that torchrun,
    which stops the other ranks at the first exit and reports what it has seen, shows the line, not the first rank
    stopped by its SIGTERM (`exitcode -15`) as the root cause."""
    files = [tmp_path / "attempt_0" / str(r) / "error.json" for r in range(2)]
    for f in files:
        f.parent.mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(files[1]))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    first = threading.Timer(0.5, lambda: files[0].write_text("{}"))
    t0 = time.time()
    first.start()
    faults.say_error("train.py: error: unrecognized arguments: --lr_rate 1")
    assert 0.4 < time.time() - t0 < 3 and files[0].exists()
    said = json.loads(files[1].read_text())["message"]["message"]
    assert said == "the same error as rank 2 (the root cause, below)"


def test_train_says_what_ran_where_things_are_and_names_flags_in_errors(toy_dir, tmp_path, capsys):
    recs = run_train(toy_dir, tmp_path / "run", "--steps", "2")
    out = capsys.readouterr().out
    assert recs[0]["ran"] == "one process, synchronous"
    assert "held-out pass rate" in out.split("done in")[1] and f"next: python fit.py {tmp_path / 'run'}" in out
    assert ("kernels: decode attention SDPA per length group | trainer attention SDPA per sample | head float32\n"
            in out.split("held-out pass rate")[0])  # at start-up, before the first eval
    with pytest.raises(SystemExit, match="--val_size 99999: --data has 2204 problems, and some must be left"):
        run_train(toy_dir, tmp_path / "big", "--val_size", "99999")
    assert not (tmp_path / "big").exists()  # checked before anything is made
    capsys.readouterr()
    train.main(config.get_args(["--data", str(FIXTURES / "code_toy.jsonl"), "--out", str(tmp_path / "data"),
                               "--steps", "1", "--val_size", "4", "--prompts", "2", "--samples", "2",
                               "--eval_every", "1", "--eval_samples", "1", "--save_every", "0"]))
    assert "--data without --model trains the embedded toy model" in capsys.readouterr().out


def test_train_eval_only_is_mean_at_k_of_sampling_and_scoring_by_hand(toy_dir, capsys, monkeypatch):
    args = config.get_args(["--eval_only", "--model", toy_dir, "--val_size", "6", "--eval_samples", "3"])
    monkeypatch.setattr(evals, "Progress", functools.partial(evals.Progress, every=0))  # a long eval's progress line, at every decode step here
    r = train.main(args)
    said = capsys.readouterr().out.strip().splitlines()
    counts = [int(m[1]) for m in map(re.compile(r"held-out eval: (\d+)/18 samples in \d+ s, ").match, said) if m]
    assert counts == sorted(counts) and counts[-1] == 18 and said[-2].endswith(", ETA 0 s"), said
    line = said[-1]  # no --data given: the toy task's, not "of --data"
    assert re.fullmatch(rf"eval {re.escape(toy_dir)} on 6 held-out problems of the toy task: pass rate {r['pass_rate']:.3f} "
                        r"\(mean@3 over 6 problems, 18 samples\) \| trunc [0-9.]+ \| intr [0-9.]+ \| len [0-9.]+ tokens \| .* s", line)
    # by hand: the same held-out problems, 3 samples each with the eval's noise keys, decoded and scored
    _, val = train.load_data(args)
    tok, model = AutoTokenizer.from_pretrained(toy_dir), AutoModelForCausalLM.from_pretrained(toy_dir)
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    prompts = [tok(data.format_prompt(tok, p["prompt"]))["input_ids"] for p in val] * 3
    out = gen.generate(model, prompts, keys=[10**12 + i for i in range(18)], eos_id=tok.eos_token_id,
                       think_end=ids("</think>"), interrupt_ids=ids(data.INTERRUPT_PHRASE), think_budget=48,
                       answer_budget=64, seed=0)
    right = [s.finish != "truncated" and verify.score(tok.decode(s.tokens, skip_special_tokens=True), p["answer"])
             for s, p in zip(out, val * 3)]  # a truncated sample never answered: wrong
    assert r["pass_rate"] == pytest.approx(np.mean(right)) and r["n"] == 18
    assert r["len"] == pytest.approx(np.mean([len(s.tokens) for s in out]))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="--eval_only runs as one process"):
        train.main(args)


def test_train_wandb_and_tensorboard_get_every_logged_number(toy_dir, tmp_path, monkeypatch):
    got = {"wandb": [], "tb": []}
    run = types.SimpleNamespace(log=lambda d, step: got["wandb"].append((step, d)))
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda project, dir, config: run))
    numbers = lambda lines: [(m["step"], {f"{m['kind']}/{k}": float(v) for k, v in m.items()
                                          if k not in ("kind", "step") and type(v) in (int, float, bool)}) for m in lines[1:]]
    expected = numbers(run_train(toy_dir, tmp_path / "w", "--wandb", "proj"))
    assert got["wandb"] == expected and "eval/pass_rate" in got["wandb"][0][1] and "train/loss" in got["wandb"][1][1]

    class Writer:
        def __init__(self, path):  # the folder's own handle: a link put at tb/ later redirects nothing
            assert os.path.realpath(path) in (str(tmp_path / "t" / "tb"), str(tmp_path / "both" / "tb"))
        add_scalar = lambda self, k, v, step: got["tb"].append((step, k, v))
        flush = lambda self: None
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    expected = numbers(run_train(toy_dir, tmp_path / "t", "--tensorboard"))
    assert got["tb"] == [(step, k, v) for step, d in expected for k, v in d.items()]
    got["wandb"].clear(), got["tb"].clear()  # both flags: both get every number (wandb alone did)
    expected = numbers(run_train(toy_dir, tmp_path / "both", "--tensorboard", "--wandb", "proj"))
    assert got["wandb"] == expected and got["tb"] == [(step, k, v) for step, d in expected for k, v in d.items()]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(SystemExit, match="--tensorboard needs a package that is not installed.*pip install tensorboard"):
        run_train(toy_dir, tmp_path / "m", "--wandb", "proj", "--tensorboard")
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: one line, before any work
    with pytest.raises(SystemExit, match="--wandb needs a package that is not installed.*pip install wandb"):
        run_train(toy_dir, tmp_path / "n", "--wandb", "proj")
    assert not (tmp_path / "n" / "metrics.jsonl").exists()


def test_train_tracker_folders_planted_as_links_are_refused_and_nothing_outside_is_written(toy_dir, tmp_path,
                                                                                          monkeypatch):
    """--tensorboard and --wandb write their folders (tb/, wandb/) by path, in their libraries' code: a link planted
    at either name is refused in one line before the library runs, and the folder it points to stays empty."""
    opened = []
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda project, dir, config: opened.append(
        dir)))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(
        SummaryWriter=lambda path: opened.append(path)))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for flag, name in (("--tensorboard", "tb"), ("--wandb", "wandb")):
        out = tmp_path / name
        out.mkdir()
        (out / name).symlink_to(elsewhere, target_is_directory=True)
        said = one_line_exit(lambda: run_train(toy_dir, out, flag, *(["proj"] if flag == "--wandb" else [])))
        assert said.startswith(f"error: {flag}'s {out / name} is a symlink"), said
    assert opened == [] and list(elsewhere.iterdir()) == []
    runs.release_lock()


def test_train_run_folders_are_never_silently_mixed_or_erased(toy_dir, tmp_path):
    out = tmp_path / "run"
    run_train(toy_dir, out, "--steps", "2")
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(SystemExit, match="already holds a run.*--resume.*--overwrite"):
        run_train(toy_dir, out, "--steps", "2")
    assert (out / "metrics.jsonl").read_text() == before  # nothing was touched
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time\nf = open(sys.argv[1], 'a+')\n"
                               "fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\nf.write(' (a test)')\nf.flush()\nprint('held', flush=True)\n"
                               "time.sleep(60)", str(out / ".lock")], stdout=subprocess.PIPE, text=True)
    try:  # another run of the same folder is under way
        assert holder.stdout.readline() == "held\n"  # (the run above released it when it ended)
        with pytest.raises(SystemExit, match="in use by another run"):
            run_train(toy_dir, out, "--steps", "2", "--overwrite")
    finally:
        holder.kill()
        holder.wait()
    (out / "ckpt-000099").mkdir()  # a stray folder of an older run
    recs = run_train(toy_dir, out, "--steps", "2", "--overwrite")
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2] and not (out / "ckpt-000099").exists()


def test_train_deletes_and_prunes_only_what_a_run_of_it_wrote(toy_dir, tmp_path):
    """--overwrite and checkpoint pruning touch only the names a run of train.py writes, in a folder that is
    a run of train.py; a folder that is not one keeps everything, as do a user's copies beside the run."""
    foreign = tmp_path / "experiments"
    for d in ("wandb/run-1", "tb/other-experiment", "ckpt-best-model"):
        (foreign / d).mkdir(parents=True)
    for f in ("ckpt-notes.txt", "metrics.jsonl"):
        (foreign / f).write_text("mine\n")
    before = sorted(str(p.relative_to(foreign)) for p in foreign.rglob("*"))
    for flag in ("--overwrite", "--resume"):
        with pytest.raises(SystemExit, match="holds metrics.jsonl but is not a run of train.py"):
            run_train(toy_dir, foreign, flag)
    assert sorted(str(p.relative_to(foreign)) for p in foreign.rglob("*")) == before
    out = tmp_path / "run"
    run_train(toy_dir, out, "--steps", "4", "--save_every", "2", "--keep", "1")
    shutil.copytree(out / "ckpt-000004", out / "ckpt-best-4")  # a user's copy, and notes, beside the run
    (out / "ckpt-v2").mkdir()
    (out / "ckpt-notes.txt").write_text("keep me")
    (out / "wandb").mkdir()
    run_train(toy_dir, out, "--steps", "6", "--save_every", "2", "--keep", "1", "--resume")
    assert sorted(p.name for p in out.glob("ckpt-*")) == ["ckpt-000006", "ckpt-best-4", "ckpt-notes.txt", "ckpt-v2"]
    run_train(toy_dir, out, "--steps", "2", "--overwrite")
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "ckpt-000002", "ckpt-best-4", "ckpt-notes.txt", "ckpt-v2", "metrics.jsonl", "wandb"]  # wandb: not this run's
    with pytest.raises(SystemExit, match="--model .*ckpt-000002 is inside --out .*which --overwrite would clear"):
        run_train(str(out / "ckpt-000002"), out, "--steps", "2", "--overwrite")
    assert (out / "ckpt-000002" / "model.safetensors").exists()


@pytest.mark.parametrize("where", [".", "toy_model", "fixtures/sub", "model"])
def test_train_refuses_an_out_in_the_source_tree_or_a_model_folder(toy_dir, tmp_path, where):
    out = Path(toy_dir) if where == "model" else ROOT / where
    with pytest.raises(SystemExit, match="inside the source tree|the source tree or holds it|a model folder"):
        run_train(toy_dir, out)
    assert not (ROOT / "fixtures" / "sub").exists() and not (out / "metrics.jsonl").exists()


def test_train_run_files_are_never_written_through_a_symlink(toy_dir, tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("precious")
    out = tmp_path / "lock"
    out.mkdir()
    (out / ".lock").symlink_to(target)
    with pytest.raises(SystemExit, match="symlink"):
        run_train(toy_dir, out)
    out = tmp_path / "run"
    run_train(toy_dir, out)
    (out / "metrics.jsonl").unlink()
    (out / "metrics.jsonl").symlink_to(target)
    with pytest.raises(SystemExit, match="symlink"):
        run_train(toy_dir, out, "--resume", "--steps", "3")
    assert target.read_text() == "precious"


def planted(tmp_path, *links):
    """A folder outside the run that links planted in it point to -> a snapshot of it (names and bytes)."""
    victim = tmp_path / "victim"
    victim.mkdir(exist_ok=True)
    (victim / "config.json").write_text("precious")
    for link in links:
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(victim if link.name.endswith("ckpt-000002.tmp") else victim / "config.json")
    return lambda: {p.name: p.read_bytes() for p in victim.iterdir()}


def test_runs_a_planted_checkpoint_temp_link_is_never_written_through(tmp_path):
    """A planted ckpt-STEP.tmp link: rmtree(ignore_errors) failed silently on it, save_pretrained wrote into another
    model folder and ckpt-STEP pointed there. The link is removed, the folder made anew."""
    out = tmp_path / "run"
    snapshot = planted(tmp_path, out / "ckpt-000002.tmp", out / "ckpt-000002")
    before = snapshot()
    write = lambda p: (Path(p) / "config.json").write_text("{}")  # noqa: E731
    fake = dict(model=types.SimpleNamespace(save_pretrained=write),
                tokenizer=types.SimpleNamespace(save_pretrained=lambda p: None), state={"step": 2}, keep=2)
    final = runs.save_checkpoint(str(out), 2, **fake)
    assert snapshot() == before and not os.path.islink(final) and (out / "ckpt-000002" / "config.json").read_text() == "{}"
    (out / "ckpt-000003.tmp").symlink_to(tmp_path / "victim")  # one left for a later rank's shards: refused
    with pytest.raises(SystemExit, match=r"^error: .*ckpt-000003\.tmp is not the folder this run made"):
        runs.save_checkpoint(str(out), 3, **fake, fresh=False)
    assert snapshot() == before


def test_runs_planted_links_at_temp_and_probe_names_change_nothing_outside(toy_dir, tmp_path, monkeypatch):
    """curriculum-rankN.json.tmp (plain open), curves.png (savefig), study's problems/*.jsonl.tmp and --out's
    .write-test-PID (its PID guessable) were written through a link planted there: now each is replaced or
    removed, never followed, and the files land in the folder."""
    out = tmp_path / "run"
    snapshot = planted(tmp_path, out / "curriculum-rank1.json.tmp", out / "curves.png", out / "curves.png.tmp",
                       tmp_path / "new" / f".write-test-{os.getpid()}", tmp_path / "study" / "problems" / "train.jsonl.tmp",
                       tmp_path / "study" / "problems" / "val.jsonl")
    before = snapshot()
    runs.replace_file(str(out / "curriculum-rank1.json"), lambda f: f.write("{}"))
    assert (out / "curriculum-rank1.json").read_text() == "{}" and snapshot() == before
    write_eval_lines(out, [{"kind": "eval", "step": i, "compute_s": 1.0 + i, "pass_rate": 0.5} for i in range(3)])
    png = fit.plot_curves(str(out))
    assert snapshot() == before and not os.path.islink(png) and Path(png).read_bytes()[:4] == b"\x89PNG"
    monkeypatch.setattr(study, "TRAIN", 20)
    paths = study.make_problems(str(tmp_path / "study"), held_out=5)
    assert snapshot() == before and [len(Path(p).read_text().splitlines()) for p in paths] == [20, 5]
    args = config.get_args(["--model", str(toy_dir), "--out", str(tmp_path / "new")])
    try:
        runs.prepare_out_dir(args)
    finally:
        runs.release_lock()
    assert snapshot() == before


def test_runs_a_checkpoint_folder_renamed_mid_save_writes_nothing_outside(toy_dir, tmp_path):
    """ckpt-STEP.tmp was checked once, then save_pretrained, the tokenizer and state.pt wrote into it by path:
    renamed away mid-save and replaced by a link to another model folder, that folder's files were overwritten and
    ckpt-STEP became the link, exit 0. Now every byte lands in the folder the run made, wherever it was moved, and
    the run stops with one line naming it; --fsdp's shards (rank 0 makes the folder) likewise."""
    out = tmp_path / "run"
    out.mkdir()
    snapshot = planted(tmp_path)
    before = snapshot()
    model, tok = AutoModelForCausalLM.from_pretrained(toy_dir), AutoTokenizer.from_pretrained(toy_dir)
    real = tok.save_pretrained

    def racing(path, **kw):  # after the weights, before the tokenizer and state.pt
        os.rename(out / "ckpt-000002.tmp", out / "moved")
        (out / "ckpt-000002.tmp").symlink_to(tmp_path / "victim")
        return real(path, **kw)
    tok.save_pretrained = racing
    with pytest.raises(SystemExit) as stop:
        runs.save_checkpoint(str(out), 2, model, tok, {"step": 2}, keep=2)
    assert re.fullmatch(rf"error: {out}/ckpt-000002\.tmp was renamed or replaced while the run wrote it [^\n]*"
                        r"the last good checkpoint is none \(no checkpoint yet\)", str(stop.value.code))
    assert snapshot() == before and not os.path.lexists(out / "ckpt-000002")
    assert {"model.safetensors", "config.json", "tokenizer_config.json", "state.pt"} <= set(os.listdir(out / "moved"))
    tmp = runs.checkpoint_tmp(str(out), 3)  # --fsdp: each trainer writes its shards into the folder rank 0 made
    with runs.private_folder(tmp) as where:
        os.rename(tmp, out / "moved3")
        os.symlink(tmp_path / "victim", tmp)
        torch.distributed.checkpoint.save({"w": torch.ones(2)}, checkpoint_id=os.path.join(where, "shards"))
    assert snapshot() == before and (out / "moved3" / "shards" / ".metadata").exists()


def in_time(call, *args, seconds=10):
    """What call(*args) raised, from a thread (a FIFO's open can wait forever: the test ends anyway)."""
    said = {}

    def run():
        try:
            call(*args)
        except BaseException as err:  # noqa: B036 (SystemExit is the answer)
            said["raised"] = err
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"no answer in {seconds} s"
    return said.get("raised")


def test_runs_hard_links_and_fifos_at_the_lock_marker_and_metrics_are_refused_in_one_line(toy_dir, tmp_path):
    """.lock, .train-run.json and metrics.jsonl hard-linked to a file elsewhere had that file overwritten; .lock as a
    FIFO ended in io.UnsupportedOperation, .train-run.json as a FIFO waited in its open forever. Each is one line
    naming the file, and the file elsewhere is untouched."""
    victim = tmp_path / "victim.txt"
    victim.write_text('{"tb": false, "wandb": false}')
    before = victim.read_bytes()
    for name in (".lock", ".train-run.json"):
        out = tmp_path / name
        out.mkdir()
        os.link(victim, out / name)
        with pytest.raises(SystemExit, match=rf"^error: {out}/{re.escape(name)} has \d hard links [^\n]*$"):
            run_train(toy_dir, out)
        assert victim.read_bytes() == before
    out = tmp_path / "run"
    run_train(toy_dir, out)
    victim.write_bytes((out / "metrics.jsonl").read_bytes())
    before = victim.read_bytes()
    (out / "metrics.jsonl").unlink()
    os.link(victim, out / "metrics.jsonl")
    with pytest.raises(SystemExit, match=r"^error: .*metrics\.jsonl has \d hard links [^\n]*$"):
        run_train(toy_dir, out, "--resume", "--steps", "3")
    assert victim.read_bytes() == before
    for name in (".lock", ".train-run.json"):
        out = tmp_path / f"fifo{name}"
        out.mkdir()
        os.mkfifo(out / name)
        args = config.get_args(["--model", str(toy_dir), "--out", str(out)])
        try:
            raised = in_time(runs.prepare_out_dir, args)
        finally:
            runs.release_lock()
        assert isinstance(raised, SystemExit) and re.fullmatch(
            rf"error: {out}/{re.escape(name)} is not a regular file \(a FIFO\)[^\n]*", str(raised.code))


def test_study_planted_links_at_its_problems_and_run_folders_are_refused(toy_dir, tmp_path, monkeypatch):
    """STUDY/problems linked to someone's dataset folder had its train.jsonl replaced; STUDY/scalerl-s0 linked
    elsewhere got the run's lock, marker and metrics (train.py's --out) and the study's minutes. Each is one line
    naming the link, before anything is written or a run starts, and the folder it points to is untouched."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "train.jsonl").write_text("precious\n")
    snapshot = lambda: {p.name: p.read_bytes() for p in theirs.iterdir()}  # noqa: E731
    before, folder = snapshot(), tmp_path / "study"
    folder.mkdir()
    (folder / "problems").symlink_to(theirs)
    monkeypatch.setattr(study, "TRAIN", 20)
    with pytest.raises(SystemExit, match=rf"^error: {folder}/problems is a symlink[^\n]*$"):
        study.make_problems(str(folder), held_out=5)
    assert snapshot() == before
    (folder / "problems").unlink()
    run = folder / "scalerl-s0"
    run.symlink_to(theirs)
    with pytest.raises(SystemExit, match=rf"^error: {run} is a symlink[^\n]*$"):
        study.save_minutes({"path": str(run)}, 1.0)
    for given in (run, f"{run}/"):
        with pytest.raises(SystemExit, match=rf"^error: --out {given} is a symlink[^\n]*$"):
            run_train(toy_dir, given, "--overwrite")
    monkeypatch.setattr(study.subprocess, "Popen", lambda *a, **k: pytest.fail("a run started"))
    with pytest.raises(SystemExit, match=rf"^study: error: {run} is a symlink[^\n]*$"):
        study.main([str(folder), "--quick"])
    assert snapshot() == before


def test_train_resume_falls_back_past_a_checkpoint_without_config_and_names_bad_metrics_lines(toy_dir, tmp_path,
                                                                                              capsys):
    out = tmp_path / "run"
    run_train(toy_dir, out, "--steps", "4", "--save_every", "2", "--keep", "2")
    (out / "ckpt-000004" / "config.json").unlink()
    recs = run_train(toy_dir, out, "--steps", "4", "--save_every", "2", "--resume")
    assert "skipping" in capsys.readouterr().out and [r["step"] for r in recs if r["kind"] == "train"] == [1, 2, 3, 4]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    for bad, why in (("[1, 2]", "not a metrics record"), ('"a string"', "not a metrics record"),
                     ('{"kind": "eval", "step": 1, "pass_rate": 0.5}', "an eval record without its compute_s")):
        (out / "metrics.jsonl").write_text("\n".join(lines[:2] + [bad] + lines[2:]) + "\n")
        with pytest.raises(SystemExit, match=rf"metrics.jsonl:3: {why}"):
            run_train(toy_dir, out, "--steps", "4", "--save_every", "2", "--resume")


def test_train_checkpoints_pruned_by_step_and_resume_survives_broken_files(toy_dir, tmp_path, capsys):
    out = tmp_path / "run"
    run_train(toy_dir, out, "--steps", "4", "--save_every", "1", "--keep", "2")
    assert sorted(p.name for p in out.glob("ckpt-*")) == ["ckpt-000003", "ckpt-000004"]
    for step in (999999, 1000000):  # past 999,999 the names no longer sort as their steps do
        shutil.copytree(out / "ckpt-000004", out / f"ckpt-{step:06d}")
    fake = dict(model=types.SimpleNamespace(save_pretrained=lambda p: os.makedirs(p, exist_ok=True)),
                tokenizer=types.SimpleNamespace(save_pretrained=lambda p: None), state={}, keep=2)
    runs.save_checkpoint(str(out), 1000001, **fake)
    assert sorted(p.name for p in out.glob("ckpt-*")) == ["ckpt-1000000", "ckpt-1000001"]
    runs.save_checkpoint(str(out), 7, **fake)  # a later step's leftovers are not this run's: left alone
    assert sorted(p.name for p in out.glob("ckpt-*")) == ["ckpt-000007", "ckpt-1000000", "ckpt-1000001"]
    run_train(toy_dir, out, "--steps", "4", "--save_every", "1", "--keep", "2", "--overwrite")
    (out / "ckpt-000004" / "state.pt").write_bytes(b"half a file")  # the newest is broken
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "ste')  # and a crash cut the last line
    recs = run_train(toy_dir, out, "--steps", "4", "--save_every", "1", "--keep", "2", "--resume")
    said = capsys.readouterr().out
    assert "skipping" in said and "ckpt-000004" in said and "dropped the half-written last line" in said
    assert "resumed from" in said and "ckpt-000003 at step 3" in said
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2, 3, 4]
    assert [r["lr"] for r in recs if r["kind"] == "train"] == pytest.approx(warmed_up(recs, 2e-4))
    with pytest.raises(SystemExit, match="--resume: --data was '', now 'toy,"):
        run_train(toy_dir, out, "--steps", "5", "--resume", "--data", "toy," + str(FIXTURES / "code_toy.jsonl"))
    with pytest.raises(SystemExit, match="--resume: --seed was 0, now 1"):  # another held-out split
        run_train(toy_dir, out, "--steps", "5", "--resume", "--seed", "1")
    recs = run_train(toy_dir, out, "--steps", "5", "--resume", "--lr", "1e-4", "--adam_eps", "1e-8",
                     "--weight_decay", "0.5", "--no-no_positive_resampling")
    assert "--lr 0.0002 -> 0.0001" in capsys.readouterr().out
    assert [r["step"] for r in recs if r["kind"] == "train"][-1] == 5
    assert [r["lr"] for r in recs if r["kind"] == "train"][-1] == pytest.approx(warmed_up(recs, 1e-4)[-1])  # new --lr
    state = torch.load(out / "ckpt-000005" / "state.pt", weights_only=True)
    group = state["optimizer"]["param_groups"][0]
    assert (group["initial_lr"], group["eps"], group["weight_decay"]) == (1e-4, 1e-8, 0.5)
    assert state["scheduler"]["base_lrs"] == [1e-4] and state["curriculum"]["npr"] is False


class RunsCode:
    """What a hostile run folder can hold: a pickle whose loading calls a function of the author's choice (here one
    that creates a file)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_train_resume_unpickles_nothing_that_could_run_code(toy_dir, tmp_path):
    """A run folder shared or downloaded is data: --resume loads state.pt as tensors and plain data only, and a
    state.pt or generator curriculum holding anything else stops the run with one line before any of it runs.
    Everything train.py saves (optimizer, schedule, curriculum, RNG, flags, float32 master weights) loads so."""
    out, ran = tmp_path / "run", tmp_path / "ran"
    run_train(toy_dir, out, "--steps", "1")  # bf16's master weights: test_train_bf16_steps_float32_master_weights_*
    state = out / "ckpt-000001" / "state.pt"
    assert torch.serialization.get_unsafe_globals_in_checkpoint(state) == []
    saved = torch.load(state, weights_only=True)
    assert {"optimizer", "scheduler", "curriculum", "torch_rng", "args"} <= set(saved) and saved["args"]["steps"] == 1
    torch.save({**saved, "note": RunsCode(str(ran))}, state)
    with pytest.raises(SystemExit) as exit_:
        run_train(toy_dir, out, "--steps", "2", "--resume")
    assert str(exit_.value.code).startswith(f"error: --resume: {state} holds objects other than tensors and plain "
                                            "data") and "\n" not in str(exit_.value.code)
    assert not ran.exists()
    torch.save(saved, state)
    torch.save(RunsCode(str(ran)), out / "curriculum-rank1.pt")  # a generator's curriculum, pickled by an older run
    args = config.get_args(["--model", str(toy_dir), "--out", str(out), "--val_size", "4", "--resume"])
    with pytest.raises(SystemExit, match=r"^error: --resume: .*curriculum-rank1.pt is a curriculum of an older "):
        runs.resume_point(args, quiet=True)
    assert not ran.exists()


@pytest.fixture(scope="module")
def resumable(toy_dir, tmp_path_factory):
    """A run of one step, saved: the resume tests below tamper with copies of it."""
    out = tmp_path_factory.mktemp("resumable") / "run"
    run_train(toy_dir, out, "--steps", "1")
    return out


def tampered(resumable, out, edit):
    """A copy of `resumable` at out whose state.pt `edit` changed -> state.pt's path."""
    shutil.copytree(resumable, out)
    path = out / "ckpt-000001" / "state.pt"
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)
    return path


def test_runs_files_planted_as_links_in_a_run_or_study_folder_are_never_read_through(resumable, tmp_path):
    """Nothing outside a run or study folder is read by following a link planted inside it: a resume reads the
    run's own metrics.jsonl, state.pt, config.json and shard metadata, a study its runs' minutes and metrics, a
    generator its curriculum; a link in their place (here to another run's intact files, which would load) is
    one line or a skipped checkpoint, and a planted checkpoint folder is no checkpoint of this run."""
    out, outside = tmp_path / "run", tmp_path / "outside"
    shutil.copytree(resumable, out)
    shutil.copytree(resumable, outside)
    assert runs.intact_checkpoint(str(out), quiet=True)[0] == str(out / "ckpt-000001")

    def plant(name, target):
        (out / name).unlink()
        (out / name).symlink_to(target)
    plant("metrics.jsonl", outside / "metrics.jsonl")
    assert "a symlink" in one_line_exit(lambda: runs.truncate_metrics(str(out / "metrics.jsonl"), 1))
    assert not runs.legacy_run(str(out))
    for name in ("state.pt", "config.json", "model.safetensors"):  # each: the checkpoint is skipped
        shutil.rmtree(out / "ckpt-000001")
        shutil.copytree(outside / "ckpt-000001", out / "ckpt-000001")
        plant(f"ckpt-000001/{name}", outside / "ckpt-000001" / name)
        assert runs.intact_checkpoint(str(out), quiet=True) == (None, {}), name
    (out / "ckpt-000007").symlink_to(outside / "ckpt-000001", target_is_directory=True)
    assert runs.checkpoints(str(out)) == [str(out / "ckpt-000001")]
    (out / "shards").mkdir()
    (out / "linked").symlink_to(out / "shards", target_is_directory=True)
    assert "its folder, or a file in it, is a symlink" in one_line_exit(lambda: runs.check_shards(str(out / "linked")))
    (out / "shards" / "__0_0.distcp").symlink_to(outside / "ckpt-000001" / "model.safetensors")  # data torch reads
    assert "its folder, or a file in it, is a symlink" in one_line_exit(lambda: runs.check_shards(str(out / "shards")))
    (outside / "curriculum-rank1.json").write_text("{}")
    (out / "curriculum-rank1.json").symlink_to(outside / "curriculum-rank1.json")
    with pytest.raises(OSError, match="a symlink"):
        runs.read_json(str(out / "curriculum-rank1.json"), follow=False)
    (outside / "study_minutes.json").write_text("12.5")
    (out / "study_minutes.json").symlink_to(outside / "study_minutes.json")
    with pytest.raises(OSError, match="a symlink"):
        study.run_minutes(str(out))
    with pytest.raises(OSError, match="a symlink"):
        study.finished(str(out), 1)
    assert runs.read_json(str(outside / "study_minutes.json")) == 12.5  # a file given by its own path: read


def test_train_resume_steps_with_the_run_s_own_adamw_whatever_the_saved_optimizer_says(toy_dir, resumable,
                                                                                       tmp_path):
    """An optimizer state whose hyperparameters say ascent (maximize), AMSGrad or Adam's L2 decay survives no
    --resume: the run's own AdamW (its flags) takes the step, the same step as from the honest state."""
    honest = tmp_path / "honest"
    shutil.copytree(resumable, honest)
    recs = run_train(toy_dir, honest, "--resume")
    out = tmp_path / "run"
    tampered(resumable, out, lambda s: s["optimizer"]["param_groups"][0].update(
        maximize=True, amsgrad=True, decoupled_weight_decay=False, lr=1.0, eps=1.0, betas=(0.0, 0.0)))
    assert strip_timing(run_train(toy_dir, out, "--resume")) == strip_timing(recs)
    theirs, ours = (AutoModelForCausalLM.from_pretrained(p / "ckpt-000002").state_dict() for p in (honest, out))
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs)


def _curriculum_edit(**fields):
    return lambda s: s["curriculum"].update(fields)


def _first_adam(key, value):
    return lambda s: s["optimizer"]["state"][0].update({key: value(s["optimizer"]["state"][0][key])})


MALFORMED_STATE = [  # (edit, the field named, what the line says of it)
    (lambda s: s.update(args=["--lr", "1"]), "args", "is a list, expected a dict"),
    (lambda s: s.update(compute_s="12.5"), "compute_s", "is a str, expected a number"),
    (lambda s: s["curriculum"]["order"].__setitem__(4, 10 ** 6), "curriculum.order", "holds 1000000"),
    (lambda s: s.update(flops=None), "flops", "is None, expected a number"),
    (lambda s: s.update(compute_s=float("nan")), "compute_s", "is nan, expected a number"),
    (lambda s: s.update(empty_steps=-1), "empty_steps", "is -1"),
    (lambda s: s.update(step=7), "step", "is 7, expected 1"),
    (lambda s: s.pop("step"), "step", "is missing"),
    (lambda s: s.update(torch_rng=torch.zeros(3)), "torch_rng", "expected"),
    (lambda s: s.pop("optimizer"), "optimizer", "is missing"),
    (lambda s: s.update(optimizer=None), "optimizer", "resume it with --fsdp"),  # a --fsdp run's state
    (lambda s: s["scheduler"].update(last_epoch="1"), "scheduler.last_epoch", "is a str"),
    (lambda s: s["scheduler"].update(optimizer={}), "scheduler.optimizer", "not a field"),
    (lambda s: s["args"].update(lr=torch.ones(2)), "args.lr", "is a Tensor"),
    (_curriculum_edit(n=5), "curriculum.n", "is 5, expected 2200"),
    (_curriculum_edit(epoch="0"), "curriculum.epoch", "is a str"),
    (_curriculum_edit(retired=[2200]), "curriculum.retired", "holds 2200"),
    (_curriculum_edit(pos=10 ** 6), "curriculum.pos", "is 1000000"),
    (lambda s: s["curriculum"]["order"].pop(), "curriculum.order", "misses"),
    (_curriculum_edit(history={"2200": [0.5]}), "curriculum.history", "2200"),
    (_first_adam("exp_avg", lambda t: t[:2]), "optimizer.state.0.exp_avg", "expected a float32 tensor of shape"),
    (_first_adam("exp_avg_sq", lambda t: -t - 1), "optimizer.state.0.exp_avg_sq", ">= 0"),
    (_first_adam("step", lambda t: t + 5), "optimizer.state.0.step", "is 6.0"),
    (lambda s: s["optimizer"]["param_groups"][0].update(params=[0, 1]), "optimizer.param_groups.0.params",
     "expected"),
]


def test_train_resume_refuses_each_malformed_state_value_in_one_line_before_the_run_starts(toy_dir, resumable,
                                                                                         tmp_path, capsys):
    """state.pt is an input like any other: a value of the wrong type or out of range (arguments as a list, no
    step, compute_s a string, a curriculum order past the data set, AdamW moments of another shape...) stops
    --resume with one line naming the file and the field, before any step runs and before metrics.jsonl is
    touched; nothing ends in a traceback, now or steps later."""
    for i, (edit, field, why) in enumerate(MALFORMED_STATE):
        out = tmp_path / f"run{i}"
        path = tampered(resumable, out, edit)
        before = (out / "metrics.jsonl").read_bytes()
        with pytest.raises(SystemExit) as exit_:
            run_train(toy_dir, out, "--resume")
        line = str(exit_.value.code)
        assert line.startswith(f"error: --resume: {path}: field {field} ") and why in line and "\n" not in line, \
            (field, line)
        assert "step 2/" not in capsys.readouterr().out and (out / "metrics.jsonl").read_bytes() == before


def test_train_resume_refuses_a_metrics_line_without_a_field_the_resume_reads(toy_dir, resumable, tmp_path,
                                                                               capsys):
    """The metrics lines a resume reads back (the alarms' windows) are checked for each field it reads: a train
    line without kept_prompts, a forget or intr that is no number stop --resume with one line naming the line and
    field, before any step."""
    for i, (kind, field, value) in enumerate((("train", "kept_prompts", None), ("train", "forget", "0.1"),
                                              ("eval", "intr", [0.5]), ("eval", "pass_rate", 2.0))):
        out = tmp_path / f"run{i}"
        shutil.copytree(resumable, out)
        lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
        at = next(n for n, r in enumerate(lines) if r["kind"] == kind)
        lines[at].pop(field) if value is None else lines[at].update({field: value})
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        with pytest.raises(SystemExit, match=rf"^error: .*metrics.jsonl:{at + 1}: .*field {field} [^\n]*$"):
            run_train(toy_dir, out, "--resume")
        assert "step 2/" not in capsys.readouterr().out


def test_pipeline_generator_refuses_a_malformed_saved_curriculum_in_one_line(tmp_path, capsys):
    """A generator rank's curriculum (in its checkpoint's state.pt, curricula.RANK) is resumed state too, checked by
    the same code as the one process's: an order past its prompts, a missing field or a pass rate out of range stop
    it with one line naming file and field, before it samples; a checkpoint with none for it says so in one line."""
    args = config.get_args(["--out", str(tmp_path), "--val_size", "4", "--resume"])
    problems = [{"prompt": str(i), "answer": str(i)} for i in range(10)]
    ctx = types.SimpleNamespace(rank=2, n_trainers=1, n_gens=2)  # generator 1 of 2: prompts 1, 3, 5, 7, 9
    honest = data.Prompts(10, 1, 2, args.prompts, args.seed, True).curriculum.state_dict()
    ckpt = tmp_path / "ckpt-000004"
    for key, value, field, why in (("order", [0, 1, 2, 3, 5], "order", "holds 5"), ("n", 10, "n", "is 10, expected 5"),
                                   ("retired", None, "retired", "is missing"),
                                   ("history", {"1": [1.5]}, "history.1", "is 1.5")):
        saved = {k: v for k, v in honest.items() if k != key}
        state = {"step": 4, "curricula": {"2": {**saved, **({key: value} if value is not None else {})}}}
        with pytest.raises(SystemExit) as exit_:
            pipeline.run_generator(ctx, args, None, None, problems, None, str(ckpt), state, [], [])
        line = str(exit_.value.code)
        assert line.startswith(f"error: --resume: {ckpt}/state.pt: field curricula.2.{field} ") and why in line and \
            "\n" not in line, line
    assert checks.resumed_curriculum(str(ckpt), {"step": 4, "curricula": {"2": honest}}, 2, 5) == honest
    assert checks.resumed_curriculum(None, {}, 2, 5) is None and capsys.readouterr().out == ""  # a new run
    assert checks.resumed_curriculum(str(ckpt), {"step": 4, "curricula": {"3": honest}}, 2, 5) is None
    assert capsys.readouterr().out == (f"generator rank 2: --resume: {ckpt}/state.pt holds no curriculum of this "
                                       "generator (saved by an older train.py, or with other --gen_ranks): it starts "
                                       "a fresh one, with no No-Positive-Resampling history of its prompts\n")


def capped_run(argv, log, script):
    """run_train_py with at most 1 GiB more data memory: a file read without end fails at once here instead of
    taking the machine (/dev/zero read whole: 2.5 GB in 10 s)."""
    import resource
    limit = bench._proc_status("VmData") + (1 << 30)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    run_train_py(argv, {}, log, script=script)


def run_capped(argv, log, script="train.py", timeout=60):
    """`python SCRIPT *argv` forked, memory capped (capped_run) -> (exit code, output); still running at the
    timeout (a hang): killed, and the test fails."""
    proc = FORKS.Process(target=capped_run, args=([str(a) for a in argv], str(log), script))
    proc.start()
    proc.join(timeout)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        pytest.fail(f"{script} {' '.join(map(str, argv))}: still running after {timeout} s (a hang): "
                    f"{Path(log).read_text()[-600:]}")
    return proc.exitcode, Path(log).read_text()


def special_file(path, kind):
    """path made a FIFO, or a link to /dev/zero (a device that never ends)."""
    if os.path.lexists(path):
        os.remove(path)
    if kind == "a FIFO":
        os.mkfifo(path)
    else:
        os.symlink("/dev/zero", path)


def test_train_resume_reads_only_regular_files_and_names_the_one_that_is_not(toy_dir, tmp_path):
    """--resume read metrics.jsonl linked to /dev/zero without end (2.5 GB in 10 s, no line) and hung on it as a
    FIFO, and on a checkpoint's state.pt as a FIFO; a checkpoint's config.json linked to /dev/zero was read without
    end. Each is refused before a byte is read: the run's metrics.jsonl stops --resume in one line naming it; a
    checkpoint with such a file is skipped with a line naming the file, and the run goes on from the one before."""
    out = tmp_path / "run"
    flags = ["--steps", "3", "--save_every", "1", "--keep", "3", "--eval_every", "3"]
    run_train(toy_dir, out, *flags)
    argv = ["--model", toy_dir, "--out", out, "--prompts", "4", "--samples", "4", "--val_size", "4",
            "--eval_samples", "1", *flags, "--resume"]
    metrics = out / "metrics.jsonl"
    kept = metrics.read_bytes()
    for kind in ("a device", "a FIFO"):
        special_file(metrics, kind)
        code, said = run_capped(argv, tmp_path / "resume.log")
        # a link to /dev/zero is refused as a link (a run's own file), before its target is looked at
        why = runs.NOT_THROUGH_A_LINK if metrics.is_symlink() else f"not a regular file ({kind})"
        assert code == 2 and said.strip().splitlines()[-1] == (
            f"train.py: error: --resume: {metrics}: {why}: a run writes its metrics as a file; move this one "
            "away, or start another --out"), said[-600:]
    metrics.unlink()
    metrics.write_bytes(kept)
    special_file(out / "ckpt-000003" / "state.pt", "a FIFO")
    special_file(out / "ckpt-000002" / "config.json", "a device")
    code, said = run_capped(argv, tmp_path / "resume.log")
    assert code == 0, said[-600:]
    assert (f"--resume: skipping {out}/ckpt-000003, it does not load (Unreadable: {out}/ckpt-000003/state.pt: "
            "not a regular file (a FIFO))") in said
    assert (f"--resume: skipping {out}/ckpt-000002, it does not load (Unreadable: {out}/ckpt-000002/"
            f"config.json: {runs.NOT_THROUGH_A_LINK})") in said
    assert f"resumed from {out}/ckpt-000001 at step 1" in said
    assert [r["step"] for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "train"] == [1, 2, 3]


def test_runs_sharded_checkpoints_load_nothing_that_could_run_code(tmp_path):
    """--resume --fsdp reads torch.distributed.checkpoint's files, which the library unpickles without
    restriction (.metadata) or with torch.load(weights_only=False) (an optimizer's hyper-parameters): a
    metadata file naming anything but its own record types stops the run with one line, and a value that is
    not plain data raises, both before any of it runs. A real sharded checkpoint loads so (one process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(1, 3)).sum().backward()
    opt.step()
    folder, ran = tmp_path / "shards", tmp_path / "ran"
    weights, optimizer = get_state_dict(model, opt)
    dcp.save({"model": weights, "optimizer": optimizer}, checkpoint_id=folder)
    back = {"model": {k: torch.zeros_like(v) for k, v in weights.items()}, "optimizer": get_state_dict(model, opt)[1]}
    dcp.load(back, storage_reader=runs.shard_reader(folder), planner=runs.safe_load_planner())
    assert all(torch.equal(back["model"][k], v) for k, v in weights.items())
    assert back["optimizer"]["param_groups"][0]["lr"] == 1e-3
    good = (folder / ".metadata").read_bytes()
    (folder / ".metadata").write_bytes(pickle.dumps(RunsCode(str(ran))))
    with pytest.raises(SystemExit, match=r"^error: --resume: .*\.metadata is not a plain sharded checkpoint's "
                                         r"metadata \(it names (io|builtins)\.open\)"):
        runs.check_shards(folder)
    value = io.BytesIO()
    torch.save(RunsCode(str(ran)), value)
    value.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        runs.safe_load_planner().load_bytes(None, value)
    assert not ran.exists() and good


def sharded_run(resumable, out):
    """A copy of `resumable` whose checkpoint keeps its optimizer as --fsdp does, in a real shards/ (one process's
    torch.distributed.checkpoint) -> (the checkpoint, its shards/ folder)."""
    import torch.distributed.checkpoint as dcp
    shutil.copytree(resumable, out)
    ckpt = out / "ckpt-000001"
    state = torch.load(ckpt / "state.pt", weights_only=True)
    torch.save({**state, "optimizer": None, "master": None, "shards": "shards"}, ckpt / "state.pt")
    dcp.save({"w": torch.ones(3), "v": torch.zeros(2)}, checkpoint_id=ckpt / "shards")
    return ckpt, ckpt / "shards"


def test_runs_a_checkpoint_whose_metadata_lists_a_missing_shard_is_refused_on_resume_in_one_line(resumable, tmp_path):
    """A --fsdp checkpoint is whole only with every data file its .metadata lists: one missing (a trainer that wrote
    into its own node's disk) was taken as intact, and every trainer failed in a CheckpointException traceback. Now
    --resume stops with one line naming the file and what to do; the whole checkpoint resumes."""
    ckpt, shards = sharded_run(resumable, tmp_path / "run")
    args = config.get_args(["--out", str(tmp_path / "run"), "--val_size", "4", "--resume"])
    assert runs.resume_point(args, quiet=True)[0] == str(ckpt)
    (shards / "__0_0.distcp").unlink()
    said = one_line_exit(lambda: runs.resume_point(args, quiet=True))
    assert said.startswith(f"error: --resume: {shards}/.metadata lists __0_0.distcp, which is not in {shards}") and \
        f"remove {ckpt} to resume from the checkpoint before it" in said and "copy" in said, said


def test_runs_a_checkpoint_is_not_final_while_its_metadata_lists_a_shard_rank0_does_not_see(resumable, tmp_path):
    """Before ckpt-STEP.tmp becomes ckpt-STEP, rank 0 finds every file the shards' .metadata lists in its own view of
    the folder: a shard that another trainer wrote onto its own node's disk stops the save with one line naming the
    file, the rank and host that wrote it and the shared --out it needs; nothing is renamed."""
    ckpt, shards = sharded_run(resumable, tmp_path / "run")
    reports = {0: {"host": "node-a", "files": ["__0_0.distcp"]}}
    runs.check_shards_written(str(shards), reports)  # all there: no exit
    os.rename(shards / "__0_0.distcp", tmp_path / "elsewhere")
    said = one_line_exit(lambda: runs.check_shards_written(str(shards), reports))
    assert said.startswith(f"error: {shards}/.metadata lists __0_0.distcp, which trainer rank 0 on host node-a "
                           "wrote, but rank 0 does not find it there") and "one shared --out" in said, said
    assert "not saved" in said


def test_runs_a_trainer_that_cannot_see_the_checkpoint_folder_rank0_made_says_so_in_one_line(tmp_path):
    """A trainer whose --out is not rank 0's (its node's own disk) finds no ckpt-STEP.tmp there: one line naming its
    host and the shared --out every rank needs, not a "symlink?" guess."""
    tmp = runs.checkpoint_tmp(str(tmp_path), 4, fresh=False)
    said = one_line_exit(lambda: runs.private_folder(tmp).__enter__())
    assert said.startswith(f"error: {tmp}, which rank 0 made for this checkpoint, is not in this rank's --out on "
                           f"host {socket.gethostname()}") and "shared --out" in said, said


def test_runs_leftover_temporary_files_of_the_run_are_pruned_at_resume_and_save(toy_dir, resumable, tmp_path):
    """A save cut short (a crash, SIGKILL, a full disk) leaves ckpt-STEP.tmp (with its shards) or NAME.tmp in --out,
    never pruned. Now the resumed run removes every such name of its own (a planted link: the link, never what it
    points at), and keeps any other file."""
    out = tmp_path / "run"
    shutil.copytree(resumable, out)
    (out / "ckpt-000005.tmp" / "shards").mkdir(parents=True)
    (out / "ckpt-000005.tmp" / "shards" / "__1_0.distcp").write_bytes(b"x" * 100)
    (out / "curriculum-rank1.json.tmp").write_text("half")
    snapshot = planted(tmp_path, out / "ckpt-000002.tmp")
    before = snapshot()
    (out / "notes.tmp").write_text("mine")  # not a name the run writes: kept
    run_train(toy_dir, out, "--steps", "2", "--resume")
    assert sorted(os.listdir(out)) == [".lock", ".train-run.json", "ckpt-000001", "ckpt-000002", "metrics.jsonl",
                                       "notes.tmp"]
    assert snapshot() == before
    (out / "ckpt-000009.tmp").mkdir()  # a save's leftover appearing mid-run: the next save prunes it
    fake = dict(model=types.SimpleNamespace(save_pretrained=lambda p: (Path(p) / "config.json").write_text("{}")),
                tokenizer=types.SimpleNamespace(save_pretrained=lambda p: None), state={"step": 3}, keep=5)
    runs.save_checkpoint(str(out), 3, **fake)
    assert not (out / "ckpt-000009.tmp").exists() and (out / "ckpt-000003").is_dir()


def shards_and_a_payload(tmp_path):
    """A real sharded checkpoint of a bf16 and a float32 layer with AdamW state -> (its folder, a state to load it
    into, the saved weights, a file that exists only if a payload ran)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2).to(torch.bfloat16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model[0](torch.randn(1, 3)).sum().backward()
    opt.step()
    weights, optimizer = get_state_dict(model, opt)
    folder = tmp_path / "shards"
    dcp.save({"model": weights, "optimizer": optimizer}, checkpoint_id=folder)
    back = {"model": {k: torch.zeros_like(v) for k, v in weights.items()}, "optimizer": get_state_dict(model, opt)[1]}
    return folder, back, weights, tmp_path / "ran"


def test_runs_shard_metadata_naming_a_dotted_name_runs_nothing(tmp_path):
    """Pickle protocol 4 lets a name be dotted: torch.distributed.checkpoint.metadata imports os, so "os.system"
    under that module ran a command inside the check itself. Only exact (module, name) pairs load."""
    folder, _, _, ran = shards_and_a_payload(tmp_path)
    runs.check_shards(folder)  # the real file passes
    module, name, command = b"torch.distributed.checkpoint.metadata", b"os.system", f"touch {ran}".encode()
    payload = (b"\x80\x04\x8c" + bytes([len(module)]) + module + b"\x8c" + bytes([len(name)]) + name + b"\x93"
               + b"\x8c" + bytes([len(command)]) + command + b"\x85R.")
    (folder / ".metadata").write_bytes(payload)
    with pytest.raises(SystemExit, match=r"^error: --resume: .*\.metadata is not a plain sharded checkpoint's "
                                         r"metadata \(it names torch\.distributed\.checkpoint\.metadata\.os\.system\)"):
        runs.check_shards(folder)
    assert not ran.exists()


def test_runs_shard_metadata_of_none_falls_back_to_no_other_file(tmp_path):
    """A .metadata holding pickle(None) passed the check, and torch's reader then fell back to __0.metadata, loaded
    unchecked. It is refused, and no other metadata file is ever read."""
    import torch.distributed.checkpoint as dcp
    folder, back, _, ran = shards_and_a_payload(tmp_path)
    (folder / ".metadata").write_bytes(pickle.dumps(None))
    (folder / "__0.metadata").write_bytes(pickle.dumps(RunsCode(str(ran))))
    with pytest.raises(SystemExit, match=r"^error: --resume: .*\.metadata is not a plain sharded checkpoint's "
                                         r"metadata \(it holds a NoneType, not a Metadata\)"):
        runs.check_shards(folder)
    with pytest.raises(SystemExit):
        dcp.load(back, storage_reader=runs.shard_reader(folder), planner=runs.safe_load_planner())
    assert not ran.exists()


def test_runs_shard_metadata_swapped_after_the_check_is_never_loaded(tmp_path):
    """The check and the load opened .metadata separately: a file swapped between them ran. The metadata is read
    once: what loads is what was checked, whatever the file holds by then."""
    import torch.distributed.checkpoint as dcp
    folder, back, weights, ran = shards_and_a_payload(tmp_path)
    reader = runs.shard_reader(folder)
    (folder / ".metadata").write_bytes(pickle.dumps(RunsCode(str(ran))))
    dcp.load(back, storage_reader=reader, planner=runs.safe_load_planner())
    assert not ran.exists() and all(torch.equal(back["model"][k], v) for k, v in weights.items())


def warmed_up(records, lr, warmup=10):
    """The learning rate each train record's step trained with: the linear warm-up at the number of optimizer
    updates before it (a step with no prompt kept, or a skipped one, makes none)."""
    rates, updates = [], 0
    for r in (r for r in records if r["kind"] == "train"):
        rates.append(lr * min(1.0, (updates + 1) / warmup))
        updates += r["kept_prompts"] > 0 and not r["skipped_bad"]
    return rates


def test_train_stopped_early_saves_and_evaluates_its_last_step(tmp_path, monkeypatch):
    """A run whose prompts run out between two checkpoints keeps what it trained: its last step is saved
    (and evaluated once). The embedded model learns here, so its steps update the weights: the logged
    learning rate is the one each step trained with."""
    real, calls = data.Curriculum.next_batch, []

    def next_batch(self, k):  # called once per prompt, 4 per step
        calls.append(k)
        if len(calls) > 2 * 4:
            raise StopIteration("every training prompt is retired (pass rate >= 0.9): nothing left to train on")
        return real(self, k)
    monkeypatch.setattr(data.Curriculum, "next_batch", next_batch)
    recs = run_train(toy.toy_model_dir(), tmp_path, "--steps", "6", "--eval_every", "2", "--save_every", "5")
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2]
    assert [r["kept_prompts"] > 0 for r in recs if r["kind"] == "train"] == [True, True]
    assert [r["lr"] for r in recs if r["kind"] == "train"] == pytest.approx([2e-5, 4e-5]) == warmed_up(recs, 2e-4)
    assert [r["step"] for r in recs if r["kind"] == "eval"] == [0, 2]
    assert (tmp_path / "ckpt-000002" / "state.pt").exists()


def test_train_disk_full_names_the_path_and_keeps_the_last_checkpoint(toy_dir, tmp_path, monkeypatch):
    out = tmp_path / "run"
    real_save, calls = torch.save, []

    def save_until_full(obj, path, *a, **k):
        calls.append(path)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *a, **k)
    monkeypatch.setattr(train.torch, "save", save_until_full)
    with pytest.raises(SystemExit, match=r"writing .*ckpt-000002.tmp failed: No space left on device; the last good "
                                         r"checkpoint is .*ckpt-000001"):
        run_train(toy_dir, out, "--steps", "2", "--save_every", "1")
    assert (out / "ckpt-000001" / "state.pt").exists() and not (out / "ckpt-000002.tmp").exists()

# =============================================================================
# bench.py: the memory figure measures what it claims


def test_bench_prints_its_figures_and_no_progress_bars(capsys):
    from transformers.utils import logging as hf_logging
    hf_logging.enable_progress_bar()  # as a fresh process has it
    bench.main(bench.get_args(["--figures", "5"]))  # loads the toy and a Qwen2 model; arithmetic figures only
    out, err = capsys.readouterr()
    assert "5 roofline" in out and "Loading weights" not in err


class FirstLaunch(Exception):
    """A figure's first launch of train.py: its command checked by train.py's and torchrun's parsers, not run."""


def launched_train_args(cmd):
    """bench.py's command of train.py (alone, under torchrun, or torchrun's `--no-python sh -c`) -> (train.py's
    parsed flags, torchrun's or None)."""
    words, launch = [str(w) for w in cmd], None
    if "torch.distributed.run" in words:
        launch = torch.distributed.run.get_args_parser().parse_args(words[words.index("torch.distributed.run") + 1:])
        words = [launch.training_script, *launch.training_script_args]
        if launch.no_python:
            words = shlex.split(words[-1])
    script = next(i for i, w in enumerate(words) if w.endswith("train.py"))
    return config.get_args(words[script + 1:]), launch


def first_launch(cmd, *_, env=None, **__):
    """subprocess.run / bench.peak_rss as a figure's first launch: FirstLaunch(train.py's flags, torchrun's, env)."""
    raise FirstLaunch(*launched_train_args(cmd), env)


def forkserver_spawn(fn, args=(), nprocs=1, join=True, **_):
    """torch.multiprocessing.spawn from the preloaded server: ~5 CPU-s of imports less a process."""
    return torch.multiprocessing.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method="forkserver")


def in_fork(fn, *args):
    with FORKS.Pool(1) as pool:
        return pool.apply(fn, args)


def replay_run(folder, step):
    """A run folder with one checkpoint at `step`: the toy model and its AdamW state after a step."""
    ckpt = folder / f"ckpt-{step:06d}"
    shutil.copytree(toy.toy_model_dir(), ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    opt = torch.optim.AdamW(model.parameters())
    sum(p.sum() for p in model.parameters()).backward()
    opt.step()
    torch.save({"optimizer": opt.state_dict()}, ckpt / "state.pt")


# bench.py's figures at their smallest: Qwen2 configs 32 wide (--size, --fsdp_size), the published shapes 64
# wide (one for figure memory), the study's task 2 x 2 samples of 8 + 8 tokens and the 8k mix 2 samples
# (figure efficiency); every process forked from the preloaded server
BENCH_TINY = ["--repeats", "1", "--batch", "2", "--prompt_len", "2", "--new_tokens", "2", "--task_prompts", "2",
              "--task_new_tokens", "2", "--train_seqs", "2", "--train_len", "8", "--mem_vocab", "64", "--mem_seqs",
              "1", "--mem_len", "8", "--chunk", "4", "--bcast_mb", "1", "--agree_seqs", "2", "--pipeline_steps", "1",
              "--fsdp_steps", "1", "--fsdp_seqs", "2", "--fsdp_len", "8", "--stability_seeds", "0",
              "--replay_steps", "2"]
TINY_QWEN2 = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64, vocab_size=256, tie_word_embeddings=False)
NARROW = dict(hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
              vocab_size=512)
# what each figure prints once it measured (a pattern); the figures that launch train.py (pipelines of several
# ranks, a process's peak RSS over 40 s) stop at their first launch, checked: FirstLaunch
BENCH_SAYS = {"1": r"1 sampler   \| toy task", "2": r"2 memory .* max \|logp diff\|", "3": r"3 broadcast \| 1 MB",
              "4": r"4 agreement \| qwen2-small bfloat16 fp32_head=False", "5": r"5 roofline", "6": FirstLaunch,
              "7": r"FSDP2 rank 1 of 2 holds \S+ params \| cap none \| peak \S+ GB \| losses \d",
              "memory": r"memory \| the README's 8-GPU command", "efficiency": r"efficiency \| trainer, 8k step",
              "stability": FirstLaunch, "replay": r"replay \| step 2 \| log-odds", "plan_rss": FirstLaunch,
              "gpu": r"gpu \| a GPU: parts tests, kernels, sampler, trainer"}


@pytest.mark.parametrize("figure", BENCH_SAYS)
def test_bench_every_figure_runs_at_its_smallest_size(figure, tmp_path, monkeypatch, capsys):
    """`bench.py --figures stability` stopped at once (study.LOOPBACK_ENV had moved away), figure 7's trainers all
    failed (the trainer's forward takes packed rows now), and no test ran either: each figure runs here at its
    smallest, to its printed line; a figure that launches train.py, to its first launch, whose flags train.py and
    torchrun parse (stability's: the README's loopback form)."""
    real_shape = bench.shape_config
    for module, name, value in (
            (bench, "shape_config", lambda shape, **kw: real_shape(shape, **{**NARROW, **kw})),
            (bench, "PLAN_SHAPES", bench.PLAN_SHAPES[:1]),
            (study, "TASK", [*study.TASK, "--prompts", "2", "--samples", "2", "--think_budget", "8",
                             "--answer_budget", "8"]),
            (bench, "budget_8k_lengths", functools.partial(bench.budget_8k_lengths, prompts=1, samples=2)),
            (bench, "in_fresh_process", in_fork), (torch.multiprocessing, "spawn", forkserver_spawn),
            (bench.subprocess, "run", first_launch), (bench, "peak_rss", first_launch),
            (bench.subprocess, "Popen", lambda cmd, **_: types.SimpleNamespace(kill=lambda: None)),  # CPU hogs
            (tempfile, "tempdir", str(tmp_path))):
        monkeypatch.setattr(module, name, value)
    monkeypatch.setitem(bench.SIZES, "small", TINY_QWEN2)
    monkeypatch.setitem(bench.SIZES, "medium", TINY_QWEN2)
    runs_dir = tmp_path / "stability"
    if figure == "stability":  # a finished one-process run, reused: the first launch is torchrun's
        (runs_dir / "toy-one" / "one-s0").mkdir(parents=True)
        (runs_dir / "toy-one" / "one-s0" / "metrics.jsonl").write_text(
            '{"kind": "config", "steps": 2}\n{"kind": "eval", "step": 2, "pass_rate": 0.5}\n')
    if figure == "replay":
        replay_run(tmp_path / "run", 2)
    if figure == "gpu":  # on any machine: to the parts it would run (test_bench_gpu_parts_* runs the runner)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(bench, "gpu_peaks", lambda: (3.35e12, 989e12, "a GPU"))
        monkeypatch.setattr(bench, "run_parts", lambda parts: print(
            f"gpu | a GPU: parts {', '.join(p[0] for p in parts)}") or {})
    args = bench.get_args(["--figures", figure, *BENCH_TINY, "--stability_dir", str(runs_dir),
                           "--replay_run", str(tmp_path / "run")])
    if BENCH_SAYS[figure] is FirstLaunch:
        with pytest.raises(FirstLaunch) as launched:
            bench.main(args)
        train_args, torchrun, env = launched.value.args
        assert train_args.model_dir if figure == "plan_rss" else train_args.out.startswith(str(tmp_path))
        if figure == "stability":
            assert (torchrun.rdzv_backend, torchrun.rdzv_conf, torchrun.local_addr, torchrun.nproc_per_node) == (
                "c10d", "store_type=file", "127.0.0.1", "2")
            assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" and train_args.seed == 0
    else:
        bench.main(args)
        out = capsys.readouterr().out
        assert re.search(BENCH_SAYS[figure], out), out
    assert set(BENCH_SAYS) == set(bench.FIGURES)  # every figure bench.py has


def test_chunked_logprobs_peak_memory_is_far_below_the_naive_path_and_values_equal():
    vocab, seqs, length, chunk = 32000, 1, 1024, 1024  # chunks of 1,024 vocabulary rows: 4 MB of logits each
    logits_bytes = seqs * (length - 1) * vocab * 4  # the naive path's (N, T-1, V) float32 logits: 131 MB
    common = (vocab, seqs, length, chunk, "cpu", torch.float32)
    with FORKS.Pool(2, maxtasksperchild=1) as pool:  # one fresh (forked) process each:
        naive, chunked = pool.starmap(bench.memory_worker, [("naive", *common), ("chunked", *common)])  # own peak RSS
    assert naive["peak_bytes"] > 2 * logits_bytes  # logits and their log-softmax both live at once
    assert chunked["peak_bytes"] < naive["peak_bytes"] / 5
    assert np.allclose(chunked["logp"], naive["logp"], atol=1e-5)  # same weights (same seed) in both processes
    assert np.allclose(chunked["grad"], naive["grad"], atol=1e-5)
    assert np.abs(np.array(naive["grad"])).max() > 0  # the backward really ran

# =============================================================================
# under pytest-xdist (the README's `-n 2 --dist loadgroup`): every test that starts a code sandbox runs on one
# worker, one after another, so that the samples' timings do not depend on the other worker's (a sandbox's limit
# is wall-clock time) and the tests that look for sandboxes from outside see no other test's: a new test that
# scores code joins SANDBOX_USERS.

SANDBOX_USERS = {"test_score_problems_routes_math_and_code", "test_data_code_toy_fixture_loads_and_its_solutions_pass",
                 "test_verify_thinking_opened_by_the_prompt_must_close",
                 "test_train_mixed_math_and_code_logs_a_pass_rate_per_domain",
                 "test_user_errors_are_one_line_naming_the_flag_and_leave_no_folder",
                 "test_train_says_what_ran_where_things_are_and_names_flags_in_errors",
                 "test_train_checkpoints_pruned_by_step_and_resume_survives_broken_files"}
for _name in [n for n in globals() if n.startswith("test_code_") or n in SANDBOX_USERS]:
    globals()[_name] = pytest.mark.xdist_group("sandbox")(globals()[_name])
