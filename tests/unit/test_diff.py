"""kiln.series.diff: the one unified-diff model behind series, port-check and rebase."""
import re
import subprocess

import pytest

from kiln.errors import KilnError
from kiln.series.diff import parse_diff
from kiln.series.series import Series

TRICKY = """\
diff --git a/vllm/x.py b/vllm/x.py
--- a/vllm/x.py
+++ b/vllm/x.py
@@ -1,3 +1,3 @@
 keep
--- a/not/a/header
+++ b/not/a/header
 keep
@@ -10 +10,2 @@
-old
+new
+more
\\ No newline at end of file
diff --git a/vllm/new.py b/vllm/new.py
new file mode 100644
--- /dev/null
+++ b/vllm/new.py
@@ -0,0 +1,2 @@
+a
+b
"""


def test_a_removed_line_that_looks_like_a_header_stays_in_its_hunk():
    x, new = parse_diff(TRICKY)
    assert (x.old_path, x.new_path) == ("vllm/x.py", "vllm/x.py")
    assert (new.old_path, new.new_path, new.paths) == (None, "vllm/new.py", ["vllm/new.py"])
    first, second = x.hunks
    assert first.lines[1] == "--- a/not/a/header" and first.added() == [(2, "++ b/not/a/header")]
    assert first.changed() == [2, 2]
    assert second.added() == [(10, "new"), (11, "more")] and second.changed() == [10, 10, 11]
    assert second.lines[-1].startswith("\\")
    assert new.hunks[0].added() == [(1, "a"), (2, "b")]


def test_every_carried_topic_parses_to_the_files_git_names(tmp_path):
    for topic in Series.load().topics:
        files = topic.file_diffs()
        assert files and all(f.hunks for f in files), topic.name
        numstat = subprocess.run(["git", "apply", "--numstat", "-"], input=topic.diff,
                                 capture_output=True, text=True, check=True).stdout
        counts = {line.split("\t")[2]: (int(line.split("\t")[0]), int(line.split("\t")[1]))
                  for line in numstat.splitlines()}
        for f in files:
            added = sum(len(h.added()) for h in f.hunks)
            removed = sum(1 for h in f.hunks for line in h.lines if line.startswith("-"))
            assert counts[f.new_path or f.old_path] == (added, removed), (topic.name, f.paths)


@pytest.mark.parametrize("text, message", [
    ("--- a/x\n+++ b/x\n@@ -1,3 +1,3 @@\n a\n",
     "0001-x.patch: the hunk at line 3 (@@ -1,3 +1,3 @@) ends early: 2 old and 2 new line(s) missing"),
    ("--- a/x\n+++ b/x\n@@ -1 +1 @@\n*a\n", "0001-x.patch: line 4 in a hunk starts with '*'; allowed"),
])
def test_a_malformed_hunk_is_refused_naming_where(text, message):
    with pytest.raises(KilnError, match=re.escape(message)):
        parse_diff(text, "0001-x.patch")
