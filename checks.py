"""
checks.py: what guards train.py's flags before anything is loaded or written: each numeric flag's
range, the clipping bounds, the model folder, the budgets against the model's context, the code
sandbox, what the sampler can run (config_problem on a config.json, check_supported on a loaded
model), and the state --resume reads back (check_resumed_state, check_optimizer_state,
resumed_curriculum). config.get_args calls check_model_dir and check_args; train.load_model
calls model_config and weight_elements before a layer is built, and every entry point's
checked_prompt_ids measures the prompts against the context before they are tokenized and after;
each failure is one line.
"""
import glob
import json
import math
import os
import re
import sys

import torch
from transformers import CONFIG_MAPPING, GenerationConfig
from transformers.activations import ACT2FN

from data import format_prompt, prompts_ids, special_tokens
from hub import one_line, resolve_model
from loss import clip_eps
from runs import check_model_files, check_resume, open_regular, read_json
from sandbox import bwrap_ready, not_ready_reason

# what each numeric flag may be, besides finite (a negative --temperature once trained to 0.000)
MAX_SECONDS = 1e7  # past this, waits overflow their clocks
POSITIVE, AT_LEAST_0 = (lambda v: v > 0, "positive"), (lambda v: v >= 0, ">= 0")
SECONDS = (lambda v: 0 < v <= MAX_SECONDS, f"in (0, {MAX_SECONDS:g}] seconds")
FLAG_RANGES = {
    **dict.fromkeys(("prompts", "samples", "think_budget", "answer_budget", "steps", "eval_every",
                     "eval_samples", "slots", "max_lag", "bucket_mb", "warmup", "max_empty_steps",
                     "max_bad_steps", "log_every", "keep", "val_size", "temperature", "lr",
                     "adam_eps", "eps_high"), POSITIVE),
    **dict.fromkeys(("neg_trust", "micro_tokens", "grad_clip", "save_every", "l_max",
                     "l_cache", "gen_ranks", "weight_decay", "eps_low"), AT_LEAST_0),  # 0: --help
    "timeout": SECONDS, "heartbeat_timeout": SECONDS,
    "seed": (lambda v: 0 <= v < 2 ** 63, "in [0, 2^63)"),
    "gen_memory": (lambda v: 0 < v <= 1, "a fraction of the device memory, in (0, 1]"),
}


def check_args(args, error):
    """Flag values that would fail late or train silently wrong -> error(one line)."""
    for name, (ok, what) in FLAG_RANGES.items():
        value = getattr(args, name)
        if value is not None and (not ok(value) or abs(value) == math.inf):
            error(f"--{name} must be {what} and finite, got {value}")
    check_clip_bounds(args, error)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        error(f"--device {args.device}: " +
              ("this PyTorch build has no CUDA (a CPU wheel); install the CUDA build"
               if torch.version.cuda is None else "no CUDA device is visible"))
    if args.resume and args.overwrite:
        error("--resume continues the run in --out and --overwrite deletes it: give one of them")
    if args.model_dir and os.path.isfile(os.path.join(args.model_dir, "config.json")):
        try:
            context = model_json(args.model_dir, "config.json").get("max_position_embeddings")
        except ValueError:  # check_model_dir said why
            context = None
        if (why := context_error(args, context)):
            error(why)


def context_error(args, context, prompt_len=0, phrase_len=0, prompt=None):
    """The longest prompt, the budgets and the interruption phrase against the model's context
    -> a one-line error, or None (prompt_len 0: not tokenized yet; prompt: what names the prompt,
    in place of "the longest prompt (N tokens)"). A prompt that leaves no room for a token of each
    budget is named alone: no budget would make it fit."""
    need = prompt_len + args.think_budget + args.answer_budget + phrase_len
    if context is None or need <= context:
        return None
    model = f"the model's context (max_position_embeddings {context})"
    named = prompt or f"the longest prompt ({prompt_len} tokens)"
    phrase = f" + the interruption phrase ({phrase_len})" if phrase_len else ""
    room = context - prompt_len - phrase_len
    if prompt_len and room < 2:
        with_phrase = f" with the interruption phrase ({phrase_len})" if phrase_len else ""
        return (f"{named} does not fit {model}{with_phrase}, whatever the budgets: shorten or drop "
                "that prompt")
    budgets = f"--think_budget {args.think_budget} + --answer_budget {args.answer_budget}"
    return (f"{named + ' + ' if prompt_len else ''}{budgets}{phrase} = {need} tokens: more than "
            f"{model}; lower the budgets" + (f" to {room} tokens together at most, or shorten that "
                                             "prompt" if prompt_len else ""))


# pre-tokenizers that keep every character of the text (some drop whitespace or a delimiter)
KEEPING = ("ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "UnicodeScripts")


def token_floor(tokenizer):
    """-> text -> the fewest tokens the tokenizer can make of it, known without tokenizing it: a
    token stands for at most as many characters as the longest in the vocabulary, once normalized
    as the tokenizer does; None where no such floor holds (a pre-tokenizer that drops characters, an
    unknown-token that swallows a run of them)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = getattr(backend, "model", None)
    if type(model).__name__ != "BPE" or (model.unk_token and model.fuse_unk
                                         and not model.byte_fallback):
        return None

    def keeps(pre):
        if pre.get("type") == "Sequence":
            return all(map(keeps, pre["pretokenizers"]))
        return pre.get("type") in KEEPING and pre.get("behavior") not in ("Removed", "removed")

    if backend.pre_tokenizer and not keeps(json.loads(backend.pre_tokenizer.__getstate__())):
        return None
    longest, norm = max(map(len, tokenizer.get_vocab())), backend.normalizer
    return lambda text: -(-len(norm.normalize_str(text) if norm else text) // longest)


def prompt_error(args, tokenizer, problems, context, phrase_len):
    """A prompt that cannot fit the model's context, known from its characters in the chat
    template before any is tokenized -> one line naming where it was read, or None."""
    floor = token_floor(tokenizer) if context else None
    for p in problems if floor else ():
        text = format_prompt(tokenizer, p["prompt"], p.get("domain"))
        least = floor(text)
        named = (f"{prompt_name(p)} ({len(text):,} characters with its template: at least {least} "
                 "tokens)")
        if (why := context_error(args, context, least, phrase_len, named)):
            return why
    return None


def prompt_name(problem):
    """'the prompt at FILE:LINE', where it was read, else its first characters (quoted)."""
    where = getattr(problem, "where", None)
    return f"the prompt {f'at {where}' if where else repr(problem['prompt'][:40])}"


def checked_prompt_ids(args, tokenizer, model, problems):
    """Every entry point's prompts against the model's context: measured from their characters
    before any is tokenized (prompt_error), then counted -> their token ids. One that does not fit
    with the budgets exits with one line naming where it was read."""
    context = getattr(model.config, "max_position_embeddings", None)
    phrase_len = len(special_tokens(tokenizer)["interrupt_ids"])
    if (why := prompt_error(args, tokenizer, problems, context, phrase_len)):
        sys.exit(f"error: {why}")
    ids = prompts_ids(tokenizer, [p["prompt"] for p in problems],
                      [p.get("domain") for p in problems])
    if ids:
        n, longest = max(zip(map(len, ids), problems), key=lambda x: x[0])
        if (why := context_error(args, context, n, phrase_len,
                                 f"{prompt_name(longest)} ({n} tokens)")):
            sys.exit(f"error: {why}")
    return ids


def check_clip_bounds(args, error):
    """--eps_low / --eps_high as loss.py reads them: CISPO's are bounds on the ratio."""
    low, high = clip_eps(args.loss, args.eps_low, args.eps_high)
    if args.loss == "cispo" and low is not None and low >= high:
        error(f"--eps_low {low} must be below --eps_high {high} (CISPO: bounds on the ratio)")
    if args.loss != "cispo" and low > 1:
        error(f"--eps_low {low}: {args.loss} clips the ratio at 1 - eps_low, which must be >= 0")


SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")
SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings")
ROPE = ("rope_theta", "factor", "original_max_position_embeddings", "low_freq_factor",
        "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "partial_rotary_factor")


def model_json(folder, name, missing=None):
    """A model folder's JSON file, through the one reader (runs.read_json, capped) -> its object
    (`missing` if there is none); ValueError 'NAME: why', one line."""
    path = os.path.join(folder, name)
    if missing is not None and not os.path.lexists(path):
        return missing
    try:
        obj = read_json(path)
    except OSError as err:
        raise ValueError(f"{name}: {err.strerror or err}") from None
    except ValueError as err:  # UnicodeDecodeError too
        why = "nested too deeply" if str(err) == "nested too deeply" else one_line(err)
        raise ValueError(f"{name}: not JSON a model folder holds ({why})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{name}: a JSON {type(obj).__name__}, not an object")
    return obj


def whole(v):
    return isinstance(v, int) and not isinstance(v, bool)


def ids_problem(cfg, vocab):
    """Token ids (a config's, a generation_config's) outside the vocabulary -> 'FIELD is ...'."""
    for k in ("bos_token_id", "eos_token_id"):
        ids = cfg.get(k) if isinstance(cfg.get(k), list) else [cfg.get(k)]
        if any(i is not None and not (whole(i) and 0 <= i < vocab) for i in ids):
            return f"{k} is {cfg.get(k)!r}, not an id below vocab_size {vocab}"
    return None


def window_problem(cfg):
    """Sliding-window attention the sampler and trainer do not run (they attend to every earlier
    token), as transformers reads each model_type's config -> 'FIELD is ...', or None."""
    kind, layers = cfg.get("model_type"), cfg.get("num_hidden_layers")
    if kind == "mistral":  # every layer, MistralConfig's default window 4096
        window, sliding = cfg.get("sliding_window", 4096), True
    elif kind in ("qwen2", "qwen3"):  # layers from max_window_layers on, unless layer_types says
        window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window") else None
        types = cfg.get("layer_types")
        if types is None:
            above = cfg.get("max_window_layers", 28)
            sliding = window is not None and not (whole(above) and layers and above >= layers)
        elif not isinstance(types, list):
            return f"layer_types is {types!r}, not a list of each layer's attention"
        elif layers and len(types) != layers:
            return f"layer_types has {len(types)} entries, not num_hidden_layers {layers}"
        else:
            odd = [(i, t) for i, t in enumerate(types)
                   if t not in ("full_attention", "sliding_attention")]
            if odd:
                return (f"layer_types[{odd[0][0]}] is {odd[0][1]!r}: the sampler and trainer run "
                        "full_attention (and sliding_attention within its window) only")
            sliding = "sliding_attention" in types
    else:
        return None
    context = cfg.get("max_position_embeddings")
    if not sliding or (window is None and kind == "mistral"):
        return None
    if not (whole(window) and window >= 1):
        return f"sliding_window is {window!r}, not a whole number >= 1"
    if context is None or window < context:
        return (f"sliding_window {window} is below max_position_embeddings {context}: the sampler "
                "and trainer attend to every earlier token (full attention); set "
                f"max_position_embeddings to at most {window} to run it")
    return None


def config_problem(cfg):
    """What in a config.json dict the sampler cannot run -> 'FIELD is ...', or None."""
    for k in SIZES:
        if cfg.get(k) is not None and not (whole(cfg[k]) and cfg[k] >= 1):
            return f"{k} is {cfg[k]!r}, not a whole number >= 1"
    heads = cfg.get("num_attention_heads") or 1
    kv = cfg.get("num_key_value_heads") or heads
    if heads % kv:
        return f"num_key_value_heads {kv} does not divide num_attention_heads {heads}"
    nested = [(f"{d}.", cfg[d]) for d in ("rope_parameters", "rope_scaling")
              if isinstance(cfg.get(d), dict)]
    for prefix, d in [("", cfg)] + nested:
        for k in ROPE:
            v = d.get(k)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool)
                                      and 0 < v < float("inf")):
                return f"{prefix}{k} is {v!r}, not a finite number > 0"
    if not isinstance(act := cfg.get("hidden_act", "silu"), str) or act not in ACT2FN:
        return (f"hidden_act is {act!r}, not an activation transformers has "
                f"({', '.join(sorted(ACT2FN))})")
    for k in ("dtype", "torch_dtype"):
        if cfg.get(k) not in (None, "auto") and not (
                isinstance(cfg[k], str) and isinstance(getattr(torch, cfg[k], None), torch.dtype)):
            return f"{k} is {cfg[k]!r}, not a torch dtype (bfloat16, float16, float32)"
    return ids_problem(cfg, cfg.get("vocab_size") or float("inf")) or window_problem(cfg)


def generation_problem(gen, vocab):
    """What in a generation_config.json dict transformers refuses or the sampler cannot use ->
    'FIELD is ...', or None."""
    def refusal(fields):
        try:
            GenerationConfig.from_dict(fields)
        except Exception as err:  # its checks raise TypeError, ValueError, ...
            return one_line(err)
        return None

    if (problem := ids_problem(gen, vocab)) or not (why := refusal(gen)):
        return problem
    field = next((k for k in gen if refusal({k: gen[k]})), None)
    return f"{field} is {gen[field]!r}: {why}" if field else why


def model_config(folder):
    """config.json and generation_config.json, checked as transformers will read them -> the
    config the model is built from; ValueError 'FILE: FIELD is ...', one line."""
    cfg = model_json(folder, "config.json")
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED:
        raise ValueError(f"model_type {model_type!r} is not supported by the sampler "
                         f"({', '.join(SUPPORTED)})")
    if problem := config_problem(cfg):
        raise ValueError(f"config.json: {problem}")
    try:
        config = CONFIG_MAPPING[model_type].from_dict(cfg)
    except Exception as err:  # transformers' own checks of each field: several kinds of error
        raise ValueError(f"config.json: {one_line(err)}") from None
    gen = model_json(folder, "generation_config.json", missing={})
    if problem := generation_problem(gen, config.vocab_size):
        raise ValueError(f"generation_config.json: {problem}")
    return config


def check_supported(model):
    """A loaded model the sampler cannot run (generate.Decoder) -> ValueError, one line."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED:
        raise ValueError(f"model_type '{cfg.model_type}' is not supported by the sampler; "
                         f"supported: {', '.join(SUPPORTED)}")
    problem = config_problem(cfg.to_dict())
    if problem:
        raise ValueError(f"config.json: {problem}")
    rope = model.model.rotary_emb.rope_type
    if "dynamic" in rope or rope == "longrope":  # length-dependent frequencies
        raise ValueError(f"rope_type '{rope}' is not supported by the sampler "
                         "(its rotary tables are fixed)")


def check_model_dir(path, error):
    """--model (a folder, or a Hub id resolved into the cache) -> the folder to load, checked to
    be one the sampler runs; "" without --model."""
    if not path:
        return ""
    try:
        folder = resolve_model(path)
    except ValueError as err:
        error(f"--model {err}")
        return ""
    name = path if folder == path else f"{path} ({folder})"
    try:
        check_model_files(folder)
    except OSError as err:
        error(f"--model {name}: {err}")
        return folder
    if not os.path.isfile(os.path.join(folder, "config.json")):
        error(f"--model {name}: no config.json there (a Hugging Face model folder is expected)")
        return folder
    if not (glob.glob(os.path.join(folder, "*.safetensors")) +
            glob.glob(os.path.join(folder, "*.bin"))):
        error(f"--model {name}: no weights (*.safetensors or *.bin) in the folder")
    try:
        model_config(folder)
    except ValueError as err:
        error(f"--model {name}: {err}")
    return folder


SAFETENSORS_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def safetensors_elements(folder, name):
    """A .safetensors file's tensor elements, its header read and checked against the file's
    size (an interrupted copy) -> int; ValueError 'NAME: why', one line."""
    again = "; copy it again"
    try:
        with open_regular(os.path.join(folder, name)) as f:
            size = os.fstat(f.fileno()).st_size
            n = int.from_bytes(f.read(8), "little")
            raw = f.read(n) if 8 + n <= size and n <= SAFETENSORS_HEADER_BYTES else None
    except OSError as err:
        raise ValueError(f"{name}: {err.strerror or err}") from None
    if raw is None:
        raise ValueError(f"{name}: its header is cut short ({size} bytes in all): an interrupted "
                         f"download?{again}")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError, JSONDecodeError too
        raise ValueError(f"{name}: its header is not a safetensors header{again}") from None
    spans, elements = [], 0
    for key, t in header.items() if isinstance(header, dict) else [("", None)]:
        if key == "__metadata__":
            continue
        shape, span = (t.get("shape"), t.get("data_offsets")) if isinstance(t, dict) else (0, 0)
        if isinstance(t, dict) and t.get("dtype") not in DTYPE_BYTES:
            raise ValueError(f"{name}: tensor {key[:80]!r} is {str(t.get('dtype'))[:20]!r}, a "
                             f"dtype the sampler does not load ({', '.join(DTYPE_BYTES)})")
        if not (isinstance(shape, list) and all(whole(d) and d >= 0 for d in shape)
                and isinstance(span, list) and len(span) == 2 and all(map(whole, span))
                and span[1] - span[0] == math.prod(shape) * DTYPE_BYTES[t["dtype"]]):
            raise ValueError(f"{name}: tensor {key[:80]!r} in its header has no valid shape and "
                             f"offsets{again}")
        spans.append(span)
        elements += math.prod(shape)
    end = 0
    for begin, stop in sorted(spans):
        if begin != end:
            raise ValueError(f"{name}: its tensors overlap or leave gaps{again}")
        end = stop
    if end != size - 8 - n:
        raise ValueError(f"{name}: holds {size - 8 - n:,} bytes of tensor data where its header "
                         f"lists {end:,}: " + ("cut short (an interrupted download?)"
                                               if end > size - 8 - n else "bytes past its tensors")
                         + again)
    return elements


def weight_elements(folder):
    """The parameters a model folder's weight files hold, each .safetensors header checked ->
    (count, unit): (elements, "") from safetensors, (bytes, " bytes") from torch pickles, whose
    size alone is read (a parameter takes at least a byte); ValueError, one line."""
    index = model_json(folder, "model.safetensors.index.json", missing={})
    shards = index.get("weight_map") if index else (
        {"": "model.safetensors"} if os.path.lexists(os.path.join(folder, "model.safetensors"))
        else {})
    if not isinstance(shards, dict) or not all(
            isinstance(f, str) and os.path.basename(f) == f and f not in ("", ".", "..")
            for f in shards.values()):
        raise ValueError("model.safetensors.index.json: its weight_map must name files in the "
                         "model folder")
    if files := sorted(set(shards.values())):
        return sum(safetensors_elements(folder, f) for f in files), ""
    return sum(os.path.getsize(f) for f in glob.glob(os.path.join(folder, "*.bin"))), " bytes"


def check_code_rewards(args, problems):
    """Code problems need the bwrap sandbox, or --unsafe_code_exec."""
    if not any(p.get("domain") == "code" for p in problems):
        return
    if not args.unsafe_code_exec and not bwrap_ready():
        sys.exit(f"error: {not_ready_reason()}")
    print("code rewards: " +
          ("--unsafe_code_exec: resource limits only, no isolation; a program can forge its reward"
           if args.unsafe_code_exec else "each program in its own bwrap sandbox"))


# -----------------------------------------------------------------------------
# resumed state (--resume): what a run folder holds is an input like any other

MISSING, WHOLE = object(), "a whole number"
ADAM = ("step", "exp_avg", "exp_avg_sq")  # AdamW's state per parameter (amsgrad is never on)


def check_resumed_state(state, path, step, args, n_train):
    """state.pt as runs.load_state read it (train.save wrote it), before any rank waits: each value
    the resume reads, by type and range, and its flags against these (runs.check_resume) -> one
    line naming the file and field. The optimizer's tensors meet the model in
    check_optimizer_state."""
    try:
        if not isinstance(state, dict):
            raise ValueError(f"it holds {_a(state)}, expected a dict")
        _check_args(state.get("args", {}))
        check_resume(state.get("args", {}), args)  # another data set: said before its curriculum
        _need(state.get("step", MISSING), "step", WHOLE, lambda v: v == step,
              f"{step} (the step its folder names)")
        for name, kind in (("compute_s", float), ("flops", float), ("empty_steps", WHOLE)):
            if name in state:  # older runs saved none
                _need(state[name], name, kind, lambda v: v >= 0,
                      ("a number" if kind is float else kind) + " >= 0")
        rng = torch.get_rng_state()
        _need(state.get("torch_rng", MISSING), "torch_rng", torch.Tensor,
              lambda v: v.dtype == rng.dtype and v.shape == rng.shape,
              f"torch's RNG state, a {rng.dtype} tensor of shape {tuple(rng.shape)}")
        _check_scheduler(state.get("scheduler", MISSING), step)
        if args.fsdp and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # train.make_trainer's test
            _need(state.get("shards", MISSING), "shards", str, lambda v: v == "shards",
                  "'shards' (a run of --fsdp resumes AdamW from the checkpoint's shards/)")
        else:
            _need(state.get("optimizer", MISSING), "optimizer", dict,
                  what="a dict (a run of --fsdp keeps it in shards/: resume it with --fsdp)")
        if "curriculum" in state:  # one process; generator ranks': curricula, by rank
            _check_curriculum(state["curriculum"], n_train, "curriculum.")
        if "curricula" in state:  # each generator checks its own (resumed_curriculum)
            _need(state["curricula"], "curricula", dict, what="a dict of generators' curricula")
    except ValueError as err:
        sys.exit(f"error: --resume: {path}: {err}")


def resumed_curriculum(ckpt, state, rank, n):
    """A generator rank's curriculum for its n prompts from the checkpoint it resumes (state.pt's
    curricula, which trainer 0 saved) -> the saved state, checked (one line naming the field); None
    when there is none, said in one line."""
    if not ckpt:
        return None
    saved = state.get("curricula", {}).get(str(rank))
    if saved is None:
        print(f"generator rank {rank}: --resume: {ckpt}/state.pt holds no curriculum of this "
              "generator (saved by an older train.py, or with other --gen_ranks): it starts a "
              "fresh one, with no No-Positive-Resampling history of its prompts", flush=True)
        return None
    try:
        _check_curriculum(saved, n, f"curricula.{rank}.")
    except ValueError as err:
        sys.exit(f"error: --resume: {ckpt}/state.pt: {err}")
    return saved


def check_optimizer_state(state, path, model):
    """check_resumed_state's state against the loaded model: AdamW's state and the float32 master
    weights hold one tensor of the stepped shape and dtype per parameter -> one line naming the
    field."""
    if state.get("optimizer") is None:  # --fsdp: in shards/, which dcp loads against the shards
        return
    params = list(model.parameters())
    n, half = len(params), params[0].dtype in (torch.bfloat16, torch.float16)
    stepped = [torch.float32 if half else p.dtype for p in params]  # trainer.master_weights
    try:
        if half and state.get("master") is not None:
            _need(state["master"], "master", list, lambda v: len(v) == n,
                  f"a list of {n} tensors, one per parameter")
            for i, (p, m) in enumerate(zip(params, state["master"])):
                _need_tensor(m, f"master.{i}", p.shape, torch.float32)
        opt = state["optimizer"]
        groups = _need(opt.get("param_groups", MISSING), "optimizer.param_groups", list,
                       lambda v: len(v) == 1, "a list of one group (train.py's AdamW)")
        _need(groups[0], "optimizer.param_groups.0", dict)
        _need(groups[0].get("params", MISSING), "optimizer.param_groups.0.params", list,
              lambda v: v == list(range(n)), f"the parameters' indices 0 to {n - 1}")
        for i, entry in _need(opt.get("state", MISSING), "optimizer.state", dict,
                              lambda v: set(v) <= set(range(n)),
                              f"a dict whose keys are parameter indices below {n}").items():
            name = f"optimizer.state.{i}"
            _need(entry, name, dict, lambda v: set(v) == set(ADAM),
                  f"a dict of {', '.join(ADAM)} (AdamW's)")
            _need_tensor(entry["exp_avg"], f"{name}.exp_avg", params[i].shape, stepped[i])
            _need_tensor(entry["exp_avg_sq"], f"{name}.exp_avg_sq", params[i].shape, stepped[i])
            if (entry["exp_avg_sq"] < 0).any():
                raise ValueError(f"field {name}.exp_avg_sq holds values < 0, expected squares >= 0")
            _need_tensor(entry["step"], f"{name}.step", (), torch.float32)
            _need(entry["step"].item(), f"{name}.step", float,
                  lambda v: v == int(v) and 0 <= v <= state["step"],
                  f"a count of AdamW's updates in [0, {state['step']}]")
    except ValueError as err:
        sys.exit(f"error: --resume: {path}: {err}")


def _need(value, name, kind=float, ok=None, what=None):
    """value -> itself if of kind (float: a finite number, WHOLE: an int, or a type) and ok(value);
    else ValueError 'field NAME is ..., expected WHAT'."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    typed = (number and math.isfinite(value) if kind is float else
             number and isinstance(value, int) if kind is WHOLE else isinstance(value, kind))
    if typed and (ok is None or ok(value)):
        return value
    shown = ("missing" if value is MISSING else "None" if value is None else
             _number(value) if number else _a(value))
    what = what or ("a number" if kind is float else WHOLE if kind is WHOLE else
                    f"a {kind.__name__}")
    raise ValueError(f"field {name} is {shown}, expected {what}")


def _a(value):
    """'a str', 'an int': a value's type, never the value (a control character)."""
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _number(v):
    return repr(v) if not isinstance(v, int) or v.bit_length() <= 64 else "a 65+ bit number"


def _key(name, k):
    """NAME.K for a key that is a short identifier (never a control character), else NAME."""
    return f"{name}.{k}" if isinstance(k, str) and k.isidentifier() and len(k) <= 64 else name


def _need_tensor(t, name, shape, dtype):
    if not (isinstance(t, torch.Tensor) and t.dtype == dtype and t.shape == shape):
        shown = _tensor(t.dtype, t.shape) if isinstance(t, torch.Tensor) else _a(t)
        raise ValueError(f"field {name} is {shown}, expected {_tensor(dtype, shape)}")
    if not torch.isfinite(t).all():
        raise ValueError(f"field {name} holds values that are not finite")


def _tensor(dtype, shape):
    return f"a {str(dtype).removeprefix('torch.')} tensor of shape {tuple(shape)}"


def _check_args(saved):
    """The flags the run started with (runs.check_resume compares and prints them)."""
    _need(saved, "args", dict)
    for k, v in saved.items():
        if not isinstance(k, str):
            raise ValueError(f"field args holds a key that is {_a(k)}, expected flag names")
        _need(v, _key("args", k), (str, int, float, bool, type(None)),
              what="a flag's value (a string, number, bool or None)")


def _check_scheduler(saved, step):
    """The warm-up's LambdaLR state: its load copies each key into the scheduler object, so only
    the keys, and their types, that a LambdaLR of this torch saves."""
    own = torch.optim.lr_scheduler.LambdaLR(torch.optim.AdamW([torch.zeros(1)]),
                                            lambda s: 1.0).state_dict()
    for k, v in _need(saved, "scheduler", dict).items():
        name = _key("scheduler", k)
        if k not in own:
            raise ValueError(f"field {name} is not a field of torch's LambdaLR ({', '.join(own)})")
        _need(v, name, type(own[k]))
    for k in ("base_lrs", "_last_lr"):
        for v in saved.get(k, []):
            _need(v, f"scheduler.{k}", float, lambda v: v >= 0, "a list of rates >= 0")
    if any(f is not None for f in saved.get("lr_lambdas", [])):
        raise ValueError("field scheduler.lr_lambdas holds values, expected None (train.py's "
                         "warm-up keeps no state)")
    _need(saved.get("last_epoch", MISSING), "scheduler.last_epoch", WHOLE,
          lambda v: 0 <= v <= step, f"a count of AdamW's updates in [0, {step}]")


def _check_curriculum(saved, n, at=""):
    """A data.Curriculum's state_dict over n prompts: its order a permutation of those not retired
    (and of some retired since), its retired and history among them."""
    _need(saved, at.rstrip(".") or "curriculum", dict)
    field = lambda k: saved.get(k, MISSING)  # noqa: E731
    _need(field("n"), f"{at}n", WHOLE, lambda v: v == n, f"{n} (the prompts it is for)")
    _need(field("seed"), f"{at}seed", WHOLE)
    _need(field("npr"), f"{at}npr", bool)
    _need(field("threshold"), f"{at}threshold", float, lambda v: 0 < v <= 1,
          "a pass rate in (0, 1]")
    _need(field("epoch"), f"{at}epoch", WHOLE, lambda v: v >= 0, "a whole number >= 0")
    for name in ("order", "retired"):
        seen = set()
        for i in _need(field(name), f"{at}{name}", list, what="a list of prompt indices"):
            if not (isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n) or i in seen:
                shown = _number(i) if isinstance(i, (int, float)) else _a(i)
                raise ValueError(f"field {at}{name} holds {shown}{' twice' if i in seen else ''}"
                                 f", expected distinct prompt indices below {n}")
            seen.add(i)
    missed = set(range(n)) - set(saved["order"]) - set(saved["retired"])
    if missed:
        raise ValueError(f"field {at}order misses {min(missed)} (not retired): expected a "
                         f"permutation of the {n} prompts' indices")
    _need(field("pos"), f"{at}pos", WHOLE, lambda v: 0 <= v <= len(saved["order"]),
          f"a place in order, in [0, {len(saved['order'])}]")
    for k, rates in _need(field("history"), f"{at}history", dict).items():
        index = int(k) if isinstance(k, str) and re.fullmatch(r"[0-9]{1,18}", k) else None
        if index is None or index >= n:
            held = f"prompt {index}" if index is not None else "a key that is no index"
            raise ValueError(f"field {at}history holds {held}, expected prompt indices below {n}")
        name = f"{at}history.{index}"
        for r in _need(rates, name, list, what="a list of pass rates"):
            _need(r, name, float, lambda v: 0 <= v <= 1, "pass rates in [0, 1]")
