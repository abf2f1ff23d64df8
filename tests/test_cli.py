"""cli.py: config files of flag values (the trainer's presets and --config), read as plain data
and checked against the flags, each problem one line naming the file and the key."""
import argparse
import os
import re
import sys

import pytest

import train_gpt2
from conftest import exit_message


def write(path, text):
    path.write_text(text)
    return str(path)


def test_a_config_sets_defaults_that_flags_override(tmp_path):
    config = write(tmp_path / "run.toml", 'n_layer = 3\nmax_lr = 1\ndevice = "cpu"\nplan = true\nlog_dir = "x"\n')
    args = train_gpt2.parse_args(["--preset", "demo", "--config", config, "--log_dir", "y"])
    assert (args.n_layer, args.max_lr, args.device, args.plan, args.log_dir) == (3, 1.0, "cpu", True, "y")
    assert isinstance(args.max_lr, float)
    assert args.n_embd == 128 and args.data_dir == os.path.join(train_gpt2.HERE, "data", "shakespeare")  # the preset's


def test_every_preset_is_a_valid_config():
    for name in train_gpt2.PRESETS:
        assert train_gpt2.parse_args(["--preset", name]).preset == name


@pytest.mark.parametrize("text, expected", [
    ("n_layers = 3", "unknown key 'n_layers' (not one of the flags' long names)"),
    ("preset = 'demo'", "unknown key 'preset'"),
    ("n_layer = '12'", "n_layer must be an integer, not '12'"),
    ("n_layer = 1.5", "n_layer must be an integer, not 1.5"),
    ("n_layer = true", "n_layer must be an integer, not True"),
    ("max_lr = 'high'", "max_lr must be a number, not 'high'"),
    ("device = 1", "device must be a string, not 1"),
    ("plan = 1", "plan must be true or false, not 1"),
    ("dtype = 'float64'", "dtype must be one of auto, bfloat16, float16, float32, not 'float64'"),
    ("fault = ['nan@1']", "fault cannot be set in a config file"),
    ("n_layer = ", "not TOML"),
])
def test_a_bad_config_is_one_line_naming_the_file_and_key(tmp_path, capsys, text, expected):
    config = write(tmp_path / "run.toml", text)
    message = exit_message(capsys, train_gpt2.main, "--config", config)
    assert message.split(": error: ", 1)[1].startswith(f"{config}: {expected}"), message


def test_a_config_that_is_missing_or_not_a_file_is_one_line(tmp_path, capsys):
    message = exit_message(capsys, train_gpt2.main, "--config", tmp_path / "none.toml")
    assert message.endswith(f": error: {tmp_path / 'none.toml'}: cannot read it (No such file or directory) (see --help)")
    os.mkfifo(tmp_path / "fifo.toml")
    message = exit_message(capsys, train_gpt2.main, "--config", tmp_path / "fifo.toml")
    assert message.endswith(f": error: {tmp_path / 'fifo.toml'}: a FIFO, not a regular file (see --help)")


def test_the_testing_flag_has_its_own_group_in_help(capsys):
    with pytest.raises(SystemExit):
        train_gpt2.main(["--help"])
    out = capsys.readouterr().out
    options, testing = out.split("\noptions:\n")[1].split("\ntesting:\n")
    assert "--fault" not in options and "--fault KIND@STEP[:RANK]" in testing


class Captured(Exception):
    pass


SCRIPTS = ["train_gpt2", "fineweb", "hellaswag", "sample", "export_hf", "plot_log", "bench", "checkpoint"]


def script_parser(script, monkeypatch):
    """The parser that script's main() builds, caught as it parses: every script's is a cli.Parser."""
    import importlib

    import cli
    parsers = []

    def capture(self, args=None, namespace=None):
        parsers.append(self)
        raise Captured
    monkeypatch.setattr(cli.Parser, "parse_args", capture)
    main = getattr(importlib.import_module(script), "main")
    with pytest.raises(Captured):
        main(["--help"])
    monkeypatch.undo()
    return parsers[0]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_scripts_help_says_what_each_flag_does_and_its_default(script, monkeypatch):
    """Every flag has help text, and --help shows its default (cli.HelpWithDefaults) unless it has none."""
    import cli
    parser = script_parser(script, monkeypatch)
    assert isinstance(parser.formatter_class(prog="x"), cli.HelpWithDefaults)
    missing = [action.option_strings or action.dest for action in parser._actions if not action.help]
    assert not missing, missing
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.option_strings and action.default not in (None, argparse.SUPPRESS) and action.help:
            shown = formatter._get_help_string(action)
            assert "%(default)s" in shown or "(default:" in shown, action.dest


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_script_takes_an_abbreviated_flag(script, monkeypatch):
    parser = script_parser(script, monkeypatch)
    positionals = ["x"] * sum(1 for action in parser._actions if not action.option_strings)
    for action in parser._actions:
        flag = max(action.option_strings, key=len, default="")
        abbreviation = flag[:-1]
        if len(flag) > 3 and flag != "--help" and abbreviation not in parser._option_string_actions:
            _, unknown = parser.parse_known_args(positionals + [abbreviation] + ["1"] * (action.nargs != 0))
            assert abbreviation in unknown, flag


def test_the_trainer_refuses_an_abbreviated_flag_in_one_line(capsys):
    message = exit_message(capsys, train_gpt2.main, "--n_lay", "6")
    assert message.endswith("error: unrecognized arguments: --n_lay 6 (see --help)"), message


def test_progress_is_a_bar_on_a_terminal_and_plain_lines_elsewhere(monkeypatch, capsys):
    import io

    import cli
    from tqdm import tqdm

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert isinstance(cli.progress_meter("job", "ex", total=10), tqdm)
    monkeypatch.undo()
    monkeypatch.setattr(cli, "PROGRESS_EVERY", 0)
    meter = cli.progress_meter("job", "ex", total=10)
    meter.update(4)
    meter.set_postfix(loss="1.5")
    meter.update(6)
    meter.close()
    lines = capsys.readouterr().err.splitlines()
    assert re.fullmatch(r"job: 4/10 ex \(40%\), [\d.,]+ ex/s, \d\d:\d\d left", lines[0]), lines
    assert re.fullmatch(r"job: 10/10 ex \(100%\), [\d.,]+ ex/s, loss=1.5", lines[1]), lines
    assert len(lines) == 3 and lines[2] == lines[1].replace(lines[1].split(", ")[1], lines[2].split(", ")[1])
