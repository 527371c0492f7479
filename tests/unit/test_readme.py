from kiln.paths import REPO_ROOT
from kiln.series.series import Series
from kiln.series.topics import readme_block, readme_table


def test_the_readme_topics_table_matches_the_patch_headers():
    readme = (REPO_ROOT / "README.md").read_text()
    current = readme_table(readme)
    assert current is not None, "README.md lost its generated topics block"
    assert current == readme_block(Series.load()), (
        "README.md's topics table is stale: run `python -m kiln topics --update-readme`")


def test_the_readme_opens_with_the_build_and_test_commands():
    first_lines = (REPO_ROOT / "README.md").read_text().splitlines()[:10]
    commands = [line.strip() for line in first_lines if line.startswith("    ")]
    assert commands == [
        "python3 -m pip install -r requirements/kiln.txt && python3 -m kiln build",
        "tests/run",
    ]
