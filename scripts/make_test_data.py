#!/usr/bin/env python
"""Build the test suite's real-data copies in tests/fixtures/ from ../shared/data, so the tests run in a
clone without it:

- ``stsbenchmark/sts-test.csv.gz``: the STS Benchmark test file, byte for byte, gzipped, beside its
  own ``LICENSE.txt`` and ``readme.txt``;
- ``scifact-test-subset/``: a BEIR folder with the 2,339 SciFact abstracts listed in
  ``scifact_test_top12.json`` (the documents that can reach any test query's top 10; see
  ``scripts/make_scifact_subset.py``), the 300 test queries and ``qrels/test.tsv``; every line is
  copied unchanged and in the original order (qrels keep their CRLF line ends);
- ``reference_scores/``: the published MTEB results the reproductions compare with, unchanged.

Usage: python scripts/make_test_data.py [--shared ../shared/data]
The output is deterministic (gzip without a timestamp).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS_DATA = REPO / "tests" / "fixtures"

SCIFACT_LICENSE = """\
# SciFact test subset (BEIR layout)

The 2,339 SciFact abstracts that can reach any test query's top 10 under all-MiniLM-L6-v2
(listed in ../scifact_test_top12.json), the 300 SciFact test claims, and the test qrels, copied
line for line from the BEIR version of SciFact (corpus rebuilt and checked against BEIR's
published hash; see ../shared/data/README.md in the development setup). Built by
scripts/make_test_data.py.

SciFact: David Wadden, Shanchuan Lin, Kyle Lo, Lucy Lu Wang, Madeleine van Zuylen, Arman Cohan,
Hannaneh Hajishirzi. "Fact or Fiction: Verifying Scientific Claims", EMNLP 2020.
https://github.com/allenai/scifact. BEIR: Thakur et al., NeurIPS 2021 Datasets and Benchmarks.

Licence: CC BY-NC 2.0 (https://creativecommons.org/licenses/by-nc/2.0/), as stated by allenai/scifact
and the HF dataset card allenai/scifact. Non-commercial use only: it is here for the test suite.
"""

REFERENCE_README = """\
# Published MTEB results of all-MiniLM-L6-v2

Verbatim copies of embeddings-benchmark/results:
results/sentence-transformers__all-MiniLM-L6-v2/8b3219a92973c328a8e22fadcfa821b5dc75636a/{SciFact,STSBenchmark}.json
(mteb 1.12.75), taken at that repository's commit f4cc6c8b365a3c779dbc708d6affe0b0355b2ddf.
The tests compare cembed's scores with them.
"""


def write_gz(path: Path, data: bytes) -> None:
    """Write ``data`` gzip-compressed, byte-identical on every run (no name, mtime 0)."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as f:
        f.write(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shared", default=str(REPO.parent / "shared" / "data"))
    p.add_argument("--out", default=str(TESTS_DATA))
    args = p.parse_args()
    shared, out = Path(args.shared), Path(args.out)

    sts = out / "stsbenchmark"
    write_gz(sts / "sts-test.csv.gz", (shared / "stsbenchmark" / "sts-test.csv").read_bytes())
    for name in ("LICENSE.txt", "readme.txt"):
        shutil.copyfile(shared / "stsbenchmark" / name, sts / name)

    keep = set(json.loads((TESTS_DATA / "scifact_test_top12.json").read_text())["doc_ids"])
    src = shared / "scifact"
    qrels = (src / "qrels" / "test.tsv").read_bytes()
    query_ids = {line.split(b"\t")[0].decode() for line in qrels.splitlines()[1:] if line.strip()}
    with gzip.open(src / "corpus.jsonl.gz", "rb") as f:
        corpus = [line for line in f if json.loads(line)["_id"] in keep]
    queries = [line for line in (src / "queries.jsonl").read_bytes().splitlines(keepends=True)]
    queries = [line for line in queries if json.loads(line)["_id"] in query_ids]
    assert len(corpus) == len(keep) == 2339 and len(queries) == 300, (len(corpus), len(queries))
    sub = out / "scifact-test-subset"
    write_gz(sub / "corpus.jsonl.gz", b"".join(corpus))
    (sub / "queries.jsonl").write_bytes(b"".join(queries))
    (sub / "qrels").mkdir(parents=True, exist_ok=True)
    (sub / "qrels" / "test.tsv").write_bytes(qrels)
    (sub / "LICENSE.md").write_text(SCIFACT_LICENSE)

    ref = out / "reference_scores"
    ref.mkdir(parents=True, exist_ok=True)
    for name in ("mteb_all-MiniLM-L6-v2_SciFact.json", "mteb_all-MiniLM-L6-v2_STSBenchmark.json"):
        shutil.copyfile(shared / "reference_scores" / name, ref / name)
    (ref / "README.md").write_text(REFERENCE_README)
    print(f"wrote {sts}, {sub} ({len(corpus)} abstracts, {len(queries)} queries) and {ref}")


if __name__ == "__main__":
    main()
