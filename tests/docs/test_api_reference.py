"""The API reference: every error a script may catch is importable from `moshpit` and listed
in docs/api.md, and docstrings' Sphinx roles render as code, not as raw markup."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import moshpit

ROOT = Path(__file__).resolve().parents[2]
API = (ROOT / "docs" / "api.md").read_text()
USER_ERRORS = [
    "StateError",
    "StateMismatchError",
    "CheckpointError",
    "CheckpointDirInUseError",
    "NoDonorError",
    "StateDownloadError",
    "NonFiniteStateError",
    "AveragingError",
    "AveragerLockError",
    "BootstrapError",
    "IdentityInUseError",
    "MultiaddrError",
    "Preempted",
]


def test_user_facing_errors_are_exported_from_moshpit_and_documented():
    for name in USER_ERRORS:
        error = getattr(moshpit, name)
        assert issubclass(error, BaseException), name
        assert name in moshpit.__all__, name
        assert re.search(rf"^::: [\w.]+\.{name}$", API, re.M), f"{name} is not in docs/api.md"
    assert issubclass(moshpit.CheckpointDirInUseError, moshpit.CheckpointError)
    assert issubclass(moshpit.NonFiniteStateError, moshpit.StateError)


def test_every_error_of_the_averaging_layer_derives_from_averaging_error():
    """One ``except moshpit.AveragingError`` catches whatever the layer raises on purpose."""
    import moshpit.averaging as package

    found = []
    for path in sorted(Path(package.__file__).parent.glob("*.py")):
        module = importlib.import_module(f"moshpit.averaging.{path.stem}")
        for name, value in vars(module).items():
            if (
                not name.startswith("_")  # internal control flow (a round that ended)
                and isinstance(value, type)
                and issubclass(value, Exception)
                and value.__module__ == module.__name__
            ):
                found.append(value)
                assert issubclass(value, moshpit.AveragingError), value
    assert len(found) >= 6, found  # GroupInfoError, MatchmakingError, ProtocolError, ...


def load_hook():
    path = ROOT / "docs" / "hooks" / "sphinx_roles.py"
    spec = importlib.util.spec_from_file_location("sphinx_roles", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sphinx_roles_render_as_code():
    hook = load_hook()
    html = (
        "raises :class:<code>~moshpit.training.health.NonFiniteStateError</code> when "
        ":meth:<code>Averager.step</code> or :py:func:<code>decompress</code> fails; "
        "a :not-a-role:<code>x</code> and plain <code>code</code> stay"
    )
    assert hook.on_page_content(html) == (
        "raises <code>NonFiniteStateError</code> when <code>Averager.step</code> or "
        "<code>decompress</code> fails; a :not-a-role:<code>x</code> and plain <code>code</code> "
        "stay"
    )
