"""The global flags through the entry point, as a user types them: --version and --debug."""

import re

from appliance_cli import run_appliance

from appliance import __version__


def test_version_prints_the_versions_and_exits_0(tmp_path):
    result = run_appliance("--version", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(
        rf"bloom-appliance {re.escape(__version__)} \(torch \S+, deepspeed \S+, python [\d.]+\)\n", result.stdout
    )


def test_bad_input_is_one_line_and_debug_adds_the_traceback(tmp_path):
    bad = ("plan", "--layout", "tp=3,pp=one")  # not a number: refused by the parser, whatever the hardware
    plain = run_appliance(*bad, cwd=tmp_path, timeout=120)
    assert plain.returncode == 2
    assert plain.stderr.splitlines() == [plain.stderr.strip()] and plain.stderr.startswith("error: --layout")

    for debug in (("--debug", *bad), (*bad, "--debug")):
        result = run_appliance(*debug, cwd=tmp_path, timeout=120)
        assert result.returncode == 2  # --debug changes what is printed, not the exit code
        assert "Traceback (most recent call last):" in result.stderr and "parse_layout" in result.stderr
        assert result.stderr.splitlines()[-1] == plain.stderr.strip()
