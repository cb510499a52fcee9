from __future__ import annotations

from pathlib import Path

import pytest
from kvwatch.daemon.cli import build_parser, config_from_args, main
from kvwatch.daemon.config import parse_listen
from kvwatch.daemon.config.load import ConfigError, load_config


def test_defaults_without_file(tmp_path: Path) -> None:
    c = load_config(environ={}, default_path=None)
    assert c.daemon.listen == "127.0.0.1:9740"
    assert c.discovery.default_rules is True
    assert c.detectors.host_tier_eviction.floor_bytes_per_second == 64 * 1024 * 1024


def test_file_env_flag_precedence(tmp_path: Path) -> None:
    f = tmp_path / "k.toml"
    f.write_text('[daemon]\nlisten = "127.0.0.1:1111"\ntick_seconds = 2\n[discovery]\ninterval_seconds = 7\n')
    env = {"KVWATCH_DAEMON__LISTEN": "127.0.0.1:2222", "KVWATCH_DISCOVERY__PIDS": "[5, 7]"}
    c = load_config(
        f,
        environ=env,
        default_path=None,
        overrides={"daemon.listen": "127.0.0.1:3333"},
        sets=["daemon.tick_seconds=0.5"],
    )
    assert c.daemon.listen == "127.0.0.1:3333"  # flag beats env beats file
    assert c.daemon.tick_seconds == 0.5  # --set beats file
    assert c.discovery.interval_seconds == 7  # file value kept
    assert c.discovery.pids == [5, 7]  # env parsed as a TOML value


def test_all_problems_reported_at_once_naming_keys(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(
        "[daemon]\nlisten = 'nonsense'\ntick_seconds = -1\nbogus = 1\n"
        "[detectors.host_tier_eviction]\nfactor = 'high'\n[nosuchsection]\nx = 1\n"
    )
    with pytest.raises(ConfigError) as ei:
        load_config(f, environ={"KVWATCH_DISCOVERY__INTERVAL_SECONDS": "soon"}, default_path=None)
    keys = {p.key for p in ei.value.problems}
    assert {
        "daemon.listen",
        "daemon.tick_seconds",
        "daemon.bogus",
        "detectors.host_tier_eviction.factor",
        "nosuchsection",
        "discovery.interval_seconds",
    } <= keys
    text = str(ei.value)
    assert "unknown key" in text
    assert "environment KVWATCH_DISCOVERY__INTERVAL_SECONDS" in text
    assert f"file {f}" in text


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    f = tmp_path / "broken.toml"
    f.write_text("[daemon\nlisten=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(f, environ={}, default_path=None)
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.toml", environ={}, default_path=None)


def test_rule_validation() -> None:
    with pytest.raises(ConfigError) as ei:
        load_config(
            environ={},
            default_path=None,
            sets=['discovery.rules=[{engine="x"}, {engine="Bad Name", comm="a"}, {engine="y", cmdline="("}]'],
        )
    msgs = " | ".join(str(p) for p in ei.value.problems)
    assert "discovery.rules.0" in msgs and "needs comm or cmdline" in msgs
    assert "discovery.rules.1.engine" in msgs
    assert "invalid regex" in msgs


def test_listen_parsing() -> None:
    assert parse_listen("127.0.0.1:9740") == ("127.0.0.1", 9740)
    assert parse_listen("[::1]:80") == ("::1", 80)
    assert parse_listen(":9740") == ("0.0.0.0", 9740)
    for bad in ("9740", "host:port", "example.com:80", "1.2.3.4:99999"):
        with pytest.raises(ValueError):
            parse_listen(bad)


def test_ringbuf_pages_power_of_two() -> None:
    with pytest.raises(ConfigError, match=r"probes\.ringbuf_pages"):
        load_config(environ={}, default_path=None, sets=["probes.ringbuf_pages=3"])


def test_tls_needs_both() -> None:
    with pytest.raises(ConfigError, match=r"tls_cert and tls_key"):
        load_config(environ={}, default_path=None, sets=['daemon.tls_cert="/x.pem"'])


def test_cli_flags_map_to_config(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "run",
            "--listen",
            "127.0.0.1:9999",
            "--pid",
            "12",
            "--pid",
            "13",
            "--kv-dir",
            str(tmp_path),
            "--log-format",
            "json",
        ]
    )
    c = config_from_args(args)
    assert c.daemon.listen == "127.0.0.1:9999"
    assert c.discovery.pids == [12, 13]
    assert c.kv_tiers.dirs[0].path == tmp_path
    assert c.daemon.log_format == "json"


def test_cli_config_error_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "k.toml"
    f.write_text("[daemon]\nlisten = 3\nunknown = true\n")
    assert main(["run", "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert "daemon.listen" in err and "daemon.unknown" in err


def test_example_config_is_valid_and_shows_the_defaults() -> None:
    example = Path(__file__).parents[2] / "deploy" / "kvwatch.example.toml"
    assert load_config(example, environ={}, default_path=None) == load_config(environ={}, default_path=None)
