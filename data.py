"""
data.py: problems in, prompts out, and the curriculum that picks them (arXiv 2510.13786: the
reward and data of section 2, the curriculum of section 3.2).

- read_jsonl(path): the (line number, JSON object) pairs of a jsonl file; a regular file only (a
  FIFO or a device is refused at once, not read), lines up to 16 MiB; every error names FILE:LINE,
  JSON nested too deeply and integers of more digits than Python converts included
  (load_problems and fit.py's load_run read with it).
- load_problems(path): jsonl in the layouts users have -> [{"prompt": str, "answer": str,
  "domain": "math"}, ...]
    problem + answer   (Polaris, DeepScaleR, MATH-500)
    question + answer  (GSM8K: the answer is what follows the last "####")
    problem + solution (MATH: the answer is the solution's last \\boxed{})
    prompt + answer
    prompt + tests     (code: {"inputs": [...], "outputs": [...]} stdin/stdout pairs as in
                        TACO/APPS/DeepCoder, or asserts as in MBPP) -> {"prompt", "tests",
                        "domain": "code"}, scored by sandbox.score_code; fixtures/code_toy.jsonl
                        has 20 tiny ones; a sample runs a problem's first 32 stdin cases
                        (sandbox.CODE_MAX_CASES), so only those are kept. An explicit "domain"
                        ("math" or "code") is honoured.
  One line on stderr each counts the duplicate prompts skipped, the gold answers no response can
  match (verify.never_matched: kept, they score -1) and the code problems cut to 32 cases.
- problems_of_records: the mapping itself, for jsonl lines and Hugging Face dataset rows alike.
- The Hugging Face Hub, through its standard caches (nothing here works around them):
  resolve_model("Qwen/Qwen3-0.6B") -> a local folder (huggingface_hub.snapshot_download; a local
  folder is returned as is); load_source_problems("openai/gsm8k:main:test") -> problems
  (datasets.load_dataset, syntax owner/name[:config[:split]]; an existing path is a jsonl file).
  Failures: one line saying what to do (a dataset's configs where it has several). A Hub that does
  not answer within 3 s is taken as offline (hub_unreachable): cached ids load, others fail then.
- format_prompt(tokenizer, problem): the tokenizer's chat template when it has one (rendered once,
  under a time limit: a template is the model folder's code), a plain template otherwise; both ask
  for reasoning inside <think></think> and the final answer in \\boxed{}.
  prompt_ids(tokenizer, problem): its token ids, with one BOS (a template writes its own);
  prompts_ids: many at once.
- special_tokens(tokenizer, model): the sampler's token ids (every eos id, "</think>",
  INTERRUPT_PHRASE) as keyword arguments of generate.sampler / generate.generate;
  completion_text(tokenizer, sample): a sample's text without its final eos.
- split_problems: the seeded held-out validation split.
- Curriculum: epochs over the training prompts, the per-prompt pass-rate history and
  No-Positive-Resampling (a prompt whose pass rate reaches 0.9 is never sampled again).
- The embedded default: a synthetic multi-step arithmetic task with graded difficulty (1 to 4
  operations) and a tiny base model for it: a 0.34M-parameter Llama decoder with a byte-level BPE
  tokenizer trained on the task, in which each number is one token. It is cold-started by a short
  supervised warm-up on traces in the exact `<think>...</think> The answer is \\boxed{..}.` format.
  In the warm-up traces an arithmetic step slips 3% of the time and the boxed answer is wrong 70% of
  the time (a near miss or an intermediate number), so the base model knows the arithmetic (its
  greedy answer is right ~60% of the time) but samples a right final answer only ~28% of the time:
  RL has room to climb. One trace in five re-checks its work, which makes it long enough to be
  interrupted: RL also learns to stop rambling. It ships in toy_model/ (1.4 MB: its warm-up needs
  about 3 minutes on 2 cores, too long to run on first use) and `python data.py --build` remakes it
  from fixed seeds. It is an ordinary Hugging Face folder loaded with from_pretrained: no toy-only
  code path. A second preset, toy-hard (`--data toy-hard`, PRESETS), is the miniature study's task:
  longer chains over a larger table, with its own base model in toy_model_hard/ built the same way.

    python data.py                       # print the toy model's folder and a few toy problems
    python data.py --build               # remake the shipped toy model (about 3 minutes on 2 cores)
    python data.py --build toy-hard      # remake toy-hard's base model (about 6 minutes)
    python data.py fixtures/gsm8k_test_sample.jsonl  # load a file, print counts and one example
    python data.py openai/gsm8k:main:test  # a Hugging Face dataset (pip install datasets; cached)
"""

import contextlib
import errno
import functools
import itertools
import json
import math
import os
import random
import select
import shutil
import signal
import stat
import sys
import time
import weakref

from hub import hub_dataset_spec, load_records, one_line, resolve_model  # noqa: F401
from sandbox import CODE_MAX_CASES, split_asserts
from verify import last_boxed, never_matched, prompt_opens_think, reward, score_problems

HERE = os.path.dirname(os.path.abspath(__file__))
# shipped in the repo (1.4 MB); `python data.py --build` remakes it
TOY_DIR = os.path.join(HERE, "toy_model")
# `--build toy-hard` remakes that one
TOY_DIRS = {"toy": TOY_DIR, "toy-hard": os.path.join(HERE, "toy_model_hard")}
INSTRUCTION = "Think inside <think> </think>, then answer in \\boxed{}."
CODE_INSTRUCTION = ("Think inside <think> </think>, then answer with a Python program in a "
                    "```python block.")
# forced in by the sampler at a sample's interruption point (generate.py; the paper's interruptions,
# section 3.2); it ends the thought
INTERRUPT_PHRASE = ("Okay, time is up. Let me stop thinking and formulate a final answer now. "
                    "</think>")
# the longest line read_jsonl reads (one record: a code problem's tests may be megabytes)
MAX_LINE_BYTES = 16 << 20
TEMPLATE_SECONDS = 10.0  # a chat template renders once; past this it is refused
PROBLEM_MARK = "\ue000problem\ue000"  # where chat_frame's render puts the problem
_FRAMES = weakref.WeakKeyDictionary()  # tokenizer -> {(template, instruction): (head, tail)}

# -----------------------------------------------------------------------------
# loading real data


def _answer_of(rec, where):
    """The gold answer of one record, as a non-empty string; `where` is 'file:line' for error
    messages."""
    if "answer" in rec and rec["answer"] is not None:
        ans = rec["answer"]
        if isinstance(ans, bool) or not isinstance(ans, (str, int, float)):
            raise ValueError(f"{where}: field 'answer' must be a string or a number, "
                             f"got {type(ans).__name__}")
        if isinstance(ans, float) and not math.isfinite(ans):
            raise ValueError(f"{where}: field 'answer' must be a finite number, got {ans}")
        try:
            ans = str(ans)
        except ValueError as err:  # an int past Python's limit on digits converted to text
            raise ValueError(f"{where}: field 'answer': {err}") from None
        gsm8k = "question" in rec and "####" in ans  # GSM8K: worked solution, then '#### 72'
        if gsm8k:
            ans = ans.rsplit("####", 1)[1]
        if not ans.strip():
            raise ValueError(f"{where}: field 'answer' is empty"
                             + (" after its last '####'" if gsm8k else ""))
        return ans.strip()
    if isinstance(rec.get("solution"), str):
        boxed = last_boxed(rec["solution"])
        if boxed is None:
            raise ValueError(f"{where}: field 'solution' has no \\boxed{{}} answer")
        return boxed.strip()
    raise ValueError(f"{where}: missing field 'answer' (or 'solution' with a \\boxed{{}} answer)")


def _tests_of(rec, where):
    """The tests of a code record, checked: {"inputs": [str], "outputs": [str]} (its first
    CODE_MAX_CASES cases: a sample runs no more) or asserts (a list of strings or one string), the
    layouts sandbox.score_code runs."""
    tests = rec["tests"]
    if isinstance(tests, dict):
        inputs, outputs = tests.get("inputs"), tests.get("outputs")
        if not (isinstance(inputs, list) and isinstance(outputs, list) and inputs
                and len(inputs) == len(outputs)
                and all(isinstance(x, str) for x in inputs + outputs)):
            raise ValueError(f"{where}: field 'tests' must have 'inputs' and 'outputs': "
                             "equally long non-empty lists of strings")
        return {"inputs": inputs[:CODE_MAX_CASES], "outputs": outputs[:CODE_MAX_CASES]}
    asserts = tests if isinstance(tests, list) else [tests]
    if not asserts or not all(isinstance(x, str) and x.strip() for x in asserts):
        raise ValueError(f"{where}: field 'tests' must be {{'inputs', 'outputs'}}, a list of "
                         "assert strings or one string of asserts")
    try:
        # the parent evaluates every assert; they must call the solution
        split_asserts("\n".join(asserts))
    except (SyntaxError, ValueError) as err:
        raise ValueError(f"{where}: field 'tests': {err}") from None
    except (RecursionError, MemoryError):
        raise ValueError(f"{where}: field 'tests': an expression nested too deeply to "
                         "parse") from None
    return tests


def _problem_of(rec, where, key):
    """One loaded problem: a math problem (gold answer) or a code problem (tests)."""
    domain = rec.get("domain", "code" if "tests" in rec else "math")
    if domain not in ("math", "code"):
        raise ValueError(f"{where}: field 'domain' must be 'math' or 'code', got {domain!r}")
    if domain == "code":
        if "tests" not in rec:
            raise ValueError(f"{where}: missing field 'tests' (a code problem)")
        return {"prompt": rec[key], "tests": _tests_of(rec, where), "domain": "code"}
    return {"prompt": rec[key], "answer": _answer_of(rec, where), "domain": "math"}


def open_regular(path):
    """path opened for reading (binary) when it is a regular file; else OSError saying what it is:
    a FIFO would wait for a writer forever, a device (/dev/zero) would be read without end."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO's open returns at once
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "a device")
        raise OSError(errno.EINVAL, f"not a regular file ({kind}): give a jsonl file")
    return os.fdopen(fd, "rb")


def read_jsonl(path):
    """The JSON objects of a jsonl file, one (line number, dict) pair at a time, blank lines
    skipped. Only a regular file is read (open_regular), a line at most MAX_LINE_BYTES long. A line
    that is too long, not UTF-8, not JSON (nested too deeply for the parser, a number with more
    digits than Python converts) or not an object: ValueError 'FILE:LINE: what is wrong'."""
    with open_regular(path) as f:
        lineno = 0
        while raw := f.readline(MAX_LINE_BYTES + 1):
            lineno += 1
            rec = _json_line(raw, f"{path}:{lineno}")
            if rec is not None:
                yield lineno, rec


def _json_line(raw, where):
    """One line of a jsonl file -> its JSON object, or None for a blank line; ValueError 'WHERE:
    what is wrong'."""
    if len(raw) > MAX_LINE_BYTES:
        raise ValueError(f"{where}: a line over {MAX_LINE_BYTES >> 20} MiB (one record a line)")
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} "
                         f"at column {e.start + 1})") from None
    if not line.strip():
        return None
    try:  # without its newline: an error at the line's end is then on it, not at column 1 after
        rec = json.loads(line.rstrip("\r\n"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg.removesuffix(' at')} at column "
                         f"{e.colno})") from None
    except RecursionError:
        raise ValueError(f"{where}: invalid JSON (nested too deeply)") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise ValueError(f"{where}: invalid JSON ({e})") from None
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    return rec


def load_problems(path):
    """Read a jsonl file of problems -> list of {"prompt": str, "answer": str, "domain": "math"} or
    {"prompt": str, "tests": ..., "domain": "code"}. Blank lines are skipped; a prompt seen before
    in the file is skipped too (counted, one summary line on stderr). Anything else wrong:
    ValueError naming file:line and the field."""
    return problems_of_records(((f"{path}:{lineno}", rec) for lineno, rec in read_jsonl(path)),
                               path)


def problems_of_records(records, source):
    """(where, record dict) pairs, from a jsonl file or a Hugging Face dataset, -> problems in the
    layouts of the docstring (load_problems). A prompt seen before is skipped; a gold answer the
    verifier can never match (verify.never_matched) and tests cut to CODE_MAX_CASES cases are kept;
    each of the three is counted in one summary line on stderr. A bad record: ValueError 'WHERE:
    what is wrong'; no record at all: ValueError naming `source`."""
    problems, seen, notes = [], set(), {}
    for where, rec in records:
        key = next((k for k in ("prompt", "problem", "question") if k in rec), None)
        if key is None:
            raise ValueError(f"{where}: missing field 'prompt' (or 'problem' / 'question')")
        if not isinstance(rec[key], str) or not rec[key].strip():
            raise ValueError(f"{where}: field '{key}' must be a non-empty string")
        problem = _problem_of(rec, where, key)
        for note in _notes(problem, rec, seen):
            notes.setdefault(note, []).append(where)
        if problem["prompt"] not in seen:
            seen.add(problem["prompt"])
            problems.append(problem)
    if not problems:
        raise ValueError(f"{source}: no problems")
    for note, wheres in notes.items():
        print(f"{source}: {note.format(n=len(wheres))} (the first at {wheres[0]})",
              file=sys.stderr)
    return problems


def _notes(problem, rec, seen):
    """The summary lines of problems_of_records that one problem counts in, as templates of their
    count {n}."""
    if problem["prompt"] in seen:
        return ["skipped {n} duplicate prompt(s); each is kept where it first occurs"]
    if problem["domain"] == "math":
        why = never_matched(problem["answer"])
        return [f"{{n}} gold answer(s) that no response can match ({why}): kept, every sample "
                "of theirs scores -1"] if why else []
    if isinstance(rec["tests"], dict) and len(rec["tests"]["inputs"]) > CODE_MAX_CASES:
        return [f"{{n}} code problem(s) with more than {CODE_MAX_CASES} test cases: each keeps "
                f"its first {CODE_MAX_CASES}, all that a sample is run on"]
    return []

def load_source_problems(source, split="train"):
    """--data / --val_data: a jsonl file (an existing path, or a name not shaped as a Hub id:
    FileNotFoundError) or a Hugging Face dataset 'owner/name[:config[:split]]' whose split defaults
    to `split` -> problems."""
    if os.path.exists(source) or hub_dataset_spec(source) is None:
        return load_problems(source)
    return problems_of_records(*load_records(source, split))


def format_prompt(tokenizer, problem, domain="math"):
    """The text the generator continues: the tokenizer's chat template when it has one (rendered
    once per instruction: chat_frame), else a plain template. ValueError (one line) for a chat
    template that fails, takes too long or does not hold the message once."""
    instruction = CODE_INSTRUCTION if domain == "code" else INSTRUCTION
    if getattr(tokenizer, "chat_template", None):
        head, tail = chat_frame(tokenizer, instruction)
        return head + problem + tail
    return f"{instruction}\nProblem: {problem}\nSolution: "


def chat_frame(tokenizer, instruction):
    """The chat template's text before and after the problem in a user message that asks
    `instruction`, rendered once (per tokenizer, template and instruction) with a marker where the
    problem goes: a template is code from the model folder, and rendering it for every prompt would
    run that code, and any loop in it, thousands of times. ValueError when the message does not
    appear in the prompt exactly once (a template that rewrites it)."""
    frames = _FRAMES.setdefault(tokenizer, {})
    key = (tokenizer.chat_template, instruction)
    if key not in frames:
        text = render_chat_template(tokenizer, f"{instruction}\n\n{PROBLEM_MARK}")
        if text.count(PROBLEM_MARK) != 1:
            raise ValueError("its chat template does not put the user's message into the prompt "
                             "once, as written")
        frames[key] = tuple(text.split(PROBLEM_MARK))
    return frames[key]


def render_chat_template(tokenizer, content):
    """tokenizer.apply_chat_template of one user message, in a forked child killed at
    TEMPLATE_SECONDS: a template is code from the model folder, and neither a loop nor one long C
    call (10 ** (10 ** 8)) in it can hold this process -> the prompt text; ValueError, one line,
    when it fails or takes too long."""
    seconds = TEMPLATE_SECONDS
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: render, send the result as JSON, exit without any clean-up
        try:
            os.close(read)
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
            said = ({"text": text} if isinstance(text, str) else
                    {"error": f"it renders a {type(text).__name__}, not text"})
        except BaseException as err:  # a PanicException too: reported, then the child exits
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
    raise ValueError(f"its chat template fails: {said['error']}")


def prompt_ids(tokenizer, problem, domain="math"):
    """A problem's prompt (format_prompt) as token ids, with one BOS: a chat template writes the
    model's own special tokens (Llama-3's begins with its BOS), so its text is tokenized without
    adding them again, as apply_chat_template(tokenize=True) does; a plain prompt gets the
    tokenizer's."""
    return prompts_ids(tokenizer, [problem], [domain])[0]


def prompts_ids(tokenizer, problems, domains):
    """[prompt_ids(tokenizer, p, d) for p, d in zip(problems, domains)], tokenized in one batch
    (a fast tokenizer's batch call: the toy's 2,204 prompts in 0.08 s, not 0.17-0.19 one by one)."""
    if not problems:
        return []
    templated = bool(getattr(tokenizer, "chat_template", None))
    texts = [format_prompt(tokenizer, p, d) for p, d in zip(problems, domains)]
    return tokenizer(texts, add_special_tokens=not templated)["input_ids"]


def eos_ids(tokenizer, model=None):
    """Every id that ends a sample: the tokenizer's eos, then the model's generation_config ones
    (Qwen2.5/3 instruct and Llama-3 list several: <|im_end|> and <|endoftext|>, <|eot_id|> and
    <|end_of_text|>)."""
    listed = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    listed = listed if isinstance(listed, (list, tuple)) else [listed]
    return list(dict.fromkeys(i for i in [tokenizer.eos_token_id, *listed] if i is not None))


def special_tokens(tokenizer, model=None):
    """The sampler's special token ids, ready as keyword arguments of generate.sampler /
    generate.generate: eos_id (a list: eos_ids), think_end (the ids of "</think>") and
    interrupt_ids (the ids of INTERRUPT_PHRASE)."""
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    return dict(eos_id=eos_ids(tokenizer, model), think_end=ids("</think>"),
                interrupt_ids=ids(INTERRUPT_PHRASE))


def completion_text(tokenizer, sample):
    """The text of a sampled completion (a generate.Sample), without its final eos: the tokenizer's,
    or the special token that ended a sample which was not truncated (one of eos_ids: the sampler
    ends a sample on nothing else)."""
    last = sample.tokens[-1] if sample.tokens else None
    added = tokenizer.added_tokens_decoder.get(last)
    ended = last == tokenizer.eos_token_id or (sample.finish != "truncated" and added is not None
                                               and added.special)
    return tokenizer.decode(sample.tokens[:-1] if ended else sample.tokens)


def score_samples(tokenizer, samples, problems, unsafe_code=False):
    """-> (texts, correct, rewards): a sample is correct only if it finished and verify.py accepts
    its answer; its reward is verify.reward's (a float: +1 / -1 for correct / not). A truncated
    sample (no eos within the budget) never gave its answer, so it is not correct, whatever its
    text holds: for the reward, No-Positive-Resampling's pass rates, pass@1 and held-out evals
    alike (the paper's evals count a sample that never answers as wrong). Truncated samples are not
    even scored. Where the chat template ends the prompt with an opened <think> (DeepSeek-R1), an
    answer counts only after </think>."""
    texts = [completion_text(tokenizer, s) for s in samples]
    done = [i for i, s in enumerate(samples) if s.finish != "truncated"]
    correct = [False] * len(samples)
    keys = {(p["prompt"], p.get("domain")) for p in problems}
    # the prompts as sampled
    opens = {key: prompt_opens_think(format_prompt(tokenizer, *key)) for key in keys}
    think_open = [opens[problems[i]["prompt"], problems[i].get("domain")] for i in done]
    for i, v in zip(done, score_problems([texts[i] for i in done], [problems[i] for i in done],
                                         unsafe_code=unsafe_code, think_open=think_open)):
        correct[i] = bool(v)
    rewards = [float(reward(t, p, c, s.finish)) for t, p, c, s in zip(texts, problems, correct,
                                                                       samples)]
    return texts, correct, rewards


def split_problems(problems, val_size, seed=0):
    """Seeded held-out split -> (train, val); the same seed always holds out the same problems."""
    if not 0 < val_size < len(problems):
        raise ValueError(f"val_size must be between 1 and {len(problems) - 1}, got {val_size}")
    order = list(range(len(problems)))
    random.Random(seed).shuffle(order)
    val = [problems[i] for i in sorted(order[:val_size])]
    train = [problems[i] for i in sorted(order[val_size:])]
    return train, val

# -----------------------------------------------------------------------------
# the curriculum


class Curriculum:
    """Serves prompt indices epoch by epoch in a seeded order and keeps each prompt's pass-rate
    history.

    No-Positive-Resampling (paper section 3.2, the data curriculum): once a prompt's measured pass
    rate is >= threshold it is retired and never sampled again: each epoch's order leaves out the
    prompts retired so far, and a prompt retired after its epoch's order was drawn is skipped when
    its turn comes.
    A batch that crosses an epoch boundary holds each prompt at most once (when at least k prompts
    are unretired): the new epoch's prompts already in the batch move to the end of its order, so
    every epoch still serves each unretired prompt once.
    """

    def __init__(self, n, seed=0, npr=True, threshold=0.9):
        self.n, self.seed, self.npr, self.threshold = n, seed, npr, threshold
        self.epoch, self.pos = 0, 0
        self.history = {}  # prompt index -> list of pass rates, one per time it was sampled
        self.retired = set()
        self.order = self._shuffled()

    def _shuffled(self):
        order = [i for i in range(self.n) if i not in self.retired]
        random.Random(f"{self.seed}-{self.epoch}").shuffle(order)
        return order

    def _next_epoch(self, batch):
        """Start the next epoch; the prompts already in `batch` go to the end of its order."""
        self.epoch, self.pos = self.epoch + 1, 0
        order = self._shuffled()
        self.order = [i for i in order if i not in batch] + [i for i in order if i in batch]
        if not self.order:
            raise StopIteration("every training prompt is retired (pass rate >= "
                                f"{self.threshold}): nothing left to train on")

    def next_batch(self, k):
        """The next k prompt indices; crosses epoch boundaries. Raises StopIteration when all are
        retired."""
        batch = []
        while len(batch) < k:
            if self.pos >= len(self.order):
                self._next_epoch(batch)
            i = self.order[self.pos]
            self.pos += 1
            if i not in self.retired:
                batch.append(i)
        return batch

    def record(self, idx, pass_rate):
        self.history.setdefault(idx, []).append(pass_rate)
        if self.npr and pass_rate >= self.threshold:
            self.retired.add(idx)

    def state_dict(self):
        return {"n": self.n, "seed": self.seed, "npr": self.npr, "threshold": self.threshold,
                "epoch": self.epoch, "pos": self.pos, "order": list(self.order),
                "history": {str(k): v for k, v in self.history.items()},
                "retired": sorted(self.retired)}

    def load_state_dict(self, state):
        if state["n"] != self.n:
            raise ValueError(f"curriculum state is for {state['n']} prompts, "
                             f"this dataset has {self.n}")
        self.seed, self.npr, self.threshold = state["seed"], state["npr"], state["threshold"]
        self.epoch, self.pos, self.order = state["epoch"], state["pos"], list(state["order"])
        self.history = {int(k): list(v) for k, v in state["history"].items()}
        self.retired = set(state["retired"])

# -----------------------------------------------------------------------------
# the embedded default: a synthetic arithmetic task


# the embedded tasks: operations per problem, start number, operand range, largest total
PRESETS = {
    # the default demo: learned in 2 minutes
    "toy": dict(ops=(1, 4), start=(1, 12), operand=(1, 3), top=20),
    # longer chains over a larger addition table, so that the tiny model's ceiling sits below 1 (6
    # operations take about 38 thinking tokens). The miniature study trains on all its chains
    # (study.MAX_OPS), where ScaleRL ends near 0.8.
    # A first try, (2-8 operations of 1-9, totals to 50), left the base model at 0.04 and RL flat
    # for 60 steps.
    "toy-hard": dict(ops=(2, 6), start=(1, 20), operand=(1, 5), top=30),
}


def toy_problem(rng, preset="toy"):
    """One problem of a preset: a start number and a chain of + / - operations, totals kept in
    0..top (toy: start 1-12, 1-4 operations of 1-3, totals in 0..20)."""
    cfg = PRESETS[preset]
    n_ops = rng.randint(*cfg["ops"])  # graded difficulty: more operations, more steps to get right
    total = rng.randint(*cfg["start"])
    text, steps = str(total), []
    for _ in range(n_ops):
        d = rng.randint(*cfg["operand"])
        op = "-" if total - d >= 0 and (total + d > cfg["top"] or rng.random() < 0.5) else "+"
        new = total - d if op == "-" else total + d
        steps.append((total, op, d, new))
        text += f"{op}{d}"
        total = new
    return {"prompt": f"Compute {text}.", "answer": str(total), "steps": steps}


def toy_problems(n, seed, preset="toy"):
    rng = random.Random(seed)
    return [toy_problem(rng, preset) for _ in range(n)]


@functools.lru_cache(maxsize=4)
def toy_task(seed, preset="toy"):
    """A preset's task as train.py's --data takes it: the distinct problems among 4000 generated
    ones (about 2200 for the toy). Made once per process and seed (~0.1-0.3 s of CPU each time):
    callers copy them before changing any."""
    seen = {}
    for p in toy_problems(4000, seed + 12345, preset):
        seen.setdefault(p["prompt"], dict(p, domain="math"))
    return tuple(seen.values())


def toy_trace(problem, rng):
    """A warm-up completion: correct-looking reasoning with some wrong steps and often a wrong
    answer."""
    shown, total = [], None
    for a, op, d, _ in problem["steps"]:
        a = a if total is None else total
        total = a + d if op == "+" else a - d
        if rng.random() < 0.03:  # a slip in the arithmetic, carried forward
            total += rng.choice([-2, -1, 1, 2])
        shown.append(f"{a}{op}{d}={total}")
    think = ",".join(shown) + "."
    if rng.random() < 0.2:  # sometimes it checks its work, which makes the trace much longer
        think += " Check:" + ",".join(shown) + "."
    answer = total
    if rng.random() < 0.7:  # the boxed answer is often wrong: an intermediate result or a near miss
        answer = rng.choice([problem["steps"][0][0], total + 1, total - 1,
                             total + rng.choice([-10, 10])])
    return f"<think>{think}</think> The answer is \\boxed{{{answer}}}."


def build_toy_model(out_dir=None, seed=0, sft_steps=3200, log=print, preset="toy"):
    """Train a preset's tokenizer and cold-start its 0.34M-parameter Llama base model; save in HF
    layout."""
    out_dir = out_dir or TOY_DIRS[preset]
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    t0 = time.time()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    problems = toy_problems(20000, seed + 1, preset)
    texts = [format_prompt(None, p["prompt"]) + toy_trace(p, rng) for p in problems]
    # byte-level BPE trained on the task's own text; numbers are words of their own, so each
    # number that occurs becomes a single token and arithmetic is a lookup, not digit-by-digit
    tok = Tokenizer(models.BPE())
    words = pre_tokenizers.Split(Regex(r" ?\d+| ?[A-Za-z]+|\s+|[^\sA-Za-z\d]"), behavior="isolated")
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [words, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<think>", "</think>"],
                                  show_progress=False)
    tok.train_from_iterator(texts + [INTERRUPT_PHRASE] * 50, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                        pad_token="<|endoftext|>")
    # a Llama config: transformers loads its tokenizer from tokenizer.json as is (a Qwen2 folder
    # would get Qwen2Tokenizer, which replaces the pre-tokenizer with Qwen2's digit-by-digit one)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.eos_token_id,
                         scalerl_task=preset)  # train.py gives its runs the toy recipe
    model = LlamaForCausalLM(config)
    _warm_up(model, tokenizer, problems, texts, sft_steps, log)
    model.save_pretrained(out_dir + ".tmp")
    tokenizer.save_pretrained(out_dir + ".tmp")
    for name in ("config.json", "generation_config.json"):
        normalize_json(os.path.join(out_dir + ".tmp", name))
    if os.path.exists(out_dir):  # a rebuild: the old folder goes only once the new one is complete
        os.replace(out_dir, out_dir + ".old")
    os.replace(out_dir + ".tmp", out_dir)  # a half-built folder is never picked up
    shutil.rmtree(out_dir + ".old", ignore_errors=True)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"built toy base model ({n_params / 1e6:.2f}M params, vocab {len(tokenizer)}) "
        f"in {time.time() - t0:.0f}s -> {out_dir}")
    return out_dir


def normalize_json(path):
    """A built folder's config file with sorted keys and no transformers_version: a rebuild with
    the same content leaves the tracked files unchanged, whatever the library's version."""
    with open(path) as f:
        config = json.load(f)
    config.pop("transformers_version", None)
    with open(path, "w") as f:
        f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _warm_up(model, tokenizer, problems, texts, steps, log, batch=16, lr=5e-3):
    """Supervised cold start: next-token loss on the completion part of each trace."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    draws = [torch.randint(len(texts), (batch,), generator=g).tolist() for _ in range(steps)]
    drawn = sorted(set(itertools.chain(*draws)))  # only the drawn texts, in two batch calls
    enc = dict(zip(drawn, (ids + [tokenizer.eos_token_id]
                           for ids in tokenizer([texts[i] for i in drawn])["input_ids"])))
    prompts = [format_prompt(None, problems[i]["prompt"]) for i in drawn]
    n_prompt = dict(zip(drawn, map(len, tokenizer(prompts)["input_ids"])))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    model.train()
    for step, idx in enumerate(draws):
        T = max(len(enc[i]) for i in idx)
        ids = torch.full((batch, T), tokenizer.pad_token_id)
        labels = torch.full((batch, T), -100)
        for r, i in enumerate(idx):
            ids[r, :len(enc[i])] = torch.tensor(enc[i])
            labels[r, n_prompt[i]:len(enc[i])] = ids[r, n_prompt[i]:len(enc[i])]
        # right padding: causal attention never sees it
        logits = model(input_ids=ids).logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for group in opt.param_groups:  # 30 warm-up steps, then linear decay to 10%
            group["lr"] = lr * min(1.0, (step + 1) / 30) * (1 - 0.9 * step / steps)
        opt.step()
        if step % 400 == 0 or step == steps - 1:
            log(f"  warm-up step {step}/{steps} | loss {loss.item():.3f}")
    model.eval()


def toy_model_dir(log=print, preset="toy"):
    """A preset's base model folder: the shipped one, or (if it was deleted) one built on first
    use."""
    if os.path.exists(os.path.join(TOY_DIRS[preset], "config.json")):
        return TOY_DIRS[preset]
    cache = os.path.join(HERE, ".cache", os.path.basename(TOY_DIRS[preset]))
    if not os.path.exists(os.path.join(cache, "config.json")):
        log(f"{TOY_DIRS[preset]} is missing: building the {preset} base model "
            f"(3-6 minutes on 2 cores) -> {cache}")
        build_toy_model(cache, log=log, preset=preset)
    return cache


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(
        description="the embedded tasks and the problem loader (see the docstring)",
        allow_abbrev=False)
    ap.add_argument("file", nargs="?", help="a jsonl of problems or a Hugging Face dataset "
                    "owner/name[:config[:split]] (split: train): load it, print the count and "
                    "the first one")
    ap.add_argument("--build", nargs="?", const="toy", choices=list(PRESETS),
                    help="remake a shipped base model from fixed seeds "
                         "(toy: toy_model/, toy-hard: toy_model_hard/)")
    cli = ap.parse_args()
    if cli.build:
        build_toy_model(preset=cli.build)
    elif cli.file:
        try:
            probs = load_source_problems(cli.file)
        except OSError as err:
            sys.exit(f"error: {cli.file}: {err.strerror or err}")
        except ValueError as err:
            sys.exit(f"error: {err}")
        print(f"{len(probs)} problems; first: {probs[0]}")
    else:
        print(toy_model_dir())
        for p in toy_problems(3, 0):
            print(p["prompt"], "->", p["answer"])
