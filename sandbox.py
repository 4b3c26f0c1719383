"""
sandbox.py: the code reward. Does the last Python block of a response pass every test, when it runs
in a bubblewrap sandbox?

Implements the code side of the reward of arXiv 2510.13786 (+1 for a verified-correct final answer,
-1 otherwise, section 2) for the math+code runs of section 5 (code problems judged by their unit
tests). This file returns the bool; the caller maps it to +1 / -1 (verify.score_problems sends code
problems here).

The program is the last fenced Python block after </think> (```python, ```py or a bare ```); a
<think> that never closes means the response never answered. It runs against the tests:
stdin/stdout pairs {"inputs": [...], "outputs": [...]} (TACO, APPS, DeepCoder; one run per pair;
outputs equal line by line after collapsing whitespace and dropping blank ends; exit code 0) or
asserts (MBPP/HumanEval: a list of statements or one string, run after the program; HumanEval's
`def check(candidate)` needs its call, e.g. "check(add)").

Threat model: a policy is an optimizer that finds any reward it can forge, so nothing the program
can read or change decides its reward: expected stdout stays with the parent, which compares; an
assert is evaluated by the parent, and the sandbox only reports, as plain data (repr of numbers,
strings, containers), the values of its leaves: the calls of the solution's functions
(split_asserts). So `assert abs(mean(xs) - 2.0) < 1e-6` runs `mean(xs)` in the sandbox and
`abs(v - 2.0) < 1e-6` in the parent: a program that patches builtins or math, or returns an object
whose __sub__, __eq__ or __len__ lies, changes nothing but its own value, and an object is not plain
data. An early exit leaves an assert unreported: it fails. Asserts that would need the sandbox to
compute more (a helper or variable of the tests, another builtin), or that never call the solution
(`assert sum([1, 2]) == 3`, `assert True` alone: the parent alone would pass any program), are
refused when the data is loaded (data.py). The parent's side runs in a checker process of its own,
under 2 s and 512 MiB: a value that an assert turns into a long loop (`max(range(f(3)))` with
f(3) = 10**18) or a huge object scores False and costs the caller nothing.
Each run is a fresh `python -I` in its own bubblewrap (bwrap) sandbox: every namespace unshared (its
own user namespace, for root's sandboxes too; no network; its own PID namespace, so nothing outside
is visible or killable and every process in it dies with it; its own mount namespace whose only
files are its own copies, made by bwrap into the sandbox's fresh root tmpfs, of the interpreter, the
libraries it loads and the standard library (_runtime; ~45 MB, ~20 ms a run): no file of the machine
at all, no /usr, no /etc, no home, no data, no /proc), a fresh 64 MiB tmpfs /tmp as the only
writable place and its cwd, uid 65534 inside (root's sandboxes: the real uid 65534),
--die-with-parent, a new session, an environment of HOME, LANG, LD_LIBRARY_PATH; a seccomp filter
(seccomp_filter: built with libseccomp, loaded by bwrap; without libseccomp code rewards refuse to
run, as without bwrap); and limits: one CPU-time budget for the whole sample, `timeout` s (10) for
all its runs together, counted by its cgroup (every process of it), each run SIGKILLed when the
budget is spent, and a wall-clock cap of CODE_WALL_FACTOR (3) times that for a program that waits:
a correct program on a busy machine keeps its reward, which then does not depend on the load. Where
no cgroup counts CPU time (cgroup v2's cpu.stat, v1's cpuacct; and --unsafe_code_exec) the budget
is wall-clock time, as a slow machine then fails slow answers; at most CODE_MAX_CASES
(32) stdin cases, its problem's first (data.py keeps only those, and says so); RLIMIT_CPU budget+1
s; RLIMIT_AS `memory` (1 GiB); RLIMIT_FSIZE and the output read back 16 MiB; no core files;
RLIMIT_NPROC = 32 tasks more than the sandbox's user namespace counts (Linux >= 5.14; before, than
its uid counts on the machine); os.fork/system/kill/setsid/posix_spawn and ctypes, subprocess,
multiprocessing are removed first (a naive fork bomb fails at once).
Those limits bind each process alone. For the whole sample, before it runs anything (bwrap waits on
a pipe meanwhile: _confine): its processes are the OOM killer's first pick (oom_score_adj 1000, so a
sample that fills the memory dies, not the trainer), and where the machine allows a cgroup (root,
or a delegated subtree: cgroup_plan) they share one of their own: memory.max CODE_SAMPLE_MEMORY
(1.19 GiB: the 1 GiB of a program, its /tmp, its copy of the interpreter; no swap; the whole sample
killed at once where cgroup v2's memory.oom.group exists), pids.max 36, cpu.max one CPU (cgroup v2;
else cgroup v1's memory, pids and cpu hierarchies). Where no cgroup can be made, cgroup_plan logs
one line saying so and what then bounds a sample: its processes' own limits. score_code_batch runs
at most one sample per CPU, each pinned to a CPU of its own, so that no neighbour's processes can
starve it; and never two samples whose problems share a mark (problem_marks: the same problem with
its tests written differently is one problem) at the same moment.

What this guarantees: the program reaches the parent only through its stdin, the stdout and
assert-value files it writes (read back capped) and its exit code; it reads nothing of the machine;
nothing of it outlives the run (processes, files, its user namespace with its keyring, IPC objects,
sockets); and it cannot hand an answer to a later sample through state the kernel keeps:
- the page cache: every page it can read is its own copy in memory, made for this run alone, so
  there is no cold page to warm and no shared page to evict or time (measured inside: the first read
  of every 7th page of its libpython takes 0.73 us at the median, as a cached read of the machine's
  files does, against ~50 us for a cold page of the machine's disk);
- the filter refuses (EPERM) what would reach state outside its copies: page-cache eviction and
  residency calls (fadvise, readahead, madvise COLD/PAGEOUT, mincore, cachestat, preadv2 flags such
  as RWF_NOWAIT, Linux AIO, io_uring, the fault counters of getrusage and wait4), the kernel
  keyring, file locks and inotify/fanotify/dnotify, the kernel log, machine-wide counters (sysinfo),
  sockets other than AF_UNIX/AF_INET/AF_INET6 (netlink; vsock, which network namespaces do not
  separate), ptrace, process_vm_*, perf_event_open, bpf, userfaultfd, new namespaces and mounts,
  personality; and what would step out of its limits: sched_setaffinity (its pinned CPU),
  memfd_create and SysV shmget (memory held unmapped, which RLIMIT_AS does not count). Other
  architectures' system-call ABIs (x32, int 0x80) kill the program.
What remains possible in principle: without a cgroup, a sample's memory is bounded per process only
(up to 34 processes of 1 GiB, and pipe and socket buffers), though the OOM killer then takes the
sample first; and timing through state no filter names: (1) contention between runs at the same
moment (memory bandwidth, shared caches; not the CPU, which each has its own of):
score_code_batch never runs two samples of one problem at once, and a program that carried an
answer to a sample of another problem gains nothing; (2) micro-architectural state one run leaves
for the next on the same core (branch predictors, CPU caches): bwrap's 45 MB copy between two runs
overwrites the caches, and such channels carry a few noisy bits at best, far from the tens of
reliable bits an answer needs; (3) a swap device, where the kernel may page the copies out under
memory pressure (none on the machines this was measured on; a cgroup v2 allows the sample none).
Without bwrap, score_code(..., unsafe=True) (train.py --unsafe_code_exec) runs the same program with
the limits alone (no filter, no cgroup), in a temp dir, as `nobody` when root can drop to it: it can
then read and write what that user can, use the network, and leave processes behind (setsid past
the removed functions). Linux only (bwrap, seccomp, ldd, /proc, os.waitid).

Usage:
    from sandbox import score_code, score_code_batch
    score_code("```python\\nprint(sum(map(int, input().split())))\\n```",
               {"inputs": ["1 2"], "outputs": ["3"]})                            # True
    score_code(response, ["assert add(1, 2) == 3"])                            # MBPP-style asserts
    score_code_batch(responses, tests_list, workers=8)                         # list of bools
    python -c "import sandbox; print(sandbox.bwrap_ready())"
                                           # True once bwrap and libseccomp work here
                                           # (apt-get install bubblewrap libseccomp2)
    python -m pytest test_all.py -k code   # the sandbox tests (skip with the reason without them)
"""
import ast
import atexit
import builtins
import contextlib
import ctypes
import errno
import functools
import importlib.util
import itertools
import json
import marshal
import math
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
import zipfile

# CPU seconds for a whole sample: all its program runs together (one per stdin case, one for
# asserts); and its wall-clock cap, this many times that (a program that sleeps or blocks)
CODE_TIMEOUT = 10.0
CODE_WALL_FACTOR = 3
CODE_MAX_CASES = 32        # stdin/stdout cases a sample is run on: its problem's first ones
CODE_MEMORY = 1 << 30      # RLIMIT_AS of a program run, bytes
# stdout (and assert values) read back, and RLIMIT_FSIZE: any file it writes
CODE_MAX_OUTPUT = 16 << 20
CODE_MAX_REPORT = 64 << 10 # characters of one assert's reported values that the checker will parse
# wall-clock seconds for the checker process that evaluates the asserts' reports
CODE_CHECK_TIMEOUT = 2.0
CODE_CHECK_MEMORY = 512 << 20  # its RLIMIT_AS: past either limit the response scores False
CODE_TMPFS = 64 << 20      # the sandbox's only writable place: a fresh tmpfs of this size
# tasks (processes + threads) a run may add to what its uid is counted for
CODE_NPROC_MARGIN = 32
SANDBOX_UID = 65534        # the unprivileged uid inside the sandbox ('nobody')
# RLIMIT_NPROC's count in a fresh sandbox's user namespace, at most: bwrap init, program
SANDBOX_TASKS = 2
# what a sample's cgroup allows all its processes together (where the machine gives one): memory
# (a program's address space, its /tmp and bwrap's copy of the interpreter), tasks (bwrap's two and
# the program's), CPU time per period
CODE_SAMPLE_MEMORY = CODE_MEMORY + CODE_TMPFS + (128 << 20)
CODE_SAMPLE_TASKS = CODE_NPROC_MARGIN + SANDBOX_TASKS + 2
CODE_SAMPLE_CPU_US = 100_000  # of every 100 ms: one CPU
LIBSECCOMP = "libseccomp.so.2"
BWRAP_MISSING = ("code rewards need bubblewrap (bwrap) to isolate model-written programs: "
                 "install it (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install "
                 "bubblewrap), or pass --unsafe_code_exec to run them with resource limits only "
                 "(a program can then forge its reward)")
SECCOMP_MISSING = (f"code rewards need libseccomp ({LIBSECCOMP}) to filter the system calls of "
                   "model-written programs (without it, programs can pass answers to each other): "
                   "install it (Debian/Ubuntu: apt-get install libseccomp2; Fedora: dnf install "
                   "libseccomp), or pass --unsafe_code_exec to run them with resource limits only "
                   "(a program can then forge its reward)")

# Runs in the child, before the program: lower the limits, remove the process-making and
# process-killing functions (a naive fork bomb fails at once), define _record (the values of an
# assert's leaves, written as the repr of plain data to the results fd), read the program, run it
# (as __main__ when it reads stdin, so that its `if __name__ == "__main__":` block runs; as
# `solution` under asserts, so that it does not), then the tests.
_PRELUDE = """
import json, os, posix, resource, sys
limits, source_fd, results_fd, uid = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
if uid >= 0:  # root's sandbox: become the unprivileged uid (RLIMIT_NPROC does not bind root)
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
limits["RLIMIT_NPROC"] += int(sys.argv[5])  # what RLIMIT_NPROC counts for this uid now
for name, value in limits.items():
    resource.setrlimit(getattr(resource, name), (value, value))
with os.fdopen(source_fd, encoding="utf-8", errors="replace") as f:
    program, tests = json.load(f)
_out = os.fdopen(results_fd, "w", encoding="utf-8")
def _plain(x, depth=0):
    if depth > 20:
        return False
    if x is None or type(x) in (bool, int, float, complex, str, bytes):
        return True
    if type(x) in (list, tuple, set, frozenset):
        return all(_plain(y, depth + 1) for y in x)
    return type(x) is dict and all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in x.items())
def _record(k, value):  # the repr of plain data has no raw newline
    _out.write(f"{k}\\t{repr(value) if _plain(value) else '<not plain data>'}\\n")
    _out.flush()
for name in ("fork", "forkpty", "system", "popen", "kill", "killpg", "setsid", "setpgid",
             "posix_spawn", "posix_spawnp", "spawnv", "spawnve", "spawnvp", "spawnvpe"):
    for module in (os, posix):
        if hasattr(module, name):
            setattr(module, name, None)
for name in ("ctypes", "_ctypes", "_posixsubprocess", "subprocess", "multiprocessing"):
    sys.modules[name] = None
sys.argv = ["solution.py"]
scope = {"__name__": "solution" if tests else "__main__", "__builtins__": __builtins__, "_record": _record}
exec(compile(program + "\\n\\n" + tests, "solution.py", "exec"), scope)
"""

# -----------------------------------------------------------------------------
# Reading the program and the tests


def extract_code(response):
    """The last fenced Python block (```python, ```py or a bare ```) after the last </think>,
    or None. A <think> that never closes means the response never answered."""
    if not isinstance(response, str):
        return None
    if "</think>" in response:
        response = response.rsplit("</think>", 1)[1]
    elif "<think>" in response:
        return None
    blocks, tag, lines = [], None, None
    for line in response.split("\n"):
        fence = line.strip().startswith("```")
        if lines is None and fence:
            tag, lines = line.strip()[3:].strip().lower(), []
        elif fence:
            if tag in ("", "python", "python3", "py"):
                blocks.append("\n".join(lines))
            lines = None
        elif lines is not None:
            lines.append(line)
    return blocks[-1] if blocks and blocks[-1].strip() else None


def _output_lines(text):
    """Output compared line by line with whitespace runs collapsed and blank ends dropped."""
    return [" ".join(line.split()) for line in text.strip().splitlines()]


# What the parent evaluates itself, on plain data: these builtins and math functions, literals,
# operators, comparisons, indexing, f-strings and str methods of a literal ("".join(...)). Nothing
# the program runs can change them (they live in the parent, and builtin types' operators cannot be
# patched).
_PARENT_NAMES = {f.__name__: f for f in (
    abs, all, any, bool, complex, dict, divmod, enumerate, float, frozenset, int, isinstance, len,
    list, max, min, range, repr, reversed, round, set, sorted, str, sum, tuple, type, zip)}
_PARENT_MATH = types.SimpleNamespace(**{name: getattr(math, name) for name in (
    "isclose", "fabs", "floor", "ceil", "trunc", "sqrt", "isnan", "isinf", "isfinite", "fsum",
    "prod", "pi", "e", "inf", "nan")})
_PARENT_NODES = (ast.Constant, ast.List, ast.Tuple, ast.Set, ast.Dict, ast.BinOp, ast.UnaryOp,
                 ast.BoolOp, ast.Compare, ast.IfExp, ast.Subscript, ast.Slice, ast.JoinedStr,
                 ast.FormattedValue, ast.keyword, ast.operator, ast.unaryop, ast.boolop, ast.cmpop,
                 ast.expr_context)


def _names_bound(tree):
    """(names the tests bind: assigned, defined, imported (a plain `import math` aside), names of
    parameters)."""
    bound, params = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {a.asname or a.name.split(".")[0] for a in node.names
                      if (a.name, a.asname) != ("math", None) or isinstance(node, ast.ImportFrom)}
        elif isinstance(node, ast.arg):
            params.add(node.arg)
    return bound, params - bound


class _Split(ast.NodeTransformer):
    """One assert's expression -> the parent's expression, each leaf replaced by _v[i], and the
    leaves: what only the sandbox can evaluate (calls of the solution's functions, names the
    solution defines)."""

    def __init__(self, bound, params, line):
        self.bound, self.params, self.line, self.leaves = bound, params, line, []

    def _math(self, node):
        """math.<one of _PARENT_MATH>, with `math` not rebound by the tests."""
        return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "math" and "math" not in self.bound
                and hasattr(_PARENT_MATH, node.attr))

    def _parent(self, node):
        if isinstance(node, ast.Name):
            return node.id in _PARENT_NAMES and node.id not in self.bound
        if isinstance(node, ast.Attribute):  # math.<function>, or a method of a literal (", ".join)
            return (self._math(node)
                    or isinstance(node.value, ast.Constant) and not node.attr.startswith("_"))
        if isinstance(node, ast.Call):
            return self._parent(node.func)
        return isinstance(node, _PARENT_NODES)

    def visit(self, node):
        if self._math(node):
            return node
        if self._parent(node):
            if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Pow, ast.LShift)):
                text, node.left = ast.unparse(node), self.visit(node.left)
                n, node.right = len(self.leaves), self.visit(node.right)
                if len(self.leaves) > n:
                    raise ValueError(f"line {self.line}: {text!r}: a power or shift by the "
                                     "solution's value could be made huge")
                return node
            return self.generic_visit(node)
        root = node
        while isinstance(root, (ast.Call, ast.Attribute, ast.Subscript)):
            root = root.func if isinstance(root, ast.Call) else root.value
        name = root.id if isinstance(root, ast.Name) else None
        if (name is None or name in self.bound or hasattr(builtins, name)
                or (name in self.params and root is node)):
            raise ValueError(f"line {self.line}: the sandbox would compute {ast.unparse(node)!r}: "
                             "an assert may use literals, operators, common builtins and math "
                             "functions (evaluated by the parent) around calls of the solution's "
                             "functions")
        self.leaves.append(node)
        return ast.Subscript(ast.Name("_v", ast.Load()), ast.Constant(len(self.leaves) - 1),
                             ast.Load())


def split_asserts(tests):
    """Assert-style tests -> (the code the sandbox runs, [check per assert]). The parent evaluates
    each assert itself; the sandbox evaluates only its leaves, the calls of the solution's functions
    (or of a test function's parameter: HumanEval's candidate) and names the solution defines, and
    `assert E` becomes `_record(k, (leaf, leaf, ...))`: the sandbox reports the leaves' values as
    plain data and check k (the source of an expression on that tuple, `_v`) computes E from them,
    so expected values never enter the sandbox and nothing the program patches (builtins, math, the
    tests' own names) takes part in the verdict. Asserts may sit in helper functions. Every leaf of
    an assert is evaluated, before the parent's expression (no short-circuit inside the sandbox).
    Raises ValueError for an assert that needs anything else computed in the sandbox (a test-defined
    helper or variable, another builtin, a comprehension), for one that computes something without
    calling the solution (`assert sum([1, 2]) == 3`: the parent's own sum would pass any program),
    and for tests where no assert calls the solution (`assert True` alone)."""
    tree, checks, leaves = ast.parse(tests), [], 0
    bound, params = _names_bound(tree)

    class Rewrite(ast.NodeTransformer):
        def visit_Assert(self, node):
            nonlocal leaves
            split, text = _Split(bound, params, node.lineno), ast.unparse(node)
            expression = split.visit(node.test)
            if not split.leaves and not isinstance(node.test, ast.Constant):
                raise ValueError(f"line {node.lineno}: {text!r} never calls the solution: "
                                 "the parent alone would evaluate it and any program would pass "
                                 "(a solution function named like a builtin is not supported)")
            checks.append(ast.unparse(expression))
            compile(checks[-1], "assert", "eval")
            leaves += len(split.leaves)
            report = ast.Call(ast.Name("_record", ast.Load()),
                              [ast.Constant(len(checks) - 1), ast.Tuple(split.leaves, ast.Load())],
                              [])
            return ast.copy_location(ast.Expr(report), node)

    tree = ast.fix_missing_locations(Rewrite().visit(tree))
    if not checks:
        raise ValueError("no assert statement")
    if not leaves:
        raise ValueError("no assert calls the solution: any program would pass")
    return ast.unparse(tree), checks


# The checker: a fresh interpreter under RLIMIT_AS and RLIMIT_CPU (and the caller's wall-clock
# bound) that parses the reports as plain data and evaluates each check on them with the parent's
# names alone; its exit code is the verdict. A process of its own, so that no report costs the
# caller more than CODE_CHECK_MEMORY and CODE_CHECK_TIMEOUT: a huge value, or one that the check
# turns into a long loop (max(range(10**18))) or a huge object ([0] * 10**12), which no signal could
# interrupt inside one builtin call.
_CHECKER = """
import ast, builtins, json, math, resource, sys, types
head = json.loads(sys.stdin.buffer.readline())
resource.setrlimit(resource.RLIMIT_AS, (head["memory"], head["memory"]))
resource.setrlimit(resource.RLIMIT_CPU, (head["seconds"], head["seconds"]))
names = {name: getattr(builtins, name) for name in head["builtins"]}
names["math"] = types.SimpleNamespace(**{name: getattr(math, name) for name in head["math"]})
checks = [compile(source, f"assert {k}", "eval") for k, source in enumerate(head["checks"])]
seen = set()
for line in sys.stdin.buffer.read().decode("utf-8", "replace").splitlines():
    k, _, text = line.partition("\\t")
    if not k.isdigit() or int(k) >= len(checks) or len(text) > head["max_report"]:
        sys.exit(1)
    values = ast.literal_eval(text)  # plain data, or it raises: exit code 1
    if type(values) is not tuple or not eval(checks[int(k)], {"__builtins__": {}, **names, "_v": values}):
        sys.exit(1)
    seen.add(int(k))
sys.exit(0 if len(seen) == len(checks) else 1)
"""


def _asserts_pass(results, checks):
    """Whether every assert was reported and every report passes its check, as the checker process
    finds within CODE_CHECK_TIMEOUT and CODE_CHECK_MEMORY (False past them): each report a tuple of
    plain data, its repr at most CODE_MAX_REPORT characters. results: the sandbox's report lines
    (bytes or str)."""
    head = {"checks": checks, "builtins": list(_PARENT_NAMES), "math": list(vars(_PARENT_MATH)),
            "memory": CODE_CHECK_MEMORY, "seconds": math.ceil(CODE_CHECK_TIMEOUT),
            "max_report": CODE_MAX_REPORT}
    data = json.dumps(head).encode() + b"\n" + (results.encode("utf-8", "replace")
                                                if isinstance(results, str) else results)
    try:
        run = subprocess.run([sys.executable, "-I", "-S", "-c", _CHECKER], input=data, env={},
                             cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             timeout=CODE_CHECK_TIMEOUT)
    except subprocess.TimeoutExpired:
        return False
    return run.returncode == 0

# -----------------------------------------------------------------------------
# Public API


def score_code(response, tests, timeout=CODE_TIMEOUT, memory=CODE_MEMORY, unsafe=False):
    """True when the last Python block of `response` passes every test, all its runs within
    `timeout` seconds of CPU time together (Budget; wall-clock where no cgroup counts it).
    `tests` is {"inputs": [str], "outputs": [str]} (stdin -> stdout, the first CODE_MAX_CASES
    pairs, each one run needing exit code 0; an output over 4x the expected one + 4 KiB fails
    unparsed) or asserts: a list of statements or one string, run after the program
    (split_asserts). unsafe: rlimits only, no bwrap (see the module docstring). Never
    raises."""
    try:
        program = extract_code(response)
        if program is None:
            return False
        budget = Budget(timeout, time.monotonic() + CODE_WALL_FACTOR * timeout)
        if isinstance(tests, dict):
            return _cases_pass(program, tests, budget, memory, unsafe)
        asserts = "\n".join(tests) if isinstance(tests, list) else tests
        if not isinstance(asserts, str):
            return False
        source, checks = split_asserts(asserts)
        code, _, results = _run_program(program, source, "", budget, memory, unsafe)
        return code == 0 and _asserts_pass(results, checks)
    except Exception:                               # malformed tests, unreadable text, ...
        return False


class Budget:
    """What is left of a sample's time: `cpu` seconds of CPU, until `deadline` (time.monotonic());
    each run of the sample spends from it (_run_program)."""

    def __init__(self, cpu, deadline):
        self.cpu, self.deadline = cpu, deadline

    def left(self):
        """-> (CPU seconds, wall-clock seconds) left; a run may start only while both are > 0."""
        return self.cpu, self.deadline - time.monotonic()


def _cases_pass(program, tests, budget, memory, unsafe):
    """Whether the program passes each stdin/stdout case (the first CODE_MAX_CASES) within
    `budget`: one time budget for the whole sample, so that a slow program costs its budget once,
    not once per case. The parent compares: expected outputs never enter the sandbox."""
    inputs, outputs = tests["inputs"], tests["outputs"]
    cases = list(zip(inputs, outputs, strict=True)) if isinstance(inputs, list) else []
    if not cases or not all(isinstance(x, str) for case in cases for x in case):
        return False
    for stdin, expected in cases[:CODE_MAX_CASES]:
        if min(budget.left()) <= 0:
            return False
        code, out, _ = _run_program(program, "", stdin, budget, memory, unsafe)
        too_long = len(out) > 4 * len(expected) + 4096  # not parsed: up to 16 MiB of lines
        if code != 0 or too_long or _output_lines(out) != _output_lines(expected):
            return False
    return True


def score_code_batch(responses, tests_list, workers=2, timeout=CODE_TIMEOUT, memory=CODE_MEMORY,
                     unsafe=False):
    """[score_code(r, t) for r, t in zip(responses, tests_list)], `workers` samples at a time, at
    most one per CPU this process may run on: each worker pins itself and the sandboxes it starts
    to a CPU of its own (which the system-call filter keeps them on), so that no neighbour's
    processes can starve a sample of its CPU. Two samples whose problems share a mark
    (problem_marks: tests compared as the judge reads them) never run at once, so contention cannot
    carry one's answer to the other."""
    if len(responses) != len(tests_list):
        raise ValueError(f"{len(responses)} responses but {len(tests_list)} tests")
    marks = [problem_marks(t) for t in tests_list]
    results, pending, busy, changed = ([None] * len(responses), list(range(len(responses))),
                                       set(), threading.Condition())

    def work(cpu):
        os.sched_setaffinity(0, {cpu})  # this thread only, and what it starts
        while True:
            with changed:
                while ((i := next((i for i in pending if not marks[i] & busy), None)) is None
                       and pending):
                    changed.wait()
                if i is None:
                    return
                pending.remove(i)
                busy.update(marks[i])
            try:
                results[i] = score_code(responses[i], tests_list[i], timeout=timeout, memory=memory,
                                        unsafe=unsafe)
            finally:
                with changed:
                    busy.difference_update(marks[i])
                    changed.notify_all()

    cpus = sorted(os.sched_getaffinity(0))[:max(1, min(workers, len(responses)))]
    threads = [threading.Thread(target=work, args=(cpu,), daemon=True) for cpu in cpus]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def problem_marks(tests):
    """What makes two samples' problems one for score_code_batch: a set of marks, and two problems
    that share one are kept apart. Stdin/stdout tests: each case, its input with whitespace
    collapsed and its output as score_code compares it; asserts: each assert as parsed (spacing,
    quotes, parentheses and its message aside), the functions it calls unnamed and the sides of an
    == or != in order; tests that do not parse: their text. So the same problem written slightly
    differently (another spacing, order, subset of cases, name of the solution) is one problem."""
    if isinstance(tests, dict):
        cases = zip(tests.get("inputs") or [], tests.get("outputs") or [])
        return {repr((" ".join(str(i).split()), _output_lines(str(o)))) for i, o in cases} or {
            repr(tests)}
    try:
        tree = ast.parse("\n".join(tests) if isinstance(tests, list) else tests)
        marks = {ast.unparse(_Unnamed().visit(node.test)) for node in ast.walk(tree)
                 if isinstance(node, ast.Assert)}
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        marks = set()
    return marks or {repr(tests)}


class _Unnamed(ast.NodeTransformer):
    """An assert's test as problem_marks compares it: every called name is `f`, and the two sides of
    a single == or != are in the order of their source."""

    def visit_Call(self, node):
        self.generic_visit(node)
        if isinstance(node.func, ast.Name):
            node.func = ast.Name("f", ast.Load())
        return node

    def visit_Compare(self, node):
        self.generic_visit(node)
        if len(node.ops) == 1 and isinstance(node.ops[0], (ast.Eq, ast.NotEq)):
            left, right = sorted([node.left, node.comparators[0]], key=ast.unparse)
            node.left, node.comparators = left, [right]
        return node


@functools.cache
def bwrap_ready():
    """Whether a sandbox starts here: bwrap installed, namespaces allowed, libseccomp there to build
    the system-call filter (not_ready_reason() says what is missing)."""
    if shutil.which("bwrap") is None:
        return False
    try:
        probe, _, groups = _start_sandbox([os.path.realpath(sys.executable), "-I", "-c", "pass"],
                                          subprocess.DEVNULL, subprocess.DEVNULL, ())
    except RuntimeError:  # no libseccomp
        return False
    try:
        return probe.wait(timeout=60) == 0
    except subprocess.TimeoutExpired:
        probe.kill()
        probe.wait()
        return False
    finally:
        _remove_cgroups(groups)


def not_ready_reason():
    """The one-line error for when bwrap_ready() is False: libseccomp is missing, or else
    bubblewrap."""
    try:
        seccomp_filter()
    except RuntimeError as err:
        return str(err)
    return BWRAP_MISSING

# -----------------------------------------------------------------------------
# A cgroup per sandbox: limits the kernel enforces on all of a sample's processes together

# the limits of a sample's cgroup: cgroup v2's files, and v1's in each of its hierarchies; a file
# in _IF_PRESENT is written where the kernel has it (swap accounting)
_V2_LIMITS = [("memory.max", CODE_SAMPLE_MEMORY), ("memory.swap.max", 0), ("memory.oom.group", 1),
              ("pids.max", CODE_SAMPLE_TASKS), ("cpu.max", f"{CODE_SAMPLE_CPU_US} 100000")]
_V1_LIMITS = {"memory": [("memory.limit_in_bytes", CODE_SAMPLE_MEMORY),
                         ("memory.memsw.limit_in_bytes", CODE_SAMPLE_MEMORY)],
              "pids": [("pids.max", CODE_SAMPLE_TASKS)],
              "cpu": [("cpu.cfs_period_us", 100_000), ("cpu.cfs_quota_us", CODE_SAMPLE_CPU_US)]}
_IF_PRESENT = {"memory.swap.max", "memory.memsw.limit_in_bytes"}
_GROUP_NUMBERS = itertools.count()


@functools.cache
def cgroup_plan():
    """Where this process's sandboxes get a cgroup each -> ([(parent folder, [(file, value)])],
    the line it logs, once, on stderr): _cgroup_parents', or none, and then the line says why and
    what bounds a sample instead (per-process limits, its pinned CPU, the OOM killer's first
    pick)."""
    try:
        plan, kind = _cgroup_parents(_own_cgroups())
        line = (f"code sandbox: each sample in a cgroup of its own ({kind}, under "
                f"{plan[0][0]}): {CODE_SAMPLE_MEMORY / 2**30:.2f} GiB, {CODE_SAMPLE_TASKS} tasks "
                "and one CPU for all its processes together")
    except OSError as err:
        plan = []
        line = (f"code sandbox: no cgroup for the samples ({err.strerror or err}; a cgroup needs "
                "root or a delegated subtree): a sample's memory is limited per process only "
                f"(RLIMIT_AS {CODE_MEMORY >> 20} MiB, up to {CODE_NPROC_MARGIN} more tasks), its "
                "CPU is the one it is pinned to, and the OOM killer picks a sandbox first")
    print(line, file=sys.stderr, flush=True)
    return plan, line


def _cgroup_parents(folders):
    """-> ([(parent folder, limits)], "cgroup v2" or "cgroup v1"): a group of ours where cgroup v2
    can give it the memory, pids and cpu controllers (_cgroup2_parent), else one in each of cgroup
    v1's memory, pids and cpu hierarchies. OSError saying why where neither can be made."""
    why = []
    if "2" in folders:
        try:
            return [(_cgroup2_parent(*folders["2"]), _V2_LIMITS)], "cgroup v2"
        except OSError as err:
            why.append("cgroup v2: no group here may have the memory, pids and cpu controllers "
                       f"({err.strerror or err})")
    if all(c in folders for c in _V1_LIMITS):
        try:
            plan = [(_our_group(folders[c][1], v2=False), limits)
                    for c, limits in _V1_LIMITS.items()]
            if "cpuacct" in folders and folders["cpuacct"][0] != folders["cpu"][0]:
                with contextlib.suppress(OSError):  # no count: the budget is wall-clock then
                    plan.append((_our_group(folders["cpuacct"][1], v2=False), []))
            return plan, "cgroup v1"
        except OSError as err:
            why.append(f"cgroup v1: cannot make a group ({err.strerror or err})")
    raise OSError(errno.ENOENT, "; ".join(why) or "no cgroup file system for this process")


def _own_cgroups():
    """{"2" or a v1 controller: (its hierarchy's mount point, this process's cgroup folder)}, from
    /proc/self/cgroup and /proc/self/mountinfo."""
    own = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else ["2"]:
                own[c] = path
    folders = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            head, _, tail = line.partition(" - ")
            root, point = head.split()[3:5]
            kind, _, options = tail.split()[:3]
            names = ["2"] if kind == "cgroup2" else options.split(",") if kind == "cgroup" else []
            inside = lambda c: (own[c] + "/").startswith(root.rstrip("/") + "/")
            for c in [c for c in names if c in own and c not in folders and inside(c)]:
                folders[c] = (point, os.path.normpath(point + "/" + own[c][len(root):]))
    return folders


def _cgroup2_parent(mount, folder):
    """cgroup v2: our group under the deepest of this process's cgroup and its ancestors whose
    children may have the memory, pids and cpu controllers (enabling them fails in a cgroup that
    holds processes, unless it is the root) -> its folder; the root's OSError where none may."""
    while True:
        try:
            return _our_group(folder, v2=True)
        except OSError:
            if folder == mount:
                raise
        folder = os.path.dirname(folder)


def _our_group(parent, v2):
    """This process's group of sandbox cgroups, made under parent (v2: with the memory, pids and
    cpu controllers enabled for it and its children) -> its folder; removed at exit."""
    enable = "+memory +pids +cpu"
    if v2:
        _write(os.path.join(parent, "cgroup.subtree_control"), enable)
    group = os.path.join(parent, f"scalerl-sandboxes-{os.getpid()}")
    os.makedirs(group, exist_ok=True)  # ours already, where cgroup_plan was cleared
    atexit.register(_remove_cgroups, [group], os.getpid())
    if v2:
        try:
            _write(os.path.join(group, "cgroup.subtree_control"), enable)
        except OSError:
            os.rmdir(group)
            raise
    return group


def _cgroup_for(pids):
    """A cgroup of its own for one sandbox under each parent of cgroup_plan(), its limits set and
    pids moved in -> its folders; [] where the machine gives none. RuntimeError if a step fails."""
    made = []
    try:
        for parent, limits in cgroup_plan()[0]:
            made.append(os.path.join(parent, f"{os.getpid()}-{next(_GROUP_NUMBERS)}"))
            os.mkdir(made[-1])
            for name, value in limits:
                path = os.path.join(made[-1], name)
                if name not in _IF_PRESENT or os.path.exists(path):
                    _write(path, value)
            for pid in pids:
                _write(os.path.join(made[-1], "cgroup.procs"), pid)
    except OSError as err:
        _remove_cgroups(made)
        raise RuntimeError(f"a sandbox's cgroup {made[-1]}: {err}") from None
    return made


def _cgroup_cpu(groups):
    """The CPU seconds all the processes of a sample's cgroup have used (every one, a process it
    never waited for included), or None where none of its groups counts them (cgroup v2's cpu.stat,
    v1's cpuacct)."""
    for folder in groups:
        for name, key, unit in (("cpu.stat", "usage_usec", 1e-6), ("cpuacct.usage", "", 1e-9)):
            with contextlib.suppress(OSError, ValueError):
                with open(os.path.join(folder, name)) as f:
                    for line in f:
                        if line.startswith(key):
                            return int(line.split()[-1]) * unit
    return None


def _remove_cgroups(folders, owner=None):
    """Remove cgroup folders once their processes are gone (a moment after they die; 5 s at most,
    then they are left); owner: only in that process (at exit: not in a forked child)."""
    if owner not in (None, os.getpid()):
        return
    deadline = time.monotonic() + 5
    for folder in reversed(folders):
        while True:
            try:
                os.rmdir(folder)
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)


def _write(path, value):
    with open(path, "w") as f:
        f.write(str(value))


# -----------------------------------------------------------------------------
# The system-call filter: what the sandboxed program may not ask the kernel

# Calls that fail with EPERM, by what they would let one program pass to another or reach outside. A
# sandbox's files are its own copies, but the page cache, the keyring and the rest are the kernel's:
# a second line of defence, should a file of the machine ever be visible (a bind added to
# _bwrap_args, a device node).
_DENIED = {
    "page cache: eviction; residency (mincore, cachestat, AIO and io_uring's nowait reads, "
    "fault counters, the NUMA calls that report whether a page is present)": (
        "fadvise64", "fadvise64_64", "arm_fadvise64_64", "readahead", "process_madvise", "mincore",
        "cachestat", "io_setup", "io_submit", "io_getevents", "io_pgetevents", "io_cancel",
        "io_destroy", "io_uring_setup", "io_uring_enter", "io_uring_register", "getrusage",
        "move_pages", "migrate_pages", "get_mempolicy", "mbind"),
    "the kernel keyring": (
        "add_key", "keyctl", "request_key"),
    "other processes, kernel tracing, exploit aids": (
        "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd", "perf_event_open",
        "bpf", "userfaultfd"),
    "new namespaces and mounts (a /proc of its own)": (
        "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree",
        "open_tree_attr", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
        "name_to_handle_at", "open_by_handle_at"),
    "machine-wide counters, the kernel log, events on and locks of files": (
        "sysinfo", "syslog", "inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_init",
        "fanotify_mark", "flock"),
    "the sandbox's own limits: its CPU (score_code_batch pins it to one) and memory that no "
    "per-process limit counts (memfd pages and SysV shared memory need not be mapped)": (
        "sched_setaffinity", "memfd_create", "memfd_secret", "shmget"),
    "the machine's own settings": (
        "personality", "acct", "swapon", "swapoff", "reboot", "kexec_load", "kexec_file_load",
        "init_module", "finit_module", "delete_module", "quotactl", "quotactl_fd", "settimeofday",
        "clock_settime", "clock_adjtime", "iopl", "ioperm", "vhangup", "lookup_dcookie", "uselib",
        "ustat", "sysfs", "_sysctl", "nfsservctl"),
}
# Numbers from 424 on are the same on every architecture: used when this libseccomp predates a name.
_NEW_SYSCALLS = {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
                 "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
                 "fsmount": 432, "fspick": 433, "clone3": 435, "pidfd_getfd": 438,
                 "process_madvise": 440, "mount_setattr": 442, "quotactl_fd": 443,
                 "memfd_secret": 447, "cachestat": 451, "open_tree_attr": 467}
# CLONE_NEW*
_CLONE_NEW = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
_NE, _EQ, _GE, _MASKED_EQ = 1, 4, 5, 7  # libseccomp's enum scmp_compare


# libseccomp's struct scmp_arg_cmp: argument `arg` `op` a; MASKED_EQ: & a == b
class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64),
                ("b", ctypes.c_uint64)]


def _seccomp_rules():
    """(system call, errno, [argument conditions, all of which must hold]) for each refused use."""
    # an int argument: the kernel reads the low 32 bits
    int_is = lambda value: (_MASKED_EQ, 0xFFFFFFFF, value)
    rules = [(name, errno.EPERM, []) for names in _DENIED.values() for name in names]
    # POSIX and OFD locks, leases, dnotify
    rules += [(name, errno.EPERM, [(1, *int_is(cmd))]) for name in ("fcntl", "fcntl64")
              for cmd in (5, 6, 7, 36, 37, 38, 1024, 1026)]
    # MADV_COLD, MADV_PAGEOUT
    rules += [("madvise", errno.EPERM, [(2, *int_is(advice))]) for advice in (20, 21)]
    # any RWF_* flag
    rules += [(name, errno.EPERM, [(5, _NE, 0, 0)]) for name in ("preadv2", "pwritev2")]
    # a child's rusage
    rules += [("wait4", errno.EPERM, [(3, _NE, 0, 0)]), ("waitid", errno.EPERM, [(4, _NE, 0, 0)])]
    # AF_UNIX, AF_INET and AF_INET6 only
    rules += [(name, errno.EPERM, [(0, op, domain, 0)]) for name in ("socket", "socketpair")
              for op, domain in [(_EQ, 0), *((_EQ, d) for d in range(3, 10)), (_GE, 11)]]
    # elsewhere clone's flags are its first argument
    if os.uname().machine not in ("s390", "s390x"):
        rules += [("clone", errno.EPERM, [(0, _MASKED_EQ, flag, flag)]) for flag in _CLONE_NEW]
    # its flags are out of reach: libc falls back to clone
    return rules + [("clone3", errno.ENOSYS, [])]


@functools.cache
def seccomp_filter():
    """The system-call filter that bwrap loads (--seccomp) before the program starts, a BPF program
    compiled by libseccomp (through ctypes): each rule of _seccomp_rules() makes its call fail with
    its errno, anything else is allowed, and a call through another architecture's ABI (i386's int
    0x80, x32) kills the program. Raises RuntimeError(SECCOMP_MISSING) when libseccomp cannot be
    loaded."""
    try:
        lib = ctypes.CDLL(LIBSECCOMP)
    except OSError:
        raise RuntimeError(SECCOMP_MISSING) from None
    lib.seccomp_init.restype, lib.seccomp_init.argtypes = ctypes.c_void_p, [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.POINTER(_ArgCmp)]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    context = lib.seccomp_init(0x7FFF0000)  # SCMP_ACT_ALLOW by default
    if not context:
        raise RuntimeError("libseccomp: seccomp_init failed")
    try:
        for name, error, conditions in _seccomp_rules():
            number = lib.seccomp_syscall_resolve_name(name.encode())
            number = _NEW_SYSCALLS.get(name, number) if number == -1 else number
            if number < 0:  # not a system call of this architecture
                continue
            args = (_ArgCmp * len(conditions))(*conditions)
            if (rc := lib.seccomp_rule_add_array(context, 0x00050000 | error, number,
                                                 len(conditions), args)) < 0:
                raise RuntimeError(f"libseccomp: a rule for {name}: {os.strerror(-rc)}")
        with tempfile.TemporaryFile() as f:
            if (rc := lib.seccomp_export_bpf(context, f.fileno())) < 0:
                raise RuntimeError(f"libseccomp: seccomp_export_bpf: {os.strerror(-rc)}")
            f.seek(0)
            return f.read()
    finally:
        lib.seccomp_release(context)


# -----------------------------------------------------------------------------
# One run: bwrap, the limits, and waiting until nothing of the sandbox is left


# -----------------------------------------------------------------------------
# The sandbox's files: a private copy of the interpreter per run, and nothing of the machine

# Left out of the copy: what needs a display, a terminal, a database, OpenSSL, or is a test of
# CPython itself. ctypes stays (the prelude removes it, but a program can load it again): the filter
# and the namespaces, not a missing module, are what stand between a program and the system calls.
_LEFT_OUT = {"test", "tests", "idle_test", "idlelib", "tkinter", "turtledemo", "turtle.py",
             "ensurepip", "lib2to3", "site-packages", "dist-packages", "pydoc_data", "venv",
             "sqlite3", "curses", "dbm", "__phello__", "lib-dynload", "__pycache__"}
_LEFT_OUT_EXTENSIONS = re.compile(r"(_tkinter|_curses|_curses_panel|readline|_test\w*|"
                                  r"_ctypes_test|xx\w*|_xx\w*|nis|spwd|ossaudiodev|_crypt|"
                                  r"_sqlite3|_ssl|_hashlib|_dbm|_gdbm)\.")


@functools.cache
def _runtime():
    """What each sandbox gets as its own files -> ([(path inside, path outside, mode)],
    LD_LIBRARY_PATH): the interpreter, the shared libraries it and the standard library's extension
    modules load (as `ldd` finds them), those modules, the standard library's .py files compiled
    into one zip held in memory (at pythonXY.zip, where the interpreter looks first) and os.py (the
    landmark by which it finds its prefix). bwrap copies each into the sandbox's own root tmpfs
    (--ro-bind-data): a program reads no file of the machine, and no page it reads is shared with
    another run. About 45 MB per run (~10 ms)."""
    stdlib = os.path.dirname(os.__file__)
    exe = os.path.realpath(sys.executable)
    modules = sorted(os.path.join(folder, f)
                     for folder in {p for p in sys.path if p.endswith("/lib-dynload")}
                     if os.path.isdir(folder) for f in os.listdir(folder)
                     if f.endswith(".so") and not _LEFT_OUT_EXTENSIONS.match(f))
    files = {exe: exe, **{m: m for m in modules}}
    try:
        found = subprocess.run(["ldd", exe, *modules], capture_output=True, text=True, timeout=60,
                               env={"LC_ALL": "C"}).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise RuntimeError("code rewards need ldd (Debian/Ubuntu: libc-bin) to list the "
                           f"interpreter's libraries: {err}")
    # "\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)", "\t/lib64/ld-... (0x...)"
    for line in found.splitlines():
        match = re.match(r"\s+\S+ => (/\S+) \(", line) or re.match(r"\s+(/\S+) \(", line)
        if match:
            files[match[1]] = os.path.realpath(match[1])
    zipped = os.memfd_create("stdlib")
    with os.fdopen(os.dup(zipped), "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as z:
        for root, dirs, names in os.walk(stdlib):
            dirs[:] = sorted(d for d in dirs if d not in _LEFT_OUT and not d.startswith("config-"))
            for name in sorted(n for n in names if n.endswith(".py") and n not in _LEFT_OUT):
                source = os.path.join(root, name)
                arcname = os.path.relpath(source, stdlib)[:-3] + ".pyc"
                z.writestr(arcname, _compiled(source))
    inside_zip = os.path.join(sys.base_prefix, sys.platlibdir,
                              f"python{sys.version_info[0]}{sys.version_info[1]}.zip")
    copies = [(inside, outside, 0o755 if os.access(outside, os.X_OK) else 0o644)
              for inside, outside in files.items()]
    copies += [(inside_zip, f"/proc/self/fd/{zipped}", 0o644), (os.__file__, os.__file__, 0o644)]
    libraries = sorted({os.path.dirname(inside) for inside in files
                        if ".so" in os.path.basename(inside)})
    return copies, ":".join(libraries)


def _compiled(source):
    """The .pyc bytes of a standard-library file: its cached .pyc when that is newer, else compiled
    here."""
    cached = importlib.util.cache_from_source(source)
    with contextlib.suppress(OSError):
        if os.stat(cached).st_mtime >= os.stat(source).st_mtime:
            with open(cached, "rb") as f:
                return f.read()
    with open(source, "rb") as f:
        code = compile(f.read(), source, "exec", dont_inherit=True)
    # flags 0, no source mtime and size
    return importlib.util.MAGIC_NUMBER + bytes(12) + marshal.dumps(code)


def _bwrap_args(fds):
    """bwrap with every namespace unshared (its own user namespace; no network; its own PID and
    mount namespaces: nothing outside is visible or killable, everything in it dies with it), the
    files of _runtime() copied into its own root tmpfs (the fds it reads them from are opened here
    and appended to `fds`; the caller closes them), no /proc, a fresh size-limited tmpfs as the only
    writable place, an unprivileged uid inside. As root, the user namespace maps root and
    SANDBOX_UID to themselves (_start_sandbox writes the maps): the program must run as the real
    SANDBOX_UID, since root's uid is exempt from RLIMIT_NPROC, so the prelude drops to it (bwrap
    keeps it only the two capabilities that needs, in its namespace); otherwise the user namespace
    maps the caller to SANDBOX_UID."""
    if os.geteuid() == 0:
        isolation = ["--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc",
                     "--unshare-uts", "--unshare-cgroup-try", "--cap-drop", "ALL",
                     "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        isolation = ["--unshare-all", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
    copies, libraries = _runtime()
    args = ["bwrap", *isolation, "--die-with-parent", "--new-session", "--dev", "/dev",
            "--perms", "1777", "--size", str(CODE_TMPFS), "--tmpfs", "/tmp", "--chdir", "/tmp",
            "--clearenv", "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8",
            "--setenv", "LD_LIBRARY_PATH", libraries]
    for inside, outside, mode in copies:
        # its own offset: runs may start at once
        fds.append(os.open(outside, os.O_RDONLY | os.O_CLOEXEC))
        args += ["--perms", f"{mode:04o}", "--ro-bind-data", str(fds[-1]), inside]
    return args


def _run_program(program, tests, stdin, budget, memory, unsafe):
    """Run `program` then `tests` (asserts rewritten by split_asserts, or "") under the limits, in a
    fresh bwrap sandbox (unsafe: a fresh temp dir, as the caller or nobody), its CPU time spent from
    `budget` (a Budget) -> (exit code, stdout, results as bytes); the exit code is None when it ran
    out of CPU time or wall-clock time or wrote more than CODE_MAX_OUTPUT."""
    if not unsafe and not bwrap_ready():
        raise RuntimeError(not_ready_reason())
    # who the program runs as
    uid = _sandbox_uid() if unsafe else SANDBOX_UID if os.geteuid() == 0 else None
    # a user namespace of its own: its count starts there
    own_namespace = not unsafe and _nproc_per_user_namespace()
    tasks = SANDBOX_TASKS if own_namespace else _tasks_of(os.getuid() if uid is None else uid)
    cpu, wall = budget.left()
    limits = {"RLIMIT_AS": memory, "RLIMIT_CPU": math.ceil(cpu) + 1, "RLIMIT_CORE": 0,
              "RLIMIT_FSIZE": CODE_MAX_OUTPUT, "RLIMIT_NOFILE": 64,
              "RLIMIT_NPROC": CODE_NPROC_MARGIN}  # + tasks
    folder, groups = tempfile.mkdtemp(prefix="sandbox-") if unsafe else None, []
    files = [tempfile.TemporaryFile() for _ in range(4)]  # source, stdin, stdout, assert values
    try:
        source, stdin_file, stdout_file, results_file = files
        source.write(json.dumps([program, tests]).encode("utf-8", errors="replace"))
        stdin_file.write(stdin.encode("utf-8", errors="replace"))
        source.seek(0), stdin_file.seek(0)
        fds = (source.fileno(), results_file.fileno())
        # unsafe: Popen itself runs it as uid
        drop_to = uid if not unsafe and uid is not None else -1
        cmd = [sys.executable, "-I", "-c", _PRELUDE, json.dumps(limits), *map(str, fds),
               str(drop_to), str(tasks)]
        if unsafe:
            if uid is not None:
                os.chown(folder, uid, uid)
            env = {"PATH": "/usr/bin:/bin", "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8"}
            user = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
            child = subprocess.Popen(cmd, cwd=folder, env=env, stdin=stdin_file, stdout=stdout_file,
                                     stderr=subprocess.DEVNULL, start_new_session=True,
                                     pass_fds=fds, **user)
        else:
            # a venv's interpreter is a link into its base prefix
            cmd[0] = os.path.realpath(sys.executable)
            child, namespace, groups = _start_sandbox(cmd, stdin_file, stdout_file, fds)
        started, counted = time.monotonic(), _cgroup_cpu(groups) is not None
        over = lambda: (_cgroup_cpu(groups) or 0.0) > cpu
        finished = (_wait_without_reaping(child.pid, wall, over) if counted else  # CPU time
                    _wait_without_reaping(child.pid, min(cpu, wall)))  # no count: wall-clock
        with contextlib.suppress(ProcessLookupError):  # the leader is not reaped yet, so its
            os.killpg(child.pid, signal.SIGKILL)       # group id still names only its group
        child.wait()
        if not unsafe and not _namespace_emptied(namespace):
            raise RuntimeError(f"processes of a sandbox ({namespace}) were still alive "
                               "10 s after it ended")
        spent = _cgroup_cpu(groups) if counted else None
        budget.cpu -= time.monotonic() - started if spent is None else spent
        finished = finished and budget.cpu >= 0
        _remove_cgroups(groups)
        stdout_file.seek(0), results_file.seek(0)
        out, results = stdout_file.read(CODE_MAX_OUTPUT + 1), results_file.read(CODE_MAX_OUTPUT + 1)
    finally:
        for f in files:
            f.close()
        if folder:
            _remove_tree(folder)
    if not finished or len(out) > CODE_MAX_OUTPUT or len(results) > CODE_MAX_OUTPUT:
        return None, "", b""
    return child.returncode, out.decode("utf-8", errors="replace"), results


def _start_sandbox(cmd, stdin, stdout, fds):
    """Start cmd in a fresh bwrap sandbox under the system-call filter, passing it fds -> (the bwrap
    process, the sandbox's PID namespace or None, its cgroup folders). bwrap waits (as root
    --userns-block-fd, else --block-fd) until this process has confined it (_confine) and, as
    root, written the uid and gid maps of the sandbox's user namespace: root (bwrap sets the
    sandbox up as the namespace's root) and SANDBOX_UID (the prelude drops to it), each to
    itself."""
    program = seccomp_filter()  # RuntimeError without libseccomp, before anything starts
    root = os.geteuid() == 0
    bpf, (info_r, info_w), (block_r, block_w) = os.memfd_create("seccomp"), os.pipe(), os.pipe()
    passed = [bpf, info_w, block_r]
    try:
        os.write(bpf, program)
        os.lseek(bpf, 0, os.SEEK_SET)
        args = _bwrap_args(passed) + ["--seccomp", str(bpf), "--info-fd", str(info_w),
                                      "--userns-block-fd" if root else "--block-fd", str(block_r)]
        child = subprocess.Popen(args + cmd, env={}, stdin=stdin, stdout=stdout,
                                 stderr=subprocess.DEVNULL, start_new_session=True,
                                 pass_fds=(*fds, *passed))
    except BaseException:
        os.close(block_w)
        raise
    finally:
        for fd in passed:
            os.close(fd)
    info = _read_info(info_r)
    try:
        # bwrap failed before its child: it exits on its own
        with contextlib.suppress(OSError, KeyError):
            for name in ("uid_map", "gid_map") if root else ():
                with open(f"/proc/{info['child-pid']}/{name}", "w") as f:
                    f.write(f"0 0 1\n{SANDBOX_UID} {SANDBOX_UID} 1\n")
        groups = _confine(child.pid, info)
        # read while bwrap waits: once it goes on, a program that exits at once takes its namespace
        namespace = _pid_namespace(info)
    except BaseException:
        child.kill()
        child.wait()
        raise
    finally:
        os.close(block_w)  # bwrap goes on
    return child, namespace, groups


def _confine(bwrap_pid, info):
    """Before the sandbox runs anything: bwrap and its first child (whose forks inherit this)
    become the OOM killer's first pick (oom_score_adj 1000: a sample that fills the machine's
    memory is killed, not the trainer; where the caller is not root this may be refused) and enter
    a cgroup of their own (_cgroup_for) -> its folders ([] when bwrap failed before its child)."""
    if "child-pid" not in info:
        return []
    pids = [bwrap_pid, info["child-pid"]]
    for pid in pids:
        try:
            with open(f"/proc/{pid}/oom_score_adj", "w") as f:
                f.write("1000")
        except OSError:
            if os.geteuid() == 0:
                raise
    return _cgroup_for(pids)


def _read_info(info_fd):
    """What bwrap reports on its --info-fd ({"child-pid": ...}), or {} when it failed before writing
    it."""
    with os.fdopen(info_fd, "rb") as f:
        ready, _, _ = select.select([f], [], [], 10)
        info = f.read() if ready else b""
    with contextlib.suppress(ValueError):
        return dict(json.loads(info))
    return {}


def _pid_namespace(info):
    """The PID namespace (e.g. 'pid:[4026532641]') of the sandbox whose bwrap reported info, read
    while its first process is alive; None when bwrap failed before starting one."""
    try:
        return os.readlink(f"/proc/{info['child-pid']}/ns/pid")
    except (KeyError, OSError):  # no child, or it is gone already (then so is its namespace's init)
        return None


def _namespace_emptied(namespace, deadline=10.0):
    """Wait until no live process is left in the sandbox's PID namespace (the kernel kills them all
    once its first process dies, but not at once; a zombie waiting for its reaper runs nothing) ->
    whether it emptied in time."""
    end = time.monotonic() + deadline
    while namespace is not None and time.monotonic() < end:
        alive = False
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/ns/pid") == namespace:
                    with open(f"/proc/{pid}/stat") as f:
                        alive = alive or f.read().rsplit(")", 1)[1].split()[0] != "Z"
        if not alive:
            return True
        time.sleep(0.01)
    return namespace is None


def _wait_without_reaping(pid, timeout, over=lambda: False):
    """Whether the child exited within `timeout` s and before over() (polled) was true; it stays a
    zombie so its pid is not reused."""
    deadline, delay = time.monotonic() + timeout, 0.001
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() > deadline or over():
            return False
        time.sleep(delay)
        delay = min(2 * delay, 0.02)
    return True


def _nproc_per_user_namespace():
    """Linux >= 5.14 counts RLIMIT_NPROC per user namespace: a sandbox, a user namespace of its own,
    starts from its own few tasks there (SANDBOX_TASKS), not from its uid's tasks outside (older
    kernels count the uid across namespaces)."""
    version = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return version is not None and (int(version[1]), int(version[2])) >= (5, 14)


def _tasks_of(uid):
    """How many tasks (processes and threads) uid runs now: what RLIMIT_NPROC counts outside a user
    namespace of the sandbox's own."""
    total = 0
    # not /proc/self and /proc/thread-self: this process again
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, AttributeError, ValueError):
            with open(f"/proc/{pid}/status") as f:
                status = f.read()
            if int(re.search(r"^Uid:\s+(\d+)", status, re.M).group(1)) == uid:
                total += int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))
    return total


@functools.cache
def _sandbox_uid():
    """unsafe path: SANDBOX_UID when this process is root and that user can start the interpreter,
    else None (programs then run as the caller's own user)."""
    if os.geteuid() != 0:
        return None
    try:
        probe = subprocess.run([sys.executable, "-I", "-c", "pass"], cwd="/", env={}, timeout=60,
                               user=SANDBOX_UID, group=SANDBOX_UID, extra_groups=[],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return SANDBOX_UID if probe.returncode == 0 else None


def _remove_tree(folder):
    """rmtree that first makes every directory the program left writable again (not links)."""
    with contextlib.suppress(OSError):
        os.chmod(folder, 0o700)
        for root, dirs, _ in os.walk(folder):
            for d in dirs:
                path = os.path.join(root, d)
                if not os.path.islink(path):
                    os.chmod(path, 0o700)
    shutil.rmtree(folder, ignore_errors=True)
