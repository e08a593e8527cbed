"""Config: loading, overrides, validation errors that name the fix, the fingerprint."""

from pathlib import Path

import pytest

from p2p_diloco import config
from p2p_diloco.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_the_papers():
    c = config.load()
    assert (c.inner.lr, c.inner.weight_decay, c.inner.warmup_steps, c.inner.steps) == (4e-4, 0.1, 1000, 500)
    assert (c.inner.batch_size, c.model.seq_len) == (512, 1024)
    assert (c.outer.lr, c.outer.momentum, c.outer.nesterov) == (0.7, 0.9, True)


@pytest.mark.parametrize(
    "path", sorted((ROOT / "peers").glob("*.toml")) + sorted((ROOT / "bench").glob("*.toml")), ids=lambda p: p.name
)
def test_every_shipped_config_loads(path):
    config.load(path)


def test_shipped_profiles_exist():
    assert {p.name for p in (ROOT / "peers").glob("*.toml")} >= {"cpu.toml", "home-gpu.toml"}


def test_toml_then_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[inner]\nlr = 1e-3\nsteps = 10\n[swarm]\ninitial_peers = ["/ip4/1.2.3.4/tcp/1/p2p/Qm"]\n')
    c = config.load(path, {"inner.steps": "20", "outer.nesterov": "false"})
    assert (c.inner.lr, c.inner.steps, c.outer.nesterov) == (1e-3, 20, False)
    assert c.swarm.initial_peers == ("/ip4/1.2.3.4/tcp/1/p2p/Qm",)


def test_saved_config_loads_back_equal(tmp_path):
    c = config.load(None, {"inner.lr": "0.002", "swarm.initial_peers": "a,b", "run.dir": str(tmp_path)})
    config.save(c, tmp_path / "config.toml")
    assert config.load(tmp_path / "config.toml") == c


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"inner.lr": "-1"}, "inner.lr must be > 0, got -1.0; set [inner] lr in run.toml"),
        ({"inner.lr": "nan"}, "inner.lr must be > 0"),
        ({"inner.lr": "abc"}, "--inner.lr must be float, got 'abc'"),
        ({"model.preset": "huge"}, "model.preset is unknown: 'huge'"),
        ({"inner.lrr": "1"}, "did you mean 'lr'?"),
        ({"innr.lr": "1"}, "unknown section 'innr'"),
        ({"outer.momentum": "1"}, "outer.momentum must be in [0, 1)"),
        ({"inner.micro_batch_size": "7"}, "must divide inner.batch_size (512)"),
        ({"data.source": "files"}, "data.path is required when data.source = files"),
        ({"data.shard": "64"}, "data.shard must be -1 or in [0, 64)"),
        ({"run.device": "gpu"}, "run.device must be auto, cpu, cuda or cuda:N"),
        ({"outer.nesterov": "maybe"}, "--outer.nesterov must be true or false"),
        ({"outer.drop_rate": "1"}, "outer.drop_rate must be in [0, 1), got 1.0"),
        ({"data.shard_by": "row"}, "data.shard_by must be one of document, folder, file, got 'row'"),
        ({"data.shard_by": "file"}, "data.shard_by = file needs a corpus of files (source = files or hub)"),
        ({"data.source": "hub", "data.name": "org/name@"}, "data.name = 'org/name@' is not a pinned Hub id"),
        ({"data.source": "hub", "data.name": "c4@main"}, "write org/name@revision"),
        ({"data.source": "hub", "data.name": "a/b@v1@v2"}, "data.name = 'a/b@v1@v2' is not a pinned Hub id"),
        ({"data.source": "hub", "data.name": "a/b@x y"}, "data.name = 'a/b@x y' is not a pinned Hub id"),
        ({"model.tokenizer": "org/tok@../main"}, "model.tokenizer = 'org/tok@../main' is not a pinned Hub id"),
        ({"swarm.claim_cap": "0.5"}, "swarm.claim_cap must be 0 (by admission.mode) or >= 1, got 0.5"),
        ({"swarm.claim_cap": "inf"}, "swarm.claim_cap must be 0 (by admission.mode) or >= 1, got inf"),
        (
            {"data.shard_by": "folder", "data.source": "hub", "data.name": "c4"},
            "data.shard_by = folder needs a corpus with folders",
        ),
    ],
)
def test_bad_values_name_the_field_and_the_fix(overrides, message):
    with pytest.raises(ConfigError) as e:
        config.load(None, overrides)
    assert message in str(e.value)


def test_bad_toml_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        config.load(tmp_path / "missing.toml")
    (tmp_path / "folder.toml").mkdir()
    with pytest.raises(ConfigError, match="is a folder, not a file"):
        config.load(tmp_path / "folder.toml")
    (tmp_path / "broken.toml").write_text("[inner\nlr = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.load(tmp_path / "broken.toml")
    (tmp_path / "typed.toml").write_text('[inner]\nsteps = "ten"\n')
    with pytest.raises(ConfigError, match=r"inner.steps in .*typed.toml must be int, got 'ten'"):
        config.load(tmp_path / "typed.toml")
    (tmp_path / "flag.toml").write_text("[inner]\nsteps = true\n")
    with pytest.raises(ConfigError, match="must be int"):
        config.load(tmp_path / "flag.toml")


def test_fingerprint_covers_shared_fields_only():
    base = config.load()
    assert (
        config.load(None, {"run.dir": "/elsewhere", "inner.micro_batch_size": "4"}).fingerprint() == base.fingerprint()
    )
    assert config.load(None, {"inner.steps": "499"}).fingerprint() != base.fingerprint()
    assert config.load(None, {"run.run_id": "other"}).fingerprint() != base.fingerprint()


def test_diff_shared_names_each_differing_field():
    a = config.load().shared_dict()
    b = config.load(None, {"inner.steps": "100", "outer.lr": "0.5"}).shared_dict()
    assert config.diff_shared(a, b) == ["inner.steps: 500 != 100", "outer.lr: 0.7 != 0.5"]


@pytest.mark.parametrize(
    "spec, parsed",
    [
        ("HuggingFaceFW/fineweb-edu", ("HuggingFaceFW/fineweb-edu", None)),
        ("HuggingFaceFW/fineweb-edu@main", ("HuggingFaceFW/fineweb-edu", "main")),
        ("org/name@0123456789abcdef0123456789abcdef01234567", ("org/name", "0123456789abcdef0123456789abcdef01234567")),
        ("org/name@refs/pr/1", ("org/name", "refs/pr/1")),
        ("org/name@v1.0", ("org/name", "v1.0")),
        ("/data/corpus", ("/data/corpus", None)),  # no "@": a local path, as before
    ],
)
def test_a_hub_spec_splits_into_name_and_pinned_revision(spec, parsed):
    assert config.hub_spec(spec) == parsed


def test_pinned_names_load_and_the_pin_is_part_of_the_fingerprint():
    pinned = config.load(None, {"data.source": "hub", "data.name": "org/data@abc123", "model.tokenizer": "org/tok@v2"})
    assert (pinned.data.name, pinned.model.tokenizer) == ("org/data@abc123", "org/tok@v2")
    latest = config.load(None, {"data.source": "hub", "data.name": "org/data", "model.tokenizer": "org/tok@v2"})
    assert pinned.fingerprint() != latest.fingerprint()
