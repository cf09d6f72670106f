"""What read_manifest says about a folder where ``cembed prepare-data --part K/N`` ran but the parts
were not joined yet: the whole line a user reads (parts done, parts missing, the commands to run)."""

from __future__ import annotations

import pytest

from cembed.data.tokens.format import part_manifest_name, read_manifest
from cembed.errors import UserError
from cembed.files import display_path


def _refusal(folder, done: list[int], n: int) -> str:
    folder.mkdir()
    for k in done:
        (folder / part_manifest_name(k, n)).write_text("{}")
    with pytest.raises(UserError) as refused:
        read_manifest(folder)
    return str(refused.value)


@pytest.mark.parametrize(
    ("done", "n", "says"),
    [
        (
            [0],
            3,
            "not complete: part 0 of 3 is prepared, parts 1, 2 are missing: run cembed prepare-data CONFIG "
            "--output {w} --part 1/3, --part 2/3 (the last part to finish writes cembed_prepared.json)",
        ),
        (
            [0, 2],
            3,
            "not complete: parts 0, 2 of 3 are prepared, part 1 is missing: run cembed prepare-data CONFIG "
            "--output {w} --part 1/3 (the last part to finish writes cembed_prepared.json)",
        ),
        (
            [0, 1, 2],
            3,
            "all 3 parts are prepared but not joined (no cembed_prepared.json): run the last part's "
            "cembed prepare-data command again",
        ),
    ],
)
def test_an_unjoined_preparation_says_which_parts_are_done_and_what_to_run(tmp_path, done, n, says):
    folder = tmp_path / "prepared"
    where = display_path(folder)
    assert _refusal(folder, done, n) == f"{where}: " + says.format(w=where)
