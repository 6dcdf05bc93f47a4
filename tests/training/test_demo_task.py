"""The demo's data: scikit-learn's bundled digits, read without importing scikit-learn where
the file is where scikit-learn keeps it, and the same images and labels either way."""

from __future__ import annotations

import gzip
import sys
from pathlib import Path

import pytest
import torch

from moshpit.training import demo_task

pytest.importorskip("sklearn")  # the [demo] extra, which the test install includes


def _refuse_sklearn():
    raise AssertionError("scikit-learn's loader was used")


def test_the_bundled_file_gives_what_load_digits_gives_without_importing_sklearn(monkeypatch):
    from sklearn.datasets import load_digits

    digits = load_digits()
    monkeypatch.setattr(demo_task, "_load_digits_through_sklearn", _refuse_sklearn)
    read = demo_task._read_bundled_digits()
    assert read is not None
    x, y = read
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert torch.equal(x, torch.tensor(digits.data, dtype=torch.float32) / 16.0)
    assert torch.equal(y, torch.tensor(digits.target, dtype=torch.int64))
    # the split is the fixed one: 30% test, every image in exactly one half
    split = demo_task.load_digits_split()
    assert len(split.y_test) == 539 and len(split.y_train) == 1797 - 539
    assert torch.equal(split.x_test, demo_task.load_digits_split().x_test)


def test_a_fresh_process_loads_the_digits_without_importing_sklearn():
    import subprocess

    code = (
        "import sys\n"
        "from moshpit.training.demo_task import load_digits_split\n"
        "data = load_digits_split()\n"
        "print(len(data.y_train), len(data.y_test), 'sklearn' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["1258", "539", "False"], out.stderr


UNEXPECTED = {  # what the file holds, before gzip
    "another-shape": b"1,2,3\n4,5,6\n",
    "not-a-number": b"0," * 64 + b"x\n",
    "pixel-above-16": (b"17," * 64 + b"3\n") * 1797,
    "label-above-9": (b"0," * 64 + b"12\n") * 1797,
}


@pytest.mark.parametrize("case", ["not-gzip", *UNEXPECTED])
def test_an_unexpected_file_falls_back_to_sklearns_own_loader(tmp_path, monkeypatch, case):
    path = tmp_path / "digits.csv.gz"
    path.write_bytes(b"not gzip at all" if case == "not-gzip" else gzip.compress(UNEXPECTED[case]))
    monkeypatch.setattr(demo_task, "bundled_digits_path", lambda: path)
    assert demo_task._read_bundled_digits() is None
    data = demo_task.load_digits_split()
    assert len(data.y_train) + len(data.y_test) == 1797
    assert int(data.y_train.max()) == 9 and float(data.x_train.max()) == 1.0


def test_without_sklearn_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)  # as on a machine without the extra
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    assert demo_task.bundled_digits_path() is None
    with pytest.raises(demo_task.MissingDemoDependency, match="moshpit-train\\[demo\\]"):
        demo_task.load_digits_split()


def test_a_missing_file_is_no_path(monkeypatch, tmp_path):
    class Spec:
        submodule_search_locations = [str(tmp_path)]

    monkeypatch.setattr(demo_task.importlib.util, "find_spec", lambda name: Spec())
    assert demo_task.bundled_digits_path() is None
    (tmp_path / "datasets" / "data").mkdir(parents=True)
    (tmp_path / "datasets" / "data" / "digits.csv.gz").write_bytes(b"")
    assert demo_task.bundled_digits_path() == Path(tmp_path) / "datasets/data/digits.csv.gz"
