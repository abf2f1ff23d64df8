"""The README and docs/ name only files that exist: every repository path in backquotes and
every relative link; and so do the install's and CI's comments."""
import glob
import os
import re

import pytest

from helpers import REPO

PAGES = ["README.md", *sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))]
# A path of the repository's own: a script, module or test, a config, a doc, a results file.
REPO_PATH = re.compile(r"`((?:gpt2repro|tests|docs|configs|bench/results|data)/[\w./-]+|[\w-]+\.(?:py|toml))`")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
WRITTEN_BY_RUNS = {"data/shakespeare/"}  # the demo's shards: named, but made by the first run
PLACEHOLDERS = ("*", "NAME", "GPU-DATE")  # paths that stand for a user's own


@pytest.mark.parametrize("page", PAGES)
def test_every_file_a_page_names_exists(page):
    with open(os.path.join(REPO, page)) as f:
        text = f.read()
    here = os.path.dirname(os.path.join(REPO, page))
    missing = [path for path in REPO_PATH.findall(text)
               if not any(p in path for p in PLACEHOLDERS) and path not in WRITTEN_BY_RUNS and not os.path.exists(os.path.join(REPO, path))]
    missing += [link for link in LINK.findall(text)
                if "://" not in link and not os.path.exists(os.path.join(here, link))]
    assert not missing, f"{page} names {missing}"


@pytest.mark.parametrize("path", ["requirements.txt", ".ci/run"])
def test_every_file_the_install_and_ci_name_exists(path):
    """Their comments name files bare, from the repository's root: gpt2repro/lm/loss.py, tests/lm/test_loss.py."""
    with open(os.path.join(REPO, path)) as f:
        named = re.findall(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.(?:py|toml|txt|md|ini))\b", f.read())
    missing = [name for name in named if not os.path.exists(os.path.join(REPO, name))]
    assert named and not missing, f"{path} names {missing}"
