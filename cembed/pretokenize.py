"""Pre-tokenization: tokenize every text column once, cache it on disk, pad in the collator.

Tokenizing 16k pairs per batch in the main process stalls a fast GPU for seconds; padding ids that
were tokenized ahead of time takes milliseconds. :func:`pretokenize` adds a ``<role>_input_ids``
column (int32 lists, special tokens included, truncated to ``max_seq_length``) next to each text
column, with the model's own fast tokenizer, batched and in several processes. The result is saved
under the cache folder keyed by the data's fingerprint, the tokenizer and ``max_seq_length``, so a
later run with the same inputs loads it instead of tokenizing again.

:class:`PaddingCollator` then only pads and stacks ids. It holds no reference to the model, so it
pickles cheaply into ``dataloader_num_workers`` worker processes.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from cembed.model import tokenizer_spec
from cembed.prompts import prompt_lengths

# Bump when the stored layout changes, so old caches are not reused.
FORMAT_VERSION = "1"
TOKEN_SUFFIX = "_input_ids"
PROMPT_SUFFIX = "_prompt_length"  # a constant int column next to a prompted role's ids


def default_cache_dir() -> Path:
    """``$CEMBED_CACHE_DIR`` or ``~/.cache/cembed``."""
    return Path(os.environ.get("CEMBED_CACHE_DIR", Path.home() / ".cache" / "cembed"))


def tokenizer_fingerprint(tokenizer) -> str:
    """xxh64 of the tokenizer's definition (:func:`cembed.model.tokenizer_spec`: vocab, normalizer,
    special tokens, post-processor; not the state of its last call)."""
    return xxhash.xxh64_hexdigest(tokenizer_spec(tokenizer).encode("utf-8"))


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
        cache_dir: where tokenized datasets are kept (default :func:`default_cache_dir`); ``None``
            entries are keyed by ``dataset._fingerprint`` (datasets' content/transform fingerprint).
        num_proc: tokenizer processes (default: up to 8 for 50k+ rows, else 1).
        prompts: ``{role: prompt}`` prepended to the role's texts before tokenizing, as
            sentence-transformers' ``Transformer.preprocess`` does (part of the cache key).
        prompt_lengths: ``{role: tokens}`` (:func:`cembed.prompts.prompt_lengths`), stored as a
            constant ``<role>_prompt_length`` column: the collator passes it to the model
            (``Pooling(include_prompt=False)``), the sampler compares texts without it.

    Returns:
        :class:`Pretokenized`; ``from_cache`` tells whether tokenization was skipped.
    """
    from datasets import List, Value, load_from_disk

    cache_root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    prompts = {r: p for r, p in (prompts or {}).items() if p and r in roles}
    lengths = {r: n for r, n in (prompt_lengths or {}).items() if r in prompts}
    prompted = {"prompts": prompts, "prompt_lengths": lengths} if prompts else None
    key = cache_key(dataset._fingerprint, tokenizer, max_seq_length, roles, prompted)
    path = cache_root / "tokenized" / key
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


@dataclass
class PaddingCollator:
    """Pad pre-tokenized ids into the batch layout sentence-transformers' collator produces.

    For each role: ``<role>_input_ids`` and ``<role>_attention_mask`` (int64, shape ``(rows,
    longest)``, right padding), ``<role>_token_type_ids`` (zeros) if the model uses them, plus the
    model's constant non-tensor features (e.g. ``modality: 'text'``) and, for a prompted role, the
    int ``<role>_prompt_length`` read from the rows (as sentence-transformers' collator passes it).
    Text columns are ignored.
    """

    roles: list[str]
    pad_token_id: int
    token_type_ids: bool = True
    constants: dict[str, Any] = field(default_factory=dict)
    valid_label_columns: list[str] = field(default_factory=list)  # read by the trainer

    def pad(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask)``, both ``(len(seqs), max_len)`` int64."""
        lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        width = int(lengths.max()) if len(seqs) else 0
        mask = np.arange(width)[None, :] < lengths[:, None]
        ids = np.full((len(seqs), width), self.pad_token_id, dtype=np.int64)
        # Boolean assignment fills row-major, i.e. each row's first len(row) slots, in order.
        ids[mask] = np.fromiter((t for s in seqs for t in s), dtype=np.int64, count=int(lengths.sum()))
        return torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64))

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        batch: dict[str, Any] = {}
        for role in self.roles:
            ids, mask = self.pad([r[role + TOKEN_SUFFIX] for r in rows])
            batch[f"{role}_input_ids"] = ids
            if self.token_type_ids:
                batch[f"{role}_token_type_ids"] = torch.zeros_like(ids)
            batch[f"{role}_attention_mask"] = mask
            for key, value in self.constants.items():
                batch[f"{role}_{key}"] = value
            if rows and role + PROMPT_SUFFIX in rows[0]:
                batch[role + PROMPT_SUFFIX] = int(rows[0][role + PROMPT_SUFFIX])
        return batch


def collator_for(model, roles: list[str]) -> PaddingCollator | None:
    """A :class:`PaddingCollator` matching ``model.preprocess`` output keys, or ``None`` when the
    model's text features are more than ids/mask/token types (then pre-tokenization is not used)."""
    sample = model.preprocess(["a"])
    tensors = {k for k, v in sample.items() if isinstance(v, torch.Tensor)}
    if not tensors <= {"input_ids", "attention_mask", "token_type_ids"} or "input_ids" not in tensors:
        return None
    tokenizer = model.tokenizer
    if getattr(tokenizer, "padding_side", "right") != "right" or tokenizer.pad_token_id is None:
        return None
    constants = {k: v for k, v in sample.items() if not isinstance(v, torch.Tensor)}
    return PaddingCollator(roles, tokenizer.pad_token_id, "token_type_ids" in tensors, constants)


def matches_model_preprocessing(
    model, collator: PaddingCollator, dataset, rows: int = 64, prompts: dict[str, str] | None = None
) -> bool:
    """Whether padding the stored ids of the first ``rows`` rows gives exactly what
    ``model.preprocess`` gives for their texts with the role's prompt (ids, attention mask, token
    types, prompt length)."""
    sample = dataset.select(range(min(rows, len(dataset))))
    batch = collator(list(sample))
    for role in collator.roles:
        prompt = (prompts or {}).get(role) or None
        ref = model.preprocess(sample[role], prompt=prompt) if prompt else model.preprocess(sample[role])
        for key in ("input_ids", "attention_mask", "token_type_ids"):
            if key in ref and not torch.equal(ref[key].to(torch.int64), batch[f"{role}_{key}"]):
                return False
        if ref.get("prompt_length") != batch.get(role + PROMPT_SUFFIX):
            return False
    return True


def tokenize_stage(model, data, enabled: bool, cache_dir: str | None, prompts: dict | None = None):
    """Pre-tokenize ``data`` (:class:`cembed.data.PreparedData`) for ``model`` (cached), ``prompts`` (``{role column: prompt}``)
    prepended, or leave tokenizing to the collator. Returns ``(dataset, collator or None, info)``:
    ``collator`` is ``None`` when sentence-transformers' collator (tokenizing on the fly) is used, ``info`` says why.
    """
    roles = data.columns
    if not enabled:
        return data.dataset, None, {"pretokenized": False, "reason": "data.pretokenize is false"}
    collator = collator_for(model, roles)
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
