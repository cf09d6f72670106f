"""Pre-tokenization: tokenize every text column once, cache it on disk, pad in the collator.

Tokenizing 16k pairs per batch in the main process stalls a fast GPU for seconds; padding ids that
were tokenized ahead of time takes milliseconds. :func:`pretokenize` adds a ``<role>_input_ids``
column (int32 lists, special tokens included, truncated to ``max_seq_length``) next to each text
column, with the model's own fast tokenizer, batched and in several processes. The result is saved
under the cache folder keyed by the data's fingerprint, the tokenizer and ``max_seq_length``, so a
later run with the same inputs loads it instead of tokenizing again.

The batches are then fetched and padded by :mod:`cembed.data.collator` (:class:`~cembed.data.collator.TokenIdRows`,
:class:`~cembed.data.collator.PaddingCollator`), which only pads and stacks the stored ids.

Equivalence with sentence-transformers' own preprocessing (special tokens, lower-casing,
truncation) is checked on real rows before training (:func:`matches_model_preprocessing`); where it
does not hold, the caller falls back to tokenizing in the collator.
"""

from __future__ import annotations

import bisect
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import xxhash

from cembed.data.collator import PROMPT_SUFFIX, TOKEN_SUFFIX, PaddingCollator, TokenIdRows, collator_for
from cembed.files import cache_root
from cembed.model.fingerprint import tokenizer_fingerprint
from cembed.model.prompts import prompt_lengths

# Bump when the stored layout changes, so old caches are not reused.
FORMAT_VERSION = "1"


def cache_key(
    data_fingerprint: str, tokenizer, max_seq_length: int, roles: list[str], prompts: dict | None = None
) -> str:
    """The cache folder name for one (data, tokenizer, max_seq_length, columns, prompts) combination."""
    parts = [FORMAT_VERSION, data_fingerprint, tokenizer_fingerprint(tokenizer), str(max_seq_length), ",".join(roles)]
    if prompts:  # absent for no prompts, so caches made before prompts existed stay valid
        parts.append(json.dumps(prompts, sort_keys=True))
    return xxhash.xxh64_hexdigest("|".join(parts).encode("utf-8"))


def _tokenize_batch(
    batch: dict[str, list],
    indices: list[int],
    roles: list[str],
    tokenizer,
    max_length: int,
    starts: list[int],
    prompts: list[dict[str, str]],
) -> dict[str, list]:
    # Module level: datasets.map(num_proc>1) pickles it into worker processes. Row ``i`` belongs to
    # the source whose first row is the last of ``starts`` <= i, and takes that source's prompts; a
    # null cell (a source without the column) stays null.
    groups = [bisect.bisect_right(starts, i) - 1 for i in indices]
    out = {}
    for role in roles:
        cells = batch[role]
        present = [k for k, t in enumerate(cells) if t is not None]
        texts = [prompts[groups[k]].get(role, "") + cells[k] for k in present]
        enc = tokenizer(
            texts,
            truncation=True,
            max_length=max_length,
            add_special_tokens=True,
            return_attention_mask=False,
            return_token_type_ids=False,
        )["input_ids"]
        ids: list = [None] * len(cells)
        for k, row_ids in zip(present, enc):
            ids[k] = row_ids
        out[role + TOKEN_SUFFIX] = ids
    return out


@dataclass(frozen=True)
class SourcePrompts:
    """One training source's prompts for :func:`pretokenize`: its ``rows`` follow the previous
    sources' rows in the dataset (``data.train.<name>.prompts``, see :mod:`cembed.model.prompts`)."""

    rows: int
    prompts: dict[str, str] = field(default_factory=dict)  # role column -> prompt (absent or "": none)
    lengths: dict[str, int] = field(default_factory=dict)  # role column -> the prompt's token count


def _prompt_groups(
    n: int, roles: list[str], prompts, prompt_lengths, sources: list[SourcePrompts] | None
) -> list[SourcePrompts]:
    """The per-source prompts, restricted to ``roles`` and non-empty prompts (one group for the
    whole dataset when ``sources`` is None)."""
    groups = sources if sources is not None else [SourcePrompts(n, prompts or {}, prompt_lengths or {})]
    out = []
    for g in groups:
        kept = {r: p for r, p in g.prompts.items() if p and r in roles}
        out.append(SourcePrompts(g.rows, kept, {r: n for r, n in g.lengths.items() if r in kept}))
    if sum(g.rows for g in out) != n:
        raise ValueError(f"the sources' prompts cover {sum(g.rows for g in out)} rows, the dataset {n}")
    return out


@dataclass
class Pretokenized:
    """A dataset with ``<role>`` text and ``<role>_input_ids`` columns, and where it came from."""

    dataset: Any
    roles: list[str]
    cache_path: Path | None
    from_cache: bool


def pretokenize(
    dataset,
    roles: list[str],
    tokenizer,
    max_seq_length: int,
    cache_dir: str | Path | None = None,
    num_proc: int | None = None,
    prompts: dict[str, str] | None = None,
    prompt_lengths: dict[str, int] | None = None,
    sources: list[SourcePrompts] | None = None,
) -> Pretokenized:
    """Tokenize each role column once (or load the cached result). A null cell (a source that does
    not map the column) stays null.

    Args:
        dataset: a ``datasets.Dataset`` with one text column per role.
        roles: the text columns, in loss order.
        tokenizer: the model's (fast) tokenizer.
        max_seq_length: truncation length in tokens, special tokens included.
        cache_dir: the cache root (``data.cache_dir``; None: the default root); tokenized datasets
            are kept in :func:`cembed.files.cache_root` ``("tokenized", cache_dir)``, entries keyed
            by ``dataset._fingerprint`` (datasets' content/transform fingerprint) among others.
        num_proc: tokenizer processes (default: up to 8 for 50k+ rows, else 1).
        prompts: ``{role: prompt}`` prepended to the role's texts before tokenizing, as
            sentence-transformers' ``Transformer.preprocess`` does (part of the cache key).
        prompt_lengths: ``{role: tokens}`` (:func:`cembed.model.prompts.prompt_lengths`), stored as a
            constant ``<role>_prompt_length`` column: the collator passes it to the model
            (``Pooling(include_prompt=False)``), the sampler compares texts without it.
        sources: per-source prompts instead of ``prompts`` / ``prompt_lengths`` (several sources,
            each with its own prompts): each source's rows get its prompts, and the
            ``<role>_prompt_length`` column holds each row's source's count (null where the source has
            no prompt for the role).

    Returns:
        :class:`Pretokenized`; ``from_cache`` tells whether tokenization was skipped.
    """
    from datasets import List, Value, load_from_disk

    groups = _prompt_groups(len(dataset), roles, prompts, prompt_lengths, sources)
    prompted = None
    same = all((g.prompts, g.lengths) == (groups[0].prompts, groups[0].lengths) for g in groups)
    if same and groups[0].prompts:  # the key of one set of prompts, as before sources had their own
        prompted = {"prompts": groups[0].prompts, "prompt_lengths": groups[0].lengths}
    elif not same:
        prompted = {"sources": [[g.rows, g.prompts, g.lengths] for g in groups]}
    key = cache_key(dataset._fingerprint, tokenizer, max_seq_length, roles, prompted)
    path = cache_root("tokenized", cache_dir) / key
    if (path / "dataset_info.json").exists():
        try:
            return Pretokenized(load_from_disk(str(path)), roles, path, True)
        except Exception:
            shutil.rmtree(path, ignore_errors=True)  # a damaged entry is rebuilt, not trusted
    if num_proc is None:
        num_proc = min(8, os.cpu_count() or 1) if len(dataset) >= 50_000 else 1
    features = dataset.features.copy()
    for role in roles:
        features[role + TOKEN_SUFFIX] = List(Value("int32"))
    tokenized = dataset.map(
        _tokenize_batch,
        batched=True,
        with_indices=True,
        batch_size=2048,
        num_proc=num_proc if num_proc > 1 else None,
        fn_kwargs={
            "roles": roles,
            "tokenizer": tokenizer,
            "max_length": max_seq_length,
            "starts": [sum(g.rows for g in groups[:i]) for i in range(len(groups))],
            "prompts": [g.prompts for g in groups],
        },
        features=features,
        desc="Tokenizing",
        load_from_cache_file=False,
    )
    for role in [r for r in roles if any(r in g.lengths for g in groups)]:
        column = [n for g in groups for n in [g.lengths.get(role)] * g.rows]
        tokenized = tokenized.add_column(role + PROMPT_SUFFIX, column, feature=Value("int32"))
    # Written to a temporary sibling, then renamed: a killed run never leaves a half-written entry.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=path.parent))
    try:
        tokenized.save_to_disk(str(tmp))
        os.replace(tmp, path)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not path.exists():
            raise
    return Pretokenized(load_from_disk(str(path)), roles, path, False)


def matches_model_preprocessing(
    model,
    collator: PaddingCollator,
    dataset,
    rows: int = 64,
    prompts: dict[str, str] | None = None,
    sources: list[SourcePrompts] | None = None,
) -> bool:
    """Whether padding the stored ids of the first ``rows`` rows (of each source, with ``sources``)
    gives exactly what ``model.preprocess`` gives for their texts with the role's prompt (ids,
    attention mask, token types, prompt length), for the columns the source maps, and no batch
    carries a column its source does not map. The ids are fetched as training fetches them
    (:class:`TokenIdRows`) and padded to the longest row, as the model pads (``pad_to_multiple_of``
    is left out)."""
    plain = replace(collator, pad_to_multiple_of=None)
    start = 0
    for group in _prompt_groups(len(dataset), collator.roles, prompts, None, sources):
        indices = list(range(start, start + min(rows, group.rows)))
        start += group.rows
        sample = dataset.select(indices)
        batch = plain(TokenIdRows(dataset, collator.roles).__getitems__(indices))
        for role in collator.roles:
            if sample[0][role] is None:  # a column this source does not map is left out of its batches
                if any(k.startswith(role + "_") for k in batch):
                    return False
                continue
            prompt = group.prompts.get(role) or None
            ref = model.preprocess(sample[role], prompt=prompt) if prompt else model.preprocess(sample[role])
            for key in ("input_ids", "attention_mask", "token_type_ids"):
                if key in ref and not torch.equal(ref[key].to(torch.int64), batch[f"{role}_{key}"]):
                    return False
            if ref.get("prompt_length") != batch.get(role + PROMPT_SUFFIX):
                return False
    return True


def tokenize_stage(
    model,
    data,
    enabled: bool,
    cache_dir: str | None,
    prompts: dict | None = None,
    pad_to_multiple_of: int | None = None,
    source_prompts: list[dict[str, str]] | None = None,
):
    """Pre-tokenize ``data`` (:class:`cembed.data.prepare.PreparedData`) for ``model`` (cached), ``prompts`` (``{role column: prompt}``)
    prepended, or leave tokenizing to the collator. Returns ``(dataset, collator or None, info)``:
    ``collator`` is ``None`` when sentence-transformers' collator (tokenizing on the fly) is used, ``info`` says why.
    ``pad_to_multiple_of`` (``batch.pad_to_multiple_of``) is applied by the pre-tokenized collator.
    ``source_prompts``: one ``{role column: prompt}`` per source of ``data.sources`` instead of ``prompts``.
    """
    roles = data.columns
    if not enabled:
        return data.dataset, None, {"pretokenized": False, "reason": "data.pretokenize is false"}
    collator = collator_for(model, roles, pad_to_multiple_of)
    if collator is None:
        return data.dataset, None, {"pretokenized": False, "reason": "the model's features are not plain token ids"}
    started = time.perf_counter()
    lengths = prompt_lengths(model, prompts or {})  # ``Pooling(include_prompt=False)`` needs them
    # One group per source, so the check below covers each source's rows (and layout).
    sizes = data.source_sizes()
    sources = [SourcePrompts(n, prompts or {}, lengths) for n in sizes]
    if source_prompts is not None:
        sources = [SourcePrompts(n, p, prompt_lengths(model, p)) for n, p in zip(sizes, source_prompts)]
    result = pretokenize(
        data.dataset, roles, model.tokenizer, model.max_seq_length, cache_dir, None, prompts, lengths, sources
    )
    if not matches_model_preprocessing(model, collator, result.dataset, prompts=prompts, sources=sources):
        return data.dataset, None, {"pretokenized": False, "reason": "stored ids differ from the model's preprocessing"}
    info = {
        "pretokenized": True,
        "from_cache": result.from_cache,
        "cache_path": str(result.cache_path),
        "seconds": round(time.perf_counter() - started, 3),
    }
    return result.dataset, collator, info
