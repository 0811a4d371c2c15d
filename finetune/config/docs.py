"""The schema documents itself: docs/CONFIG.md and configs/schema.json are generated from
`finetune.config.schema` (`finetune config --markdown` / `--schema`); a test fails when either is stale."""

from __future__ import annotations

import json
import types
import typing
from typing import Any, Literal

from finetune.config.files import keys_that_may_change_on_resume
from finetune.config.schema import Config, LoraConfig, SweepRange


def _type_name(a: Any) -> str:
    origin, args = typing.get_origin(a), typing.get_args(a)
    if origin is Literal:
        return " / ".join(str(x) for x in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(x) for x in args)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return "mapping"
    return "null" if a is type(None) else getattr(a, "__name__", str(a))


def schema_markdown() -> str:
    """docs/CONFIG.md: every section and key with its type, default and description."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `finetune/config/schema.py` (`finetune config --markdown`); a test fails when it is stale.",
        "Every key can be set in the YAML file or as a dotted override (`train.learning_rate=3e-5`).",
        "Resuming from a checkpoint refuses a changed value of any key not marked *may change on resume*",
        "(docs/RESUME.md).",
        "",
    ]
    may_change = keys_that_may_change_on_resume()
    for section, field in Config.model_fields.items():
        model = next(a for a in (field.annotation, *getattr(field.annotation, "__args__", ())) if isinstance(a, type))
        lines += [
            f"## `{section}`",
            "",
            (model.__doc__ or "").strip(),
            "",
            "| key | type | default | description |",
            "|---|---|---|---|",
        ]
        for name, f in model.model_fields.items():
            default = "required" if f.is_required() else json.dumps(f.default if f.default_factory is None else None)
            # the schema's resume declaration, so the reference says which keys a resumed run may change
            resume = " (may change on resume)" if f"{section}.{name}" in may_change else ""
            lines.append(f"| `{section}.{name}` | {_type_name(f.annotation)} | {default} | {f.description}{resume} |")
            nested = {"lora": LoraConfig, "space": SweepRange}.get(name)  # sub-keys (of each entry, for space)
            for sub, g in nested.model_fields.items() if nested is not None else []:
                lines.append(
                    f"| `{section}.{name}.{sub}` | {_type_name(g.annotation)} | {json.dumps(g.default)} | "
                    f"{g.description or ''} |"
                )
        lines.append("")
    return "\n".join(lines)


def json_schema() -> str:
    """configs/schema.json: JSON Schema of a config file, for editors (yaml-language-server)."""
    return json.dumps(Config.model_json_schema(), indent=2, sort_keys=True) + "\n"
