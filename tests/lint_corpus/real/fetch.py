"""Bring the real-engine corpus into ``.cache/`` (not committed: see README.md).

    python tests/lint_corpus/real/fetch.py                  # from raw.githubusercontent.com
    python tests/lint_corpus/real/fetch.py --git-root DIR   # from local clones DIR/<owner>+<name>

Each file is checked against the sha256 in ``corpus.json``, so the hand labels in ``labels/``
(line numbers) always refer to the text they were written for. An entry's ``siblings`` (files
of the same repository that it imports, linted with it: cross-module summaries) are fetched by
the same pinned commit into ``.cache/NAME.siblings/<their repository path>``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import subprocess
import sys
import urllib.request

HERE = pathlib.Path(__file__).resolve().parent
CACHE = HERE / ".cache"


def _get(entry: dict, git_root: pathlib.Path | None, path: str | None = None) -> bytes:
    entry = {**entry, "path": path or entry["path"]}
    if git_root is not None:
        repo = git_root / entry["repo"].replace("/", "+")
        git_dir = repo / "repo" if (repo / "repo").exists() else repo
        return subprocess.run(["git", "-C", str(git_dir), "show",
                               f"{entry['commit']}:{entry['path']}"],
                              capture_output=True, check=True).stdout
    url = f"https://raw.githubusercontent.com/{entry['repo']}/{entry['commit']}/{entry['path']}"
    with urllib.request.urlopen(url, timeout=60) as response:
        return response.read()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--git-root", type=pathlib.Path, default=None,
                        help="directory of local clones named <owner>+<name>")
    args = parser.parse_args(argv)
    CACHE.mkdir(exist_ok=True)
    bad = 0
    for entry in json.loads((HERE / "corpus.json").read_text()):
        data = _get(entry, args.git_root)
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            print(f"{entry['name']}: sha256 differs from corpus.json; not written", file=sys.stderr)
            bad += 1
            continue
        (CACHE / f"{entry['name']}.py").write_bytes(data)
        for sibling in entry.get("siblings", []):
            out = CACHE / f"{entry['name']}.siblings" / sibling
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(_get(entry, args.git_root, sibling))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
