"""
runs.py: the run folder (--out): its checks and lock, atomic checkpoints, resume, metrics; and the
one reader of files taken from a folder.

Start at prepare_out_dir, then save_checkpoint and resume_point. A run writes only its own names
(RUN_NAME), into the folder it opened (hold, _parent), never through a link, FIFO or hard link
(open_run_file), reads only regular files within a size cap (open_regular, check_model_files), and
unpickles nothing but plain data (load_state, check_shards).

  python -m pytest -q test_all.py -k "run_folder or resume or symlink or source_tree or checkpoints
  or regular_files"
"""
import contextlib
import errno
import fcntl
import fnmatch
import glob
import io
import json
import math
import os
import pickle
import re
import secrets
import shlex
import shutil
import socket
import stat
import sys
import time

from faults import printable
from hub import MODEL_FILES

HERE = os.path.dirname(os.path.abspath(__file__))
# rank 0 marks --out as a run, with its trackers
RUN_MARK = ".train-run.json"
# the names a run writes
RUN_NAME = re.compile(r"metrics\.jsonl|ckpt-\d{6,}(\.tmp)?|curriculum-rank\d+\.(json|pt)(\.tmp)?")
SOURCE_DIRS = ("toy_model", "toy_model_hard", "fixtures", "assets", ".ci", ".git")
_LOCK = []
# --out's path -> its folder's handle, opened once (hold): the run writes into that folder only
_HELD = {}
_TRACKED = []  # --tensorboard's folder, held while its writer lives
# a path -> (device, inode) of the file replace_file wrote there (copy_written)
_WRITTEN = {}


def run_names(out):
    """The entries of --out a run wrote."""
    mark = read_mark(out)
    trackers = [name for name in ("tb", "wandb") if mark.get(name)]
    return sorted(n for n in os.listdir(out) if RUN_NAME.fullmatch(n) or n in trackers)


def read_mark(out):
    path = os.path.join(out, RUN_MARK)
    if not os.path.isfile(path) or os.path.islink(path):
        return {}
    try:
        mark = read_json(path, follow=False)
    except (OSError, ValueError):
        return {}
    return mark if isinstance(mark, dict) else {}


def legacy_run(out):
    """Written before RUN_MARK existed."""
    try:
        with open_regular(os.path.join(out, "metrics.jsonl"), follow=False) as f:
            first = json.loads(f.readline(MAX_LINE_BYTES))
        return isinstance(first, dict) and first.get("kind") == "config" and "ran" in first
    except (OSError, ValueError):
        return False


def check_out_dir(args):
    """Why --out is unsafe, or None."""
    out, here = os.path.realpath(args.out), os.path.realpath(HERE)
    inside = os.path.relpath(out, here).split(os.sep)[0]
    if os.path.commonpath([out, here]) == out or inside in SOURCE_DIRS:
        return (
            f"--out {args.out} is "
            f"{'the source tree or holds it' if inside in ('.','..') else 'inside the source tree'}"
            f" ({here}): give a folder under runs/ or outside the repository"
        )
    if os.path.isfile(os.path.join(out, "config.json")) and not read_mark(out):
        return (f"--out {args.out} holds a config.json that no run of train.py wrote "
                "(a model folder?): choose another --out")
    if (args.model_dir and args.overwrite
            and os.path.commonpath([out, os.path.realpath(args.model_dir)]) == out):
        return (f"--model {args.model} is inside --out {args.out}, which --overwrite would clear: "
                "copy it out first")
    return None


def prepare_out_dir(args, need_mb=100):
    """Refuse an unsafe, full or taken --out; rank 0 locks it."""
    out = args.out
    problem = check_out_dir(args)
    if problem:
        sys.exit(f"error: {problem}")
    if int(os.environ.get("RANK", "0")) == 0:  # the one that logs: a missing library, before --out
        tracker_libraries(args)
    try:
        hold(out)
        with _parent(os.path.join(out, f".write-test-{secrets.token_hex(8)}")) as (folder, probe):
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                         dir_fd=folder)  # a new file: never a link
            os.write(fd, b"x")
            os.close(fd)
            os.unlink(probe, dir_fd=folder)
    except OSError as err:
        sys.exit(f"error: --out {out} is not writable: {err}")
    free_mb = shutil.disk_usage(out).free / 2 ** 20
    if free_mb < need_mb:
        sys.exit(f"error: --out {out}: only {free_mb:.0f} MB free on its disk "
                 "(checkpoints need more)")
    held = run_names(out)
    if held and not read_mark(out) and not legacy_run(out):
        sys.exit(f"error: --out {out} holds {', '.join(held[:3])} but is not a run of train.py "
                 f"(no {RUN_MARK}): nothing there is deleted or resumed; move those files or "
                 "choose another --out")
    if held and not (args.resume or args.overwrite):
        sys.exit(f"error: --out {out} already holds a run "
                 f"({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}): "
                 "pass --resume to continue it, --overwrite to start over, or another --out")
    if int(os.environ.get("RANK", "0")) != 0:
        return
    lock_run(out)
    for name in held if args.overwrite else []:
        remove(os.path.join(out, name))
    prune_leftovers(out)  # a resumed run's saves cut short
    mark = {} if args.overwrite else read_mark(out)
    write_file(os.path.join(out, RUN_MARK),
               json.dumps({"tb": mark.get("tb") or args.tensorboard,
                           "wandb": mark.get("wandb") or bool(args.wandb),
                           "nonce": secrets.token_hex(8)}))  # this start's: check_same_out


def run_facts(args, ckpt):
    """Rank 0's --out and resume point, for every rank (ranks.share_run)."""
    return {"ckpt": ckpt and os.path.basename(ckpt), "nonce": read_mark(args.out).get("nonce"),
            "host": socket.gethostname(), "out": os.path.realpath(args.out)}


def check_same_out(args, facts, wait=5.0):
    """Is --out here the folder rank 0 marked (its nonce, read within `wait` s: a shared disk's cache
    may show a new file late)? Else exit with one line (faults.fail adds this rank and host)."""
    deadline = time.time() + wait
    while read_mark(args.out).get("nonce") != facts["nonce"]:
        if time.time() > deadline:
            sys.exit(f"error: --out {args.out} is not the run folder that rank 0 writes "
                     f"({facts['out']} on {facts['host']}): every node must see one --out, the same "
                     "path on a shared disk")
        time.sleep(0.2)


def resume_facts(args, facts):
    """A rank other than 0: the checkpoint rank 0 resumes, loaded here -> (its folder, its state)."""
    if not facts["ckpt"]:
        return None, {}
    ckpt, state = intact_checkpoint(args.out, quiet=True)
    if ckpt is None or os.path.basename(ckpt) != facts["ckpt"]:
        sys.exit(f"error: --resume: rank 0 resumes {facts['ckpt']} but {socket.gethostname()} finds "
                 f"{ckpt or 'no intact checkpoint'} in --out {args.out} (its disk out of step?)")
    return ckpt, state


def hold(out):
    """--out made if new and opened once, never through a link: every write of the run goes into
    this folder, and a folder put at its path later stops the run (_parent)."""
    release_lock()  # tests call main again
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    _HELD[os.path.abspath(out)] = open_folder(out, "--out ", make=True)


def open_folder(path, what="", make=False):
    """A folder's handle, opened without following a link at its name (make: made if new)."""
    name = os.path.abspath(path)  # "LINK/" would follow the link
    if make:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name)  # never through a link
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        if os.path.islink(name):
            sys.exit(f"error: {what}{path} is a symlink: a run or study writes into its own "
                     "folders only, never through a link (give or make the folder itself)")
        raise


@contextlib.contextmanager
def _parent(path):
    """-> (path's folder's handle, path's name): --out's held handle while the folder is still at
    its path, else the folder opened without following a link."""
    folder, name = os.path.split(os.path.abspath(path))
    held = _HELD.get(folder)
    if held is None:
        fd = open_folder(folder)
        try:
            yield fd, name
        finally:
            os.close(fd)
        return
    if not _same(held, folder):
        sys.exit(f"error: {folder} was renamed or replaced while the run wrote into it (does "
                 "someone else write there?): the run stops and writes nothing elsewhere; "
                 "its files are in the folder it opened")
    yield held, name


def _ident(st):
    return st.st_dev, st.st_ino


def _same(fd, name, folder=None):
    """Whether name (in folder) is still the file or folder open as fd."""
    try:
        return _ident(os.stat(name, dir_fd=folder, follow_symlinks=False)) == _ident(os.fstat(fd))
    except FileNotFoundError:
        return False


def open_run_file(path, mode, new=False):
    """Open for writing (mode w, a or r+) a regular file of the folder's own: never through a
    symlink, never a FIFO, device or file with another hard link."""
    with _parent(path) as (folder, name):
        return _open_at(folder, name, mode, new, path)


def _open_at(folder, name, mode, new, path):
    flags = (os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a FIFO's open: at once
             | (os.O_RDWR if "+" in mode else os.O_WRONLY) | (os.O_APPEND if "a" in mode else 0)
             | (os.O_EXCL if new else 0))
    fd = None
    try:
        fd = os.open(name, flags, 0o644, dir_fd=folder)
        st = os.fstat(fd)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.EEXIST):
            sys.exit(f"error: {path} is a symlink{' or was made again' if new else ''}: a run "
                     "writes its own files only, never through a link")
        if err.errno not in (errno.ENXIO, errno.EISDIR):  # a FIFO nobody reads, a folder
            raise
        st = os.stat(name, dir_fd=folder, follow_symlinks=False)
    problem = (f"is not a regular file ({file_kind(st.st_mode)})" if not stat.S_ISREG(st.st_mode)
               else f"has {st.st_nlink} hard links (one to a file elsewhere?)" if st.st_nlink > 1
               else None)
    if problem:
        if fd is not None:
            os.close(fd)
        sys.exit(f"error: {path} {problem}: a run writes its own files only; remove it")
    os.set_blocking(fd, True)
    if "w" in mode:
        os.ftruncate(fd, 0)  # only now: a hard-linked file elsewhere is never truncated
    return open(path, mode, opener=lambda *_: fd)


def replace_file(path, write, mode="w"):
    """Write path whole or not at all, via PATH.tmp, in its folder's handle."""
    with _parent(path) as (folder, name):
        _remove_at(folder, name + ".tmp")
        with _open_at(folder, name + ".tmp", mode, True, path + ".tmp") as f:
            write(f)
            written = _ident(os.fstat(f.fileno()))
        os.replace(name + ".tmp", name, src_dir_fd=folder, dst_dir_fd=folder)
    _WRITTEN[os.path.abspath(path)] = written


def copy_written(src, dst):
    """dst made a copy of the file replace_file wrote at src, never of a file put there since."""
    with _parent(src) as (folder, name):
        try:
            f = open(src, "rb", opener=lambda *_: os.open(
                name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder))
        except OSError:  # a link, or nothing
            f = None
    with f or contextlib.nullcontext():
        if f is None or _ident(os.fstat(f.fileno())) != _WRITTEN.get(os.path.abspath(src)):
            sys.exit(f"error: {src} was replaced since it was written (does someone else write "
                     f"there?): not copied to {dst}")
        replace_file(dst, lambda out: shutil.copyfileobj(f, out), "wb")


def remove(path):
    """Delete a file, folder or link (never its target)."""
    with _parent(path) as (folder, name):
        _remove_at(folder, name)


def _remove_at(folder, name):
    try:
        mode = os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(name, dir_fd=folder)
    else:
        os.unlink(name, dir_fd=folder)


def write_file(path, text):
    with open_run_file(path, "w") as f:
        f.write(text)


def lock_run(out):
    path = os.path.join(out, ".lock")
    try:
        f = open_run_file(path, "r+")
    except OSError as err:
        sys.exit(f"error: {path}: {err.strerror or err}")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = f.read().strip() or "another process"
        f.close()
        sys.exit(f"error: --out {out} is in use by another run ({holder}, per {out}/.lock); "
                 "wait for it to end or choose another --out")
    except OSError as err:  # Lustre without -o flock, some NFS mounts: the disk has no file locks
        if err.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK):
            raise
        print(f"warning: --out {out}: its filesystem cannot lock files "
              f"({errno.errorcode[err.errno]}), so nothing stops a second run from writing the "
              "same --out: start one run per --out (or mount the disk with locks, Lustre: "
              "-o flock)", flush=True)
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}")
    f.flush()
    _LOCK.append(f)


def disk_error(path, err, out):
    """A failed write: one line naming the last good checkpoint."""
    return SystemExit(f"error: writing {path} failed: {err.strerror or err}; {last_good(out)}")


def last_good(out):
    ckpt = (checkpoints(out) or [None])[-1]
    return f"the last good checkpoint is {ckpt or 'none (no checkpoint yet)'}"


def checkpoint_tmp(out, step, fresh=True):
    """Where ckpt-STEP is written (fresh: made anew)."""
    tmp = os.path.join(out, f"ckpt-{step:06d}.tmp")
    if fresh:
        with _parent(tmp) as (folder, name):
            _remove_at(folder, name)
            try:  # fails if made since: never a link; 0o755: nobody else writes in it
                os.mkdir(name, 0o755, dir_fd=folder)
            except FileExistsError:
                sys.exit(f"error: {tmp} was made again while the run writes it: a run writes its "
                         "own files only, never through a link")
    return tmp


@contextlib.contextmanager
def _made_folder(tmp):
    """ckpt-STEP.tmp's handle, if it is the folder this run made (rank 0's, for --fsdp)."""
    with _parent(tmp) as (folder, name):
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                         dir_fd=folder)
        except OSError:
            fd = None
    st = None if fd is None else os.fstat(fd)
    if st is None or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        if fd is not None:
            os.close(fd)
        sys.exit(f"error: {tmp} is not the folder this run made (a symlink?): a run writes its "
                 "own files only, never through a link")
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def private_folder(tmp):
    """-> a path to ckpt-STEP.tmp that no rename or link mid-save redirects (--fsdp's shards)."""
    if not os.path.lexists(tmp):  # a trainer whose --out is its node's own disk
        sys.exit(printable(f"error: {tmp}, which rank 0 made for this checkpoint, is not in this "
                           f"rank's --out on host {socket.gethostname()}: every rank must write "
                           "into one shared --out (the same folder on a disk every node mounts)"))
    with _made_folder(tmp) as fd:
        yield f"/proc/self/fd/{fd}"  # this folder, wherever it is moved


def save_checkpoint(out, step, model, tokenizer, state, keep, fresh=True):
    """Write ckpt-STEP atomically; keep the newest `keep`."""
    import torch
    final = os.path.join(out, f"ckpt-{step:06d}")
    tmp = checkpoint_tmp(out, step, fresh)
    with _made_folder(tmp) as made:
        where = f"/proc/self/fd/{made}"  # save_pretrained writes by path: this folder's own
        try:
            model.save_pretrained(where)
            tokenizer.save_pretrained(where)
            with _open_at(made, "state.pt", "wb", True, os.path.join(tmp, "state.pt")) as f:
                torch.save(state, f)
        except OSError as err:
            with _parent(tmp) as (folder, name):
                if _same(made, name, folder):
                    shutil.rmtree(name, dir_fd=folder, ignore_errors=True)
            raise disk_error(tmp, err, out) from None
        moved = lambda path: SystemExit(  # noqa: E731
            f"error: {path} was renamed or replaced while the run wrote it (does someone else "
            f"write in {out}?): the run stops and wrote nothing elsewhere; {last_good(out)}")
        with _parent(final) as (folder, name):
            if not _same(made, name + ".tmp", folder):
                raise moved(tmp)
            _remove_at(folder, name)
            try:
                os.replace(name + ".tmp", name, src_dir_fd=folder, dst_dir_fd=folder)
            except OSError as err:
                raise disk_error(final, err, out) from None
            if not _same(made, name, folder):
                raise moved(final)
    older = [p for p in checkpoints(out) if step_of(p) < step]
    for old in older[:max(0, len(older) - (keep - 1))]:
        remove(old)
    prune_leftovers(out)
    return final


def prune_leftovers(out):
    """Rank 0 (the one writer): remove what a save or write cut short left in --out, NAME.tmp of the
    names a run writes (a planted link: the link only)."""
    for name in os.listdir(out):
        if name.endswith(".tmp") and RUN_NAME.fullmatch(name):
            remove(os.path.join(out, name))


def check_shards_written(folder, reports, where=None):
    """Rank 0, before ckpt-STEP.tmp becomes ckpt-STEP: every file --fsdp's .metadata in folder
    (read at `where`, its private path) lists is there. reports: {trainer rank: {"host": ...}},
    from ranks.shards_written."""
    missing = missing_shards(where or folder)
    if missing:
        writer = re.match(r"__(\d+)_", missing[0])  # torch.distributed.checkpoint's __RANK_N.distcp
        rank = int(writer[1]) if writer else None
        host = reports.get(rank, {}).get("host", "?")
        sys.exit(printable(
            f"error: {folder}/.metadata lists {missing[0]}, which trainer rank {rank} on host "
            f"{host} wrote, but rank 0 does not find it there (on host {socket.gethostname()}): "
            "every rank must write into one shared --out (the same folder on a disk every node "
            "mounts); this checkpoint is not saved, "
            f"{last_good(os.path.dirname(os.path.dirname(folder)))}"))


def missing_shards(folder):
    """The data files --fsdp's .metadata in folder lists that are not regular files there."""
    names = sorted({info.relative_path for info in check_shards(folder).storage_data.values()})
    return [n for n in names if not os.path.isfile(os.path.join(folder, n))]


def step_of(ckpt):
    return int(ckpt.rsplit("-", 1)[1])


def checkpoints(out):
    """A run's ckpt-NNNNNN folders, oldest first."""
    names = ([n for n in os.listdir(out) if re.fullmatch(r"ckpt-\d{6,}", n)]
             if os.path.isdir(out) else [])
    # a planted link to another run's folder is no checkpoint of this one
    return sorted((os.path.join(out, n) for n in names if os.path.isdir(os.path.join(out, n))
                   and not os.path.islink(os.path.join(out, n))), key=step_of)


def intact_checkpoint(out, quiet=False):
    """The newest checkpoint that loads -> (path, state)."""
    from safetensors import safe_open
    for path in reversed(checkpoints(out)):
        try:
            check_model_files(path, follow=False)  # read when the run loads it
            weights = glob.glob(os.path.join(path, "*.safetensors"))
            if not weights:
                raise FileNotFoundError("no *.safetensors")
            state = load_state(os.path.join(path, "state.pt"), LARGE_BYTES + STATE_PER_WEIGHT_BYTE
                               * sum(os.path.getsize(w) for w in weights))
            read_json(os.path.join(path, "config.json"), follow=False)
            for w in weights:
                with safe_open(w, "pt"):
                    pass
            if state.get("shards") and not os.path.isfile(
                    os.path.join(path, state["shards"], ".metadata")):
                raise FileNotFoundError(f"no {state['shards']}/.metadata")
            if state.get("shards"):
                whole_shards(path, os.path.join(path, state["shards"]))
            return path, state
        except Exception as err:
            if not quiet:
                print(printable(f"--resume: skipping {path}, it does not load "
                                f"({type(err).__name__}: {err})"), flush=True)
    return None, {}


def whole_shards(ckpt, folder):
    """--resume: every file the shards' .metadata lists is there, or one line naming the first."""
    missing = missing_shards(folder)
    if missing:
        sys.exit(printable(
            f"error: --resume: {folder}/.metadata lists {missing[0]}, which is not in {folder} "
            f"({len(missing)} of its files missing; written onto another node's disk?): copy "
            f"{'them' if len(missing) > 1 else 'it'} there from the --out of the node that wrote "
            f"{'them' if len(missing) > 1 else 'it'}, or remove {ckpt} to resume from the "
            "checkpoint before it"))


def load_state(path, cap):
    """state.pt as plain data only: unpickling anything else runs code. One open file: what
    loads is what was checked."""
    import torch
    with open_regular(path, cap, follow=False) as f:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(f)
        if unsafe:
            sys.exit(f"error: --resume: {path} holds objects other than tensors and plain data "
                     f"({', '.join(unsafe[:3])}): it is not loaded, since loading them could run "
                     "code from the file (a checkpoint of an older train.py, or not written by "
                     "train.py); start another --out")
        f.seek(0)
        return torch.load(f, weights_only=True)


# what torch 2.13's .metadata names: exact pairs
SHARD_METADATA = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                  ("pathlib", "PosixPath"),
                  ("torch.distributed.checkpoint.filesystem", "_StorageInfo")} | {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                 "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
                 "_MEM_FORMAT_ENCODING")}


def check_shards(folder):
    """--fsdp's .metadata, naming only SHARD_METADATA and dtypes."""
    import torch
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
    allowed = SHARD_METADATA | {("torch", n) for n, v in vars(torch).items()
                                if isinstance(v, torch.dtype)}

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) in allowed:
                return super().find_class(module, name)
            raise pickle.UnpicklingError(f"it names {module}.{name}")

    path = os.path.join(folder, ".metadata")
    try:
        if os.path.islink(folder) or any(os.path.islink(os.path.join(folder, n))
                                         for n in os.listdir(folder)):
            raise ValueError("its folder, or a file in it, is a symlink")
        metadata = Unpickler(io.BytesIO(read_file(path, LARGE_BYTES, follow=False))).load()
        if not (isinstance(metadata, Metadata) and isinstance(metadata.storage_data, dict)
                and isinstance(metadata.storage_meta, (StorageMeta, type(None)))):
            raise ValueError(f"it holds a {type(metadata).__name__}, not a Metadata")
        for info in metadata.storage_data.values():
            name = getattr(info, "relative_path", None)
            if not (isinstance(name, str) and re.fullmatch(r"[\w.-]+", name) and name[0] != "."):
                raise ValueError(f"it names a data file {name!r} outside its folder")
    except Exception as err:
        sys.exit(f"error: --resume: {path} is not a plain sharded checkpoint's metadata ({err}): "
                 "it is not loaded, since loading it could run code from the file; start another "
                 "--out")
    return metadata


def shard_reader(folder):
    """dcp.load's reader of what check_shards read, with no fallback file."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta
    metadata = check_shards(folder)

    class Reader(FileSystemReader):
        def read_metadata(self):  # no rank: no fallback file
            metadata.storage_meta = metadata.storage_meta or StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(folder)


def safe_load_planner():
    """dcp's planner; non-tensor values load as plain data first."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            torch.load(value, weights_only=True)  # raises unless plain data
            value.seek(0)
            super().load_bytes(read_item, value)

    return SafeLoadPlanner()


def resume_point(args, quiet):
    """--resume: the newest intact checkpoint -> (its folder, its state); checks.check_resumed_state
    checks that state's values."""
    if not args.resume:
        return None, {}
    ckpt, state = intact_checkpoint(args.out, quiet)
    if ckpt is None and not quiet:
        print(f"--resume: no intact checkpoint in {args.out}, starting from scratch")
    if ckpt:
        old = sorted(glob.glob(os.path.join(args.out, "curriculum-rank*.pt")))
        if old:
            sys.exit(f"error: --resume: {old[0]} is a curriculum of an older train.py, a "
                     "pickle: it is not loaded, since loading it could run code from the file; "
                     "start another --out")
    return ckpt, state


def check_resume(saved, args):
    """Another data set, split or model is refused; other changes logged."""
    now = vars(args)
    identity = [k for k in ("data", "val_data", "val_size", "seed", "model")
                if saved.get(k, now[k]) != now[k]]
    if identity:
        sys.exit("error: --resume: " +
                 "; ".join(f"--{k} was {saved[k]!r}, now {now[k]!r}" for k in identity) +
                 " (start another --out for another run)")
    ignore = {"resume", "overwrite", "out", "steps", "timeout", "heartbeat_timeout", "model_dir"}
    changed = [k for k in sorted(now) if k in saved and k not in ignore and saved[k] != now[k]]
    if changed:
        print("--resume: changed since the run started (the new values apply from here): " +
              ", ".join(f"--{k} {saved[k]!r} -> {now[k]!r}" for k in changed), flush=True)


def truncate_metrics(path, step):
    """Drop metrics lines after the checkpoint, and a half-written last one."""
    if not os.path.exists(path):
        return []
    try:
        text = read_file(path, LARGE_BYTES, follow=False)
    except OSError as err:
        sys.exit(f"error: --resume: {path}: {err.strerror}: a run writes its metrics as a file; "
                 "move this one away, or start another --out")
    lines = [ln for ln in text.decode().split("\n") if ln.strip()]
    records = []
    for i, ln in enumerate(lines):
        try:
            records.append(json.loads(ln))
        except json.JSONDecodeError as err:
            if i < len(lines) - 1:
                sys.exit(f"error: {path}:{i + 1}: not a JSON line ({err}); "
                         "only a half-written last line is dropped")
            print(f"--resume: dropped the half-written last line of {path}", flush=True)
            continue
        problem = metrics_problem(records[-1])
        if problem:
            sys.exit(f"error: {path}:{i + 1}: {problem} (a line edited by hand?); "
                     "fix or delete it, then --resume")
    # "stopped" ended a run now going on
    records = [r for r in records if r.get("step", -1) <= step and r["kind"] != "stopped"]
    write_file(path, "".join(json.dumps(r) + "\n" for r in records))
    return records


def _real(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# the fields a resume reads back (metrics.new_record), each -> (ok, what); older lines lack intr
RESUMED_FIELDS = {
    "train": {"kept_prompts": (lambda v: _real(v) and isinstance(v, int) and v >= 0,
                               "a whole number >= 0"),
              "forget": (lambda v: v is None or _real(v), "a number or null")},
    "eval": {"compute_s": (lambda v: _real(v) and v >= 0, "a number >= 0"),
             "pass_rate": (lambda v: _real(v) and 0 <= v <= 1, "a rate in [0, 1]"),
             "intr": (lambda v: _real(v) and 0 <= v <= 1, "a rate in [0, 1]")},
}


def metrics_problem(r):
    if not isinstance(r, dict) or r.get("kind") not in ("config", "train", "eval", "stopped"):
        return ("not a metrics record (a JSON object whose kind is config, train, eval or "
                "stopped)")
    if r["kind"] != "config" and not (isinstance(r.get("step"), int) and r["step"] >= 0):
        return "no whole step number"
    for k, (ok, what) in RESUMED_FIELDS.get(r["kind"], {}).items():
        v = r.get(k)
        if (k in r or k != "intr") and not ok(v):
            shown = ("missing" if k not in r else "null" if v is None else repr(v)
                     if isinstance(v, float) or type(v) is int and abs(v) < 2 ** 63
                     else f"a {type(v).__name__}")
            return (f"{'an' if r['kind'] == 'eval' else 'a'} {r['kind']} record without its {k} "
                    f"as {what} (field {k} is {shown})")
    return None


def metrics_log(args, rank0):
    """-> log(m): rank 0 appends to metrics.jsonl and trackers."""
    if not rank0:
        return lambda m: None
    path, track = os.path.join(args.out, "metrics.jsonl"), tracker(args)

    def log(m):
        try:
            with open_run_file(path, "a") as f:
                f.write(json.dumps(m) + "\n")
        except OSError as err:
            raise disk_error(path, err, args.out) from None
        track(m)
    return log


FRESH_FILE = '"$(mktemp -u)"'  # the shell names a new rendezvous file when the line is run


def resume_command():
    """The command line that resumes this run: under torchrun with the launcher's own flags (its
    rendezvous among them), as it was started."""
    flags = [a for a in sys.argv[1:] if a not in ("--resume", "--overwrite")] + ["--resume"]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    launcher = ["python"] if world == 1 else ["torchrun", *launcher_flags()]
    return " ".join([w if w.startswith("(") or w == FRESH_FILE else shlex.quote(w) for w in launcher]
                    + [sys.argv[0]]
                    + [shlex.quote(a) for a in flags])


def launcher_flags():
    """torchrun's flags: read from its command line (this process's parent), else rebuilt from the
    environment it gives its ranks."""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            words = f.read().decode().split("\0")[:-1]
        start = next((i + 1 for i, w in enumerate(words)
                      if os.path.basename(w) == "torchrun" or w == "torch.distributed.run"), None)
        if start is not None and sys.argv[0] in words[start:]:
            flags = words[start:words.index(sys.argv[0], start)]
            if "store_type=file" in flags:  # a file rendezvous refuses a second run: a fresh file
                flags = [FRESH_FILE if before in ("--rdzv-endpoint", "--rdzv_endpoint") else w
                         for before, w in zip(["", *flags], flags)]
            return flags
    env = os.environ.get
    world, local = int(env("WORLD_SIZE", "1")), int(env("LOCAL_WORLD_SIZE", "1"))
    flags = ["--nnodes", str(world // local)] if world > local else []
    flags += ["--nproc_per_node", str(local)]
    where = f"{env('MASTER_ADDR')}:{env('MASTER_PORT')}"
    if env("TORCHELASTIC_RUN_ID", "none") != "none" and env("TORCHELASTIC_USE_AGENT_STORE") == "True":
        flags += ["--rdzv-backend", "c10d", "--rdzv-endpoint", where, "--rdzv-id",
                  env("TORCHELASTIC_RUN_ID")]  # c10d: the launcher's store is the rendezvous'
    elif env("TORCHELASTIC_RUN_ID") and env("TORCHELASTIC_USE_AGENT_STORE") == "True":
        flags += ["--master_addr", env("MASTER_ADDR"), "--master_port", env("MASTER_PORT")]
        flags += ["--node_rank", env("GROUP_RANK", "0")] if world > local else []
    elif world > local:
        flags += ["(and your rendezvous flags)"]
    if int(env("TORCHELASTIC_MAX_RESTARTS", "0")):
        flags += ["--max-restarts", env("TORCHELASTIC_MAX_RESTARTS")]
    return flags


def tracker_libraries(args):
    """--wandb / --tensorboard's libraries -> (wandb, SummaryWriter), None where not asked for; one
    not installed exits with one line (prepare_out_dir asks before anything is made in --out)."""
    wandb = writer = name = None
    try:
        if args.wandb:
            name = "wandb"
            import wandb
        if args.tensorboard:
            name = "tensorboard"
            from torch.utils.tensorboard import SummaryWriter as writer
    except ImportError as err:
        sys.exit(f"error: --{name} needs a package that is not installed ({err}); pip install "
                 f"{name}, or run without the flag")
    return wandb, writer


def tracker(args):
    """--wandb / --tensorboard -> track(m)."""
    numbers = lambda m: {f"{m['kind']}/{k}": float(v) for k, v in m.items()
                         if k not in ("kind", "step") and isinstance(v, (int, float))}
    sinks, (wandb, SummaryWriter) = [], tracker_libraries(args)
    if args.wandb:
        # its folder made here, never through a planted link (the library writes by path)
        os.close(open_folder(os.path.join(args.out, "wandb"), "--wandb's ", make=True))
        run = wandb.init(project=args.wandb, dir=args.out, config=vars(args))
        sinks.append(lambda m: run.log(numbers(m), step=m["step"]))
    if args.tensorboard:
        # the library writes by path: it gets this folder's own, which no rename redirects
        _TRACKED.append(open_folder(os.path.join(args.out, "tb"), "--tensorboard's ", make=True))
        writer = SummaryWriter(f"/proc/self/fd/{_TRACKED[-1]}")
        sinks.append(lambda m: ([writer.add_scalar(k, v, m["step"])
                                 for k, v in numbers(m).items()], writer.flush()))
    return lambda m: [send(m) for send in sinks]


def release_lock():
    """--out is free again: its lock and handle closed."""
    while _LOCK:
        _LOCK.pop().close()
    while _HELD:
        os.close(_HELD.popitem()[1])

# -----------------------------------------------------------------------------
# the one reader of files taken from a folder (run, study, checkpoint, model, --data): regular files
# only, their size checked before the first byte is read

MAX_LINE_BYTES = 16 << 20  # code tests may be megabytes
JSON_BYTES = 16 << 20  # a config, a marker, a number of minutes: kilobytes
MODEL_FILE_BYTES = 256 << 20  # read whole by transformers: Gemma 3's tokenizer.json is 33 MB
# what grows with the run, the data set or the model: metrics (~1 KB a step), a curriculum's
# history, --fsdp's shard index
LARGE_BYTES = 1 << 30
# state.pt besides that: AdamW's two moments and float32 master weights, 12 bytes a parameter, are
# 6x bf16 weights (2x float32 ones)
STATE_PER_WEIGHT_BYTE = 8


class Unreadable(OSError):
    """A file the reader refuses; str(): 'PATH: why'."""

    def __str__(self):
        return f"{self.filename}: {self.strerror}"


def _refuse(path, st, cap, hint):
    """Unreadable unless st is a regular file of at most cap bytes (None: any size)."""
    why = None
    if not stat.S_ISREG(st.st_mode):
        why = f"not a regular file ({file_kind(st.st_mode)})"
    elif cap is not None and st.st_size > cap:
        why = f"{st.st_size:,} bytes, over the {cap:,} such a file may hold"
    if why:
        raise Unreadable(errno.EINVAL, why + (f": {hint}" if hint else ""), path)


NOT_THROUGH_A_LINK = "a symlink: a run's or study's own files are never read through a link"


def open_regular(path, cap=None, hint="", follow=True):
    """path opened for reading if a regular file of at most cap bytes: a FIFO never ends, a link
    to /dev/zero never stops. Checked before the open and on what was opened. follow=False: a
    run's or study's own file, never read through a link planted in its place."""
    st = os.stat(path) if follow else os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise Unreadable(errno.ELOOP, NOT_THROUGH_A_LINK, path)
    _refuse(path, st, cap, hint)  # a device is not even opened
    # O_NONBLOCK: a FIFO swapped in since returns at once
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
                 | (0 if follow else os.O_NOFOLLOW))
    try:
        _refuse(path, os.fstat(fd), cap, hint)
    except OSError:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def file_kind(mode):
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a device")


def read_file(path, cap, follow=True):
    """path's bytes, through open_regular."""
    with open_regular(path, cap, follow=follow) as f:
        data = f.read(min(os.fstat(f.fileno()).st_size, cap) + 1)  # a buffer of the file's size
    if len(data) > cap:  # grown since the check
        raise Unreadable(errno.EFBIG, f"over the {cap:,} bytes such a file may hold", path)
    return data


def read_json(path, cap=JSON_BYTES, follow=True):
    """path's JSON value, through read_file; ValueError when it is not JSON."""
    try:
        return json.loads(read_file(path, cap, follow))
    except RecursionError:
        raise ValueError("nested too deeply") from None


def check_model_files(folder, follow=True):
    """Every file from_pretrained may read from folder (hub's MODEL_FILES): a regular file within
    its cap, or Unreadable naming it. transformers opens them by name later: checked, not held.
    follow=False: a run's checkpoint (a Hub cache's snapshot is links to its blobs)."""
    for name in sorted(os.listdir(folder)):
        if not any(fnmatch.fnmatch(name, p) for p in MODEL_FILES + ["*.bin"]):
            continue
        weights = name.endswith((".safetensors", ".bin"))  # any size: the memory plan's business
        path = os.path.join(folder, name)
        st = os.stat(path) if follow else os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            raise Unreadable(errno.ELOOP, NOT_THROUGH_A_LINK, path)
        _refuse(path, st, None if weights else MODEL_FILE_BYTES, "")


def read_jsonl(path, follow=True):
    """(line number, object) pairs; ValueError 'FILE:LINE: why'."""
    with open_regular(path, hint="give a jsonl file", follow=follow) as f:
        lineno = 0
        while raw := f.readline(MAX_LINE_BYTES + 1):
            lineno += 1
            rec = _json_line(raw, f"{path}:{lineno}")
            if rec is not None:
                yield lineno, rec


def _json_line(raw, where):
    if len(raw) > MAX_LINE_BYTES:
        raise ValueError(f"{where}: a line over {MAX_LINE_BYTES >> 20} MiB (one record a line)")
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} "
                         f"at column {e.start + 1})") from None
    if not line.strip():
        return None
    try:  # an error at the end stays on its line
        rec = json.loads(line.rstrip("\r\n"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg.removesuffix(' at')} at column "
                         f"{e.colno})") from None
    except RecursionError:
        raise ValueError(f"{where}: invalid JSON (nested too deeply)") from None
    except ValueError as e:  # past Python's digit limit
        raise ValueError(f"{where}: invalid JSON ({e})") from None
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    return rec
