"""
hub.py: Hugging Face Hub ids for --model and --data, through the standard caches.

resolve_model gives a model's folder, load_records a dataset's rows. A Hub silent for
HUB_PROBE_SECONDS counts as offline: cached ids load, others fail at once, in one line.
"""

import contextlib
import functools
import os
import re
import threading

from faults import printable

HUB_PROBE_SECONDS = 3.0
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".txt", ".gz")  # a file, not an id
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
# where datasets' errors list the configs
CONFIG_LISTS = re.compile(r"(?:available configs|Available configs in the cache|Available): "
                          r"\[([^\]]*)\]|configurations in the cache: ([^\n]*)")


def one_line(err):
    """An exception quoted in an error line: one line, its control characters shown."""
    return " ".join(printable(err).split())[:400]


def hide_progress_bars():
    """transformers' and the Hub's tqdm bars off ("Loading weights"): every entry point prints its
    own lines."""
    from transformers.utils import logging
    logging.disable_progress_bar()


@functools.lru_cache(maxsize=None)
def hub_unreachable(endpoint):
    """Why `endpoint` cannot be reached, or None: one HEAD request per process."""
    from huggingface_hub.utils import get_session
    answer = {}

    def probe():
        try:
            get_session().head(endpoint, timeout=HUB_PROBE_SECONDS)
            answer["why"] = None
        except Exception as err:  # DNS, refused, TLS, a proxy, ...
            answer["why"] = f"{type(err).__name__}: {one_line(err)}"
            if "Timeout" in type(err).__name__:
                answer["why"] = f"{endpoint} did not answer within {HUB_PROBE_SECONDS:g} s"

    # a thread: name resolution ignores the timeout
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(HUB_PROBE_SECONDS + 1)
    return answer.get("why", f"{endpoint} did not answer within {HUB_PROBE_SECONDS:g} s")


@contextlib.contextmanager
def hub_offline(datasets):
    """Offline for the block (both libraries read HF_HUB_OFFLINE at import)."""
    from huggingface_hub import constants
    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


def hub_id(text):
    """Whether a value is shaped as a Hub repository, owner/name."""
    return (bool(HUB_ID.fullmatch(text)) and not text.lower().endswith(DATA_SUFFIXES)
            and not os.path.isdir(text.split("/")[0]))


def resolve_model(name):
    """--model NAME -> a folder: NAME itself, or a Hub id's cached snapshot."""
    if os.path.exists(name):
        return name
    if not hub_id(name):
        raise ValueError(f"{name}: no such folder (and not a Hugging Face Hub id, owner/name)")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError)
    offline = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else hub_unreachable(
        constants.ENDPOINT)
    try:
        return snapshot_download(name, allow_patterns=MODEL_FILES, local_files_only=bool(offline))
    except GatedRepoError:
        why = (f"it is gated on the Hub: accept its terms at https://huggingface.co/{name}, "
               "then log in (hf auth login)")
    except RepositoryNotFoundError:
        why = ("there is no such model on the Hugging Face Hub "
               "(or it is private: log in with hf auth login)")
    except LocalEntryNotFoundError as err:  # offline and not cached
        cause = err.__cause__ or err
        reason = offline or f"{type(cause).__name__}: {one_line(cause)}"
        why = (f"not in the Hugging Face cache (HF_HUB_CACHE={constants.HF_HUB_CACHE}); "
               f"the Hub could not be reached ({reason}): download it once with network access "
               f"(hf download {name}) or give a local folder")
    except Exception as err:  # a Hub error, a full disk, ...
        why = f"the Hugging Face Hub download failed ({type(err).__name__}: {one_line(err)})"
    raise ValueError(f"{name}: not a local folder, and {why}")


def hub_dataset_spec(text):
    """'owner/name[:config[:split]]' -> (repo, config, split), or None."""
    repo, *rest = text.split(":", 2)
    if not hub_id(repo):
        return None
    config, split = (rest + ["", ""])[:2]
    return repo, config or None, split or None


def load_records(spec, split="train"):
    """A dataset spec -> ((where, row) pairs, its label)."""
    repo, config, named_split = hub_dataset_spec(spec)
    split = named_split or split
    label = f"{repo}:{config or ''}:{split}"
    records = ((f"{label} row {i}", {k: v for k, v in rec.items() if v is not None})
               for i, rec in enumerate(load_hub_dataset(repo, config, split)))
    return records, label


def load_hub_dataset(repo, config, split):
    """datasets.load_dataset; OSError, one line, on failure."""
    try:
        import datasets
    except ImportError:
        raise OSError("a Hugging Face dataset id needs the datasets package: pip install datasets "
                      "(or give a jsonl file)") from None
    offline = ("HF_HUB_OFFLINE is set" if datasets.config.HF_HUB_OFFLINE
               else hub_unreachable(datasets.config.HF_ENDPOINT))
    try:
        with hub_offline(datasets) if offline else contextlib.nullcontext():
            return datasets.load_dataset(repo, config, split=split)
    except Exception as err:  # not cached, no such dataset, config or split
        raise OSError(hub_dataset_error(repo, config, split, offline, err)) from None


def hub_dataset_error(repo, config, split, offline, err):
    """The one line for a dataset that did not load."""
    found = CONFIG_LISTS.search(str(err))
    names = ",".join(g for g in found.groups() if g).split(",") if found else []
    configs = sorted(c.strip(" '\"") for c in names if c.strip(" '\""))
    if configs and config is None:
        return (f"not a file, and the Hugging Face dataset {repo} has several configs "
                f"({', '.join(configs)}): name one, {repo}:{configs[0]}")
    if configs and config not in configs:
        return (f"not a file, and the Hugging Face dataset {repo} has no config {config} (configs "
                f"found: {', '.join(configs)}): name one, {repo}:{configs[0]}")
    if isinstance(err, ConnectionError):
        import datasets
        named = "" if config else (f"; if it has several configs, name one: {repo}:CONFIG "
                                   "(GSM8K's: openai/gsm8k:main)")
        return (f"not a file, and not in the Hugging Face datasets cache (HF_DATASETS_CACHE="
                f"{datasets.config.HF_DATASETS_CACHE}); the Hub could not be reached "
                f"({offline or one_line(err)}): run this once with network access (it is cached "
                f"then) or give a jsonl file{named}")
    return (f"not a file, and the Hugging Face dataset {repo} (config {config}, split {split}) "
            f"could not be loaded ({type(err).__name__}: {one_line(err)}); the syntax is "
            "owner/name[:config[:split]]")
