"""Shared fixtures: a tiny random BERT sentence-transformer built in the test (no downloads), the
real data (in the repository: the packaged COCO pairs, tests/fixtures; the larger optional sets in
../shared/data, which a clone may not have), and a small config writer."""

from __future__ import annotations

import json
import os
import string
import textwrap
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch (OpenMP) thread per test process and, through the environment, per CLI subprocess and rank
# it starts: `make test` runs 2 xdist workers on CI's 2 cores, and 2 threads each (torch's default there)
# oversubscribe them: OpenMP's waiting threads spin. Four heavy test files (test_packed_paths,
# test_packed_models, test_sweep, test_loss_options; 148 tests, -n 2, 2 cores) took 555 s with the
# default and 90 s with one thread. Set OMP_NUM_THREADS to override.
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"  # optional: full SciFact, the batch-size study
TESTS_DATA = REPO / "tests" / "fixtures"  # built by scripts/make_test_data.py, with licences
COCO_PAIRS = REPO / "cembed" / "samples" / "coco_captions" / "train_pairs.jsonl.gz"  # cembed:coco-captions
COCO_HELDOUT = REPO / "cembed" / "samples" / "coco_captions" / "heldout"  # cembed:coco-captions-heldout
STS_TEST = TESTS_DATA / "stsbenchmark" / "sts-test.csv.gz"
SCIFACT_TEST_SUBSET = TESTS_DATA / "scifact-test-subset"  # BEIR folder: 2,339 abstracts, test queries/qrels
REFERENCE = TESTS_DATA / "reference_scores"  # published MTEB results

WORDS = (
    "a an the of on in with and to is are at for by man woman people dog cat train table street "
    "sitting standing two large small white black red blue next near top car room plate food bus"
).split()


def tiny_tokenizer():
    """A WordPiece tokenizer over ``WORDS``, single characters and ``##`` characters (about 120 tokens)."""
    from transformers import BertTokenizerFast

    chars = list(string.ascii_lowercase + string.digits + ".,'!?-")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + chars + ["##" + c for c in chars] + WORDS
    return BertTokenizerFast(vocab={t: i for i, t in enumerate(dict.fromkeys(vocab))}, do_lower_case=True)


def make_tiny_model(
    path: Path, dropout: float = 0.0, seed: int = 0, hidden: int = 32, layers: int = 1, positions: int = 256
) -> Path:
    """Build and save a random 1-layer BERT + mean pooling SentenceTransformer at ``path`` (its
    position table has ``positions`` entries; max_seq_length min(64, positions))."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Pooling, Transformer
    from transformers import BertConfig, BertModel

    path = Path(path)
    hf_dir = path / "hf"
    hf_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(hf_dir)
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=positions,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    BertModel(config).save_pretrained(hf_dir)
    transformer = Transformer(str(hf_dir), max_seq_length=min(64, positions))
    model = SentenceTransformer(modules=[transformer, Pooling(hidden, "mean")], device="cpu")
    st_dir = path / "st"
    model.save(str(st_dir))
    return st_dir


def make_static_model(
    path: Path, dim: int = 16, seed: int = 0, truncation: int | None = None, prompts: dict | None = None
) -> Path:
    """Build and save a random StaticEmbedding SentenceTransformer (an embedding bag over the tiny
    uncased WordPiece vocabulary of :func:`make_tiny_model`; ``max_seq_length`` infinite) at ``path``;
    ``truncation``: the tokenizer's own limit (tokens), ``prompts``: the model's prompts."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding
    from transformers import BertTokenizerFast

    chars = list(string.ascii_lowercase + string.digits + ".,'!?-")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + chars + ["##" + c for c in chars] + WORDS
    tokenizer = BertTokenizerFast(vocab={t: i for i, t in enumerate(dict.fromkeys(vocab))}, do_lower_case=True)
    torch.manual_seed(seed)
    module = StaticEmbedding(tokenizer, embedding_dim=dim)
    if truncation is not None:
        module.tokenizer.enable_truncation(max_length=truncation)
    model = SentenceTransformer(modules=[module], device="cpu", prompts=prompts)
    model.save(str(path))
    return Path(path)


def make_other_kind_folders(path: Path, st_dir: Path) -> dict[str, Path]:
    """Save the three other sentence-transformers model types built on the tiny BERT of ``st_dir``
    (:func:`make_tiny_model`) under ``path``: ``SparseEncoder`` (MLM head + SPLADE max pooling),
    ``MultiVectorEncoder`` (token projection to 16, mask, normalize) and ``CrossEncoder`` (one label).
    Returns model type -> folder."""
    import shutil

    import torch
    from sentence_transformers import CrossEncoder, MultiVectorEncoder, SparseEncoder
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask
    from transformers import BertForMaskedLM

    hf = Path(st_dir).parent / "hf"
    torch.manual_seed(1)
    mlm = path / "mlm"
    BertForMaskedLM.from_pretrained(str(hf)).save_pretrained(mlm)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        if (hf / name).is_file():
            shutil.copy(hf / name, mlm / name)
    out = {
        "SparseEncoder": path / "sparse",
        "MultiVectorEncoder": path / "multi_vector",
        "CrossEncoder": path / "cross",
    }
    SparseEncoder(str(mlm), device="cpu").save(str(out["SparseEncoder"]))
    transformer = Transformer(str(hf), max_seq_length=64)
    dense = Dense(
        transformer.get_embedding_dimension(),
        16,
        bias=False,
        activation_function=torch.nn.Identity(),
        module_input_name="token_embeddings",
    )
    mve = MultiVectorEncoder(
        modules=[transformer, dense, MultiVectorMask(), Normalize(module_input_name="token_embeddings")], device="cpu"
    )
    mve.save(str(out["MultiVectorEncoder"]))
    CrossEncoder(str(hf), num_labels=1, device="cpu").save(str(out["CrossEncoder"]))
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def other_kind_dirs(tmp_path_factory, tiny_model_dir) -> dict[str, Path]:
    return make_other_kind_folders(tmp_path_factory.mktemp("other_kinds"), tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_dropout_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_dropout"), dropout=0.1)


@pytest.fixture
def write_config(tmp_path):
    """Write a config mapping (or raw text) to tmp_path/config.yaml and return its path."""

    def _write(content, name: str = "config.yaml") -> Path:
        p = tmp_path / name
        p.write_text(content if isinstance(content, str) else yaml.safe_dump(content, sort_keys=False))
        return p

    return _write


@pytest.fixture
def pairs_file(tmp_path):
    """Write rows as JSONL and return the path."""
    import json

    def _write(rows, name: str = "pairs.jsonl") -> Path:
        p = tmp_path / name
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return p

    return _write


def distinct_pairs(n: int) -> list[dict]:
    return [{"anchor": f"question number {i}", "positive": f"answer text {i}"} for i in range(n)]


def write_toy_beir(root: Path, docs: dict[str, str], queries: dict[str, str], qrels: dict[str, set[str]]) -> Path:
    """A BEIR folder at ``root``: ``corpus.jsonl`` (``_id``, ``text``), ``queries.jsonl`` and
    ``qrels/test.tsv`` (every pair in ``qrels`` graded 1). Returns ``root``."""
    root.mkdir(parents=True)
    (root / "corpus.jsonl").write_text("".join(json.dumps({"_id": i, "text": t}) + "\n" for i, t in docs.items()))
    (root / "queries.jsonl").write_text("".join(json.dumps({"_id": i, "text": t}) + "\n" for i, t in queries.items()))
    (root / "qrels").mkdir()
    rows = "".join(f"{q}\t{d}\t1\n" for q, ds in qrels.items() for d in sorted(ds))
    (root / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + rows)
    return root


def save_with_similarity(model_dir: Path, folder: Path, similarity: str | None, normalize=False, prompts=None) -> Path:
    """The SentenceTransformer at ``model_dir`` saved to ``folder`` declaring ``similarity_fn_name``
    ``similarity`` (a ``Normalize`` module appended with ``normalize``; ``prompts`` saved with it)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Normalize

    model = SentenceTransformer(str(model_dir), device="cpu", similarity_fn_name=similarity, prompts=prompts)
    if normalize:
        model.append(Normalize())
    model.save(str(folder))
    return folder


def install_distribution(site: Path, name: str, files: dict[str, str], entry_points: dict[str, dict[str, str]]) -> Path:
    """Write an installed distribution ``name`` 0.1 into the folder ``site`` (as pip would into
    site-packages): its ``files`` (path under ``site`` -> source) and ``<name>-0.1.dist-info`` with
    ``METADATA`` and ``entry_points.txt`` (group -> {entry point name: ``module:attr``}). Put ``site``
    on ``sys.path`` (``monkeypatch.syspath_prepend``, which clears importlib's caches) or on a
    subprocess's ``PYTHONPATH`` and ``importlib.metadata`` finds it."""
    for path, text in files.items():
        (site / path).parent.mkdir(parents=True, exist_ok=True)
        (site / path).write_text(textwrap.dedent(text))
    # The folder's name escapes "-" as the wheel format says: importlib.metadata reads the project
    # name as the stem up to the first "-", so "cembed-test-hang-0.1.dist-info" would read as
    # "cembed" and be shadowed by cembed's own metadata (a cembed.egg-info in the working folder).
    info = site / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    groups = [
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()) for group, points in entry_points.items()
    ]
    (info / "entry_points.txt").write_text("\n".join(groups))
    return site


def write_rows(path: Path, rows: list[dict], fmt: str) -> Path:
    """``rows`` (anchor, positive texts) as a parquet file, or as JSON Lines (whatever the name says)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        pq.write_table(
            pa.Table.from_pylist(rows, schema=pa.schema([("anchor", pa.string()), ("positive", pa.string())])), path
        )
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def spark_folder(folder: Path, rows: list[dict], fmt: str = "jsonl") -> None:
    """``rows`` as Spark, Hadoop and Jupyter leave a job's output: two real parts and a 0-row part
    (an empty partition), a ``_temporary/0/task_1/`` attempt copy, a ``.ipynb_checkpoints/`` copy
    (an older version of part 0: other rows), ``_SUCCESS``, Hadoop's hidden ``.crc`` checksums and a
    ``part-xxx.crc``."""
    half = len(rows) // 2
    ext = ".snappy.parquet" if fmt == "parquet" else ".json"
    write_rows(folder / f"part-00000-a1b2{ext}", rows[:half], fmt)
    write_rows(folder / f"part-00001-a1b2{ext}", rows[half:], fmt)
    write_rows(folder / f"part-00002-a1b2{ext}", [], fmt)  # an empty partition: 0 bytes, or a 0-row parquet file
    write_rows(folder / "_temporary" / "0" / "task_1" / f"part-00001-a1b2{ext}", rows[half:], fmt)
    write_rows(
        folder / ".ipynb_checkpoints" / f"part-00000-a1b2-checkpoint{ext}",
        [{"anchor": f"topic {i % 13} (old)", "positive": f"passage number {i} (old)"} for i in range(half)],
        fmt,
    )
    (folder / "_SUCCESS").write_bytes(b"")
    (folder / f".part-00000-a1b2{ext}.crc").write_bytes(b"crc\x00\x01")
    (folder / "part-00000.crc").write_bytes(b"crc\x00\x02")


def load_script(path: Path, name: str):
    """The script at ``path`` (under scripts/, not a package) imported as module ``name``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a test's own process group rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_gloo_rank(rank: int, world: int, port: int, hang_s: float) -> None:
    """Set up one spawned test rank: the env:// variables of a ``world``-process job on this machine,
    one thread, faulthandler on (a native crash prints the Python stacks), and a timer that ends the
    process after ``hang_s`` seconds, so a hung collective fails the test instead of the CI job."""
    import faulthandler
    import threading

    import torch

    faulthandler.enable()
    guard = threading.Timer(hang_s, os._exit, (3,))
    guard.daemon = True
    guard.start()
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        HF_HUB_OFFLINE="1",
        TQDM_DISABLE="1",
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)


def end_gloo_rank() -> None:
    """End a spawned test rank as a launched cembed worker ends (``leave_process_group``, then
    ``exit_worker``: output flushed, ``os._exit(0)``). Why: freeing the gloo group at interpreter
    exit can abort a rank that finished (``terminate called without an active exception``, SIGABRT;
    seen in CI on rank 1 of the mixture test); :func:`cembed.distributed.group.exit_worker` says more.
    Call last, after the rank wrote its results."""
    from cembed.distributed.group import exit_worker, leave_process_group

    leave_process_group()
    exit_worker(0)


# --- shared by the loss tests (tests/losses, tests/model) ---------------------------------------

TEXTS = {
    "anchor": [
        "a man on a bus",
        "two dogs",
        "the red car",
        "a cat on a table",
        "people at the street",
        "white plate of food",
        "a train",
    ],
    "positive": [
        "man riding bus",
        "dogs playing",
        "car in red",
        "cat sitting on table",
        "street with people",
        "food on a plate",
        "train on track",
    ],
    "negative_1": [
        "a blue room",
        "large black dog",
        "small white car",
        "top of the bus",
        "near the table",
        "next to a woman",
        "the woman",
    ],
}


def features_for(model, columns):
    """The tokenized ``TEXTS`` of each named column, in order."""
    return [model.tokenize(TEXTS[c]) for c in columns]


def loss_and_grads(model, loss, features):
    """``(loss value, every parameter's gradient flattened into one vector)`` after one backward."""
    import torch

    model.zero_grad()
    value = loss(features, labels=None)
    value.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return value.detach(), grads


def rel_diff(a, b):
    """``||a - b|| / ||b||``."""
    import torch

    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()


def make_tiny_splade(
    path: Path,
    activation: str = "relu",
    width: int | None = None,
    bias: float = 0.0,
    seed: int = 0,
    dropout: float = 0.0,
):
    """A random SPLADE ``SparseEncoder`` (a 1-layer, hidden-32 ``BertForMaskedLM`` as sentence-transformers 6.3
    builds it: ``Transformer(transformer_task="fill-mask")`` + ``SpladePooling("max", activation)``), its
    files under ``path``. ``width``: the MLM vocabulary (the embedding's width; default the tokenizer's
    size, larger widths only add never-typed tokens); ``bias`` is added to the MLM head's output bias,
    which sets how many coordinates are active (negative: sparser)."""
    import torch
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import SpladePooling
    from transformers import BertConfig, BertForMaskedLM

    hf_dir = Path(path) / "hf"
    hf_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(hf_dir)
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=width or len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    mlm = BertForMaskedLM(config)
    with torch.no_grad():
        mlm.cls.predictions.bias.add_(bias)
    mlm.save_pretrained(hf_dir)
    transformer = Transformer(str(hf_dir), transformer_task="fill-mask", max_seq_length=32)
    return SparseEncoder(modules=[transformer, SpladePooling("max", activation_function=activation)], device="cpu")


# A training run that receives a real SIGTERM at the end of step 3 (tests/train, tests/model).
KILL_AT_STEP_3 = textwrap.dedent(
    """
    import os, signal, sys
    import cembed.train.recipe as T

    class SigtermAtStep3(T.InterruptCallback):
        # Delivers a real SIGTERM to this process at the end of step 3, through the real handler.
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 3 and self.signum is None:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().on_step_end(args, state, control, **kw)

    T.InterruptCallback = SigtermAtStep3
    from cembed.cli.app import main
    sys.argv = ["cembed", "train", sys.argv[1]]
    main()
    """
)


def pytest_collection_modifyitems(config, items):
    """Under mutmut (``make mutate``: one mutant per test run, ``-x``) run a mutant's quick tests first,
    ordered by the time each took in mutmut's stats run (``mutmut-stats.json``, in the ``mutants``
    folder the run starts in), the tests that build the tiny model last: the first failure ends the
    run, so a mutant a quick test kills costs that test, not the slow ones mutmut happened to list
    first. Outside mutmut the order is untouched."""
    if "__mutmut_" not in os.environ.get("MUTANT_UNDER_TEST", ""):
        return
    try:
        durations = json.loads(Path("mutmut-stats.json").read_text())["duration_by_test"]
    except (OSError, ValueError, KeyError):
        return
    items.sort(key=lambda item: ("tiny_model_dir" in item.fixturenames, durations.get(item.nodeid, 1.0)))


@pytest.fixture
def sighup_default():
    """SIGHUP at its default disposition, as a process started from a terminal has it, for the test only:
    a suite started under ``nohup`` inherits SIGHUP ignored, which cembed keeps ignored by design."""
    import signal

    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, previous)
