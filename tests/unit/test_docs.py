"""The README stays true: its config reference is generated, its commands are the ones CI runs."""

import re
from pathlib import Path

from p2p_diloco.cli import reference_markdown

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_readme_config_reference_is_current():
    match = re.search(r"<!-- config-reference:[^\n]*-->\n(.*?)\n<!-- end config-reference -->", README, re.S)
    assert match, "README lost its config-reference markers"
    assert match.group(1) == reference_markdown(), "run `p2p-diloco config --reference` and paste it into the README"


def test_ci_runs_the_readme_test_command():
    ci_command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert f"```bash\n{ci_command}\n```" in README


def test_readme_main_command_uses_a_shipped_profile():
    for profile in re.findall(r"--config (peers/[\w.-]+\.toml)", README):
        assert (ROOT / profile).is_file(), profile
