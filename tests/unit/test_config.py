from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwatch.daemon.cli import build_parser, config_from_args, main
from kvwatch.daemon.config import Config, parse_listen
from kvwatch.daemon.config.base import parse
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


# --- every problem one line, naming its key, never a traceback or a secret -------------------------


@pytest.fixture(autouse=True)
def _never_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A configuration ``main`` accepts must fail the test, never start the daemon."""

    def accepted(*_: object) -> int:
        raise AssertionError("the configuration was accepted")

    monkeypatch.setattr("kvwatch.daemon.cli.cmd_run", accepted)


def _problems(capsys: pytest.CaptureFixture[str], *argv: str) -> list[str]:
    """``kvwatch run ARGV``'s problems: it exits 2 and prints a header and one line per problem."""
    assert main(["run", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "ValidationError" not in err and "pydantic" not in err, err
    head, *lines = err.rstrip("\n").split("\n")
    assert head.startswith("kvwatch: invalid configuration"), err
    assert lines and all(line.startswith("  - ") for line in lines), err
    return [line[4:] for line in lines]


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        (["--pid", "0"], "discovery.pids.0"),
        (["--pid", "12", "--pid", "-3"], "discovery.pids.1"),
        (["--set", "discovery.pids=[4]", "--pid", "0"], "discovery.pids.1"),
    ],
)
def test_a_bad_pid_flag_is_one_line_naming_the_key(
    capsys: pytest.CaptureFixture[str], argv: list[str], key: str
) -> None:
    (line,) = _problems(capsys, *argv)
    assert line.startswith(f"{key}: ") and line.endswith("(from flag --pid)"), line


def test_pid_and_kv_dir_flags_add_to_the_configured_ones(tmp_path: Path) -> None:
    args = build_parser().parse_args(["run", "--pid", "9", "--pid", "3", "--kv-dir", str(tmp_path)])
    args.set = ["discovery.pids=[3, 5]", f'kv_tiers.dirs=[{{path="{tmp_path}/a"}}]']
    c = config_from_args(args)
    assert c.discovery.pids == [3, 5, 9]
    assert [d.path for d in c.kv_tiers.dirs] == [tmp_path / "a", tmp_path]


@pytest.mark.parametrize(
    "setting",
    [
        "probes.max_evicted_pages_tracked=100000000000000",
        "probes.max_reclaimers=100000000000000",
        "probes.cuda_max_ledger=100000000000000",
        "probes.ringbuf_pages=1099511627776",  # a power of two
        "kv_tiers.max_files=100000000000000",
        "discovery.exec_hints_per_tick=100000000000000",
        "engines.kv_block_bytes=100000000000000",
        "daemon.max_connections=100000",
        "discovery.pids=[" + ",".join(str(p) for p in range(1, 5000)) + "]",
        "kv_tiers.dirs=[" + ",".join(f'{{path="/d{i}"}}' for i in range(65)) + "]",
        "discovery.rules=[" + ",".join(f'{{engine="e", comm="c{i}"}}' for i in range(300)) + "]",
        "engines.endpoints=[" + ",".join(f'{{pid={i + 1}, metrics_url="http://h"}}' for i in range(300)) + "]",
        "engines.tenants=[" + ",".join(f'{{name="t{i}", lora="l{i}"}}' for i in range(1100)) + "]",
        "alerts.alertmanager.labels={" + ",".join(f"l{i}='v'" for i in range(100)) + "}",
    ],
)
def test_every_memory_and_size_setting_has_an_upper_bound(capsys: pytest.CaptureFixture[str], setting: str) -> None:
    key = setting.split("=", 1)[0]
    (line,) = _problems(capsys, "--set", setting)
    assert line.startswith(f"{key}: "), line


@pytest.mark.parametrize("name", ["default", "unknown", "other", "salt-0a1b2c3d", "lora:chat"])
def test_a_tenant_rule_may_not_take_a_reserved_name(capsys: pytest.CaptureFixture[str], name: str) -> None:
    (line,) = _problems(capsys, "--set", f'engines.tenants=[{{name="{name}", lora="x"}}]')
    assert line.startswith("engines.tenants.0.name: ") and "reserved" in line, line


def test_the_reserved_tenant_names_are_the_namer_s() -> None:
    from kvwatch.daemon.config import RESERVED_TENANT_NAMES, RESERVED_TENANT_PREFIXES
    from kvwatch.daemon.engines import tenants

    assert tenants.RESERVED == RESERVED_TENANT_NAMES
    namer = tenants.TenantNamer([], b"k" * 32)
    assert namer.name("s", None).startswith(RESERVED_TENANT_PREFIXES[0])
    assert namer.name(None, "x").startswith(RESERVED_TENANT_PREFIXES[1])


@pytest.mark.parametrize(
    "setting",
    [
        'engines.tenants=[{name="a", salt_sha256="hunter2-the-raw-salt"}]',
        'engines.tenants=[{name="a", salt=1234567890}]',
        'engines.tenants=["hunter2-the-raw-salt"]',
        'alerts.alertmanager.url="ftp://admin:hunter2@alertmanager:9093"',
        'alerts.alertmanager.url="admin:hunter2@alertmanager:9093"',
        'engines.endpoints=[{pid=4, metrics_url="ftp://admin:hunter2@engine:8000/metrics"}]',
        'engines.endpoints=[{pid=4, kv_events="admin:hunter2@engine:5557"}]',
        "engines.tenants.0.salt:hunter2",  # no '=': the whole argument is not echoed either
    ],
)
def test_a_problem_never_echoes_a_secret(capsys: pytest.CaptureFixture[str], setting: str) -> None:
    lines = _problems(capsys, "--set", setting)
    assert len(lines) == 1
    assert "hunter2" not in lines[0] and "1234567890" not in lines[0], lines


def test_a_problem_is_one_line_whatever_its_key_or_value(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = tmp_path / "k.toml"
    f.write_text('"evil\\nkey" = 1\n[daemon]\nlisten = "a\\nb"\n[discovery]\nrules = [{engine="e", cmdline="(\\n"}]\n')
    lines = _problems(capsys, "--config", str(f))
    assert len(lines) == 3 and any(line.startswith("evil\\nkey: unknown key") for line in lines), lines


@pytest.mark.parametrize("setting", [".=1", "a..b=1", "=1", "daemon.=1"])
def test_a_malformed_set_key_is_a_problem_not_a_crash(capsys: pytest.CaptureFixture[str], setting: str) -> None:
    (line,) = _problems(capsys, "--set", setting)
    assert line.startswith("--set #1: ") and "KEY=VALUE" in line, line


def test_a_malformed_environment_key_is_a_problem_not_a_crash() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(environ={"KVWATCH_": "1", "KVWATCH_DAEMON__": "2"}, default_path=None)
    assert sorted(p.source for p in err.value.problems) == ["environment KVWATCH_", "environment KVWATCH_DAEMON__"]


def test_a_config_file_is_read_up_to_a_bound(tmp_path: Path) -> None:
    f = tmp_path / "huge.toml"
    with f.open("wb") as out:
        out.truncate(2 * 1024 * 1024)  # two MiB of NULs, sparse
    with pytest.raises(ConfigError, match=r"larger than 1 MiB"):
        load_config(f, environ={}, default_path=None)


def _unprivileged(check: Callable[[], None]) -> None:
    """Run ``check`` as a user that cannot search a mode-0 directory: in a forked child as
    nobody when the tests run as root (root searches any directory), else here."""
    if os.geteuid() != 0:
        check()
        return
    pid = os.fork()
    if pid == 0:  # the child: its verdict is its exit status, never back into pytest
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            check()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the check failed as an unprivileged user"


def test_an_unreadable_default_file_is_a_problem_not_a_crash() -> None:
    base = Path(tempfile.mkdtemp(prefix="kvwatch-config-"))  # not under pytest's 0700 tree
    base.chmod(0o755)  # nobody reaches locked/ and stops there
    locked = base / "locked"
    locked.mkdir()
    (locked / "kvwatch.toml").write_text("")
    locked.chmod(0)

    def check() -> None:
        with pytest.raises(ConfigError, match="cannot read"):
            load_config(environ={}, default_path=locked / "kvwatch.toml")

    try:
        _unprivileged(check)
    finally:
        locked.chmod(0o700)
        shutil.rmtree(base)


def _tree() -> st.SearchStrategy[object]:
    """Trees shaped like a configuration: the real keys (and strangers) holding any TOML value."""
    sections = ["daemon", "discovery", "engines", "alerts", "alertmanager", "probes", "kv_tiers", "dirs", "rules"]
    keys = ["tenants", "listen", "pids", "name", "salt", "lora", "url", "path", "engine", "cmdline", "labels", "x\n"]
    names = st.sampled_from([*sections, *keys])
    leaves = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
    return st.recursive(
        leaves,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(names, inner, max_size=5),
        max_leaves=24,
    )


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(["daemon", "discovery", "engines", "alerts", "kv_tiers", "zz"]), _tree()))
def test_fuzz_any_tree_is_a_config_or_problems_one_line_each(tree: dict[str, object]) -> None:
    """Whatever a file holds, the answer is a configuration or every problem in it, each on one line,
    naming a key: never another exception."""
    try:
        parse(Config, tree)
    except ConfigError as err:
        assert err.problems
        for problem in err.problems:
            assert problem.key and "\n" not in str(problem), problem


def test_each_bad_item_of_a_list_is_its_own_problem() -> None:
    rules = [{"engine": "a", "comm": "("}, {"engine": "B!"}, {"engine": "ok", "cmdline": "x"}, {"comm": "y"}]
    with pytest.raises(ConfigError) as ei:
        parse(Config, {"discovery": {"rules": rules, "pids": [4, 0, -2]}, "daemon": {"tls_cert": "/c"}})
    assert sorted(p.key for p in ei.value.problems) == [
        "daemon",  # tls_cert without tls_key: a rule between two keys is said at their section
        "discovery.pids.1",  # msgspec stops at a list's first bad item: the list is one value
        "discovery.rules.0.comm",
        "discovery.rules.1.engine",
        "discovery.rules.3.engine",
    ]
