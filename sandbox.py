"""
The code reward: does the last Python block of a response pass every test, run in a bubblewrap
sandbox? verify.score_problems maps the bool to +1 / -1. Start at score_code.

Tests: stdin/stdout pairs {"inputs": [...], "outputs": [...]} or asserts. The parent compares
outputs and evaluates each assert on the plain-data values of the solution's calls
(split_asserts): a program cannot forge its reward. Each run: own namespaces and interpreter copy
(_bwrap_args), a system-call filter (_seccomp_rules), rlimits, a cgroup per sample (cgroup_plan).
A model folder's chat template renders in a child killed at TEMPLATE_SECONDS
(render_chat_template). Guarantees and limits: docs/reference.md, "Untrusted inputs".

    python -c "import sandbox; print(sandbox.bwrap_ready())"  # needs bubblewrap, libseccomp2
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

from hub import one_line

# CPU seconds for all of a sample's runs; x this: its wall-clock cap
CODE_TIMEOUT = 10.0
CODE_WALL_FACTOR = 3
CODE_MAX_CASES = 32        # stdin cases run: the problem's first
CODE_MEMORY = 1 << 30      # RLIMIT_AS
# stdout read back; RLIMIT_FSIZE
CODE_MAX_OUTPUT = 16 << 20
CODE_MAX_REPORT = 64 << 10
# the checker's limits
CODE_CHECK_TIMEOUT = 2.0
CODE_CHECK_MEMORY = 512 << 20
CODE_TMPFS = 64 << 20
# tasks a run may add
CODE_NPROC_MARGIN = 32
SANDBOX_UID = 65534        # 'nobody'
SANDBOX_TASKS = 2
# a sample's cgroup, all its processes
CODE_SAMPLE_MEMORY = CODE_MEMORY + CODE_TMPFS + (128 << 20)
CODE_SAMPLE_TASKS = CODE_NPROC_MARGIN + SANDBOX_TASKS + 2
CODE_SAMPLE_CPU_US = 100_000  # one CPU
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

# Runs in the child before the program.
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
    """The last fenced Python block after the last </think>, or None."""
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
    """Output lines, whitespace runs collapsed, blank ends dropped."""
    return [" ".join(line.split()) for line in text.strip().splitlines()]


# What the parent evaluates on plain data itself.
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
    """Names the tests bind (a plain `import math` aside)."""
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
    """One assert -> the parent's expression over _v[i], and the sandbox's leaves."""

    def __init__(self, bound, params, line):
        self.bound, self.params, self.line, self.leaves = bound, params, line, []

    def _math(self, node):
        """math.<one of _PARENT_MATH>, `math` not rebound by the tests."""
        return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "math" and "math" not in self.bound
                and hasattr(_PARENT_MATH, node.attr))

    def _parent(self, node):
        if isinstance(node, ast.Name):
            return node.id in _PARENT_NAMES and node.id not in self.bound
        if isinstance(node, ast.Attribute):  # math.f, or a literal's method
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
    """Asserts -> (the sandbox's code, [the parent's check per assert]). ValueError for an assert
    needing more than the solution's calls, or none."""
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


# The checker: its own process, under its own limits.
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
    """Whether every assert was reported and passes, per the checker process."""
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
    """Whether the last Python block of `response` passes every test within `timeout` CPU seconds;
    never raises. unsafe: rlimits only."""
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
    except Exception:
        return False


class Budget:
    """A sample's time left: `cpu` seconds, until `deadline`."""

    def __init__(self, cpu, deadline):
        self.cpu, self.deadline = cpu, deadline

    def left(self):
        """-> (CPU seconds, wall-clock seconds) left."""
        return self.cpu, self.deadline - time.monotonic()


def _cases_pass(program, tests, budget, memory, unsafe):
    """Whether the program passes each stdin/stdout case within the budget."""
    inputs, outputs = tests["inputs"], tests["outputs"]
    cases = list(zip(inputs, outputs, strict=True)) if isinstance(inputs, list) else []
    if not cases or not all(isinstance(x, str) for case in cases for x in case):
        return False
    for stdin, expected in cases[:CODE_MAX_CASES]:
        if min(budget.left()) <= 0:
            return False
        code, out, _ = _run_program(program, "", stdin, budget, memory, unsafe)
        too_long = len(out) > 4 * len(expected) + 4096  # not parsed
        if code != 0 or too_long or _output_lines(out) != _output_lines(expected):
            return False
    return True


def score_code_batch(responses, tests_list, workers=2, timeout=CODE_TIMEOUT, memory=CODE_MEMORY,
                     unsafe=False):
    """score_code over a batch, each worker on a CPU of its own; one problem's samples
    (problem_marks) never at once."""
    if len(responses) != len(tests_list):
        raise ValueError(f"{len(responses)} responses but {len(tests_list)} tests")
    marks = [problem_marks(t) for t in tests_list]
    results, pending, busy, changed = ([None] * len(responses), list(range(len(responses))),
                                       set(), threading.Condition())

    def work(cpu):
        os.sched_setaffinity(0, {cpu})
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
    """A problem's tests as the judge reads them: problems sharing a mark never run at once."""
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
    """An assert as problem_marks compares it: calls named `f`, == sides in order."""

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
    """Whether a sandbox starts here: bwrap, namespaces, libseccomp."""
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
    """The one-line error when bwrap_ready() is False."""
    try:
        seccomp_filter()
    except RuntimeError as err:
        return str(err)
    return BWRAP_MISSING

# -----------------------------------------------------------------------------
# A cgroup per sample

# a sample cgroup's limits: v2, v1
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
    """Where this process's sandboxes get cgroups, and the line it logs once."""
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
    """-> ([(parent, limits)], 'cgroup v2' or 'cgroup v1'); OSError saying why."""
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
                with contextlib.suppress(OSError):  # no count: wall-clock
                    plan.append((_our_group(folders["cpuacct"][1], v2=False), []))
            return plan, "cgroup v1"
        except OSError as err:
            why.append(f"cgroup v1: cannot make a group ({err.strerror or err})")
    raise OSError(errno.ENOENT, "; ".join(why) or "no cgroup file system for this process")


def _own_cgroups():
    """{controller: (mount point, this process's cgroup folder)}."""
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
    """Our group under the deepest cgroup that may enable our controllers."""
    while True:
        try:
            return _our_group(folder, v2=True)
        except OSError:
            if folder == mount:
                raise
        folder = os.path.dirname(folder)


def _our_group(parent, v2):
    """This process's group of sandbox cgroups; removed at exit."""
    enable = "+memory +pids +cpu"
    if v2:
        _write(os.path.join(parent, "cgroup.subtree_control"), enable)
    group = os.path.join(parent, f"scalerl-sandboxes-{os.getpid()}")
    os.makedirs(group, exist_ok=True)  # ours already
    atexit.register(_remove_cgroups, [group], os.getpid())
    if v2:
        try:
            _write(os.path.join(group, "cgroup.subtree_control"), enable)
        except OSError:
            os.rmdir(group)
            raise
    return group


def _cgroup_for(pids):
    """One sandbox's cgroups, limited, pids moved in."""
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
    """CPU seconds a sample's cgroup used, or None."""
    for folder in groups:
        for name, key, unit in (("cpu.stat", "usage_usec", 1e-6), ("cpuacct.usage", "", 1e-9)):
            with contextlib.suppress(OSError, ValueError):
                with open(os.path.join(folder, name)) as f:
                    for line in f:
                        if line.startswith(key):
                            return int(line.split()[-1]) * unit
    return None


def _remove_cgroups(folders, owner=None):
    """Remove cgroup folders once empty (5 s at most)."""
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
# The system-call filter

# Refused (EPERM): state outside a sandbox's copies.
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
# same on every architecture
_NEW_SYSCALLS = {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
                 "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
                 "fsmount": 432, "fspick": 433, "clone3": 435, "pidfd_getfd": 438,
                 "process_madvise": 440, "mount_setattr": 442, "quotactl_fd": 443,
                 "memfd_secret": 447, "cachestat": 451, "open_tree_attr": 467}
# CLONE_NEW*
_CLONE_NEW = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
_NE, _EQ, _GE, _MASKED_EQ = 1, 4, 5, 7  # libseccomp's enum scmp_compare


# MASKED_EQ: arg & a == b
class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64),
                ("b", ctypes.c_uint64)]


def _seccomp_rules():
    """(system call, errno, [argument conditions]) for each refused use."""
    # an int argument: the low 32 bits
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
    # clone's flags: its first argument but on s390
    if os.uname().machine not in ("s390", "s390x"):
        rules += [("clone", errno.EPERM, [(0, _MASKED_EQ, flag, flag)]) for flag in _CLONE_NEW]
    # libc falls back to clone
    return rules + [("clone3", errno.ENOSYS, [])]


@functools.cache
def seccomp_filter():
    """The BPF filter bwrap loads; RuntimeError(SECCOMP_MISSING) without libseccomp."""
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
# One run


# -----------------------------------------------------------------------------
# The sandbox's files

# Left out of the copy
_LEFT_OUT = {"test", "tests", "idle_test", "idlelib", "tkinter", "turtledemo", "turtle.py",
             "ensurepip", "lib2to3", "site-packages", "dist-packages", "pydoc_data", "venv",
             "sqlite3", "curses", "dbm", "__phello__", "lib-dynload", "__pycache__"}
_LEFT_OUT_EXTENSIONS = re.compile(r"(_tkinter|_curses|_curses_panel|readline|_test\w*|"
                                  r"_ctypes_test|xx\w*|_xx\w*|nis|spwd|ossaudiodev|_crypt|"
                                  r"_sqlite3|_ssl|_hashlib|_dbm|_gdbm)\.")


@functools.cache
def _runtime():
    """Each sandbox's files -> ([(inside, outside, mode)], LD_LIBRARY_PATH)."""
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
    """A standard-library file's .pyc bytes."""
    cached = importlib.util.cache_from_source(source)
    with contextlib.suppress(OSError):
        if os.stat(cached).st_mtime >= os.stat(source).st_mtime:
            with open(cached, "rb") as f:
                return f.read()
    with open(source, "rb") as f:
        code = compile(f.read(), source, "exec", dont_inherit=True)
    return importlib.util.MAGIC_NUMBER + bytes(12) + marshal.dumps(code)


def _bwrap_args(fds):
    """bwrap, every namespace unshared, _runtime()'s files, a small tmpfs; root drops to SANDBOX_UID
    (RLIMIT_NPROC)."""
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
        # its own offset
        fds.append(os.open(outside, os.O_RDONLY | os.O_CLOEXEC))
        args += ["--perms", f"{mode:04o}", "--ro-bind-data", str(fds[-1]), inside]
    return args


def _run_program(program, tests, stdin, budget, memory, unsafe):
    """Run program then tests in a fresh sandbox -> (exit code, stdout, results); exit code None
    past a limit."""
    if not unsafe and not bwrap_ready():
        raise RuntimeError(not_ready_reason())
    # who the program runs as
    uid = _sandbox_uid() if unsafe else SANDBOX_UID if os.geteuid() == 0 else None
    # its own user namespace
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
        # Popen runs it as uid
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
            cmd[0] = os.path.realpath(sys.executable)
            child, namespace, groups = _start_sandbox(cmd, stdin_file, stdout_file, fds)
        started, counted = time.monotonic(), _cgroup_cpu(groups) is not None
        over = lambda: (_cgroup_cpu(groups) or 0.0) > cpu
        finished = (_wait_without_reaping(child.pid, wall, over) if counted else  # CPU time
                    _wait_without_reaping(child.pid, min(cpu, wall)))  # no count: wall-clock
        with contextlib.suppress(ProcessLookupError):  # the leader is not reaped:
            os.killpg(child.pid, signal.SIGKILL)       # its group id is still its own
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
    """Start cmd in bwrap, held until _confine -> (bwrap, PID namespace, cgroups)."""
    program = seccomp_filter()  # RuntimeError without libseccomp
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
        with contextlib.suppress(OSError, KeyError):
            for name in ("uid_map", "gid_map") if root else ():
                with open(f"/proc/{info['child-pid']}/{name}", "w") as f:
                    f.write(f"0 0 1\n{SANDBOX_UID} {SANDBOX_UID} 1\n")
        groups = _confine(child.pid, info)
        # read while bwrap waits
        namespace = _pid_namespace(info)
    except BaseException:
        child.kill()
        child.wait()
        raise
    finally:
        os.close(block_w)
    return child, namespace, groups


def _confine(bwrap_pid, info):
    """Make the sandbox the OOM killer's first pick, in a cgroup of its own -> its folders."""
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
    """bwrap's --info-fd report, or {}."""
    with os.fdopen(info_fd, "rb") as f:
        ready, _, _ = select.select([f], [], [], 10)
        info = f.read() if ready else b""
    with contextlib.suppress(ValueError):
        return dict(json.loads(info))
    return {}


def _pid_namespace(info):
    """The sandbox's PID namespace, or None."""
    try:
        return os.readlink(f"/proc/{info['child-pid']}/ns/pid")
    except (KeyError, OSError):
        return None


def _namespace_emptied(namespace, deadline=10.0):
    """Whether the PID namespace emptied in time."""
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
    """Whether the child exited in time; a zombie, so its pid is not reused."""
    deadline, delay = time.monotonic() + timeout, 0.001
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() > deadline or over():
            return False
        time.sleep(delay)
        delay = min(2 * delay, 0.02)
    return True


def _nproc_per_user_namespace():
    """Whether RLIMIT_NPROC counts per user namespace (Linux >= 5.14)."""
    version = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return version is not None and (int(version[1]), int(version[2])) >= (5, 14)


def _tasks_of(uid):
    """The tasks uid runs now (RLIMIT_NPROC's count)."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, AttributeError, ValueError):
            with open(f"/proc/{pid}/status") as f:
                status = f.read()
            if int(re.search(r"^Uid:\s+(\d+)", status, re.M).group(1)) == uid:
                total += int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))
    return total


@functools.cache
def _sandbox_uid():
    """unsafe: SANDBOX_UID where root can use it, else None."""
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
    """rmtree, first making the program's directories writable."""
    with contextlib.suppress(OSError):
        os.chmod(folder, 0o700)
        for root, dirs, _ in os.walk(folder):
            for d in dirs:
                path = os.path.join(root, d)
                if not os.path.islink(path):
                    os.chmod(path, 0o700)
    shutil.rmtree(folder, ignore_errors=True)

# -----------------------------------------------------------------------------
# a chat template is code too (jinja2): data.chat_frame renders it here, in a child killed at the limit

TEMPLATE_SECONDS = 10.0
TEMPLATE_CHARS = 1 << 16  # what a template may add around a prompt; every prompt carries it


def render_chat_template(tokenizer, content):
    """A template is code: it runs in a child killed at the limit, its text capped in length."""
    seconds = TEMPLATE_SECONDS
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: exit without clean-up
        try:
            os.close(read)
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
            if not isinstance(text, str):
                said = {"error": f"it renders a {type(text).__name__}, not text"}
            elif len(text) - len(content) > TEMPLATE_CHARS:
                said = {"too long": f"its chat template renders {len(text) - len(content):,} "
                                    f"characters around one prompt, over the {TEMPLATE_CHARS:,} "
                                    "a template may add"}
            else:
                said = {"text": text}
        except BaseException as err:  # a PanicException too
            said = {"error": f"{type(err).__name__}: {one_line(err)}"}
        with contextlib.suppress(BaseException):
            with os.fdopen(write, "w") as f:
                json.dump(said, f)
        os._exit(0)
    os.close(write)
    deadline, chunks = time.monotonic() + seconds, []
    try:
        while (left := deadline - time.monotonic()) > 0 and select.select([read], [], [], left)[0]:
            if not (chunk := os.read(read, 1 << 20)):
                break
            chunks.append(chunk)
        else:
            raise ValueError(f"its chat template took over {seconds:g} s to render one prompt "
                             "(a loop or a huge computation in it?)")
    finally:
        os.close(read)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    try:
        said = json.loads(b"".join(chunks))
    except ValueError:
        said = {"error": "its renderer died"}
    if "text" in said:
        return said["text"]
    raise ValueError(said.get("too long") or f"its chat template fails: {said['error']}")
