"""Profiles: a YAML file of overrides merged into params.yaml (README "Profiles").

``python -m nv.profile apply profiles/paper.yaml [--params params.yaml]`` (what ``make repro PROFILE=paper``
runs) merges the overrides into params.yaml in place, keeping its comments and layout (ruamel round trip).
A section merges key by key, a list or a scalar replaces the value, and so does a mapping that is one value
(``live.extra_body``, ``defences.knobs``) or a collection of named entries (``timing_family``, ``timing.platforms``,
``validation.models``: ``EachOf`` in ``nv.params.SCHEMA``), so a profile can name a different reference family. Every other key of the profile must already exist in params.yaml;
the result is validated with ``nv.params.load_params`` before params.yaml is replaced.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from nv.errors import NVError, run_main
from nv.params import SCHEMA, EachOf, load_params, yaml_problem


def _yaml() -> YAML:
    y = YAML()  # round trip: comments, key order, flow style and quotes survive
    y.preserve_quotes = True
    y.width = 4096
    y.indent(mapping=2, sequence=4, offset=2)  # params.yaml's block lists: "  key:\n    - item"
    y.representer.add_representer(type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    return y


def _read(path: Path):
    try:
        return _yaml().load(path.read_text())
    except FileNotFoundError:
        raise NVError(f"file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:  # a folder, unreadable, not text
        raise NVError(f"{path} cannot be read: {exc.strerror if isinstance(exc, OSError) else 'not UTF-8 text'}") from None
    except YAMLError as exc:
        raise NVError(f"{path} is not valid YAML: {yaml_problem(exc)}") from None


def merge(base: dict, over: dict, schema, path: str = "") -> list[str]:
    """Merge ``over`` into ``base`` in place (rules in the module docstring); return the changed keys."""
    changed = []
    for key, value in over.items():
        name = f"{path}.{key}" if path else str(key)
        if key not in base:
            raise NVError(f"unknown key '{name}' (known: {', '.join(map(str, base))})")
        rule = schema.get(key) if isinstance(schema, dict) else None
        if isinstance(value, dict) and isinstance(base[key], dict):
            if isinstance(rule, dict) and not isinstance(rule, EachOf):  # a section: key by key
                changed += merge(base[key], value, rule, name)
            else:  # a collection of named entries, or a mapping that is one value (live.extra_body): replaced whole
                if dict(base[key]) != dict(value):
                    changed.append(name)
                base[key].clear()
                base[key].update(value)
            continue
        if base[key] != value:
            changed.append(name)
        if isinstance(value, list) and isinstance(base[key], list):
            base[key][:] = value  # in place: the comments attached to the list stay
        else:
            base[key] = value
    return changed


def apply(profile: str | Path, params: str | Path = "params.yaml") -> list[str]:
    """Merge the overrides of ``profile`` into ``params`` in place; return the changed keys."""
    profile, params = Path(profile), Path(params)
    over = _read(profile)
    if not isinstance(over, dict):
        raise NVError(f"profile {profile} must be a mapping of params.yaml sections")
    doc = _read(params)
    try:
        changed = merge(doc, over, SCHEMA)
    except NVError as exc:
        raise NVError(f"profile {profile}: {exc}") from None
    buf = io.StringIO()
    _yaml().dump(doc, buf)
    tmp = params.with_name(params.name + ".profile.tmp")
    tmp.write_text(buf.getvalue())
    try:
        load_params(tmp)
    except NVError as exc:
        tmp.unlink()
        raise NVError(f"profile {profile}: {str(exc).replace(str(tmp), str(params))}") from None
    tmp.replace(params)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nv.profile", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("apply", help="merge a profile's overrides into params.yaml in place")
    cmd.add_argument("profile", help="e.g. profiles/paper.yaml")
    cmd.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)

    def work() -> None:
        changed = apply(args.profile, args.params)
        names = f": {', '.join(changed)}" if changed else ""
        print(f"{args.params}: {len(changed)} value(s) from {args.profile}{names}")

    return run_main(work)


if __name__ == "__main__":
    sys.exit(main())
