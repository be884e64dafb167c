"""params.yaml: loading and validation, with one-line errors naming the bad key.

Each section is checked against ``SCHEMA``: every key present, of the right type, in range; a section the schema
does not know (a misspelled name, silently ignored before) is an error.
"""

from __future__ import annotations

import json
import math
import re

from collections.abc import Callable, Hashable
from pathlib import Path

import yaml

from nv.errors import NVError

Check = tuple[type | tuple[type, ...], Callable[[object], bool] | None, str]


def _one_of(*options) -> Check:
    return (str, lambda v: v in options, f"one of {options}")


_POS_INT: Check = (int, lambda v: v >= 1, ">= 1")
_NONNEG_INT: Check = (int, lambda v: v >= 0, ">= 0")
_POS_NUM: Check = ((int, float), lambda v: v > 0, "> 0")
_BOOL: Check = (bool, None, "")
_STR: Check = (str, lambda v: len(v) > 0, "non-empty")
_PROB: Check = ((int, float), lambda v: 0 < v < 1, "in (0, 1)")
_OPT_POS_INT: Check = ((int, type(None)), lambda v: v is None or v >= 1, ">= 1 or null")
_BUDGETS: Check = (list, lambda v: len(v) > 0 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v),
                   "a non-empty list of ints >= 1")
_TEMPERATURES: Check = (list, lambda v: len(v) > 0 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                          and 0 < x < math.inf for x in v), "a non-empty list of finite numbers > 0")

_FRACTION: Check = ((int, float), lambda v: 0 <= v < 0.5, "in [0, 0.5)")
_D_HAT: Check = ((str, int), lambda v: v == "phase1" or (isinstance(v, int) and v >= 1), "'phase1' or an int >= 1")


def _opt(types, ok: Callable[[object], bool], rule: str) -> Check:
    """A knob that is null (off) or a value of ``types`` satisfying ``ok``."""
    return ((*types, type(None)), lambda v: v is None or ok(v), f"null or {rule}")


# what every request of the attack sets itself (nv.oracle.http's body): live.extra_body may add fields, not change these
REQUEST_FIELDS = {"model", "max_tokens", "max_completion_tokens", "min_tokens", "temperature", "messages", "prompt",
                  "logprobs", "top_logprobs", "n", "best_of", "use_beam_search", "echo", "logit_bias", "seed", "stream"}


def _plain_json(value) -> bool:
    """Sendable as a request body: JSON with string keys (YAML reads ``on:``, ``no:`` or ``1:`` as others) and no
    dates, NaN or other YAML-only values."""
    def string_keys(v) -> bool:
        if isinstance(v, dict):
            return all(isinstance(k, str) and string_keys(x) for k, x in v.items())
        return all(string_keys(x) for x in v) if isinstance(v, list) else True

    if not string_keys(value):
        return False
    try:
        json.dumps(value, allow_nan=False)
        return True
    except (TypeError, ValueError):
        return False


class EachOf(dict):
    """Schema of a mapping whose every value (e.g. one reference model) follows the same schema,
    or one of the ``alternatives`` (chosen by its exact set of keys)."""

    def __init__(self, schema: dict, *alternatives: dict) -> None:
        super().__init__(schema)
        self.alternatives = (dict(schema), *alternatives)

    def schema_for(self, name: str, entry: dict) -> dict:
        if len(self.alternatives) == 1:
            return self.alternatives[0]
        match = next((a for a in self.alternatives if set(a) == set(entry)), None)
        if match is None:
            options = " or ".join("{" + ", ".join(a) + "}" for a in self.alternatives)
            raise NVError(f"params: '{name}' must have exactly the keys {options}, got {{{', '.join(entry)}}}")
        return match


class StageItems(EachOf):
    """``EachOf`` whose keys name DVC ``foreach`` items: DVC reads a dot in a params path as nesting."""


class Platforms(EachOf):
    """``EachOf`` whose keys are timing platforms (the first is the reference platform)."""

    names = ("inprocess", "llamacpp")


_SHAPE = {"d": _POS_INT, "L": _POS_INT, "n_kv_heads": _POS_INT, "d_ffn": _POS_INT}  # a random-weight reference's shape
HEAD_DIM = 64  # its head size unless the entry sets head_dim: nv.models.reference_family.HEAD_DIM (timing stages do not import params)



# the timing protocol (§4.2, App. D): one platform's settings, and the rest of params.yaml's timing section; a
# calibration file copies r, trials and the rest (``check_timing_protocol``)
_PLATFORM = {"r": _POS_NUM, "trials": (int, lambda v: v >= 2, ">= 2"), "threads": _POS_INT,
             "references": ((str, list), lambda v: v == "all" or (isinstance(v, list) and len(v) > 0 and all(isinstance(x, str) for x in v)
                                                                  and len(set(v)) == len(v)),
                            "'all' or a non-empty list of distinct timing_family names")}
_PROTOCOL = {"warmups": (int, lambda v: v >= 2, ">= 2 (two calibrate the prompt length)"), "trim": _FRACTION,
             "n_lengths": (int, lambda v: v >= 2, ">= 2"), "discard": _NONNEG_INT, "kv_ratio": _POS_NUM, "ffn_ratio": _POS_NUM}

SCHEMA: dict[str, dict] = {
    "model": {
        "spec": _STR,
        "dtype": _one_of("bfloat16", "float32"),
        "device": _one_of("auto", "cpu", "cuda"),
        "template": _BOOL,
        "logprobs": _one_of("processed", "raw"),
        "logits": _one_of("bfloat16", "float32"),
        "argmax_dtype": _one_of("bfloat16", "float32"),
        "batch_size": _POS_INT,
    },
    "model_card": {
        "low_entropy_prompt": _STR,
        "high_entropy_prompt": _STR,
        "temperature": _POS_NUM,
        "top_k": _POS_INT,
    },
    "search": {
        "mode": _one_of("paper", "diverse"),
        "D": _POS_INT,
        "rounds": _POS_INT,
        "batch_size": _POS_INT,
        "explore_rounds": _POS_INT,
        "threshold": _PROB,
        "length": _POS_INT,
    },
    "sampling": {
        "N": ((int, str), lambda v: v == "auto" or (isinstance(v, int) and v >= 1), "an int >= 1 or 'auto'"),
        "N0": _POS_INT,
        "N_max": _POS_INT,
        "growth": ((int, float), lambda v: v > 1, "> 1"),
        "estimator": _one_of("robust", "incomplete"),
        "temperature": _POS_NUM,
        "chunk": _POS_INT,
    },
    "spectrum": {
        "method": _one_of("robust", "paper"),
        "whitebox_prompts": _POS_INT,
        "paper": {"p": _PROB, "g": _POS_INT, "w": _OPT_POS_INT, "w_s": _OPT_POS_INT, "lam_sad": _POS_NUM, "lam_peak": _POS_NUM},
        "robust": {"g": _POS_INT, "z_min": _POS_NUM, "min_ratio": ((int, float), lambda v: v >= 1, ">= 1 (sigma_k / sigma_{k+1} >= 1 always: 1 switches the check off)")},
        "incomplete": {"frac": ((int, float), lambda v: 0 < v <= 1, "in (0, 1]"),
                       "rungs": (list, lambda v: len(v) >= 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                                     and 0 < x <= 1 for x in v) and v == sorted(set(v)),
                                 "a list of >= 2 increasing numbers in (0, 1] (saturated only when two rungs agree)"),
                       "tol": _PROB, "max_iters": _POS_INT},
    },
    "sweep": {"budgets": _BUDGETS},
    # the exactness stage (nv.phase1.exactness): the (D, N, tau) grid and the paper's (D, N) for comparison
    "exactness": {
        "D_values": _BUDGETS,
        "N_values": _BUDGETS,
        "temperatures": _TEMPERATURES,
        "validation_temperatures": _TEMPERATURES,
        "paper_budget": (list, lambda v: len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v),
                         "[D, N], two ints >= 1"),
    },
    "live": {
        "chat": _BOOL,
        "n_per_request": _POS_INT,
        "top_logprobs": _NONNEG_INT,
        "extra_body": (dict, lambda v: _plain_json(v) and not set(v) & REQUEST_FIELDS,
                       f"a mapping of plain JSON (string keys: quote 'on', 'no' or numbers; no dates, no NaN) setting none of the attack's own fields "
                       f"({', '.join(sorted(REQUEST_FIELDS))}: the report would describe other requests than were sent)"),
        "columns": (int, lambda v: 1 <= v <= 2**24, "in [1, 2^24]: one column per distinct token (a vocabulary's size)"),
        "prompt_tokens": _POS_INT,
        "concurrency": _POS_INT,
        "rpm": ((int, float), lambda v: v >= 0, ">= 0"),
        "tpm": ((int, float), lambda v: v >= 0, ">= 0"),
        "retries": _NONNEG_INT,
        "backoff": _POS_NUM,
        "timeout": _POS_NUM,
    },
    # the budget planner (nv.phase1.planner): the pilot inside each model's sample, and the tail fit
    "planner": {"pilot_prompts": _POS_INT, "pilot_N": _POS_INT, "min_seen": _POS_INT},
    "sample_complexity": {
        "D_values": _BUDGETS,
        "d_values": _BUDGETS,
        "temperature": _POS_NUM,
        "length": _POS_INT,
        "runs": (int, lambda v: v >= 2, ">= 2"),
        "delta": _PROB,
        "grid_points": (int, lambda v: v >= 2, ">= 2"),
    },
    "carlini_baseline": {
        "n_prompts": _POS_INT,
        "length": _POS_INT,
        "bias": ((int, float), lambda v: v < 0, "< 0"),
        "precisions": (list, lambda v: len(v) > 0 and all(x in ("float32", "bfloat16") for x in v),
                       "a non-empty list of 'float32' / 'bfloat16'"),
        "max_rel_error": _POS_NUM,
    },
    "timing": {"platforms": Platforms(_PLATFORM), **_PROTOCOL},
    "timing_target": {"p_max": _POS_INT, "d_hat": _D_HAT},
    "overall": {"trials": _BUDGETS, "estimator": _one_of("robust", "paper", "incomplete")},
    # nv.oracle.defence: what the provider switches on (null = off)
    "defence": {
        "round_decimals": _opt((int,), lambda v: 0 <= v <= 15,
                               "an int in [0, 15] (above 15 a float64 log-prob is unchanged: it defends nothing)"),
        "round_format": _opt((str,), lambda v: v in ("fp16", "bf16", "fp8_e4m3"), "one of ('fp16', 'bf16', 'fp8_e4m3')"),
        # a setting that defends nothing (noise 0, top_p 1, min_p 0, no delay, buckets of 1 token) is refused: a
        # provider reading "the attack survives" must have switched something on; null switches a knob off
        "noise_sigma": _opt((int, float), lambda v: 0 < v < math.inf, "a finite number > 0 (0 defends nothing)"),
        "min_logprob": _opt((int, float), lambda v: v <= 0, "a number <= 0"),
        "max_temperature": _opt((int, float), lambda v: v > 0, "a number > 0"),
        "top_k": _opt((int,), lambda v: v >= 1, "an int >= 1"),
        "top_p": _opt((int, float), lambda v: 0 < v < 1, "a number in (0, 1) (1 defends nothing)"),
        "min_p": _opt((int, float), lambda v: 0 < v <= 1, "a number in (0, 1] (0 defends nothing)"),
        "latency_quantum_ms": _opt((int, float), lambda v: 0 < v < math.inf, "a finite number > 0"),
        "delay_uniform_ms": _opt((int, float), lambda v: 0 < v < math.inf, "a finite number > 0 (0 defends nothing)"),
        "delay_exp_ms": _opt((int, float), lambda v: 0 < v < math.inf, "a finite number > 0 (0 defends nothing)"),
        "pad_to_tokens": _opt((int,), lambda v: v >= 2, "an int >= 2 (1 defends nothing)"),
    },
    # the defences stage (nv.defences): knobs swept one at a time, each a list of defence-section values
    "defences": {
        "knobs": (dict, lambda v: len(v) > 0 and all(isinstance(x, list) and len(x) > 0 for x in v.values()),
                  "a non-empty mapping of knob -> non-empty list of settings"),
        "fastest": ((int, float), lambda v: 0 < v <= 1, "in (0, 1]"),
        "L_tolerance": _POS_NUM,
        "price_temperature": _POS_NUM,
        "price_prompts": (list, lambda v: len(v) > 0 and all(isinstance(x, str) and x for x in v), "a non-empty list of prompts"),
    },
    # per model of the validation set (issue 13): its phase-1 budgets and its phase-2 scale
    "validation": {
        "price_usd_per_mtok": _POS_NUM,
        "models": StageItems({
            "spec": _STR,
            "N": _POS_INT,
            "budgets": _BUDGETS,
            "trials": (int, lambda v: v >= 2, ">= 2"),
            "platforms": (list, lambda v: len(v) > 0 and all(x in Platforms.names for x in v),
                          f"a non-empty list of {Platforms.names}"),
            "p_max": _POS_INT,
            "d_hat": _D_HAT,
        }),
    },
    # a random-weight shape (CPU default; heads of 64 unless it sets head_dim), or {spec: a hub id / folder / .gguf}
    # of a real model (GPU profile)
    "timing_family": StageItems(_SHAPE, {"spec": _STR}, {**_SHAPE, "head_dim": _POS_INT}),
}


def check_section(name: str, section: object, where: str = "params") -> dict:
    """Validate one section (recursively) against ``SCHEMA[name]``; return it unchanged. ``where`` begins the
    one-line error of a key's value (``--defence`` for the command line's overrides)."""
    if not isinstance(section, dict):
        raise NVError(f"params: section '{name}' must be a mapping, got {type(section).__name__}")
    _check(name, section, SCHEMA[name], where)
    if name == "defences":
        check_knobs(section["knobs"])
    for item, entry in section.items() if name == "timing_family" else ():
        head = entry.get("head_dim", HEAD_DIM)
        if "d" in entry and (entry["d"] % head or (entry["d"] // head) % entry["n_kv_heads"]):
            raise NVError(f"params: 'timing_family.{item}': d = {entry['d']} must be a multiple of the head size {head} "
                          f"into a number of heads that n_kv_heads = {entry['n_kv_heads']} divides")
    if name == "sampling" and section["N0"] > section["N_max"]:  # before the prompt search pays (the rounds' own check)
        raise NVError(f"params: 'sampling.N0' = {section['N0']:,} is above 'sampling.N_max' = {section['N_max']:,}")
    if name == "search" and section["rounds"] * section["batch_size"] < section["D"]:  # before the probe pays (search's own check)
        raise NVError(f"params: 'search.rounds' x 'search.batch_size' = {section['rounds'] * section['batch_size']:,} "
                      f"prompts evaluated at most, fewer than 'search.D' = {section['D']:,}")
    if name == "timing":
        _discard_fits(section, "params")
        for platform, cfg in section["platforms"].items():
            _trim_keeps(section["trim"], cfg["trials"], "params", f"timing.platforms.{platform}.trials")
    return section


def check_knobs(knobs: dict, where: str = "params") -> dict:
    """``defences.knobs``: each knob a defence-section key the defences stage emulates on stored draws (all but
    ``max_temperature``: the draws are of one temperature), each setting a value of that key (not null: the
    undefended row is always swept), none twice."""
    defence = SCHEMA["defence"]
    known = [k for k in defence if k != "max_temperature"]
    unknown = sorted(map(str, set(knobs) - set(known)))
    if unknown:
        raise NVError(f"{where}: defences.knobs names {unknown}; known: {', '.join(known)}")
    for knob, values in knobs.items():
        for i, value in enumerate(values):
            if value is None:
                raise NVError(f"{where}: 'defences.knobs.{knob}' lists null: the undefended row is always swept")
            _check("defences.knobs", {knob: value}, {knob: defence[knob]}, where)
            if value in values[:i]:
                raise NVError(f"{where}: 'defences.knobs.{knob}' lists {value!r} twice")
    return knobs


def check_timing_protocol(values: dict, where: str) -> None:
    """A copy of the timing protocol (r, trials, warmups, trim, n_lengths, discard, kv_ratio, ffn_ratio; e.g. a
    calibration file's) against params.yaml's rules for it; a one-line error beginning with ``where``."""
    _check("timing", values, {"r": _PLATFORM["r"], "trials": _PLATFORM["trials"], **_PROTOCOL}, where)
    _discard_fits(values, where)
    _trim_keeps(values["trim"], values["trials"], where, "trials")


def _trim_keeps(trim: float, trials: int, where: str, key: str) -> None:
    """App. D's trimmed mean keeps two trials at least (else sigma_T is undefined, found only once all are timed)."""
    from nv.phase2.fit import trim_cut

    if trials - 2 * trim_cut(trim, trials) < 2:
        raise NVError(f"{where}: 'timing.trim' = {trim} on {key} = {trials} keeps fewer than 2 trials of each length: "
                      "raise the trials or lower the trim")


def _discard_fits(timing: dict, where: str) -> None:
    """App. D's fit drops the ``discard`` shortest of ``n_lengths`` lengths and needs two left for a line."""
    if timing["discard"] > timing["n_lengths"] - 2:
        raise NVError(f"{where}: 'timing.discard' must be <= n_lengths - 2 = {timing['n_lengths'] - 2} (the fit needs two "
                      f"lengths), got {timing['discard']}")


def _check(name: str, section: dict, schema: dict, where: str = "params") -> dict:
    """``section`` (``name`` in messages) against ``schema``; a one-line error beginning with ``where``."""
    if isinstance(schema, EachOf):
        if not section:
            raise NVError(f"{where}: '{name}' must list at least one entry")
        bad = [k for k in section if isinstance(schema, Platforms) and k not in Platforms.names]
        if bad:
            raise NVError(f"{where}: unknown platform '{name}.{bad[0]}' (known: {', '.join(Platforms.names)})")
        unquoted = [k for k in section if isinstance(schema, StageItems) and not isinstance(k, str)]
        if unquoted:  # YAML reads on, yes, null, 1_000 as a bool, None or an int, which no stage's --item matches
            raise NVError(f"{where}: '{name}.{unquoted[0]}': YAML reads this name as {type(unquoted[0]).__name__}, not text: "
                          "quote it")
        dotted = [k for k in section if isinstance(schema, StageItems) and not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_-]*", k)]
        if dotted:
            raise NVError(f"{where}: '{name}.{dotted[0]}': a stage item name may hold only letters, digits, '_' and '-', "
                          "not first (DVC reads a dot as nesting, a leading '-' as an option); put the model in its 'spec'")
        for key, entry in section.items():
            if not isinstance(entry, dict):
                raise NVError(f"{where}: '{name}.{key}' must be a mapping, got {type(entry).__name__}")
            _check(f"{name}.{key}", entry, schema.schema_for(f"{name}.{key}", entry), where)
        return section
    unknown = sorted(map(str, set(section) - set(schema))) if schema else []
    if unknown:
        raise NVError(f"{where}: unknown key '{name}.{unknown[0]}' (known: {', '.join(schema)})")
    for key, rule_ in schema.items():
        if key not in section:
            raise NVError(f"{where}: missing key '{name}.{key}'")
        value = section[key]
        if isinstance(rule_, dict):
            if not isinstance(value, dict):
                raise NVError(f"{where}: '{name}.{key}' must be a mapping, got {type(value).__name__}")
            _check(f"{name}.{key}", value, rule_, where)
            continue
        types, ok, rule = rule_
        # bool is an int subclass: never accept it where a number is expected
        if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
            raise NVError(f"{where}: '{name}.{key}' must be {_type_name(types)}, got bool {value!r}")
        if not isinstance(value, types):
            raise NVError(f"{where}: '{name}.{key}' must be {_type_name(types)}, got {type(value).__name__} "
                          f"{value!r}{_number_as_text(value)}")
        if isinstance(value, float) and not math.isfinite(value):  # YAML's .inf and .nan: no setting means them
            raise NVError(f"{where}: '{name}.{key}' must be a finite number, got {value!r}")
        if ok is not None and not ok(value):
            raise NVError(f"{where}: '{name}.{key}' must be {rule}, got {value!r}")
    return section


def _number_as_text(value) -> str:
    """A hint for a number YAML 1.1 reads as text (``1e6``, ``1.0e6``: an exponent needs a dot and a sign there),
    else ''."""
    try:
        number = float(value) if isinstance(value, str) else math.nan
    except ValueError:
        return ""
    if not math.isfinite(number):
        return ""
    if number.is_integer() and abs(number) < 1e15:
        written = str(int(number))
    else:
        mantissa, _, exponent = repr(number).partition("e")  # repr: '1e-05', '1e+20', '0.5'
        written = mantissa + ("" if "." in mantissa else ".0") + (f"e{exponent}" if exponent else "")
    return f" (YAML reads {value} as text: write {written})"


def _type_name(types) -> str:
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join("null" if t is type(None) else t.__name__ for t in types)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last one silently). A merge
    key's (``<<: *anchor``) entries are not the mapping's own: a key of the mapping overrides them, as YAML says."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                raise yaml.constructor.ConstructorError(None, None, f"a mapping key must be a scalar, got "
                                                        f"{type(key).__name__}", key_node.start_mark)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error in one line: what is wrong and where (line and column, 1-based)."""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem


def load_params(path: str | Path = "params.yaml", sections: list[str] | None = None) -> dict:
    """Read ``path``; validate and return the requested sections (all when None).

    The top-level ``seed`` (int >= 0) seeds every random step.
    """
    path = Path(path)
    try:
        raw = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except FileNotFoundError:
        raise NVError(f"params file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:  # a folder, unreadable, not text
        raise NVError(f"params file {path} cannot be read: {exc.strerror if isinstance(exc, OSError) else 'not UTF-8 text'}") from None
    except yaml.YAMLError as exc:
        raise NVError(f"params file {path} is not valid YAML: {yaml_problem(exc)}") from None
    if not isinstance(raw, dict):
        raise NVError(f"params file {path} must be a mapping of sections")
    if "seed" not in raw:
        raise NVError(f"params: missing key 'seed' in {path}")
    seed = raw["seed"]
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:  # torch.manual_seed's range
        raise NVError(f"params: 'seed' must be an int in [0, 2^63), got {seed!r}")
    unknown = [k for k in raw if k != "seed" and k not in SCHEMA]
    if unknown:
        raise NVError(f"params: unknown section '{unknown[0]}' in {path} (known: seed, {', '.join(SCHEMA)})")
    names = sections if sections is not None else [k for k in raw if k != "seed"]
    out: dict = {"seed": seed}
    for name in names:
        if name == "seed":
            continue
        if name not in raw:
            raise NVError(f"params: missing section '{name}' in {path}")
        out[name] = check_section(name, raw[name])
    _check_links(out)
    return out


def _check_links(params: dict) -> None:
    """Names and sizes one section takes from another, where both were loaded: a validation model's platforms are
    timing platforms, overall.trials' budgets reach what is timed (some platform, each validation model, at one budget
    at least) and those used keep two trials under the trim, a platform's listed references are members of the timing
    family, and no model is attacked twice (the main one and the validation models by their spec)."""
    seen = {params["model"]["spec"]: "model.spec"} if "model" in params else {}
    for name, model in params.get("validation", {}).get("models", {}).items():  # each model attacked once
        if model["spec"] in seen:
            raise NVError(f"params: 'validation.models.{name}.spec' = {model['spec']!r} is {seen[model['spec']]}'s: list "
                          "each model once")
        seen[model["spec"]] = f"validation.models.{name}.spec"
    platforms = params.get("timing", {}).get("platforms")
    if platforms is None:
        return
    for name, model in params.get("validation", {}).get("models", {}).items():
        missing = [p for p in model["platforms"] if p not in platforms]
        if missing:
            raise NVError(f"params: 'validation.models.{name}.platforms' names '{missing[0]}', which is not in "
                          f"timing.platforms ({', '.join(platforms)})")
    trials = params.get("overall", {}).get("trials")
    timed = max(cfg["trials"] for cfg in platforms.values())
    above = [K for K in trials or () if K > timed]  # a budget above one platform's trials is left out there only
    if above:
        raise NVError(f"params: 'overall.trials' budget {above[0]} is above every timing platform's trials "
                      f"({', '.join(str(cfg['trials']) for cfg in platforms.values())}): no platform times it")
    for K in trials or ():
        _trim_keeps(params["timing"]["trim"], K, "params", "overall.trials")
    for name, model in params.get("validation", {}).get("models", {}).items():  # its sweeps' K, timed before they are fitted
        _trim_keeps(params["timing"]["trim"], model["trials"], "params", f"validation.models.{name}.trials")
    for name, model in params.get("validation", {}).get("models", {}).items() if trials else ():
        if model["trials"] < min(trials):
            raise NVError(f"params: 'validation.models.{name}.trials' = {model['trials']} is below every overall.trials "
                          f"budget ({', '.join(map(str, trials))}): the model would be left out of the validation")
    family = params.get("timing_family")
    for name, cfg in platforms.items() if family is not None else ():
        missing = [] if cfg["references"] == "all" else [r for r in cfg["references"] if r not in family]
        if missing:
            raise NVError(f"params: 'timing.platforms.{name}.references' names '{missing[0]}', which is not in "
                          f"timing_family")
