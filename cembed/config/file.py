"""YAML file -> validated :class:`~cembed.config.schema.CembedConfig`, and back (``--write``).

``load_config(path, overrides)`` is the only entry point: it parses the YAML (syntax errors name the
line and column), applies ``dotted.key=value`` overrides (values parsed as YAML), validates the
result with pydantic (unknown keys are rejected with a did-you-mean), and resolves every path
relative to the config file. Every failure is a :class:`cembed.errors.UserError` whose message names
the file, line and dotted field. :func:`set_yaml_value` edits one key in place, keeping comments.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from cembed.config.loss import DEFAULT_LOSS, LOSS_CONFIGS, LossConfig
from cembed.config.model import DEFAULT_KIND, MODEL_CONFIGS, ModelConfig
from cembed.config.schema import CembedConfig
from cembed.config.sources import SourceConfig, source_config_class_of
from cembed.errors import UserError
from cembed.files import display_path
from cembed.plugins import load_plugins
from cembed.samples import resolve_sample


def line_index(text: str) -> dict[tuple[str, ...], int]:
    """Map each dotted key path in a YAML document to its 1-based line, for error messages."""
    index: dict[tuple[str, ...], int] = {}

    def walk(node: yaml.Node, prefix: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                path = prefix + (str(key_node.value),)
                index[path] = key_node.start_mark.line + 1
                walk(value_node, path)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                index[prefix + (str(i),)] = item.start_mark.line + 1
                walk(item, prefix + (str(i),))

    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return index
    if root is not None:
        walk(root, ())
    return index


def parse_yaml(text: str, source: str) -> Any:
    """Parse YAML text; a syntax error becomes a UserError naming ``source``, line and column."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UserError(f"{where}: YAML syntax error: {problem}") from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``dotted.key=value`` set (value parsed as YAML).

    Raises:
        UserError: an override without ``=``, or one that descends into a non-mapping value.
    """
    out = yaml.safe_load(yaml.safe_dump(data)) if data else {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"override {item!r}: expected section.field=value, e.g. batch.mini_batch_size=64")
        value = parse_yaml(raw, f"override {item!r}")
        parts = key.strip().split(".")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise UserError(f"override {item!r}: {'.'.join(parts[: i + 1])} is not a section")
            node = child
        node[parts[-1]] = value
    return out


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation names, through unions, ``Annotated`` and lists, in order."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _known_fields(model: type[BaseModel], loc: tuple[Any, ...], data: Any = None) -> list[str]:
    """The field names valid at ``loc`` (the parent of an unknown key), for did-you-mean.

    ``data`` is the validated mapping: under ``loss`` its ``name`` picks the registered loss class,
    whose own fields are the valid ones (the schema only names the :class:`LossConfig` base); under
    ``model`` its ``kind`` picks the registered model class (and, with no loss name, the kind's
    default loss); under ``data.train`` the source's ``kind`` (or shorthand key) picks the registered
    source class.
    """
    current: Any = model
    model_data = data.get("model") if isinstance(data, dict) else None
    kind = model_data.get("kind", DEFAULT_KIND) if isinstance(model_data, dict) else DEFAULT_KIND
    kind_cls = MODEL_CONFIGS.get(kind, ModelConfig) if isinstance(kind, str) else ModelConfig
    for part in loc:
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        data = data.get(part) if isinstance(data, dict) else None
        current = next(iter(_models_in(field.annotation)), None)
        if current is None:
            return []
        if current is ModelConfig:
            current = kind_cls
        elif current is LossConfig:
            default = kind_cls.default_loss if kind_cls is not ModelConfig else DEFAULT_LOSS
            name = data.get("name", default) if isinstance(data, dict) else default
            current = LOSS_CONFIGS.get(name, LossConfig) if isinstance(name, str) else LossConfig
        elif current is SourceConfig:
            current = source_config_class_of(data)
    return list(getattr(current, "model_fields", {}))


def _format_validation_error(
    err: ValidationError,
    source: str,
    lines: dict[tuple[str, ...], int],
    overrides: list[str] | None = None,
    data: Any = None,
) -> str:
    by_key = {item.partition("=")[0].strip(): item for item in overrides or []}
    messages = []
    for e in err.errors():
        loc = tuple(str(p) for p in e["loc"] if not str(p).startswith("function-after"))
        # pydantic reports union members as extra loc parts (a class name); drop them.
        loc = tuple(p for p in loc if not p[:1].isupper())
        if e["type"] == "union_tag_invalid":  # an unknown `kind`: name the kind key (and its line)
            loc += (e["ctx"]["discriminator"].strip("'"),)
        dotted = ".".join(loc) or "(top level)"
        line = lines.get(loc) or lines.get(loc[:-1])
        where = f"{source}:{line}" if line else source
        override = next((by_key[k] for k in (".".join(loc[:i]) for i in range(len(loc), 0, -1)) if k in by_key), None)
        if override is not None:  # the value came from the command line, not from the file
            where = f"override {override!r}"
        if e["type"] == "extra_forbidden":
            known = _known_fields(CembedConfig, loc[:-1], data)
            close = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.5)
            hint = f"; did you mean '{'.'.join(loc[:-1] + (close[0],))}'?" if close else ""
            allowed = f" (allowed: {', '.join(known)})" if known and not close else ""
            messages.append(f"{where}: unknown key '{dotted}'{hint}{allowed}")
        elif e["type"] == "union_tag_invalid":
            ctx = e["ctx"]
            messages.append(f"{where}: {dotted}: unknown value {ctx['tag']!r}; allowed: {ctx['expected_tags']}")
        elif e["type"] == "missing":
            messages.append(f"{where}: missing required field '{dotted}'")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            shown = e.get("input")
            got = f" (got {shown!r})" if not isinstance(shown, (dict, list)) else ""
            messages.append(f"{where}: {dotted}: {msg}{got}")
    return "\n".join(messages[:3]) + (f"\n... and {len(messages) - 3} more" if len(messages) > 3 else "")


def _resolve_path(value: str, base: Path) -> str:
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def _resolve_data_path(value: str, base: Path, field: str) -> str:
    """A data path made absolute: ``cembed:<name>`` -> the packaged file or folder, else relative
    to ``base``. An unknown ``cembed:`` name is a UserError naming ``field``."""
    try:
        sample = resolve_sample(value)
    except UserError as err:
        raise UserError(f"{field}: {err}") from None
    return str(sample) if sample is not None else _resolve_path(value, base)


def resolve_paths(cfg: CembedConfig, base: Path) -> CembedConfig:
    """Make local paths absolute relative to ``base`` (the config file's folder); a data path
    ``cembed:<name>`` becomes the packaged data it names (:func:`cembed.samples.resolve_sample`)."""
    cfg = cfg.model_copy(deep=True)
    for item in cfg.data.sources():
        for field in item.source.path_fields:  # the source kind says which fields hold paths (a hub id does not)
            value = getattr(item.source, field)
            if isinstance(value, str):
                setattr(item.source, field, _resolve_data_path(value, base, item.key))
            elif isinstance(value, list):  # a file source's shards, each resolved as one path is
                setattr(item.source, field, [_resolve_data_path(v, base, item.key) for v in value])
    cfg.train.output_dir = _resolve_path(cfg.train.output_dir, base)
    if cfg.data.cache_dir is not None:
        cfg.data.cache_dir = _resolve_path(cfg.data.cache_dir, base)
    if cfg.eval is not None:
        for field in ("retrieval", "sts"):
            for i, item in enumerate(getattr(cfg.eval, field)):
                item.path = _resolve_data_path(item.path, base, f"eval.{field}.{i}.path")
    model_path = base / cfg.model.name_or_path
    if not Path(cfg.model.name_or_path).is_absolute() and model_path.exists():
        cfg.model.name_or_path = str(model_path.resolve())
    return cfg


def config_from_dict(
    data: Any, source: str = "<config>", base: Path | None = None, text: str = "", overrides: list[str] | None = None
) -> CembedConfig:
    """Validate a mapping into a :class:`CembedConfig`; errors name ``source``, line and field. The
    plugins (:func:`cembed.plugins.load_plugins`) are loaded first, so their source kinds and losses validate."""
    if data is None:
        raise UserError(f"{source}: the config is empty; it needs at least a 'data.train' file")
    if not isinstance(data, dict):
        raise UserError(
            f"{source}: the config must be a mapping of sections (model, data, batch, ...), not a {type(data).__name__}"
        )
    load_plugins()
    try:
        # The config's folder lets DataConfig infer `kind: file` for a relative path that exists there.
        cfg = CembedConfig.model_validate(data, context={"base": base or Path.cwd()})
    except ValidationError as err:
        raise UserError(_format_validation_error(err, source, line_index(text), overrides, data)) from None
    return resolve_paths(cfg, base or Path.cwd())


def load_config(path: str | Path, overrides: list[str] | None = None) -> CembedConfig:
    """Read, override, validate and path-resolve a YAML config.

    Args:
        path: the YAML file.
        overrides: ``section.field=value`` strings, values parsed as YAML, applied after the file.

    Returns:
        The validated config with absolute local paths.

    Raises:
        UserError: unreadable file, YAML syntax error (line:column), unknown key (did-you-mean),
            a wrong type or range (dotted field and line).
    """
    path = Path(path)
    shown = display_path(path)  # messages name the file as short as the working directory allows
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{shown}: config file not found") from None
    except IsADirectoryError:
        raise UserError(f"{shown}: is a folder; give the YAML config file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{shown}: cannot read the config ({err.__class__.__name__}: {err})") from None
    data = parse_yaml(text, shown)
    if overrides:
        if data is not None and not isinstance(data, dict):
            raise UserError(f"{shown}: the config must be a mapping of sections, not a {type(data).__name__}")
        data = apply_overrides(data or {}, overrides)
    return config_from_dict(data, shown, path.resolve().parent, text, overrides)


def set_yaml_value(path: str | Path, key: tuple[str, str], value: Any) -> None:
    """Set ``section.field: value`` (``key = (section, field)``) in the YAML file at ``path``,
    keeping its other lines and comments: the existing line is edited in place, or the field is added
    to the section (which is created when missing). Used by ``probe-minibatch --write``.

    Raises:
        UserError: the file cannot be read or written, or the section is a flow mapping.
    """
    section, name = key
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise UserError(f"{path}: cannot read the config for --write ({err})") from None
    lines = text.splitlines(keepends=True)
    index = line_index(text)
    line_no = index.get(key)
    if line_no is not None:
        old = lines[line_no - 1]
        lines[line_no - 1] = re.sub(rf"({re.escape(name)}\s*:\s*)([^\s#,}}]+)", rf"\g<1>{value}", old, count=1)
    elif (section,) in index:
        at = index[(section,)]
        if "{" in lines[at - 1]:
            raise UserError(f"{path}:{at}: {section} is a flow mapping; add {name}: {value} to it by hand")
        child_indent = next(
            (re.match(r"\s*", lines[n - 1]).group(0) for k, n in index.items() if len(k) == 2 and k[0] == section),
            "  ",
        )
        lines.insert(at, f"{child_indent}{name}: {value}\n")
    else:
        if lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n"
        lines += [f"{section}:\n", f"  {name}: {value}\n"]
    try:
        path.write_text("".join(lines), encoding="utf-8")
    except OSError as err:
        raise UserError(f"{path}: cannot write the config for --write ({err})") from None
