#!/usr/bin/env python
"""Scale benchmark of cembed's data side (issue 24 item 5): cost per stage against corpus rows.

Generates a seeded synthetic pairs corpus (``anchor``: a query of 8-15 words, ``positive``: a passage
of 40-80 words, ~5 % of each column's texts a copy of an earlier row's text; words drawn from a fixed
vocabulary of pronounceable made-up words with a Zipf-like frequency) as JSONL.gz, then, for each size,
runs the stages of a training start through cembed's own functions in a FRESH Python process (so
memory figures belong to that size only):

=================  ==================================================================================
read               :func:`cembed.train.recipe.check_run_inputs` (plan, pre-flight, load the file through
                   cembed's loader, column mapping, cell checks, the distinct-text check)
model load         the ``load_model`` call inside ``build_components`` (a constant, split off so the
                   tokenize row's slope is not blurred by it)
tokenize           :func:`cembed.train.recipe.build_components` (prompts, cembed's pre-tokenization
                   ``tokenize_stage`` with a cold cache, its equivalence check, the loss) minus the
                   model load above and the cache write below
cache write        the ``Dataset.save_to_disk`` call inside :func:`cembed.data.tokens.tokenize.pretokenize`
                   (timed by wrapping that method in this process; no change to cembed)
sampler build      :func:`cembed.train.recipe.build_trainer`: the trainer, its data loader and the
                   :class:`~cembed.data.batching.full_table.NoDuplicatesSampler` training uses (row hashes and the
                   first epoch's batches, since the recipe reads ``len`` of it)
epoch batches      ``set_epoch(1)`` on that sampler and iterating every batch's indices (a new epoch's
                   batches are built on the first ``iter``)
first batch        ``next(iter(trainer.get_train_dataloader()))``: fetch + collate the first batch with
                   the real ``TokenIdRows`` / ``PaddingCollator``
=================  ==================================================================================

Measurement, per stage (the child process measures itself):

- wall s; CPU s = user+sys of the process and of its reaped children (``resource.getrusage``
  ``RUSAGE_SELF`` + ``RUSAGE_CHILDREN`` deltas; datasets' tokenizer processes at >= 50k rows are
  reaped when ``map`` ends, so they count);
- peak RSS = the kernel's exact ``VmHWM``, reset at each stage start by writing ``5`` to
  ``/proc/self/clear_refs``;
- peak anonymous memory = the maximum of ``RssAnon`` (heap, not file-backed pages such as a
  memory-mapped Arrow file) that a separate monitor process samples from ``/proc/<pid>/status`` every
  5 ms. Why a monitor process and not a thread or a subprocess per stage: the kernel keeps no
  RssAnon peak, a sampling thread stalls while C code holds the GIL (Arrow / tokenizer calls), and a
  subprocess per stage would have to redo (or reload) the earlier stages, whose memory would then
  be counted in the later stage's peak. A peak shorter than 5 ms can be missed; VmHWM bounds it.
  Memory of datasets' tokenizer worker processes (>= 50k rows) is not in these figures; their
  largest RSS is reported as ``child_maxrss_mb`` in the JSON.
- disk: bytes under this size's cembed cache (``data.cache_dir``) and datasets' cache
  (``HF_DATASETS_CACHE``), both pointed at a temporary folder per size, after the stage.

Then, per stage and figure, a least-squares line over the sizes (``numpy.polyfit``, degree 1): its
slope per row (µs/row of CPU, bytes/row of anonymous memory and disk) and the value it extrapolates
to at 100M rows.

Model: the packaged all-MiniLM-L6-v2 (offline copy; HF_HUB_OFFLINE=1 is set for the child),
max_seq_length 128, on CPU; batch ``min(--batch, rows // 4)`` (printed), no-duplicates sampler on,
``cached_mnrl``.

``--shards K`` writes the corpus as K files and points ``data.train`` at ``<folder>/*.jsonl.gz``:
this needs folder/glob sources (issue 24 item 1); without them the read stage fails with cembed's
"data file not found". Default: one file.

``--ranks N`` (N >= 2) adds, per size, a real ``cembed train CONFIG --nproc-per-node N`` (gloo, CPU,
``train.max_steps: 1``, global batch as above) on a tiny random BERT (1 layer, hidden 32) that uses
all-MiniLM-L6-v2's own tokenizer, so the data side (load, checks, tokenization, sampler, first batch)
is the real one and the model is negligible. A thread of this process samples, every 20 ms,
``RssAnon`` and ``VmHWM`` of every process under the launcher (ranks told apart by ``LOCAL_RANK`` in
their environment; a process a rank forked, such as datasets' tokenizer workers, is reported apart
as ``rank N workers``: it inherits ``LOCAL_RANK``, and its RssAnon counts pages it shares with the
rank copy-on-write) and reports each one's peak, with the least-squares slope per row of the ranks'
peak anonymous memory. Cold caches per size, so rank 0's preparation is inside its peak.

``--prepare-data`` adds, per size, ``cembed prepare-data`` on the same corpus, model and
``max_seq_length`` (a prepared source: token ids and row hashes, no text): its CPU seconds and the
bytes it leaves on disk against the raw token ids (4 B per token + 4 B per row and column).

Usage::

    python scripts/bench_scale.py [--sizes 20000,50000] [--batch 65536] [--seed 0] [--shards K]
        [--ranks N [--ranks-only]] [--prepare-data] [--workdir DIR] [--keep] [--json OUT]

Sizes of the issue: ``--sizes 100000,300000,1000000,3000000`` (hours on 2 cores; needs
~2.6 KB of disk per row).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

STAGES = ("read", "model load", "tokenize", "cache write", "sampler build", "epoch batches", "first batch")
QUERY_WORDS = (8, 15)  # inclusive
PASSAGE_WORDS = (40, 80)
DUPLICATE_SHARE = 0.05
EXTRAPOLATE_ROWS = 100_000_000

# --- the corpus --------------------------------------------------------------------------------


def vocabulary(size: int = 6000, seed: int = 1234) -> list[str]:
    """``size`` distinct pronounceable made-up words (2-4 syllables), the same for every ``seed``."""
    rng = np.random.default_rng(seed)
    onsets = "b c d f g h j k l m n p r s t v w z br ch cl dr fl gr pl sh st th tr".split()
    vowels = "a e i o u ai ea ee oo ou".split()
    codas = ["", "", "", "n", "r", "s", "t", "l", "nd", "st"]
    words: dict[str, None] = {}
    while len(words) < size:
        n = int(rng.integers(1, 4))
        parts = [onsets[rng.integers(len(onsets))] + vowels[rng.integers(len(vowels))] for _ in range(n)]
        words[("".join(parts) + codas[rng.integers(len(codas))])] = None
    return list(words)


def _texts(rng, n: int, lengths: tuple[int, int], vocab: np.ndarray, p: np.ndarray) -> list[str]:
    counts = rng.integers(lengths[0], lengths[1] + 1, size=n)
    words = vocab[rng.choice(len(vocab), size=int(counts.sum()), p=p)]
    ends = np.cumsum(counts)
    return [" ".join(words[e - c : e]) for e, c in zip(ends.tolist(), counts.tolist())]


def _duplicate(rng, texts: list[str], start: int, share: float) -> None:
    """Replace ``share`` of ``texts`` (not the first row) by a copy of an earlier row's text (earlier
    in the whole corpus: ``start`` is the global index of ``texts[0]``, ``texts`` the current chunk
    appended to the corpus so far)."""
    n = len(texts) - start
    picks = np.flatnonzero(rng.random(n) < share) + start
    for i in picks[picks > 0].tolist():
        texts[i] = texts[int(rng.integers(0, i))]


def generate_pairs(rows: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """``rows`` synthetic (query, passage) pairs: queries of 8-15 words, passages of 40-80 words,
    about 5 % of each column a copy of an earlier row's text (the rest distinct up to chance).
    Deterministic for ``(rows, seed)``."""
    rng = np.random.default_rng(seed)
    vocab = np.array(vocabulary())
    ranks = np.arange(1, len(vocab) + 1)
    p = 1.0 / (ranks + 10.0)  # Zipf-like word frequencies
    p /= p.sum()
    queries, passages = [], []
    for start in range(0, rows, 100_000):
        n = min(100_000, rows - start)
        queries += _texts(rng, n, QUERY_WORDS, vocab, p)
        passages += _texts(rng, n, PASSAGE_WORDS, vocab, p)
        _duplicate(rng, queries, start, DUPLICATE_SHARE)
        _duplicate(rng, passages, start, DUPLICATE_SHARE)
    return queries, passages


def write_corpus(folder: Path, rows: int, seed: int, shards: int = 1) -> tuple[str, int]:
    """Write the corpus of :func:`generate_pairs` as JSONL.gz (``{"anchor", "positive"}`` per line)
    into ``folder``: one ``pairs.jsonl.gz``, or ``shards`` files ``pairs-0000i-of-K.jsonl.gz`` of
    near-equal rows. Returns ``(data.train value, bytes written)``."""
    folder.mkdir(parents=True, exist_ok=True)
    queries, passages = generate_pairs(rows, seed)
    bounds = np.linspace(0, rows, shards + 1).astype(int)
    size = 0
    for k in range(shards):
        name = "pairs.jsonl.gz" if shards == 1 else f"pairs-{k:05d}-of-{shards:05d}.jsonl.gz"
        with gzip.open(folder / name, "wt", encoding="utf-8", compresslevel=1) as f:
            for q, d in zip(queries[bounds[k] : bounds[k + 1]], passages[bounds[k] : bounds[k + 1]]):
                f.write(json.dumps({"anchor": q, "positive": d}) + "\n")
        size += (folder / name).stat().st_size
    return str(folder / ("pairs.jsonl.gz" if shards == 1 else "*.jsonl.gz")), size


# --- measuring one size (child process) --------------------------------------------------------

MONITOR = r"""
import select, sys
path = f"/proc/{sys.argv[1]}/status"
def anon():
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
    except OSError:
        return 0
    return 0
peak = anon()
while True:
    ready, _, _ = select.select([sys.stdin], [], [], 0.005)
    peak = max(peak, anon())
    if ready:
        line = sys.stdin.readline()
        if not line:
            break
        print(peak, flush=True)
        peak = anon()
"""


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def folder_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (0 if it does not exist)."""
    if not path.exists():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


class StageMeter:
    """Accumulates wall, CPU and peaks per stage; :meth:`switch` ends the current stage and starts
    another (a stage entered twice adds its times and keeps the larger peaks)."""

    def __init__(self, cembed_cache: Path, hf_cache: Path) -> None:
        self.caches = (cembed_cache, hf_cache)
        self.monitor = subprocess.Popen(
            [sys.executable, "-c", MONITOR, str(os.getpid())], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.results: dict[str, dict] = {}
        self.current: str | None = None
        self.start_anon = _status_kb("RssAnon") * 1024  # after the imports, before the first stage

    def _cpu(self) -> float:
        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime

    def _anon_peak_kb(self) -> int:
        self.monitor.stdin.write("p\n")
        self.monitor.stdin.flush()
        return int(self.monitor.stdout.readline())

    def switch(self, name: str | None) -> None:
        if self.current is not None:
            wall, cpu = time.perf_counter() - self.t0, self._cpu() - self.c0
            hwm, anon = _status_kb("VmHWM"), max(self._anon_peak_kb(), _status_kb("RssAnon"))
            r = self.results.setdefault(self.current, {"wall_s": 0.0, "cpu_s": 0.0, "peak_rss": 0, "peak_anon": 0})
            r["wall_s"] += wall
            r["cpu_s"] += cpu
            r["peak_rss"] = max(r["peak_rss"], hwm * 1024)
            r["peak_anon"] = max(r["peak_anon"], anon * 1024)
            r["disk_cembed"], r["disk_datasets"] = (folder_bytes(p) for p in self.caches)
        self.current = name
        if name is not None:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self._anon_peak_kb()  # resets the monitor's peak
            self.t0, self.c0 = time.perf_counter(), self._cpu()

    def close(self) -> None:
        self.monitor.stdin.close()
        self.monitor.wait()


def _config(work: Path, train: str, batch: int):
    from cembed.config.file import config_from_dict

    raw = {
        "model": {"name_or_path": "all-MiniLM-L6-v2", "max_seq_length": 128, "device": "cpu"},
        "data": {
            "train": train,
            "columns": {"anchor": "anchor", "positive": "positive"},
            "cache_dir": str(work / "cembed-cache"),
        },
        "batch": {"per_device_train_batch_size": batch, "mini_batch_size": 32},
        "loss": {"name": "cached_mnrl"},
        "sampler": {"no_duplicates": True},
        "train": {"max_steps": 1, "seed": 42, "output_dir": str(work / "run")},
    }
    return config_from_dict(raw, source="bench_scale", base=work)


def measure_size(work: Path, train: str, batch: int) -> dict:
    """Run the stages of a training start on ``train`` in this process (see the module docstring);
    returns ``{stage: {wall_s, cpu_s, peak_rss, peak_anon, disk_cembed, disk_datasets}}`` (bytes)."""
    import datasets

    from cembed.train import recipe

    meter = StageMeter(work / "cembed-cache", Path(os.environ["HF_DATASETS_CACHE"]))
    save = datasets.Dataset.save_to_disk

    def timed_save(self, *args, **kwargs):  # the cache write inside pretokenize, as its own stage
        meter.switch("cache write")
        try:
            return save(self, *args, **kwargs)
        finally:
            meter.switch("tokenize")

    load_model = recipe.load_model

    def timed_load(*args, **kwargs):  # the model load inside build_components, as its own stage
        meter.switch("model load")
        try:
            return load_model(*args, **kwargs)
        finally:
            meter.switch("tokenize")

    datasets.Dataset.save_to_disk = timed_save
    recipe.load_model = timed_load
    cfg = _config(work, train, batch)
    meter.switch("read")
    plan, data = recipe.check_run_inputs(cfg, world_size=1)
    meter.switch("tokenize")
    parts = recipe.build_components(cfg, plan, data, "cpu")
    meter.switch("sampler build")
    (work / "run").mkdir(parents=True, exist_ok=True)
    run = recipe.build_trainer(cfg, plan, parts, recipe.RunDir(work / "run", None))
    loader = run.trainer.get_train_dataloader()
    meter.switch("first batch")
    first = next(iter(loader))
    meter.switch("epoch batches")
    sampler = getattr(loader.batch_sampler, "batch_sampler", loader.batch_sampler)
    sampler.set_epoch(1)
    batches = sum(1 for _ in sampler)
    meter.switch(None)
    meter.close()
    datasets.Dataset.save_to_disk, recipe.load_model = save, load_model
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {
        "stages": meter.results,
        "start_anon": meter.start_anon,
        "batches_per_epoch": batches,
        "rows_unplaced": run.rows_unplaced,
        "first_batch_keys": sorted(first),
        "pretokenized": parts.token_info.get("pretokenized"),
        "child_maxrss_mb": round(children / 2**20, 1),
    }


# --- several ranks (--ranks N) -----------------------------------------------------------------


def tiny_model(path: Path) -> Path:
    """A random 1-layer BERT (hidden 32) + mean pooling with all-MiniLM-L6-v2's tokenizer, saved at
    ``path`` as a sentence-transformers folder (returned): the real tokenization at a negligible
    model cost."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Pooling, Transformer
    from transformers import AutoTokenizer, BertConfig, BertModel

    from cembed.model.load import resolve_model_path

    hf = path / "hf"
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))
    tokenizer.save_pretrained(hf)
    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    BertModel(config).save_pretrained(hf)
    model = SentenceTransformer(modules=[Transformer(str(hf), max_seq_length=128), Pooling(32, "mean")], device="cpu")
    model.save(str(path / "st"))
    return path / "st"


def _proc_tree(root: int) -> list[int]:
    """``root`` and every process below it (from ``/proc/*/stat``)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += parents.get(pid, [])
    return tree


def _parent(pid: int) -> int:
    """``pid``'s parent process id (0 once gone)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _proc_memory(pid: int) -> tuple[str | None, int, int]:
    """``(LOCAL_RANK or None, RssAnon bytes, VmHWM bytes)`` of ``pid`` ((None, 0, 0) once gone)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None, 0, 0
    rank = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"LOCAL_RANK=")), None)
    values = {
        line.split(":")[0]: int(line.split()[1]) * 1024 for line in status if line.startswith(("RssAnon", "VmHWM"))
    }
    return rank, values.get("RssAnon", 0), values.get("VmHWM", 0)


def measure_ranks(work: Path, train: str, batch: int, ranks: int, env: dict) -> dict:
    """Run ``cembed train --nproc-per-node ranks`` (one step, tiny model, see the module docstring)
    and sample its processes' memory. Returns ``{"launcher": {...}, "rank 0": {...}, ...}`` with
    ``peak_anon`` / ``peak_rss`` bytes, plus ``wall_s`` and ``cpu_s`` (the whole job's user+sys)."""
    import yaml

    model = tiny_model(work / "tiny-model")
    cfg = {
        "model": {"name_or_path": str(model), "max_seq_length": 128, "device": "cpu"},
        "data": {"train": train, "cache_dir": str(work / "cembed-cache")},
        "batch": {"per_device_train_batch_size": batch // ranks, "mini_batch_size": min(256, batch // ranks)},
        "loss": {"name": "cached_mnrl"},
        "sampler": {"no_duplicates": True},
        "train": {"max_steps": 1, "seed": 42, "output_dir": str(work / "run"), "logging_steps": 1},
    }
    path = work / "ranks.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "cembed", "train", str(path), "--nproc-per-node", str(ranks)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, list] = {}  # pid -> [label, anon, hwm]

    def sample() -> None:
        while job.poll() is None:
            for pid in _proc_tree(job.pid):
                rank, anon, hwm = _proc_memory(pid)
                label = "launcher" if pid == job.pid else (f"rank {rank}" if rank is not None else None)
                if label is None:  # helper processes without LOCAL_RANK (the elastic agent's)
                    continue
                if pid != job.pid and _proc_memory(_parent(pid))[0] == rank:
                    # A process a rank forked (datasets' tokenizer workers): it inherits LOCAL_RANK, and
                    # its RssAnon counts the pages it shares with the rank copy-on-write; kept apart.
                    label += " workers"
                peak = peaks.setdefault(pid, [label, 0, 0])
                peak[1], peak[2] = max(peak[1], anon), max(peak[2], hwm)
            time.sleep(0.02)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    _, err = job.communicate()
    watcher.join()
    if job.returncode != 0:
        raise SystemExit(f"bench_scale: {' '.join(cmd)} failed (exit {job.returncode}):\n{err[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    out: dict = {
        "wall_s": round(time.perf_counter() - started, 2),
        "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2),
    }
    for label, anon, hwm in peaks.values():  # one launcher; a rank restarted by the agent keeps its peak
        prev = out.get(label, {"peak_anon": 0, "peak_rss": 0})
        out[label] = {"peak_anon": max(prev["peak_anon"], anon), "peak_rss": max(prev["peak_rss"], hwm)}
    return out


# --- fit and report ----------------------------------------------------------------------------


def fit_line(rows: list[int], values: list[float]) -> tuple[float, float]:
    """Least-squares ``(slope per row, intercept)`` of ``values`` against ``rows`` (>= 2 distinct sizes)."""
    slope, intercept = np.polyfit(np.asarray(rows, dtype=float), np.asarray(values, dtype=float), 1)
    return float(slope), float(intercept)


def _mb(b: float) -> str:
    return f"{b / 2**20:,.1f}"


def report(results: list[dict]) -> str:
    """Markdown tables: the measurements per size and stage, then the fitted slopes and the 100M
    extrapolation (with >= 2 sizes)."""
    out = [
        "| rows | batch | stage | wall s | CPU s | peak RSS MB | peak anon MB | cembed cache MB | datasets cache MB "
        "| CPU µs/row | anon over start B/row | disk B/row |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        n = r["rows"]
        for stage in [st for st in STAGES if st in r["stages"]]:
            s = r["stages"][stage]
            disk = s["disk_cembed"] + s["disk_datasets"]
            out.append(
                f"| {n:,} | {r['batch']:,} | {stage} | {s['wall_s']:.2f} | {s['cpu_s']:.2f} | {_mb(s['peak_rss'])} "
                f"| {_mb(s['peak_anon'])} | {_mb(s['disk_cembed'])} | {_mb(s['disk_datasets'])} "
                f"| {s['cpu_s'] / n * 1e6:.1f} | {(s['peak_anon'] - r['start_anon']) / n:,.0f} | {disk / n:,.0f} |"
            )
    out.append("")
    out.append("anon over start: the stage's peak RssAnon minus the process's after its imports (torch, datasets).")
    out.append(", ".join(f"{r['rows']:,} rows: input {r['input_bytes'] / r['rows']:.0f} B/row" for r in results))
    if len({r["rows"] for r in results}) < 2:
        return "\n".join(out)
    rows = [r["rows"] for r in results]
    out += [
        "",
        f"Least-squares fit over {', '.join(f'{n:,}' for n in rows)} rows; value at {EXTRAPOLATE_ROWS:,} rows:",
        "",
        "| stage | CPU µs/row | CPU s @100M | anon B/row | peak anon GB @100M | disk B/row | disk GB @100M |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    # "cache write" exists only where pre-tokenization saves its result in a second pass (before
    # issue 24's single write, which the tokenize row now includes).
    for stage in [st for st in STAGES if all(st in r["stages"] for r in results)]:
        figs = []
        for key in ("cpu_s", "peak_anon", "disk"):
            values = [
                r["stages"][stage]["disk_cembed"] + r["stages"][stage]["disk_datasets"]
                if key == "disk"
                else r["stages"][stage][key]
                for r in results
            ]
            figs.append(fit_line(rows, values))
        (cs, ci), (ms, mi), (ds, di) = figs
        at = EXTRAPOLATE_ROWS
        out.append(
            f"| {stage} | {cs * 1e6:.1f} | {cs * at + ci:,.0f} | {ms:,.0f} | {(ms * at + mi) / 1e9:,.1f} "
            f"| {ds:,.0f} | {(ds * at + di) / 1e9:,.1f} |"
        )
    return "\n".join(out)


def prepare_report(results: list[dict]) -> str:
    """Markdown table of the ``--prepare-data`` runs: CPU per row and disk per row against the raw ids."""
    out = [
        "cembed prepare-data (the prepared source, no text):",
        "",
        "| rows | wall s | CPU s | CPU µs/row | prepared B/row | left in datasets' cache B/row | raw ids B/row "
        "| disk / raw ids |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        p, n = r["prepare_data"], r["rows"]
        out.append(
            f"| {n:,} | {p['wall_s']:.1f} | {p['cpu_s']:.1f} | {p['cpu_s'] / n * 1e6:.1f} "
            f"| {p['disk_prepared'] / n:,.0f} | {p['disk_datasets_left'] / n:,.0f} | {p['raw_ids'] / n:,.0f} "
            f"| {(p['disk_prepared'] + p['disk_datasets_left']) / p['raw_ids']:.3f} |"
        )
    return "\n".join(out)


def ranks_report(results: list[dict]) -> str:
    """Markdown table of the ``--ranks`` runs (peak anonymous memory and RSS per process) and the
    least-squares slope per row of each process's peak anonymous memory (>= 2 sizes)."""
    labels = sorted({k for r in results for k in r["ranks"] if k not in ("wall_s", "cpu_s")})
    out = [
        "| rows | process | peak anon MB | peak RSS MB | anon B/row | job wall s | job CPU s |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        m = r["ranks"]
        for label in labels:
            if label in m:
                out.append(
                    f"| {r['rows']:,} | {label} | {_mb(m[label]['peak_anon'])} | {_mb(m[label]['peak_rss'])} "
                    f"| {m[label]['peak_anon'] / r['rows']:,.0f} | {m['wall_s']:.1f} | {m['cpu_s']:.1f} |"
                )
    rows = [r["rows"] for r in results]
    if len(set(rows)) >= 2:
        out.append("")
        for label in labels:
            if all(label in r["ranks"] for r in results):
                slope, intercept = fit_line(rows, [r["ranks"][label]["peak_anon"] for r in results])
                at = (slope * EXTRAPOLATE_ROWS + intercept) / 1e9
                out.append(f"- {label}: peak anon slope {slope:,.0f} B/row, {at:,.1f} GB at {EXTRAPOLATE_ROWS:,} rows")
    return "\n".join(out)


def measure_prepare_data(work: Path, train: str, batch: int, env: dict) -> dict:
    """Run ``cembed prepare-data`` (same model, max_seq_length and data as the per-stage run) into
    ``work/prepared`` and return its wall and CPU seconds (the command and its tokenizer processes),
    the bytes it leaves on disk (the prepared folder, and anything left in ``HF_DATASETS_CACHE``),
    and the raw token-id bytes it reports (4 B per token + 4 B per row and column)."""
    import yaml

    path = work / "prepare.yaml"
    cfg = _config(work, train, batch).model_dump(mode="json", exclude_none=True)
    path.write_text(yaml.safe_dump({k: cfg[k] for k in ("model", "data")}))
    out = work / "prepared"
    cmd = [sys.executable, "-m", "cembed", "prepare-data", str(path), "--output", str(out)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"bench_scale: {' '.join(cmd)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    manifest = json.loads((out / "cembed_prepared.json").read_text())
    raw = 0
    from datasets import Dataset

    for part in manifest["parts"]:  # the ids' own size: 4 B per token + 4 B per row of offsets
        table = Dataset.from_file(str(out / part["file"])).data.table
        for c in manifest["columns"]:
            column = table.column(c + "_input_ids")
            raw += 4 * (pc_sum_lengths(column) + len(column))
    return {
        "wall_s": round(wall, 2),
        "cpu_s": round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 2),
        "disk_prepared": folder_bytes(out),
        "disk_datasets_left": folder_bytes(Path(env["HF_DATASETS_CACHE"])),
        "raw_ids": raw,
    }


def pc_sum_lengths(column) -> int:
    """Total tokens of a list column."""
    import pyarrow.compute as pc

    return int(pc.sum(pc.list_value_length(column)).as_py() or 0)


# --- driver ------------------------------------------------------------------------------------


def run_size(rows: int, args, root: Path) -> dict:
    """Generate the corpus of ``rows`` rows under ``root`` and measure it in a fresh process."""
    work = root / f"rows-{rows}"
    shutil.rmtree(work, ignore_errors=True)
    started = time.perf_counter()
    train, input_bytes = write_corpus(work / "data", rows, args.seed, args.shards)
    generated = time.perf_counter() - started
    batch = min(args.batch, rows // 4)
    env = dict(
        os.environ,
        HF_DATASETS_CACHE=str(work / "hf-datasets"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join(
            filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")])
        ),
    )
    result: dict = {"stages": {}}
    if not args.ranks_only:
        cmd = [sys.executable, __file__, "--_child", str(work), train, str(batch)]
        done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise SystemExit(f"bench_scale: the {rows:,}-row run failed (exit {done.returncode}); its log is above")
        result = json.loads(done.stdout.strip().splitlines()[-1])
    result.update(rows=rows, batch=batch, input_bytes=input_bytes, generate_s=round(generated, 2))
    if args.prepare_data:
        prep_env = dict(env, HF_DATASETS_CACHE=str(work / "hf-prepare"))
        result["prepare_data"] = measure_prepare_data(work, train, batch, prep_env)
    if args.ranks > 1:
        ranks_work = work / f"ranks-{args.ranks}"
        ranks_work.mkdir()
        ranks_env = dict(env, HF_DATASETS_CACHE=str(ranks_work / "hf-datasets"))
        result["ranks"] = measure_ranks(ranks_work, train, batch - batch % args.ranks, args.ranks, ranks_env)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return result


def tokenizer_rate(rows: int, seed: int) -> dict:
    """The model's tokenizer alone on the first ``rows`` rows of the same corpus, both columns, in
    this process: batches of 2,048 texts (as pre-tokenization's ``map``), truncation at 128 tokens,
    no padding. Returns ``{rows, cpu_s, cpu_us_per_row}``: the floor the tokenize stage's CPU per row
    is compared with (issue 24: preparation at most 1.2x the tokenizer's own rate)."""
    from transformers import AutoTokenizer

    from cembed.model.load import packaged_model_dir

    queries, passages = generate_pairs(rows, seed)
    tok = AutoTokenizer.from_pretrained(str(packaged_model_dir()))
    before = resource.getrusage(resource.RUSAGE_SELF)
    for column in (queries, passages):
        for start in range(0, rows, 2048):
            tok(column[start : start + 2048], truncation=True, max_length=128)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"rows": rows, "cpu_s": round(cpu, 2), "cpu_us_per_row": round(cpu / rows * 1e6, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="20000,50000", help="comma-separated row counts")
    parser.add_argument("--batch", type=int, default=65536, help="batch (capped at rows // 4 per size)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1, help="write K files (needs folder/glob sources)")
    parser.add_argument("--ranks", type=int, default=1, help="also a real N-process gloo start per size")
    parser.add_argument(
        "--ranks-only", action="store_true", help="with --ranks N: only the N-process starts, not the per-stage run"
    )
    parser.add_argument(
        "--prepare-data", action="store_true", help="also run cembed prepare-data per size (disk and CPU)"
    )
    parser.add_argument("--workdir", default=None, help="where corpora and caches go (default: a temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep each size's corpus and caches")
    parser.add_argument("--json", default=None, help="write the raw measurements here")
    parser.add_argument(
        "--tokenizer-rate", type=int, default=0, metavar="ROWS", help="also time the tokenizer alone on ROWS rows"
    )
    parser.add_argument("--_child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._child:
        work, train, batch = args._child
        print(json.dumps(measure_size(Path(work), train, int(batch))))
        return 0
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench_scale-"))
    started = time.perf_counter()
    results = []
    for rows in sizes:
        results.append(run_size(rows, args, root))
        print(f"{rows:,} rows measured ({time.perf_counter() - started:.0f} s so far)", file=sys.stderr)
    if args.tokenizer_rate:
        results.append({"tokenizer_alone": tokenizer_rate(args.tokenizer_rate, args.seed)})
    if args.json:  # first: a report that fails must not lose a long run's figures
        Path(args.json).write_text(json.dumps(results, indent=1))
    alone = [r.pop("tokenizer_alone") for r in results if "tokenizer_alone" in r]
    results = [r for r in results if r]
    print(
        "all-MiniLM-L6-v2, max_seq_length 128, CPU, no-duplicates sampler; batch min("
        f"{args.batch:,}, rows // 4); seed {args.seed}; {args.shards} file(s) per size; "
        f"{os.cpu_count()} CPUs; {time.perf_counter() - started:.0f} s in all"
    )
    if not args.ranks_only:
        print()
        print(report(results))
    if args.ranks > 1:
        print()
        print(f"cembed train --nproc-per-node {args.ranks} (gloo, CPU, 1 step, tiny model with MiniLM's tokenizer):")
        print()
        print(ranks_report(results))
    if args.prepare_data:
        print()
        print(prepare_report(results))
    for rate in alone:
        print()
        print(
            f"tokenizer alone ({rate['rows']:,} rows, both columns, one process): {rate['cpu_s']} CPU s, "
            f"{rate['cpu_us_per_row']} CPU us/row"
        )
    if args.workdir is None and not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
