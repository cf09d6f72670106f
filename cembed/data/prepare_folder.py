"""``cembed prepare-data``'s back end: run the config's data stage, then write a prepared folder.

The data stage runs as training runs it (:func:`cembed.data.load.load_training_data`), the
tokenizer and prompts resolve as training resolves them, and the rows are written by
:mod:`cembed.data.tokens.writer` in the one on-disk format (:mod:`cembed.data.tokens.format`).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from cembed.data.load import load_training_data
from cembed.data.prompts import training_prompts
from cembed.data.tokens.collator import collator_for
from cembed.data.tokens.encode import prompt_groups, resolve_num_proc, tokenize_into
from cembed.data.tokens.format import (
    SAMPLE_ROWS,
    PreparedManifest,
    write_manifest,
)
from cembed.data.tokens.model_check import column_layouts, role_lengths
from cembed.data.tokens.writer import (
    PrepareResult,
    check_equivalence,
    check_folder,
    folder_bytes,
    join_parts,
    part_rows,
    publish_part,
    temporary_datasets_cache,
)
from cembed.errors import UserError
from cembed.files import display_path
from cembed.model.fingerprint import tokenizer_fingerprint
from cembed.model.load import load_model, quiet_libraries
from cembed.model.prompts import prompt_lengths


def prepare_folder(
    cfg,
    output: str | Path,
    part: tuple[int, int] = (0, 1),
    overwrite: bool = False,
    progress=None,
) -> PrepareResult:
    """Prepare ``cfg``'s (a :class:`cembed.config.schema.CembedConfig`) one training source for
    ``cfg.model`` into ``output`` as a prepared source (:mod:`cembed.data.tokens.format`); see the module
    docstring for the layout, kill-safety and ``part``.

    Args:
        part: ``(K, N)``: prepare the K-th of N contiguous row ranges (:func:`parse_part`).
        overwrite: replace a finished preparation or other files in ``output`` (one process only).
        progress: ``progress(rows_done, rows_total)`` while tokenizing (from another thread).

    Raises:
        UserError: several training sources (``data.train``), a folder that is not empty or already
            prepared, data errors (:func:`cembed.data.load.load_training_data`), a model that cannot be
            loaded or whose inputs are not plain token ids.
    """
    k, n = part
    started = time.perf_counter()
    sources = cfg.data.sources()
    if len(sources) > 1:
        raise UserError(
            f"data.train: {len(sources)} sources; prepare-data writes one source: prepare each separately "
            "(a config whose data.train is that source, its own --output) and list the folders as "
            "{kind: prepared, path: DIR} sources"
        )
    _check_source(sources[0])
    folder = Path(output)
    check_folder(folder, k, n, overwrite)
    made = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{k:05d}-", dir=folder))
    try:
        with temporary_datasets_cache(tmp / "datasets-cache"):
            manifest, files, procs = _tokenize_part(cfg, k, n, tmp / "ids", progress)
        result = publish_part(folder, k, n, tmp / "ids", files, manifest, procs)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if made:  # the folder this run made goes with it (unless another node wrote into it meanwhile)
            try:
                folder.rmdir()
            except OSError:
                pass
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if n == 1:
        write_manifest(folder, manifest)
        result.complete, result.total_token_bytes = True, result.token_bytes
    else:
        join_parts(folder, n, result)
    if result.complete:
        from cembed.data.tokens.format import read_manifest

        top = read_manifest(folder)
        result.total_rows, result.total_files, result.fingerprint = top.rows, len(top.parts), top.fingerprint
        result.disk_bytes = folder_bytes(folder)
    result.seconds = round(time.perf_counter() - started, 3)
    return result


def _check_source(item) -> None:
    """Refuse a training source ``prepare-data`` cannot prepare whole: a stream (its data stage reads
    only the first ``check_rows`` rows) and a source that is already a prepared one (token ids, no text).
    ``item``: a :class:`cembed.config.data.TrainSource`.

    Raises:
        UserError: one line naming the field and the fix.
    """
    source = item.source
    if source.stream_options() is not None:
        raise UserError(
            f"{item.key}.streaming: prepare-data reads the whole source, not a stream; remove "
            f"{item.key}.streaming from the config (or add the override {item.key}.streaming=false)"
        )
    if source.is_pretokenized:
        raise UserError(
            f"{item.key}: {display_path(source.label)} is already a {source.kind} source (token ids, no text); train "
            "from it as it is, or point data.train at the text files it was prepared from"
        )


def _tokenize_part(cfg, k: int, n: int, ids_dir: Path, progress) -> tuple[PreparedManifest, list[str], int]:
    """Run the data stage, load the model, tokenize part K of N into ``ids_dir`` (training's map) and
    check the ids against the model's own preprocessing. Returns the part's manifest (its ``parts``
    still empty), the map's files in ``ids_dir`` in row order and the tokenizer processes used."""
    data = load_training_data(cfg.data)
    quiet_libraries()
    model = load_model(cfg.model, "cpu")
    roles = data.columns
    layouts = column_layouts(model, roles)
    collator = collator_for(model, roles, expansions=layouts[1]) if layouts is not None else None
    if collator is None:
        raise UserError(
            f"model {cfg.model.name_or_path}: its inputs are more than token ids; a prepared source "
            "stores only ids: train from the text source instead"
        )
    tp = training_prompts(data, model, cfg.data.prompts)
    prompts = tp.by_source[0] if tp.by_source is not None else tp.columns
    lengths = prompt_lengths(model, prompts)
    dataset = data.dataset
    samples = dataset.select(range(min(SAMPLE_ROWS, len(dataset)))).to_dict()
    start, end = part_rows(len(dataset), k, n)
    # datasets' shard(n, k, contiguous=True) rows; its select refuses an empty range past the end.
    rows = dataset if n == 1 else dataset.select(range(start, end) if end > start else [])
    if rows._indices is not None:  # the map would keep the texts (a column join rewrites them)
        rows = rows.flatten_indices()
    procs = resolve_num_proc(cfg.data.num_proc, len(rows))
    ids_dir.mkdir()
    groups = prompt_groups(len(rows), roles, prompts, lengths, None)
    cut = role_lengths(layouts[0], int(model.max_seq_length))  # a multi-vector model's query / document lengths
    lengths_by_role = layouts[0] if cut else model.max_seq_length
    files = tokenize_into(rows, roles, model.tokenizer, lengths_by_role, ids_dir, groups, procs, progress)
    check_equivalence(model, collator, rows, ids_dir, files, prompts, cfg.model.name_or_path)
    src = data.sources[0] if data.sources else None
    input_files = None
    if src is not None:
        reads_files = cfg.data.sources()[0].source.reads_files  # a kind reading files: 1 unless sharded
        input_files = src.files if src.files is not None else (1 if reads_files else None)
    manifest = PreparedManifest(
        columns=roles,
        tokenizer=tokenizer_fingerprint(model.tokenizer),
        max_seq_length=int(model.max_seq_length),
        rows=len(rows),
        parts=[],
        prompts={r: p for r, p in prompts.items() if p},
        samples={r: samples[r] for r in roles},
        model=cfg.model.name_or_path,
        source=data.source,
        rows_read=data.rows_read,
        rows_dropped=data.rows_dropped,
        input_files=input_files,
        role_lengths=cut,
    )
    return manifest, files, procs
