"""
data.py: problems in, prompts out, and the curriculum that picks them (paper sections 2, 3.2).

Start at load_source_problems (jsonl or a Hub dataset -> math or code problems), then
format_prompt, score_samples, Curriculum (No-Positive-Resampling) and Prompts (a
generator's share of the curriculum).

    python data.py FILE_OR_HUB_ID      # the count and the first problem
"""

import copy
import math
import os
import random
import sys
import weakref

from faults import printable
from hub import hub_dataset_spec, load_records
from runs import read_jsonl
from sandbox import CODE_MAX_CASES, render_chat_template, split_asserts
from verify import last_boxed, never_matched, prompt_opens_think, reward, score_problems

INSTRUCTION = "Think inside <think> </think>, then answer in \\boxed{}."
CODE_INSTRUCTION = ("Think inside <think> </think>, then answer with a Python program in a "
                    "```python block.")
# forced in at an interruption (paper 3.2)
INTERRUPT_PHRASE = ("Okay, time is up. Let me stop thinking and formulate a final answer now. "
                    "</think>")
PROBLEM_MARK = "\ue000problem\ue000"
_FRAMES = weakref.WeakKeyDictionary()

# -----------------------------------------------------------------------------
# loading problems


def _answer_of(rec, where):
    """A record's gold answer (GSM8K: after '####')."""
    if "answer" in rec and rec["answer"] is not None:
        ans = rec["answer"]
        if isinstance(ans, bool) or not isinstance(ans, (str, int, float)):
            raise ValueError(f"{where}: field 'answer' must be a string or a number, "
                             f"got {type(ans).__name__}")
        if isinstance(ans, float) and not math.isfinite(ans):
            raise ValueError(f"{where}: field 'answer' must be a finite number, got {ans}")
        try:
            ans = str(ans)
        except ValueError as err:  # past Python's digit limit
            raise ValueError(f"{where}: field 'answer': {err}") from None
        gsm8k = "question" in rec and "####" in ans
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
        split_asserts("\n".join(asserts))
    except (SyntaxError, ValueError) as err:
        raise ValueError(f"{where}: field 'tests': {err}") from None
    except (RecursionError, MemoryError):
        raise ValueError(f"{where}: field 'tests': an expression nested too deeply to "
                         "parse") from None
    return tests


class Problem(dict):
    """A problem's fields, and where it was read (FILE:LINE) for a message that names it."""
    where = None


def _problem_of(rec, where, key):
    domain = rec.get("domain", "code" if "tests" in rec else "math")
    if domain not in ("math", "code"):
        raise ValueError(f"{where}: field 'domain' must be 'math' or 'code', got {domain!r}")
    if domain == "code":
        if "tests" not in rec:
            raise ValueError(f"{where}: missing field 'tests' (a code problem)")
        problem = Problem(prompt=rec[key], tests=_tests_of(rec, where), domain="code")
    else:
        problem = Problem(prompt=rec[key], answer=_answer_of(rec, where), domain="math")
    problem.where = where
    return problem


def load_problems(path):
    """A jsonl file -> problems."""
    return problems_of_records(((f"{path}:{lineno}", rec) for lineno, rec in read_jsonl(path)),
                               path)


def problems_of_records(records, source):
    """(where, record) pairs -> problems, duplicates skipped."""
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
        print(printable(f"{source}: {note.format(n=len(wheres))} (the first at {wheres[0]})"),
              file=sys.stderr)
    return problems


def _notes(problem, rec, seen):
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
    """--data: a jsonl path or 'owner/name[:config[:split]]'."""
    if os.path.exists(source) or hub_dataset_spec(source) is None:
        return load_problems(source)
    return problems_of_records(*load_records(source, split))


def format_prompt(tokenizer, problem, domain="math"):
    """The prompt: the chat template if any, else plain."""
    instruction = CODE_INSTRUCTION if domain == "code" else INSTRUCTION
    if getattr(tokenizer, "chat_template", None):
        head, tail = chat_frame(tokenizer, instruction)
        return head + problem + tail
    return f"{instruction}\nProblem: {problem}\nSolution: "


def chat_frame(tokenizer, instruction):
    """The chat template's text around the problem, rendered once."""
    frames = _FRAMES.setdefault(tokenizer, {})
    key = (tokenizer.chat_template, instruction)
    if key not in frames:
        text = render_chat_template(tokenizer, f"{instruction}\n\n{PROBLEM_MARK}")
        if text.count(PROBLEM_MARK) != 1:
            raise ValueError("its chat template does not put the user's message into the prompt "
                             "once, as written")
        frames[key] = tuple(text.split(PROBLEM_MARK))
    return frames[key]


def prompt_ids(tokenizer, problem, domain="math"):
    """A prompt's token ids, with one BOS."""
    return prompts_ids(tokenizer, [problem], [domain])[0]


def prompts_ids(tokenizer, problems, domains):
    if not problems:
        return []
    templated = bool(getattr(tokenizer, "chat_template", None))
    texts = [format_prompt(tokenizer, p, d) for p, d in zip(problems, domains)]
    return tokenizer(texts, add_special_tokens=not templated)["input_ids"]


def eos_ids(tokenizer, model=None):
    """Every id that ends a sample."""
    listed = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    listed = listed if isinstance(listed, (list, tuple)) else [listed]
    return list(dict.fromkeys(i for i in [tokenizer.eos_token_id, *listed] if i is not None))


def special_tokens(tokenizer, model=None):
    """The sampler's token ids, as keyword arguments."""
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    return dict(eos_id=eos_ids(tokenizer, model), think_end=ids("</think>"),
                interrupt_ids=ids(INTERRUPT_PHRASE))


def completion_text(tokenizer, sample):
    """A sample's text without its final eos."""
    last = sample.tokens[-1] if sample.tokens else None
    added = tokenizer.added_tokens_decoder.get(last)
    ended = last == tokenizer.eos_token_id or (sample.finish != "truncated" and added is not None
                                               and added.special)
    return tokenizer.decode(sample.tokens[:-1] if ended else sample.tokens)


def score_samples(tokenizer, samples, problems, unsafe_code=False):
    """-> (texts, correct, rewards); a truncated sample is never correct."""
    texts = [completion_text(tokenizer, s) for s in samples]
    done = [i for i, s in enumerate(samples) if s.finish != "truncated"]
    correct = [False] * len(samples)
    keys = {(p["prompt"], p.get("domain")) for p in problems}
    opens = {key: prompt_opens_think(format_prompt(tokenizer, *key)) for key in keys}
    think_open = [opens[problems[i]["prompt"], problems[i].get("domain")] for i in done]
    for i, v in zip(done, score_problems([texts[i] for i in done], [problems[i] for i in done],
                                         unsafe_code=unsafe_code, think_open=think_open)):
        correct[i] = bool(v)
    rewards = [float(reward(t, p, c, s.finish)) for t, p, c, s in zip(texts, problems, correct,
                                                                       samples)]
    return texts, correct, rewards


def split_problems(problems, val_size, seed=0):
    """Seeded held-out split -> (train, val)."""
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
    """Prompt indices epoch by epoch, in a seeded order.

    No-Positive-Resampling (paper 3.2): a prompt whose historical pass rate (the mean of every
    group of it so far) reaches `threshold` is retired.
    """

    def __init__(self, n, seed=0, npr=True, threshold=0.9):
        self.n, self.seed, self.npr, self.threshold = n, seed, npr, threshold
        self.epoch, self.pos = 0, 0
        self.history = {}
        self.retired = set()
        self.order = self._shuffled()

    def _shuffled(self):
        order = [i for i in range(self.n) if i not in self.retired]
        random.Random(f"{self.seed}-{self.epoch}").shuffle(order)
        return order

    def _next_epoch(self, batch):
        self.epoch, self.pos = self.epoch + 1, 0
        order = self._shuffled()
        self.order = [i for i in order if i not in batch] + [i for i in order if i in batch]
        if not self.order:
            raise StopIteration("every training prompt is retired (pass rate >= "
                                f"{self.threshold}): nothing left to train on")

    def next_batch(self, k):
        """The next k distinct prompt indices; StopIteration once all retire."""
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
        history = self.history.setdefault(idx, [])
        history.append(pass_rate)
        # section 3.2: "historical" pass rate, every group of G samples alike
        if self.npr and sum(history) / len(history) >= self.threshold:
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


class Prompts:
    """No-Positive-Resampling over generator g's prompts (every n_gens-th): the curriculum, and per
    batch in flight the state a resume there starts from."""

    def __init__(self, n_problems, g, n_gens, batch, seed, npr, saved=None):
        self.mine, self.batch = list(range(g, n_problems, n_gens)), batch
        self.curriculum = Curriculum(len(self.mine), seed + 1 + g)
        if saved:
            self.curriculum.load_state_dict(saved)
        self.curriculum.npr = npr  # the flag of this run, whatever the saved state says
        self.at = {}

    def pick(self, gi):
        """Group gi's slot in self.mine; StopIteration once every prompt is retired."""
        # the first pick of a batch: what a resume at that step starts from
        if gi // self.batch not in self.at:
            self.at[gi // self.batch] = copy.deepcopy(self.curriculum)
        (c,) = self.curriculum.next_batch(1)
        return c

    def record(self, gi, c, pass_rate):
        """A pass rate into the curriculum and into the resume copies of the batches after gi's
        (which started before this group of an earlier batch finished)."""
        for curriculum in [self.curriculum] + [s for b, s in self.at.items()
                                               if gi // self.batch < b]:
            curriculum.record(c, pass_rate)

    def state_at(self, step):
        return self.at.get(step, self.curriculum)

    def forget_before(self, version):
        self.at = {b: c for b, c in self.at.items() if b >= version}


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="the problem loader (see the docstring)",
                                 allow_abbrev=False)
    ap.add_argument("file", help="a jsonl of problems or a Hugging Face dataset "
                    "owner/name[:config[:split]] (split: train): load it, print the count and "
                    "the first one")
    cli = ap.parse_args()
    try:
        probs = load_source_problems(cli.file)
    except OSError as err:
        sys.exit(printable(f"error: {cli.file}: {err.strerror or err}"))
    except ValueError as err:
        sys.exit(printable(f"error: {err}"))
    print(f"{len(probs)} problems; first: {probs[0]}")
