"""The README's first section gives exactly two commands, and CI runs the second."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _first_section_commands():
    text = (ROOT / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert first_block is not None, "README has no bash block"
    assert text.index("```bash") < text.index("\n## "), "the commands must open the README"
    return [line for line in first_block.group(1).splitlines() if line.strip()]


def test_readme_opens_with_two_commands_and_ci_runs_the_second():
    commands = _first_section_commands()
    assert len(commands) == 2
    assert "examples/" in commands[0]
    assert "pytest" in commands[1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert commands[1] in ci, ".ci/run must run the README's test command verbatim"
