"""The README stays true: its config reference is generated, its commands are the ones CI runs."""

import re
from pathlib import Path

from p2p_diloco import config
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


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_link_and_path_in_the_docs_exists_in_the_repo():
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        links = [m.split("#")[0] for m in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in m]
        for link in filter(None, links):
            if not (doc.parent / link).exists():
                missing.append(f"{doc.name}: ({link})")
        for path in re.findall(r"`((?:p2p_diloco|tests|bench|peers|docs)/[\w./-]+)`", text):
            if not (ROOT / path).exists():
                missing.append(f"{doc.name}: `{path}`")
    assert not missing, missing


def test_the_project_points_to_nothing_outside_itself():
    sources = [*DOCS, *ROOT.glob("p2p_diloco/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("bench/*.py")]
    outside = re.compile(r"\.\./shared|shared/(DESIGN|STYLE)\.md|\b(DESIGN|STYLE)\.md|STYLE rule")
    offenders = [str(p.relative_to(ROOT)) for p in sources if p != Path(__file__) and outside.search(p.read_text())]
    assert not offenders, offenders


def test_the_readme_status_the_package_and_version_agree():
    import tomllib

    from p2p_diloco import __version__

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    status = re.search(r"\*\*Status \(v(\d+\.\d+)\)\.\*\*", README)
    assert status, "README lost its status line"
    assert declared.startswith(status.group(1) + "."), (declared, status.group(1))
    assert __version__ in (declared, "unknown"), "reinstall: pip install -e ."


def test_every_name_design_md_cites_in_the_package_exists():
    """`module.name` and `Class.name` in docs/design.md name something in that module or class's
    file (config keys such as `swarm.clip` and file names aside): a renamed function shows here."""
    package = ROOT / "p2p_diloco"
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path.read_text()
    # a module in a folder is also cited by its own name (`agreement.backed`), where no other has it
    by_name: dict[str, list[str]] = {}
    for path in package.rglob("*.py"):
        if path.stem != "__init__":
            by_name.setdefault(path.stem, []).append(path.read_text())
    modules.update({n: s[0] for n, s in by_name.items() if len(s) == 1 and n not in modules})
    classes: dict[str, list[str]] = {}
    for source in modules.values():
        for found in re.finditer(r"^class\s+(\w+)", source, re.M):
            classes.setdefault(found.group(1), []).append(source)
    keys = {f"{section}.{key}" for section, fields in config.load().to_dict().items() for key in fields}
    design = (ROOT / "docs" / "design.md").read_text()
    missing = []
    for cite in re.finditer(r"`([A-Za-z_][\w.]*)\.([A-Za-z_]\w*)(?:\([^`]*\))?`", design):
        owner, name = cite.groups()
        sources = [modules[owner]] if owner in modules else classes.get(owner, [])
        if f"{owner}.{name}" in modules or f"{owner}.{name}" in keys or name in ("py", "md", "toml", "json"):
            continue
        if sources and not any(re.search(rf"\b{name}\b", source) for source in sources):
            missing.append(f"{owner}.{name}")
    assert not missing, missing
