"""``cembed mine-negatives``: hard negatives for a pair file, mined with sentence-transformers'
``mine_hard_negatives`` (``sentence_transformers.util.hard_negatives``), written as a file
``cembed train`` reads (``data.columns.negatives``).

What sentence-transformers does (its code, not cembed's): embed the anchors with the query prompt
and the corpus (every distinct positive) with the document prompt, take each anchor's
``range_max`` nearest candidates by cosine similarity, drop the anchor's positives (compared as
exact text), drop candidates too close to the anchor's least similar positive (``absolute_margin``:
``score + margin > positive``; ``relative_margin``: ``score > positive - |positive| x margin``), skip
the first ``range_min`` of the rest and keep the top ``num_negatives``. It prints how many
candidates each margin removed; cembed reads those counts from that output (the function returns
none) and checks them in the tests against a recount.

What cembed adds around it:

* **texts are compared as the model sees them.** sentence-transformers compares texts as strings;
  cembed first maps every text to one representative per token-id identity (the hash the
  no-duplicates sampler and ``validate`` use: :func:`cembed.data.tokens.encode.text_hashes`, ids
  after truncation, without prompt), the first such text in the data. So "the  cat sat." is "The
  cat sat." under an uncased tokenizer: as another row's positive it is the anchor's own text (or
  its positive), excluded like it, and it fills one corpus slot, not one per spelling. Because the
  mapping happens before mining, sentence-transformers fills ``num_negatives`` from distinct texts
  and a pair is short only for the reasons below. Negatives are written as the representative.
* **the anchor's own text is never its negative.** In symmetric data (caption pairs, duplicate
  questions) a text is one row's anchor and another row's positive, so it is in the corpus and
  would be its own nearest candidate. cembed adds ``(anchor, anchor)`` as a positive for each such
  anchor; sentence-transformers then excludes it like any positive (the corpus is unchanged: the
  text was in it already).
* **``group_column``** (e.g. COCO's ``image_id``): texts of one group are all positives of each
  other, so every positive of the group is excluded for every anchor of the group, not only the
  anchor's own rows' positives. Note that the margins are taken against the anchor's least similar
  positive (sentence-transformers' rule), which then includes the group's texts.
* the output keeps exactly the input's (anchor, positive) pairs (the added pairs only steer
  exclusion), one row per pair with ``negative_1..k`` columns (``columns``: pairs without ``k``
  negatives are dropped, as sentence-transformers' ``n-tuple`` does) or one row per negative
  (``rows``: column ``negative``; pairs keep the negatives found).
* **embedding cache.** ``mine_hard_negatives`` takes no precomputed embeddings; it has its own
  ``cache_folder``, whose file names hash the model's *name* (``model_card_data.base_model``), the
  prompts and the texts, but not the weights, so two fine-tuned models of one base would share
  entries. cembed therefore points it at ``<cache root>/mining/<model fingerprint>``
  (:func:`mining_cache_folder`): the same cache root (:func:`cembed.files.cache_root`) and model key
  (:func:`cembed.model.fingerprint.model_fingerprint`: weights, tokenizer, length, prompts) as
  ``cembed eval``'s corpus embeddings, with sentence-transformers' own file names inside.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from cembed.config.sources import SourceConfig, local_source
from cembed.errors import UserError, first_line

OutputFormat = Literal["columns", "rows"]
_SKIPPED = re.compile(r"Skipped ([\d,]+) potential negatives \([^)]*\) due to the (\w+) of")
_RANGE_MAX = re.compile(r"Setting range_max to (\d+)")


@dataclass
class MiningReport:
    """What :func:`mine_negatives` did. Counts are of (anchor, positive) pairs unless named otherwise.

    Attributes:
        rows_in: rows read (after ``max_samples``); ``pairs``: distinct (anchor, positive) pairs among them.
        anchors: distinct anchors; ``corpus``: distinct candidate texts (the positives); both
            counted by token ids (``variants``: texts that are another text's token ids, e.g.
            its case or spacing under an uncased tokenizer, and so compared as that text).
        self_excluded: anchors whose own text is in the corpus and was excluded as their negative.
        group_excluded: (anchor, text) exclusions added by ``group_column`` beyond the rows' own pairs.
        skipped: filter (``absolute_margin`` / ``relative_margin``) -> candidates it removed, as
            sentence-transformers counted them (0 when the filter was off or removed none).
        rows_out: rows written; ``short``: pairs without ``num_negatives`` negatives (dropped in
            ``columns``; kept with fewer in ``rows``); ``negatives``: negatives written.
        cache_hit: the corpus embeddings came from the cache.
    """

    source: str
    output: Path
    output_format: str
    model: str
    rows_in: int
    pairs: int
    anchors: int
    corpus: int
    variants: int
    num_negatives: int
    range_min: int
    range_max: int | None
    absolute_margin: float | None
    relative_margin: float | None
    self_excluded: int
    group_excluded: int
    skipped: dict[str, int]
    rows_out: int
    short: int
    negatives: int
    columns: dict[str, Any]
    prompts: dict[str, Any]
    cache_dir: str | None
    cache_hit: bool
    seconds: float
    log: list[str] = field(default_factory=list)  # sentence-transformers' printed lines

    def lines(self) -> list[str]:
        """The report as text lines: counts, what each filter removed, the file written and the
        ``data`` section that trains on it."""
        r = self
        out = [
            f"{r.source}: {r.rows_in} rows, {r.pairs} pairs, {r.anchors} anchors, {r.corpus} candidate texts; {r.model}",
            f"prompts: query {r.prompts['query']!r}, document {r.prompts['document']!r}; "
            f"ranks {r.range_min}..{r.range_max}, {r.num_negatives} negatives per pair",
            f"excluded besides each anchor's positives: its own text for {r.self_excluded} anchors, "
            f"{r.group_excluded} same-group texts; {r.variants} texts compared as another with the same "
            "token ids (case/spacing the tokenizer drops)",
        ]
        for name, count in r.skipped.items():
            value = getattr(r, name)
            out.append(f"{name} {value}: removed {count:,} candidates" if value is not None else f"{name}: off")
        kept = "dropped" if r.output_format == "columns" else "kept with fewer"
        cache = f"cache {r.cache_dir} ({'hit' if r.cache_hit else 'written'})" if r.cache_dir else "no cache"
        negs = ", ".join(r.columns["negatives"])
        return out + [
            f"{r.short} pairs had fewer than {r.num_negatives} negatives ({kept}); {cache}; {r.seconds:.1f} s",
            f"wrote {r.output}: {r.rows_out} rows, {r.negatives} negatives; train on it with",
            f"  data: {{train: {r.output}, columns: {{anchor: {r.columns['anchor']}, "
            f"positive: {r.columns['positive']}, negatives: [{negs}]}}}}",
        ]


def _mined_source(data):
    """``(source config, how messages name it)`` of ``mine_negatives``' ``data``: a path (or
    ``cembed:<sample>``) is a file source, or a saved source for a ``save_to_disk`` folder
    (:func:`cembed.config.sources.local_source`); a source config of a kind that
    :attr:`~cembed.config.sources.SourceConfig.can_mine`.

    Raises:
        UserError: a source config of a kind that cannot be mined.
    """
    from cembed.samples import resolve_sample

    if not isinstance(data, SourceConfig):  # the command line's path
        return local_source(str(resolve_sample(data) or data)), data
    if not data.can_mine:
        raise UserError(f"{data.label}: a {data.kind} source cannot be mined (mine-negatives reads text pairs)")
    return data, data.label


def _load_pairs(
    source: SourceConfig, data: str, anchor: str, positive: str, group: str | None, max_samples: int | None
):
    from cembed.data.load import check_cells
    from cembed.data.sources.registry import load_source, row_locator

    raw = load_source(source)
    if len(raw) == 0:
        raise UserError(f"{data}: the data has no rows")
    for flag, col in (("--anchor-column", anchor), ("--positive-column", positive), ("--group-column", group)):
        if col is not None and col not in raw.column_names:
            raise UserError(
                f"{data}: column {col!r} ({flag}) not found; the data has columns: {', '.join(raw.column_names)}"
            )
    if anchor == positive:
        raise UserError("--anchor-column and --positive-column name the same column; each needs its own")
    if max_samples is not None and max_samples < len(raw):
        raw = raw.select(range(max_samples))
    texts, _ = check_cells(raw.select_columns([anchor, positive]), data, {}, False, row_locator(source))
    groups = raw[group] if group else None
    return list(texts[anchor]), list(texts[positive]), groups


def canonical_texts(texts: list[str], hashes) -> tuple[dict[str, str], int]:
    """Each distinct text -> the first of ``texts`` with its hash (``hashes[i]`` of ``texts[i]``:
    its token-id identity, :func:`_identity_hashes`), so texts the model cannot tell apart become one
    string that sentence-transformers' exact-text comparisons see as one.

    Returns:
        ``(mapping, variants)``: ``variants`` counts the texts mapped to another text.
    """
    first: dict[int, str] = {}
    canon = {t: first.setdefault(int(h), t) for t, h in zip(texts, hashes)}
    return canon, sum(1 for t, c in canon.items() if t != c)


def _identity_hashes(model, texts: list[str]):
    """The texts' token-id hashes as ``model`` sees them, as the no-duplicates sampler computes them.

    A transformers tokenizer (the Transformer module) truncates at the model's ``max_seq_length``;
    where the model has no finite one (None, or a module that reads any length), at the tokenizer's
    own ``model_max_length`` when that is a real limit, else not at all (every token is seen). A
    ``tokenizers`` tokenizer (StaticEmbedding's: its ``max_seq_length`` is infinite) gives the ids
    its module embeds, ``encode_batch`` without special tokens and with its own truncation, if it
    has one (:func:`_static_hashes`). A model without a tokenizer compares raw text."""
    from cembed.data.identity import hash_texts
    from cembed.data.tokens.encode import text_hashes

    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        return hash_texts(texts)
    if not callable(tokenizer) and hasattr(tokenizer, "encode_batch"):  # a tokenizers.Tokenizer
        return _static_hashes(tokenizer, texts)
    return text_hashes(tokenizer, texts, token_limit(getattr(model, "max_seq_length", None), tokenizer))


# transformers' VERY_LARGE_INTEGER (int(1e30)) marks a tokenizer saved without a length limit; any
# model_max_length this large is no limit either.
_NO_LIMIT = 10**12


def token_limit(max_seq_length, tokenizer) -> int:
    """Tokens per text a model with ``max_seq_length`` (a number, ``inf`` or None) and a transformers
    ``tokenizer`` sees: the finite ``max_seq_length``, else the tokenizer's ``model_max_length`` when
    it is a real limit, else every token (:data:`_NO_LIMIT`)."""
    for limit in (max_seq_length, getattr(tokenizer, "model_max_length", None)):
        if isinstance(limit, (int, float)) and math.isfinite(limit) and 0 < limit < _NO_LIMIT:
            return int(limit)
    return _NO_LIMIT


def _static_hashes(tokenizer, texts: list[str]):
    """Hashes (:func:`cembed.data.identity.hash_token_ids`) of the ids a ``tokenizers.Tokenizer``
    gives ``texts`` the way StaticEmbedding calls it (``encode_batch``, no special tokens, the
    tokenizer's own truncation), shape ``(len(texts),)`` uint64."""
    import numpy as np
    import pyarrow as pa

    from cembed.data.identity import hash_token_ids

    out = np.empty(len(texts), dtype=np.uint64)
    for start in range(0, len(texts), _HASH_SLICE):
        part = tokenizer.encode_batch(texts[start : start + _HASH_SLICE], add_special_tokens=False)
        out[start : start + len(part)] = hash_token_ids(pa.array([e.ids for e in part], type=pa.list_(pa.int64())))
    return out


_HASH_SLICE = 65_536  # texts tokenized at once (bounds the id lists held)


def exclusion_pairs(anchors: list[str], positives: list[str], groups: list | None = None) -> tuple[list, int, int]:
    """The (anchor, text) pairs to add as positives so that they are excluded as negatives.

    Returns:
        ``(extra pairs, anchors excluded from themselves, group exclusions)``: ``(a, a)`` for each
        distinct anchor whose text is in the corpus (some row's positive), and with ``groups`` (one
        value per row) ``(a, p)`` for every positive ``p`` of ``a``'s group that is not already a
        positive of ``a``. No added text is new to the corpus.
    """
    corpus = set(positives)
    own: dict[str, set[str]] = {}
    for a, p in zip(anchors, positives):
        own.setdefault(a, set()).add(p)
    extra = [(a, a) for a in own if a in corpus and a not in own[a]]
    n_self = len(extra)
    n_group = 0
    if groups is not None:
        by_group: dict[Any, set[str]] = {}
        anchor_groups: dict[str, set] = {}
        for a, p, g in zip(anchors, positives, groups):
            by_group.setdefault(g, set()).add(p)
            anchor_groups.setdefault(a, set()).add(g)
        for a, gs in anchor_groups.items():
            for text in sorted(set().union(*(by_group[g] for g in gs)) - own[a] - {a}):
                extra.append((a, text))
                n_group += 1
    return extra, n_self, n_group


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    from cembed.files import write_atomic

    payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
    if path.name.lower().endswith(".gz"):
        payload = gzip.compress(payload, mtime=0)
    write_atomic(path, lambda f: f.write(payload), binary=True)


def mine_negatives(
    data: str | SourceConfig,
    model_name: str,
    output: Path,
    anchor_column: str = "anchor",
    positive_column: str = "positive",
    num_negatives: int = 3,
    range_min: int = 0,
    range_max: int | None = None,
    relative_margin: float | None = None,
    absolute_margin: float | None = None,
    output_format: OutputFormat = "columns",
    group_column: str | None = None,
    max_samples: int | None = None,
    batch_size: int = 32,
    device: str = "auto",
    cache_dir: Path | None = None,
    no_cache: bool = False,
) -> MiningReport:
    """Mine ``num_negatives`` hard negatives per (anchor, positive) pair of ``data`` (a pair file,
    ``cembed:<sample>``, or a source config of any kind that :attr:`~cembed.config.sources.SourceConfig.can_mine`)
    with ``model_name`` and write them to ``output`` (``.jsonl`` or ``.jsonl.gz``, atomically).

    Ranks, margins and the output layout: see the module docstring. Queries get the model's query
    prompt, the corpus its document prompt (:func:`cembed.model.prompts.resolve_prompts`, as in training
    and evaluation). Prints nothing: sentence-transformers' statistics are captured into ``log``,
    its progress bars (stderr) show.

    Returns:
        A :class:`MiningReport`.

    Raises:
        UserError: a missing file or column, a bad cell (naming line and column), an output that is
            not ``.jsonl[.gz]``, an impossible rank range, a model that cannot be loaded or that is not
            one dense vector per text (a sparse or multi-vector model).
    """
    from datasets import Dataset

    from cembed.model.load import load_eval_model, quiet_libraries
    from cembed.model.prompts import resolve_prompts

    _check_arguments(output, output_format, num_negatives, range_min, range_max)
    started = time.perf_counter()
    source, shown = _mined_source(data)
    anchors, positives, groups = _load_pairs(source, shown, anchor_column, positive_column, group_column, max_samples)
    pairs = list(dict.fromkeys(zip(anchors, positives)))
    quiet_libraries()
    model = load_eval_model(model_name, device)
    _check_dense(model, model_name)
    distinct = list(dict.fromkeys(anchors + positives))
    canon, n_variants = canonical_texts(distinct, _identity_hashes(model, distinct))
    anchors, positives = [canon[a] for a in anchors], [canon[p] for p in positives]
    mined_pairs = list(dict.fromkeys(zip(anchors, positives)))
    extra, n_self, n_group = exclusion_pairs(anchors, positives, groups)
    prompts = resolve_prompts(None, model)
    cache = None if no_cache else mining_cache_folder(model, cache_dir)
    mined_input = Dataset.from_dict(
        {"anchor": [a for a, _ in mined_pairs + extra], "positive": [p for _, p in mined_pairs + extra]}
    )
    settings = {
        "range_min": range_min,
        "range_max": range_max,
        "absolute_margin": absolute_margin,
        "relative_margin": relative_margin,
        "num_negatives": num_negatives,
        "batch_size": batch_size,
    }
    mined, log = _run_library(mined_input, model, model_name, prompts, settings, output_format, cache)
    skipped, range_max = _read_library_log(log, range_max)
    rows, neg_cols, short = _output_rows(
        mined, pairs, canon, anchor_column, positive_column, num_negatives, output_format
    )
    _write_jsonl(output, rows)
    columns = {"anchor": anchor_column, "positive": positive_column, "negatives": neg_cols}
    return MiningReport(
        source=shown,
        output=output,
        output_format=output_format,
        model=model_name,
        rows_in=len(anchors),
        pairs=len(pairs),
        anchors=len(set(anchors)),
        corpus=len(set(positives)),
        variants=n_variants,
        num_negatives=num_negatives,
        range_min=range_min,
        range_max=range_max,
        absolute_margin=absolute_margin,
        relative_margin=relative_margin,
        self_excluded=n_self,
        group_excluded=n_group,
        skipped=skipped,
        rows_out=len(rows),
        short=short,
        negatives=len(rows) * len(neg_cols),
        columns=columns,
        prompts={"query": prompts.anchor, "document": prompts.positive},
        cache_dir=str(cache) if cache else None,
        cache_hit=any("[Cache] Loaded corpus embeddings" in line for line in log),
        seconds=round(time.perf_counter() - started, 2),
        log=log,
    )


def mining_cache_folder(model, cache_dir: str | Path | None = None) -> Path:
    """The folder given to sentence-transformers' ``mine_hard_negatives(cache_folder=...)`` for ``model``:
    :func:`cembed.files.cache_root` ``("mining", cache_dir)`` / :func:`cembed.model.fingerprint.model_fingerprint`
    (``cache_dir``: ``--cache-dir``; None: the default root). Not created here."""
    from cembed.files import cache_root
    from cembed.model.fingerprint import model_fingerprint

    return cache_root("mining", cache_dir) / model_fingerprint(model)


def _check_dense(model, model_name: str) -> None:
    """Refuse a model that is not one dense vector per text: the installed sentence-transformers'
    ``mine_hard_negatives`` (6.3) encodes with ``normalize_embeddings=True, convert_to_numpy=True`` and ranks
    one dense vector per text: ``SparseEncoder.encode`` refuses those keywords (ValueError), a
    ``MultiVectorEncoder``'s ragged token arrays do not stack (tests/data/test_field_cases_sparse_data.py
    checks that the library still fails with a sparse model).

    Raises:
        UserError: naming the model's kind, that the installed library cannot mine with it, and what to do instead.
    """
    import sentence_transformers

    from cembed.config.model import OUTPUT_WORDS
    from cembed.model.kinds.lookup import kind_of

    kind = kind_of(model)
    output = kind.config_class.output
    if output != "vector":
        raise UserError(
            f"--model {model_name}: a {kind.name} model ({OUTPUT_WORDS.get(output, output)}); the installed "
            f"sentence-transformers {sentence_transformers.__version__} cannot mine with a {kind.name} model (its "
            "mine_hard_negatives ranks one dense vector per text, encoded with normalize_embeddings, convert_to_numpy): "
            "mine with a dense model (e.g. all-MiniLM-L6-v2), then train this one on the mined file"
        )


def _check_arguments(
    output: Path, output_format: str, num_negatives: int, range_min: int, range_max: int | None
) -> None:
    """Refuse an output sentence-transformers cannot write for training, or an impossible rank range."""
    if not output.name.lower().endswith((".jsonl", ".jsonl.gz")):
        raise UserError(f"--output {output}: write .jsonl or .jsonl.gz (a file `cembed train` reads)")
    if output_format not in ("columns", "rows"):
        raise UserError(f"--output-format {output_format!r}: use columns (negative_1..k) or rows (one per negative)")
    if num_negatives < 1 or range_min < 0 or (range_max is not None and range_max - range_min < num_negatives):
        raise UserError(
            f"--num-negatives {num_negatives}, --range-min {range_min}, --range-max {range_max}: need "
            "num_negatives >= 1, range_min >= 0 and range_max - range_min >= num_negatives"
        )


def _run_library(mined_input, model, model_name: str, prompts, settings: dict, output_format: str, cache: Path | None):
    """sentence-transformers' ``mine_hard_negatives`` on the pairs (and the added exclusion pairs),
    its printed statistics captured. Returns ``(mined dataset, non-empty printed lines)``.

    Raises:
        UserError: the library refused the arguments or failed (one line: its exception's type and
            first line, naming ``--model``), never its traceback.
    """
    from sentence_transformers.util import mine_hard_negatives

    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            mined = mine_hard_negatives(
                mined_input,
                model,
                anchor_column_name="anchor",
                positive_column_name="positive",
                sampling_strategy="top",
                query_prompt=prompts.anchor,
                corpus_prompt=prompts.positive,
                output_format="n-tuple" if output_format == "columns" else "triplet",
                verbose=True,
                cache_folder=str(cache) if cache else None,
                **settings,
            )
    except ValueError as err:  # sentence-transformers' own argument checks (rank range vs corpus)
        raise UserError(f"mine-negatives: {' '.join(str(err).split())}") from None
    except Exception as err:  # noqa: BLE001 - any other library failure is one line, not its traceback
        raise UserError(
            f"mine-negatives --model {model_name}: sentence-transformers' mine_hard_negatives failed: "
            f"{type(err).__name__}: {first_line(err)}"
        ) from None
    return mined, [line for line in captured.getvalue().splitlines() if line.strip()]


def _read_library_log(log: list[str], range_max: int | None) -> tuple[dict[str, int], int | None]:
    """From sentence-transformers' printed lines: candidates each margin filter removed, and the
    ``range_max`` it chose when none was given. Returns ``(skipped, range_max)``."""
    skipped = {"absolute_margin": 0, "relative_margin": 0}
    for line in log:
        match = _SKIPPED.search(line)
        if match:
            skipped[match.group(2)] = int(match.group(1).replace(",", ""))
        derived = _RANGE_MAX.search(line)
        if derived and range_max is None:
            range_max = int(derived.group(1))  # sentence-transformers' default, reported
    return skipped, range_max


def _output_rows(
    mined,
    pairs: list[tuple[str, str]],
    canon: dict[str, str],
    anchor_column: str,
    positive_column: str,
    num_negatives: int,
    output_format: str,
) -> tuple[list[dict], list[str], int]:
    """The rows to write: the input's pairs only (the added exclusion pairs dropped), in input order,
    each with its texts as the input spells them and the negatives mined for its representative pair
    (``canon``: :func:`canonical_texts`), in the input's column names. Returns ``(rows, negative
    columns, pairs short of num_negatives)``.

    Raises:
        UserError: no pair got ``num_negatives`` negatives.
    """
    neg_cols = [f"negative_{i}" for i in range(1, num_negatives + 1)] if output_format == "columns" else ["negative"]
    found: dict[tuple[str, str], list[dict]] = {}  # representative pair -> its negatives' cells, one per row
    for row in mined:
        found.setdefault((row["anchor"], row["positive"]), []).append({c: row[c] for c in neg_cols})
    # Looking up the input's pairs leaves out the added exclusion pairs.
    rows = [
        {anchor_column: a, positive_column: p, **cells}
        for a, p in pairs
        for cells in found.get((canon[a], canon[p]), [])
    ]
    if output_format == "columns":
        short = len(pairs) - len(rows)
    else:
        per_pair: dict[tuple[str, str], int] = {}
        for row in rows:
            key = (row[anchor_column], row[positive_column])
            per_pair[key] = per_pair.get(key, 0) + 1
        short = sum(1 for p in pairs if per_pair.get(p, 0) < num_negatives)
    if not rows:
        raise UserError(
            f"mine-negatives: no pair got {num_negatives} negatives; lower --num-negatives or the margins, "
            "or raise --range-max"
        )
    return rows, neg_cols, short
