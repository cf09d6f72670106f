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

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
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
    batch: dict[str, list], roles: list[str], tokenizer, max_length: int, prompts: dict[str, str] | None = None
) -> dict[str, list]:
    # Module level: datasets.map(num_proc>1) pickles it into worker processes.
    out = {}
    for role in roles:
        prompt = (prompts or {}).get(role, "")
        enc = tokenizer(
            [prompt + t for t in batch[role]] if prompt else batch[role],
            truncation=True,
            max_length=max_length,
            add_special_tokens=True,
            return_attention_mask=False,
            return_token_type_ids=False,
        )
        out[role + TOKEN_SUFFIX] = enc["input_ids"]
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
) -> Pretokenized:
    """Tokenize each role column once (or load the cached result).

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

    Returns:
        :class:`Pretokenized`; ``from_cache`` tells whether tokenization was skipped.
    """
    from datasets import List, Value, load_from_disk

    prompts = {r: p for r, p in (prompts or {}).items() if p and r in roles}
    lengths = {r: n for r, n in (prompt_lengths or {}).items() if r in prompts}
    prompted = {"prompts": prompts, "prompt_lengths": lengths} if prompts else None
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
        batch_size=2048,
        num_proc=num_proc if num_proc > 1 else None,
        fn_kwargs={"roles": roles, "tokenizer": tokenizer, "max_length": max_seq_length, "prompts": prompts},
        features=features,
        desc="Tokenizing",
        load_from_cache_file=False,
    )
    for role, length in lengths.items():
        tokenized = tokenized.add_column(role + PROMPT_SUFFIX, [length] * len(tokenized), feature=Value("int32"))
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
    model, collator: PaddingCollator, dataset, rows: int = 64, prompts: dict[str, str] | None = None
) -> bool:
    """Whether padding the stored ids of the first ``rows`` rows gives exactly what
    ``model.preprocess`` gives for their texts with the role's prompt (ids, attention mask, token
    types, prompt length). The ids are fetched as training fetches them (:class:`TokenIdRows`) and
    padded to the longest row, as the model pads (``pad_to_multiple_of`` is left out)."""
    sample = dataset.select(range(min(rows, len(dataset))))
    plain = replace(collator, pad_to_multiple_of=None)
    batch = plain(TokenIdRows(dataset, collator.roles).__getitems__(list(range(len(sample)))))
    for role in collator.roles:
        prompt = (prompts or {}).get(role) or None
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
):
    """Pre-tokenize ``data`` (:class:`cembed.data.prepare.PreparedData`) for ``model`` (cached), ``prompts`` (``{role column: prompt}``)
    prepended, or leave tokenizing to the collator. Returns ``(dataset, collator or None, info)``:
    ``collator`` is ``None`` when sentence-transformers' collator (tokenizing on the fly) is used, ``info`` says why.
    ``pad_to_multiple_of`` (``batch.pad_to_multiple_of``) is applied by the pre-tokenized collator.
    """
    roles = data.columns
    if not enabled:
        return data.dataset, None, {"pretokenized": False, "reason": "data.pretokenize is false"}
    collator = collator_for(model, roles, pad_to_multiple_of)
    if collator is None:
        return data.dataset, None, {"pretokenized": False, "reason": "the model's features are not plain token ids"}
    started = time.perf_counter()
    lengths = prompt_lengths(model, prompts or {})  # ``Pooling(include_prompt=False)`` needs them
    result = pretokenize(data.dataset, roles, model.tokenizer, model.max_seq_length, cache_dir, None, prompts, lengths)
    if not matches_model_preprocessing(model, collator, result.dataset, prompts=prompts):
        return data.dataset, None, {"pretokenized": False, "reason": "stored ids differ from the model's preprocessing"}
    info = {
        "pretokenized": True,
        "from_cache": result.from_cache,
        "cache_path": str(result.cache_path),
        "seconds": round(time.perf_counter() - started, 3),
    }
    return result.dataset, collator, info
