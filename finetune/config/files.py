"""Config files in and out: YAML 1.2 reading, `${VAR}` expansion, dotted overrides, validation errors
listed at once, and the resolved config written back (config.yaml in a run directory, tracker hparams).

The schema itself (every key, its default and description) is `finetune.config.schema`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from finetune.config.schema import Config, _section_class, closest_name
from finetune.core.errors import UserError

# ----------------------------------------------------------------------------------------------
# YAML 1.2 scalars. PyYAML follows YAML 1.1: `3e-5` is a string and `no`/`on` are booleans.
# This loader resolves numbers and booleans by the YAML 1.2 core schema instead; the schema
# below still accepts `no`/`off`/`yes`/`on` where a boolean is expected (pydantic coerces them),
# while a string field keeps them as text (a label called "no" stays "no").


class Yaml12Loader(yaml.SafeLoader):
    """`yaml.SafeLoader` with YAML 1.2 core-schema resolution of bool, int and float."""


Yaml12Loader.yaml_implicit_resolvers = {
    first: [
        (tag, rx)
        for tag, rx in resolvers
        if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)
Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def _construct_int12(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    if text.startswith("0o"):
        return int(text[2:], 8)
    if text.startswith("0x"):
        return int(text[2:], 16)
    return int(text)  # YAML 1.1 would read "010" as octal 8


def _construct_bool12(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> bool:
    return loader.construct_scalar(node).lower() == "true"


Yaml12Loader.add_constructor("tag:yaml.org,2002:int", _construct_int12)
Yaml12Loader.add_constructor("tag:yaml.org,2002:bool", _construct_bool12)


def parse_yaml12(text: str, source: str = "<string>") -> Any:
    """Parse YAML text with YAML 1.2 number/bool rules; raise UserError naming the line on bad YAML.

    Raises:
        UserError: the text is not valid YAML (the message names the line).
    """
    try:
        return yaml.load(text, Loader=Yaml12Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"{source} is not valid YAML{where}: {problem}") from None


# ----------------------------------------------------------------------------------------------
# Loading, overrides and error reporting.

_ENV_RX = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _expand_env(value: Any) -> Any:
    """Expand ${VAR} and ${VAR:-default} in every string of a nested structure."""
    if isinstance(value, str):

        def repl(m: re.Match[str]) -> str:
            var, default = m.group(1), m.group(2)
            got = os.environ.get(var)
            if got is None or got == "":
                if default is None:
                    raise UserError(f"environment variable {var} is not set (used as ${{{var}}} in the config)")
                return default
            return got

        return _ENV_RX.sub(repl, value)
    if isinstance(value, dict):
        return {k: _expand_env(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_env(v) for v in value]
    return value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `dotted.key=value` overrides; values are YAML 1.2 scalars (or flow lists/maps).

    Raises:
        UserError: an override is not `dotted.key=value` or walks into a non-section.
    """
    for item in overrides:
        if "=" not in item:
            raise UserError(f"override {item!r} is not of the form dotted.key=value")
        key, _, text = item.partition("=")
        parts = key.strip().split(".")
        if not all(parts):
            raise UserError(f"override {item!r} has an empty key part")
        value = parse_yaml12(text, source=f"override {key}") if text.strip() else None
        node = raw
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise UserError(f"override {key}: {'.'.join(parts[: i + 1])} is not a section")
            node = child
        node[parts[-1]] = value
    return raw


def _schema_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The schema class that holds the field at `loc` (for did-you-mean suggestions)."""
    cls: Any = Config
    for part in loc[:-1]:
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        ann = field.annotation
        candidates = [ann, *getattr(ann, "__args__", ())]
        cls = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if cls is None:
            return None
    return cls


def _format_errors(exc: ValidationError) -> list[str]:
    problems = []
    for err in exc.errors():
        # drop pydantic's union-branch markers such as 'int' / 'literal[...]' from the location
        loc = tuple(
            p
            for p in err["loc"]
            if not (
                isinstance(p, str)
                and (
                    p.startswith(("literal[", "function-"))
                    or p in ("int", "float", "str", "bool", "constrained-int", "constrained-float")
                )
            )
        )
        key = ".".join(str(p) for p in loc) or "config"
        kind = err["type"]
        if kind == "extra_forbidden":
            cls = _schema_at(loc)
            names = list(cls.model_fields) if cls else []
            close = closest_name(str(loc[-1]), names)
            hint = f" (did you mean {'.'.join(str(p) for p in loc[:-1] + (close,))}?)" if close else ""
            problems.append(f"{key}: unknown key{hint}")
        elif kind == "missing":
            problems.append(f"{key}: required key is missing")
        elif kind in ("value_error", "assertion_error"):
            msg = err["msg"].removeprefix("Value error, ")
            problems.append(msg if key == "config" or msg.startswith(key) else f"{key}: {msg}")
        else:
            problems.append(f"{key}: {err['msg'].lower()} (got {err.get('input')!r})")
    # one problem per key is enough: unions report each branch
    seen: dict[str, str] = {}
    for p in problems:
        seen.setdefault(p.split(":")[0], p)
    return list(seen.values())


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read, override and validate a config; raise one UserError that lists every problem.

    Raises:
        UserError: the file is missing or invalid; every problem is listed in one message.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"config file {path} is not UTF-8 text") from None
    raw = parse_yaml12(text, source=str(path))
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"{path}: the top level must be a mapping of sections (run, model, data, ...)")
    raw = apply_overrides(raw, list(overrides or []))
    return validate_config(raw, source=str(path))


def validate_config(raw: dict[str, Any], source: str = "config") -> Config:
    """Validate a raw mapping (env vars expanded) into a Config, listing all problems at once.

    Raises:
        UserError: unknown keys (with a did-you-mean) or invalid values, all listed at once.
    """
    raw = _expand_env(raw)
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        problems = _format_errors(exc)
        if len(problems) == 1:
            raise UserError(f"{source}: {problems[0]}") from None
        raise UserError(f"{source}: {len(problems)} problems: " + "; ".join(problems)) from None


class _Yaml12SafeDumper(yaml.SafeDumper):
    """Quotes a string that either YAML 1.1 or our 1.2 loader would read as something else (`1e5`, `no`)."""

    def resolve(self, kind: Any, value: Any, implicit: Any) -> str:
        tag = super().resolve(kind, value, implicit)
        if kind is yaml.ScalarNode and implicit[0] and tag == "tag:yaml.org,2002:str":
            resolvers = Yaml12Loader.yaml_implicit_resolvers.get(
                value[:1], []
            ) + Yaml12Loader.yaml_implicit_resolvers.get(None, [])
            for tag12, rx in resolvers:
                if rx.match(value):
                    return tag12  # differs from the node's str tag, so the emitter quotes the value
        return tag


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML (what `config.yaml` in a run directory holds); reloads to the same Config."""
    return yaml.dump(cfg.model_dump(mode="json"), Dumper=_Yaml12SafeDumper, sort_keys=False)


def flat_config(cfg: Config) -> dict[str, int | float | str | bool]:
    """The resolved config as dotted scalar keys, for trackers (TensorBoard's hparams rejects nested
    values, lists and None): lists and mappings as JSON text, None as "null"."""
    out: dict[str, int | float | str | bool] = {}

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict) and key not in ("architecture", "plan_architecture", "label_map", "label_files"):
                walk(value, f"{prefix}{key}.")
            elif isinstance(value, (bool, int, float, str)):
                out[prefix + key] = value
            else:
                out[prefix + key] = "null" if value is None else json.dumps(value)

    walk(cfg.model_dump(mode="json"), "")
    return out


def keys_that_may_change_on_resume() -> frozenset[str]:
    """The dotted `section.key` names declared `MAY_CHANGE_ON_RESUME` in the schema: the keys whose change
    does not change the trained weights, so resume accepts a checkpoint whose config differs in them."""
    return frozenset(
        f"{section}.{name}"
        for section, field in Config.model_fields.items()
        for name, f in _section_class(field.annotation).model_fields.items()
        if (f.json_schema_extra or {}).get("resume") == "may_change"
    )
