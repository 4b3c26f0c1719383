"""
sandbox.py: the code reward. Does the last Python block of a response pass every test, when it runs
in a bubblewrap sandbox?

Implements the code side of the reward of arXiv 2510.13786 (+1 for a verified-correct final answer, -1
otherwise, section 2) for the math+code runs of section 5 (code problems judged by their unit tests).
This file returns the bool; the caller maps it to +1 / -1 (verify.score_problems sends code
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
compute more (a helper or variable of the tests, another builtin) are refused when the data is
loaded (data.py).
Each run is a fresh `python -I` in its own bubblewrap (bwrap) sandbox: every namespace unshared (no
network; its own PID namespace, so nothing outside is visible or killable and every process in it
dies with it; its own mount namespace with /usr, /lib and the interpreter read-only and nothing else
of the machine, no /etc, no home, no data), a fresh 64 MiB tmpfs /tmp as the only writable place and
its cwd, uid 65534 inside, --die-with-parent, a new session, an environment of PATH, HOME, LANG; and
limits: wall clock `timeout` s then SIGKILL; RLIMIT_CPU timeout+1 s; RLIMIT_AS `memory` (1 GiB);
RLIMIT_FSIZE and the output read back 16 MiB; no core files; RLIMIT_NPROC = 32 tasks more than its
user is counted for now (a non-root caller's sandbox is a user namespace of its own, counted apart on
Linux >= 5.14: there, its own tasks); os.fork/system/kill/setsid/posix_spawn and ctypes, subprocess,
multiprocessing are removed first (a naive fork bomb fails at once). The program reaches the parent
only through its stdin, the stdout and assert-value files it writes (read back capped) and its exit code.
Without bwrap, score_code(..., unsafe=True) (train.py --unsafe_code_exec) runs the same program with
the limits alone, in a temp dir, as `nobody` when root can drop to it: it can then read and write what
that user can, use the network, and leave processes behind (setsid past the removed functions).
Linux only (bwrap, /proc, os.waitid).

Usage:
    from sandbox import score_code, score_code_batch
    score_code("```python\\nprint(sum(map(int, input().split())))\\n```",
               {"inputs": ["1 2"], "outputs": ["3"]})                            # True
    score_code(response, ["assert add(1, 2) == 3"])                            # MBPP-style asserts
    score_code_batch(responses, tests_list, workers=8)                         # list of bools
    python -c "import sandbox; print(sandbox.bwrap_ready())"   # True once bwrap works here (apt-get install bubblewrap)
    python -m pytest test_all.py -k code                      # the sandbox tests (skip with the reason without bwrap)
"""
import ast
import builtins
import contextlib
import functools
import itertools
import json
import math
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
from concurrent.futures import ThreadPoolExecutor

CODE_TIMEOUT = 6.0         # wall-clock seconds per program run (one run per stdin case, one for asserts)
CODE_MEMORY = 1 << 30      # RLIMIT_AS of a program run, bytes
CODE_MAX_OUTPUT = 16 << 20 # stdout (and assert values) read back, and RLIMIT_FSIZE: any file it writes
CODE_MAX_REPORT = 64 << 10 # characters of one assert's reported values that the parent will parse
CODE_TMPFS = 64 << 20      # the sandbox's only writable place: a fresh tmpfs of this size
CODE_NPROC_MARGIN = 32     # tasks (processes + threads) a run may add to what its uid is counted for
SANDBOX_UID = 65534        # the unprivileged uid inside the sandbox ('nobody')
BWRAP_MISSING = ("code rewards need bubblewrap (bwrap) to isolate model-written programs: install it "
                 "(Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap), or pass "
                 "--unsafe_code_exec to run them with resource limits only (a program can then forge its reward)")

# Runs in the child, before the program: lower the limits, remove the process-making and process-killing
# functions (a naive fork bomb fails at once), define _record (the values of an assert's leaves, written
# as the repr of plain data to the results fd), read the program, run it (as __main__ when it reads stdin,
# so that its `if __name__ == "__main__":` block runs; as `solution` under asserts, so that it does not),
# then the tests.
_PRELUDE = """
import json, os, posix, resource, sys
limits, source_fd, results_fd, uid = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
tasks = int(sys.argv[5])  # what RLIMIT_NPROC counts now, or -1: count here (a user namespace counted apart)
if uid >= 0:  # root's sandbox: become the unprivileged uid (RLIMIT_NPROC does not bind root)
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
if tasks < 0:  # the sandbox's own tasks: everything in its PID namespace (its /proc), threads included
    tasks = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                tasks += int(f.read().split("Threads:")[1].split()[0])
        except OSError:
            pass
limits["RLIMIT_NPROC"] += tasks
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


# What the parent evaluates itself, on plain data: these builtins and math functions, literals, operators,
# comparisons, indexing, f-strings and str methods of a literal ("".join(...)). Nothing the program runs
# can change them (they live in the parent, and builtin types' operators cannot be patched).
_PARENT_NAMES = {f.__name__: f for f in (abs, all, any, bool, complex, dict, divmod, enumerate, float, frozenset, int,
                                         isinstance, len, list, max, min, range, repr, reversed, round, set, sorted,
                                         str, sum, tuple, type, zip)}
_PARENT_MATH = types.SimpleNamespace(**{name: getattr(math, name) for name in (
    "isclose", "fabs", "floor", "ceil", "trunc", "sqrt", "isnan", "isinf", "isfinite", "fsum", "prod",
    "pi", "e", "inf", "nan")})
_PARENT_NODES = (ast.Constant, ast.List, ast.Tuple, ast.Set, ast.Dict, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare,
                 ast.IfExp, ast.Subscript, ast.Slice, ast.JoinedStr, ast.FormattedValue, ast.keyword, ast.operator,
                 ast.unaryop, ast.boolop, ast.cmpop, ast.expr_context)


def _names_bound(tree):
    """(names the tests bind: assigned, defined, imported (a plain `import math` aside), names of parameters)."""
    bound, params = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {a.asname or a.name.split(".")[0] for a in node.names if (a.name, a.asname) != ("math", None)
                      or isinstance(node, ast.ImportFrom)}
        elif isinstance(node, ast.arg):
            params.add(node.arg)
    return bound, params - bound


class _Split(ast.NodeTransformer):
    """One assert's expression -> the parent's expression, each leaf replaced by _v[i], and the leaves: what
    only the sandbox can evaluate (calls of the solution's functions, names the solution defines)."""

    def __init__(self, bound, params, line):
        self.bound, self.params, self.line, self.leaves = bound, params, line, []

    def _math(self, node):
        """math.<one of _PARENT_MATH>, with `math` not rebound by the tests."""
        return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "math"
                and "math" not in self.bound and hasattr(_PARENT_MATH, node.attr))

    def _parent(self, node):
        if isinstance(node, ast.Name):
            return node.id in _PARENT_NAMES and node.id not in self.bound
        if isinstance(node, ast.Attribute):  # math.<function>, or a method of a literal (", ".join)
            return self._math(node) or isinstance(node.value, ast.Constant) and not node.attr.startswith("_")
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
                    raise ValueError(f"line {self.line}: {text!r}: a power or shift by the solution's value could "
                                     "be made huge")
                return node
            return self.generic_visit(node)
        root = node
        while isinstance(root, (ast.Call, ast.Attribute, ast.Subscript)):
            root = root.func if isinstance(root, ast.Call) else root.value
        name = root.id if isinstance(root, ast.Name) else None
        if name is None or name in self.bound or hasattr(builtins, name) or (name in self.params and root is node):
            raise ValueError(f"line {self.line}: the sandbox would compute {ast.unparse(node)!r}: an assert may use "
                             "literals, operators, common builtins and math functions (evaluated by the parent) "
                             "around calls of the solution's functions")
        self.leaves.append(node)
        return ast.Subscript(ast.Name("_v", ast.Load()), ast.Constant(len(self.leaves) - 1), ast.Load())


def split_asserts(tests):
    """Assert-style tests -> (the code the sandbox runs, [check per assert]). The parent evaluates each
    assert itself; the sandbox evaluates only its leaves, the calls of the solution's functions (or of a
    test function's parameter: HumanEval's candidate) and names the solution defines, and `assert E`
    becomes `_record(k, (leaf, leaf, ...))`: the sandbox reports the leaves' values as plain data and
    check k (a function of that tuple) computes E from them, so expected values never enter the sandbox
    and nothing the program patches (builtins, math, the tests' own names) takes part in the verdict.
    Asserts may sit in helper functions. Every leaf of an assert is evaluated, before the parent's
    expression (no short-circuit inside the sandbox). An assert that needs anything else computed in the
    sandbox (a test-defined helper or variable, another builtin, a comprehension) raises ValueError."""
    tree, checks = ast.parse(tests), []
    bound, params = _names_bound(tree)

    class Rewrite(ast.NodeTransformer):
        def visit_Assert(self, node):
            split = _Split(bound, params, node.lineno)
            expression = ast.fix_missing_locations(ast.Expression(split.visit(node.test)))
            code = compile(expression, f"assert {len(checks)}", "eval")
            checks.append(lambda values, code=code: bool(eval(code, {"__builtins__": {}, **_PARENT_NAMES,
                                                                     "math": _PARENT_MATH, "_v": values})))
            report = ast.Call(ast.Name("_record", ast.Load()),
                              [ast.Constant(len(checks) - 1), ast.Tuple(split.leaves, ast.Load())], [])
            return ast.copy_location(ast.Expr(report), node)

    tree = ast.fix_missing_locations(Rewrite().visit(tree))
    if not checks:
        raise ValueError("no assert statement")
    return ast.unparse(tree), checks


def _asserts_pass(results, checks):
    """Every assert reported at least once, every report a tuple of plain data (its repr at most
    CODE_MAX_REPORT characters: the parent parses it) whose check passes."""
    seen = set()
    for line in results.splitlines():
        k, _, text = line.partition("\t")
        if not k.isdigit() or int(k) >= len(checks) or len(text) > CODE_MAX_REPORT:
            return False
        try:
            values = ast.literal_eval(text)
            if type(values) is not tuple or not checks[int(k)](values):
                return False
        except Exception:                       # not plain data, or a check that raises
            return False
        seen.add(int(k))
    return len(seen) == len(checks)

# -----------------------------------------------------------------------------
# Public API


def score_code(response, tests, timeout=CODE_TIMEOUT, memory=CODE_MEMORY, unsafe=False):
    """True when the last Python block of `response` passes every test. `tests` is
    {"inputs": [str], "outputs": [str]} (stdin -> stdout, each pair one run, exit code 0 needed; an output
    over 4x the expected one + 4 KiB fails unparsed)
    or asserts: a list of statements or one string, run after the program (split_asserts).
    unsafe: rlimits only, no bwrap (see the module docstring). Never raises."""
    try:
        program = extract_code(response)
        if program is None:
            return False
        if isinstance(tests, dict):
            inputs, outputs = tests["inputs"], tests["outputs"]
            cases = list(zip(inputs, outputs, strict=True)) if isinstance(inputs, list) else []
            if not cases or not all(isinstance(x, str) for case in cases for x in case):
                return False
            for stdin, expected in cases:  # the parent compares: expected outputs never enter the sandbox
                code, out, _ = _run_program(program, "", stdin, timeout, memory, unsafe)
                too_long = len(out) > 4 * len(expected) + 4096  # not parsed: up to 16 MiB of lines
                if code != 0 or too_long or _output_lines(out) != _output_lines(expected):
                    return False
            return True
        asserts = "\n".join(tests) if isinstance(tests, list) else tests
        if not isinstance(asserts, str):
            return False
        source, checks = split_asserts(asserts)
        code, _, results = _run_program(program, source, "", timeout, memory, unsafe)
        return code == 0 and _asserts_pass(results, checks)
    except Exception:                               # malformed tests, unreadable text, ...
        return False


def score_code_batch(responses, tests_list, workers=2, timeout=CODE_TIMEOUT, memory=CODE_MEMORY, unsafe=False):
    """[score_code(r, t) for r, t in zip(responses, tests_list)], `workers` programs at a time."""
    if len(responses) != len(tests_list):
        raise ValueError(f"{len(responses)} responses but {len(tests_list)} tests")
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(lambda rt: score_code(*rt, timeout=timeout, memory=memory, unsafe=unsafe),
                             zip(responses, tests_list)))



@functools.cache
def bwrap_ready():
    """Whether bubblewrap can start a sandbox here (installed, and namespaces allowed)."""
    if shutil.which("bwrap") is None:
        return False
    probe = subprocess.run(_bwrap_args() + ["/bin/true"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=60)
    return probe.returncode == 0


# -----------------------------------------------------------------------------
# One run: bwrap, the limits, and waiting until nothing of the sandbox is left


def _bwrap_args():
    """bwrap with every namespace unshared (no network, its own PID and mount namespaces: nothing outside is
    visible or killable, everything in it dies with it), system folders and the interpreter's prefix
    read-only, a fresh size-limited tmpfs as the only writable place, an unprivileged uid inside. As root,
    no user namespace: a uid mapped to root stays exempt from RLIMIT_NPROC, so the prelude itself drops to
    SANDBOX_UID (bwrap keeps it only the two capabilities that needs); otherwise a user namespace maps the
    caller to SANDBOX_UID."""
    if os.geteuid() == 0:
        isolation = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                     "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        isolation = ["--unshare-all", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
    args = ["bwrap", *isolation, "--die-with-parent", "--new-session",
            "--ro-bind", "/usr", "/usr", "--proc", "/proc", "--dev", "/dev",
            "--perms", "1777", "--size", str(CODE_TMPFS), "--tmpfs", "/tmp", "--chdir", "/tmp", "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8"]
    for top in ("/bin", "/lib", "/lib64", "/lib32", "/sbin"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    prefix = os.path.realpath(sys.base_prefix)
    if not prefix.startswith("/usr/"):  # e.g. a pyenv Python under /root: its folders made traversable
        parents = [p for p in itertools.accumulate(prefix.split("/")[1:-1], lambda a, b: f"{a}/{b}", initial="")][1:]
        args += [x for p in parents for x in ("--perms", "0755", "--dir", p)] + ["--ro-bind", prefix, prefix]
    return args


def _run_program(program, tests, stdin, timeout, memory, unsafe):
    """Run `program` then `tests` (asserts rewritten by split_asserts, or "") under the limits, in a fresh
    bwrap sandbox (unsafe: a fresh temp dir, as the caller or nobody) -> (exit code, stdout, results);
    the exit code is None when it ran out of time or wrote more than CODE_MAX_OUTPUT."""
    if not unsafe and not bwrap_ready():
        raise RuntimeError(BWRAP_MISSING)
    uid = _sandbox_uid() if unsafe else SANDBOX_UID if os.geteuid() == 0 else None  # who the program runs as
    own_namespace = not unsafe and uid is None and _nproc_per_user_namespace()  # its count starts inside
    tasks = -1 if own_namespace else _tasks_of(os.getuid() if uid is None else uid)  # -1: the prelude counts
    limits = {"RLIMIT_AS": memory, "RLIMIT_CPU": math.ceil(timeout) + 1, "RLIMIT_CORE": 0,
              "RLIMIT_FSIZE": CODE_MAX_OUTPUT, "RLIMIT_NOFILE": 64, "RLIMIT_NPROC": CODE_NPROC_MARGIN}  # + tasks
    folder = tempfile.mkdtemp(prefix="sandbox-") if unsafe else None
    files = [tempfile.TemporaryFile() for _ in range(4)]  # source, stdin, stdout, assert values
    try:
        source, stdin_file, stdout_file, results_file = files
        source.write(json.dumps([program, tests]).encode("utf-8", errors="replace"))
        stdin_file.write(stdin.encode("utf-8", errors="replace"))
        source.seek(0), stdin_file.seek(0)
        fds = (source.fileno(), results_file.fileno())
        drop_to = uid if not unsafe and uid is not None else -1  # unsafe: Popen itself runs it as uid
        cmd = [sys.executable, "-I", "-c", _PRELUDE, json.dumps(limits), *map(str, fds), str(drop_to), str(tasks)]
        if unsafe:
            if uid is not None:
                os.chown(folder, uid, uid)
            env = {"PATH": "/usr/bin:/bin", "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8"}
            user = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
            child = subprocess.Popen(cmd, cwd=folder, env=env, stdin=stdin_file, stdout=stdout_file,
                                     stderr=subprocess.DEVNULL, start_new_session=True, pass_fds=fds, **user)
        else:
            cmd[0] = os.path.realpath(sys.executable)  # a venv's interpreter is a link into its base prefix
            info_r, info_w = os.pipe()
            child = subprocess.Popen(_bwrap_args() + ["--info-fd", str(info_w)] + cmd, env={}, stdin=stdin_file,
                                     stdout=stdout_file, stderr=subprocess.DEVNULL, start_new_session=True,
                                     pass_fds=(*fds, info_w))
            os.close(info_w)
            namespace = _pid_namespace(info_r)
        finished = _wait_without_reaping(child.pid, timeout)
        with contextlib.suppress(ProcessLookupError):  # the leader is not reaped yet, so its
            os.killpg(child.pid, signal.SIGKILL)       # group id still names only its group
        child.wait()
        if not unsafe and not _namespace_emptied(namespace):
            raise RuntimeError(f"processes of a sandbox ({namespace}) were still alive 10 s after it ended")
        stdout_file.seek(0), results_file.seek(0)
        out, results = stdout_file.read(CODE_MAX_OUTPUT + 1), results_file.read(CODE_MAX_OUTPUT + 1)
    finally:
        for f in files:
            f.close()
        if folder:
            _remove_tree(folder)
    if not finished or len(out) > CODE_MAX_OUTPUT or len(results) > CODE_MAX_OUTPUT:
        return None, "", ""
    return child.returncode, out.decode("utf-8", errors="replace"), results.decode("utf-8", errors="replace")


def _pid_namespace(info_fd):
    """The PID namespace (e.g. 'pid:[4026532641]') of the sandbox that bwrap reports on info_fd, read while
    its first process is alive; None when bwrap failed before starting one."""
    with os.fdopen(info_fd, "rb") as f:
        ready, _, _ = select.select([f], [], [], 10)
        info = f.read() if ready else b""
    try:
        return os.readlink(f"/proc/{json.loads(info)['child-pid']}/ns/pid")
    except (ValueError, KeyError, OSError):  # no child, or it is gone already (then so is its namespace's init)
        return None


def _namespace_emptied(namespace, deadline=10.0):
    """Wait until no live process is left in the sandbox's PID namespace (the kernel kills them all once its
    first process dies, but not at once; a zombie waiting for its reaper runs nothing) -> whether it
    emptied in time."""
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


def _wait_without_reaping(pid, timeout):
    """Whether the child exited within `timeout` s; it stays a zombie so its pid is not reused."""
    deadline, delay = time.monotonic() + timeout, 0.001
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(delay)
        delay = min(2 * delay, 0.02)
    return True


def _nproc_per_user_namespace():
    """Linux >= 5.14 counts RLIMIT_NPROC per user namespace: a non-root caller's sandbox, a user namespace
    of its own, starts from its own few tasks there, not from the caller's tasks outside (older kernels
    count the caller's uid across namespaces)."""
    version = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return version is not None and (int(version[1]), int(version[2])) >= (5, 14)


def _tasks_of(uid):
    """How many tasks (processes and threads) uid runs now: what RLIMIT_NPROC counts outside a user
    namespace of the sandbox's own."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):  # not /proc/self and /proc/thread-self: this process again
        with contextlib.suppress(OSError, AttributeError, ValueError):
            with open(f"/proc/{pid}/status") as f:
                status = f.read()
            if int(re.search(r"^Uid:\s+(\d+)", status, re.M).group(1)) == uid:
                total += int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))
    return total


@functools.cache
def _sandbox_uid():
    """unsafe path: SANDBOX_UID when this process is root and that user can start the interpreter, else
    None (programs then run as the caller's own user)."""
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
