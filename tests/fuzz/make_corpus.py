"""Write the fuzz corpus: ``tests/fuzz/corpus/<target>/<seed>.bin``.

Every target's ``seeds()`` are valid encodings made by the real encoders with fixed keys,
tensors and random seeds, so running this again gives the same bytes (a change in them means
an encoder changed its wire format). Seeds the targets no longer produce are removed; the
``crash-*.bin`` files (inputs that crashed a decoder once, replayed as regressions) are kept.

    python -m tests.fuzz.make_corpus           # write the corpus
    python -m tests.fuzz.make_corpus --check   # exit 1 if the committed corpus is stale
"""

from __future__ import annotations

import argparse
import sys

from ._harness import CORPUS_DIR, load_all


def plan() -> dict[str, dict[str, bytes]]:
    """``{target: {file name: bytes}}`` of every seed file."""
    return {
        name: {f"{seed}.bin": data for seed, data in target.seeds().items()}
        for name, target in sorted(load_all().items())
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, write nothing")
    args = parser.parse_args(argv)
    stale = []
    for name, files in plan().items():
        folder = CORPUS_DIR / name
        present = {p.name for p in folder.glob("*.bin") if not p.name.startswith("crash-")}
        for file_name, data in files.items():
            path = folder / file_name
            if not path.exists() or path.read_bytes() != data:
                stale.append(str(path.relative_to(CORPUS_DIR)))
                if not args.check:
                    folder.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(data)
        for file_name in sorted(present - files.keys()):
            stale.append(f"{name}/{file_name} (no longer a seed)")
            if not args.check:
                (folder / file_name).unlink()
    for line in stale:
        print(("stale: " if args.check else "wrote: ") + line)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
